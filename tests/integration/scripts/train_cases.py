"""examples/train.py, unchanged, run once per case in one torchrun: cases are cut at ``--then``
(``ckpt_state.split_cases``) and run in turn in one process group, so that the runs of a test
that differ only in their arguments pay for one launcher and its ranks (importing torch) instead
of one each. Left without the interpreter's teardown at the end (``exit_without_teardown``).

    torchrun ... train_cases.py --async 0 --steps 24 --uri U1 ... [--then --async 1 --uri U2 ...]

``--async 0|1`` (this script's, taken out before train.py parses the rest) sets ``SPOTJOB_ASYNC``
for that case: train.py's ``Checkpointer.from_env`` reads it when the case builds it. Before each
case each rank writes a line ``=== case N rank R`` to stderr, where train.py logs each line
with ``rankR``, so that a test can read each case's lines apart (``case_logs``). train.py starts
every run by seeding every RNG stream it draws from, so one case leaves nothing to the next in
what is compared.

The group is made once, before the first case; train.py's own ``init_process_group`` and
``destroy_process_group`` calls are skipped while the cases run (a gloo group made again on the
same torchrun store would meet the first one's keys).
"""

from __future__ import annotations

import os
import re
import runpy
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from ckpt_state import exit_without_teardown, split_cases

TRAIN = Path(__file__).resolve().parents[3] / "examples" / "train.py"
MARK = re.compile(r"^=== case (\d+) rank (\d+)$")
LOGGED = re.compile(r" rank(\d+) ")  # train.py's log format: "<time> rank<r> <logger>: <message>"


def case_logs(stderr: str) -> dict[int, str]:
    """The log lines of a run of this script by case: each rank's lines belong to the case its
    last mark named (the ranks' lines interleave; each line is written whole)."""
    current: dict[int, int] = {}
    cases: dict[int, list[str]] = {}
    for line in stderr.splitlines():
        if mark := MARK.match(line):
            current[int(mark[2])] = int(mark[1])
        elif (logged := LOGGED.search(line)) and int(logged[1]) in current:
            cases.setdefault(current[int(logged[1])], []).append(line)
    return {case: "\n".join(lines) + "\n" for case, lines in cases.items()}


def parse(case: list[str]) -> tuple[str | None, list[str]]:
    """(the case's SPOTJOB_ASYNC or None, train.py's arguments)."""
    if "--async" not in case:
        return None, case
    at = case.index("--async")
    value = case[at + 1] if at + 1 < len(case) else ""
    if value not in ("0", "1"):
        raise SystemExit(f"train_cases.py: --async takes 0 or 1, not {value!r}")
    return value, case[:at] + case[at + 2 :]


def main() -> None:
    cases = [parse(case) for case in split_cases(sys.argv[1:])]  # every case checked before any runs
    dist.init_process_group("gloo")
    init, destroy = dist.init_process_group, dist.destroy_process_group

    def kept(*args: Any, **kwargs: Any) -> None:
        """train.py's calls: the group made above serves every case."""

    dist.init_process_group, dist.destroy_process_group = kept, kept  # type: ignore[assignment]
    try:
        for number, (async_save, args) in enumerate(cases):
            if async_save is None:
                os.environ.pop("SPOTJOB_ASYNC", None)
            else:
                os.environ["SPOTJOB_ASYNC"] = async_save
            sys.stderr.write(f"=== case {number} rank {dist.get_rank()}\n")
            sys.stderr.flush()
            sys.argv = [str(TRAIN), *args]
            try:
                runpy.run_path(str(TRAIN), run_name="__main__")
            except SystemExit as e:
                if e.code not in (0, None):
                    raise
    finally:
        dist.init_process_group, dist.destroy_process_group = init, destroy  # type: ignore[assignment]
    exit_without_teardown()


if __name__ == "__main__":
    main()
