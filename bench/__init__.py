"""Benchmarks that run spotjob next to the baselines it has to beat, in the same process and run.

Each benchmark is a module run as ``python -m bench.<name>`` (``make bench`` runs them all) and
writes its raw results as JSON to ``bench/out/`` (gitignored); ``bench/README.md`` holds the
numbers of the last full run. Helpers shared by the benchmarks (timing, the machine's description,
starting moto, peak memory, dropping files from the page cache) live in ``bench._common``.
"""
