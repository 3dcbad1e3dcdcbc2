"""``make bench``'s benchmarks at their smallest settings, so that they cannot rot unseen: each runs as
``make bench`` runs it (``python -m bench.<name>`` in a process of its own, with the real moto and
torch underneath) and its output must hold the rows ``bench/README.md`` describes. Nothing here
judges a timing. Results go to a temporary ``$SPOTJOB_BENCH_OUT``, never to ``bench/out/``.

Not here: a run of ``bench.goodput`` (its smallest run with one notice takes over two minutes: a horizon of
about a minute plus the restart floor's six torch starts) and ``bench.controller_scale``, whose
smoke test is ``tests/scale/``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_bench(module: str, out: Path, *args: str) -> tuple[dict[str, Any], str]:
    """Run ``python -m bench.<module> args`` with its results in ``out``: its latest JSON and Markdown
    (what it printed where it writes no Markdown)."""
    env = {**os.environ, "SPOTJOB_BENCH_OUT": str(out)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(list(out.glob(f"{module}-2*.json"))) == 1  # the stamped copy beside -latest
    md = out / f"{module}-latest.md"
    return json.loads((out / f"{module}-latest.json").read_text()), md.read_text() if md.exists() else proc.stdout


@pytest.fixture(scope="module")
def libraries(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    return run_bench("libraries", tmp_path_factory.mktemp("libraries"))


def test_libraries_reports_each_swap_against_what_it_replaced(libraries: tuple[dict[str, Any], str]) -> None:
    """Pins behaviour that already worked (about 3 s)."""
    data, md = libraries
    whats = [r["what"] for r in data["rows"]]
    assert len(whats) == 4
    for start in ("CRC32C of 256 MiB", "combine two CRC32Cs", "one pass over all", "read the Checkpointer's"):
        assert any(w.startswith(start) for w in whats), whats
        assert start in md


def test_libraries_names_the_watch_loops_real_walk_interval(libraries: tuple[dict[str, Any], str]) -> None:
    """The psutil row's baseline is the agent's own /proc walk; its label must give the interval the
    agent walks at (``TREE_SCAN_EVERY``), not a rate it no longer has."""
    from agent.launcher import TREE_SCAN_EVERY

    data, _ = libraries
    row = next(r for r in data["rows"] if r["what"].startswith("one pass over all"))
    assert f"every {TREE_SCAN_EVERY:g} s" in row["before"], row


def test_libraries_answers_help_without_running_and_refuses_an_unknown_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m bench.libraries --help`` used to run the benchmark (and overwrite its results)
    instead of saying what it does; an option it does not have was ignored the same way."""
    import bench._common
    import bench.libraries

    monkeypatch.setattr(bench._common, "OUT_DIR", tmp_path)
    monkeypatch.setattr(bench.libraries, "OUT_DIR", tmp_path)
    for argv, code in ((["--help"], 0), (["--sizes", "1"], 2)):
        with pytest.raises(SystemExit) as stopped:
            bench.libraries.main(argv)
        assert stopped.value.code == code, capsys.readouterr()
    out = capsys.readouterr()
    assert "usage: python -m bench.libraries" in out.out and "unrecognized arguments: --sizes" in out.err, out
    assert not list(tmp_path.iterdir()), "nothing was measured nor written"


def test_libraries_names_the_cpu_it_ran_on(libraries: tuple[dict[str, Any], str]) -> None:
    """The two CRC32C libraries' ratio is the CPU's (AVX-512 or not): the results say which CPU."""
    data, md = libraries
    assert data["cpu"] and "AVX-512" in data["cpu"], data
    assert f"CPU: {data['cpu']}" in md


class FileAndGcs(NamedTuple):
    data: dict[str, Any]
    md: str
    scratch: Path
    left_in_tmp: list[str]


def section(md: str, heading: str) -> str:
    """The Markdown from ``heading`` to the next ``###``: one store's table of a run of several."""
    start = md.index(heading)
    end = md.find("\n### ", start + len(heading))
    return md[start : end if end >= 0 else len(md)]


@pytest.fixture(scope="module")
def file_and_gcs(tmp_path_factory: pytest.TempPathFactory) -> FileAndGcs:
    """One ``bench.checkpoint --backends file,gs`` run at the smallest size, for the filesystem and
    the GCS test below: two runs (one per store) paid an interpreter's and torch's start, the
    state's build and the torch.save baselines twice, about 4 CPU-seconds. The wrapper of
    fake-gcs-server keeps the server's objects in a temporary folder: here, to see it emptied."""
    base = tmp_path_factory.mktemp("checkpoint-file-gs")
    tmp = base / "tmp"
    tmp.mkdir()
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp)
    try:
        data, md = run_bench(
            "checkpoint", base / "out", "--sizes", "0.01", "--backends", "file,gs", "--repeat", "1",
            "--no-warm-up", "--scratch", str(base / "scratch"),
        )  # fmt: skip
    finally:
        if saved is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = saved
    left = [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")]  # torch's own cache
    return FileAndGcs(data, md, base / "scratch", left)


@pytest.mark.slow
def test_checkpoint_at_its_smallest_size_on_the_filesystem(file_and_gcs: FileAndGcs) -> None:
    """Pins behaviour that already worked (about 15 s on 2 cores): one repetition of the smallest state
    (one 2048-wide layer, 50 MB) on the filesystem, no warm-up; the run is the GCS test's too."""
    data, md = file_and_gcs.data, file_and_gcs.md
    assert [s["size_gb"] for s in data["sizes"]] == [0.01]
    assert not file_and_gcs.scratch.exists() or not any(file_and_gcs.scratch.iterdir())
    assert data["args"]["device"] == "cpu" and data["device"]["type"] == "cpu"
    assert md.startswith("State on: CPU ("), md[:200]
    (size,) = data["sizes"]
    assert size["skipped"] == {} and "file/0.01gb" in data["evaluation"]
    for heading in (
        "### Against the targets",
        "### Filesystem, 50.36 MB",
        "### Where an async save's time goes",
        "### Memory (filesystem, medians)",
        "### Bytes written",
    ):
        assert heading in md, heading
    table = section(md, "### Filesystem, 50.36 MB")  # not the GCS table's rows of the same names
    for row in (
        "| Checkpointer async: `step()` blocks |",
        "| floor of the blocking: memcpy of the state into existing buffers |",
        "| Checkpointer async: save call → manifest committed |",
        "| … a Checkpointer's first async save (allocates the buffers): blocks |",
        "| … with `release_staging=True`: `step()` blocks |",
        "| Checkpointer sync: `step()` (whole save) |",
        "| … the same with `direct_io=False` (through the page cache) |",
        "| floor: raw write of the state's bytes + fsync |",
        "| torch.save, one file + fsync |",
        "| plain dcp.save (FileSystemWriter) |",
        "| Checkpointer `restore()` (cold cache) |",
        "| floor: raw read (cold cache) |",
        "| deserialise: torch.load (warm) + load_state_dict |",
        "| torch.load (cold) + load_state_dict |",
        "| plain dcp.load (cold) + set_state_dict |",
    ):
        assert row in table, row


@pytest.mark.slow
def test_checkpoint_on_gcs_at_its_smallest_size(file_and_gcs: FileAndGcs) -> None:
    """``--backends gs`` beside ``file`` (25 s on 2 cores at load 10 when it ran alone): one
    repetition of the smallest state on fake-gcs-server, started by the benchmark on loopback, with its
    floor (google-cloud-storage's own upload and chunked download) and its columns and verdicts, no
    S3 run; the server's folder and the scratch are gone after it."""
    data, md = file_and_gcs.data, file_and_gcs.md
    assert not file_and_gcs.left_in_tmp, file_and_gcs.left_in_tmp
    assert not file_and_gcs.scratch.exists() or not any(file_and_gcs.scratch.iterdir())
    assert data["gs_endpoint"] == "fake-gcs-server on 127.0.0.1 (own process)" and data["s3_endpoint"] is None
    assert data["args"]["gs_max_gb"] == 1.0
    (size,) = data["sizes"]
    assert size["size_gb"] == 0.01 and size["skipped"] == {} and size["server_peak_rss_bytes"]["gs"] > 0
    for op in (
        "gs.floor.upload", "gs.floor.download", "gs.ckpt.sync.step", "gs.ckpt.sync.commit",
        "gs.ckpt.restore.cold", "gs.ckpt.async.step", "gs.ckpt.async.commit", "gs.ckpt.async.first.commit",
    ):  # fmt: skip
        assert len(size["ops"][op]["seconds"]) == 1, op
    assert not any(op.startswith("s3.") for op in size["ops"]), sorted(size["ops"])  # S3 was not asked for
    key = "gs/0.01gb"
    assert set(data["evaluation"]) == {"file/0.01gb", key}
    targets = data["evaluation"][key]["targets"]
    assert {k: t["target"] for k, t in targets.items()} == {
        "async_block_vs_sync": 0.05, "commit_vs_floor": 1.5, "sync_commit_vs_floor": 1.5, "restore_vs_floor": 1.25,
    }  # fmt: skip
    for name, t in targets.items():
        assert isinstance(t["value"], float) and isinstance(t["met"], bool), name
    assert "| GCS (fake-gcs-server on loopback) | 50.36 MB |" in md
    assert "### GCS (fake-gcs-server on loopback), 50.36 MB" in md
    table = section(md, "### GCS (fake-gcs-server on loopback), 50.36 MB")  # not the filesystem's rows
    for row in (
        "| Checkpointer async: `step()` blocks |",
        "| Checkpointer async: save call → manifest committed |",
        "| Checkpointer sync: `step()` (whole save) |",
        "| floor: google-cloud-storage resumable upload of the state's bytes (100 MiB chunks) |",
        "| Checkpointer `restore()` |",
        "| floor: transfer_manager download_chunks_concurrently (8 x 64 MiB) |",
        "| deserialise: torch.load (warm) + load_state_dict |",
    ):
        assert row in table, row
    assert "The store's server (its own process) peaked at" in md


def test_checkpoint_backends_option_takes_gs_and_its_own_size_cap(capsys: pytest.CaptureFixture[str]) -> None:
    """``--backends`` takes ``gs`` beside ``file`` and ``s3`` (default still file,s3) and refuses
    ``gcs`` naming the three; ``--gs-max-gb`` caps GCS (default 1 GB: fake-gcs-server holds an upload in
    memory) apart from ``--s3-max-gb``. In-process, nothing timed."""
    from bench.checkpoint import parse_args

    assert parse_args([]).backends == ["file", "s3"]
    args = parse_args(["--backends", "file,gs", "--gs-max-gb", "0.5"])
    assert args.backends == ["file", "gs"] and args.gs_max_gb == 0.5 and args.s3_max_gb == 1.5
    assert parse_args([]).gs_max_gb == 1.0
    with pytest.raises(SystemExit):
        parse_args(["--backends", "gcs"])
    assert "backends are file, s3 and gs" in capsys.readouterr().err


def test_checkpoint_device_option_defaults_to_cpu_and_refuses_cuda_without_a_gpu(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--device`` (cpu by default; cuda puts the state on the GPU): what of it runs without a GPU,
    in-process and without timing anything. ``--device cuda`` where torch sees no GPU stops at the
    argument check, saying why, before any state is built."""
    import torch

    from bench.checkpoint import describe_device, device_line, parse_args

    assert parse_args([]).device == "cpu"
    assert parse_args(["--device", "cpu"]).device == "cpu"
    with pytest.raises(SystemExit):
        parse_args(["--device", "tpu"])
    assert "invalid choice: 'tpu'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--device", "cuda", "--many-layers", "2"])
    assert "--many-layers runs on CPU" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            parse_args(["--device", "cuda"])
        assert "--device cuda: torch.cuda.is_available() is False" in capsys.readouterr().err
    described = describe_device("cpu", {"cpu_model": "Some CPU"})
    assert described == {"type": "cpu", "name": "Some CPU"}
    assert device_line(described) == "State on: CPU (Some CPU).\n"
    gpu = {
        "type": "cuda", "index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 85_520_809_984,
        "capability": "9.0", "count": 1, "torch_cuda": "13.0",
    }  # fmt: skip
    line = device_line(gpu)
    assert line.startswith("State on: GPU cuda:0, NVIDIA H100 80GB HBM3 (85.52 GB, compute capability 9.0"), line
    assert "device-to-host copy into pinned host buffers" in line


def test_checkpoint_many_small_tensors_side_by_side_with_plain_dcp(tmp_path: Path) -> None:
    """``--many-layers`` at its smallest (2 layers of 4: 16 tensors, one repetition, a few seconds):
    plain DCP and the Checkpointer's sync save, async save and restore each timed, with their ratios
    to plain DCP in the JSON and the table, a cProfile of one more sync save naming spotjob's own
    functions, and (``--gc-loop``) two sync and two async saves back to back with the collections of
    each generation inside each and the objects each moved into the oldest."""
    data, md = run_bench(
        "checkpoint", tmp_path / "out", "--many-layers", "2", "--many-width", "4", "--repeat", "1",
        "--profile", "1", "--gc-loop", "2", "--scratch", str(tmp_path / "scratch"),
    )  # fmt: skip
    assert data["mode"] == "many-layers"
    many = data["many_layers"]
    assert (many["layers"], many["width"], many["tensor_count"], many["repeat"]) == (2, 4, 16, 1)
    ops = (
        "many.dcp.save", "many.dcp.load.cold", "many.ckpt.sync.step", "many.ckpt.sync.commit",
        "many.ckpt.async.step", "many.ckpt.async.commit", "many.ckpt.restore.cold",
    )  # fmt: skip
    for op in ops:
        assert len(many["ops"][op]["seconds"]) == 1, op
        assert isinstance(data["ratios_to_plain_dcp"][op], float), op
    for op in ("many.dcp.save", "many.ckpt.sync.step", "many.ckpt.async.step", "many.ckpt.async.commit"):
        gcs, gc_seconds = many["ops"][op]["full_gcs"], many["ops"][op]["full_gc_seconds"]
        assert len(gcs) == len(gc_seconds) == 1 and gcs[0] >= 0 and gc_seconds[0] >= 0.0, (op, gcs, gc_seconds)
    assert many["ops"]["many.ckpt.sync.commit"]["full_gcs"] == []  # timed by the Checkpointer, not around it
    assert data["ratios_to_plain_dcp"]["many.dcp.save"] == data["ratios_to_plain_dcp"]["many.dcp.load.cold"] == 1.0
    assert not (tmp_path / "scratch").exists() or not any((tmp_path / "scratch").iterdir())
    assert "### Many small tensors (filesystem): 2 Linear layers of 4x4 + Adam, 16 tensors" in md
    for row in (
        "| plain dcp.save (get_state_dict + FileSystemWriter) |",
        "| Checkpointer sync: save call → manifest committed |",
        "| Checkpointer sync: `step()` (whole save, retention included) |",
        "| Checkpointer async: `step()` blocks |",
        "| Checkpointer async: save call → manifest committed |",
        "| plain dcp.load (cold) + set_state_dict |",
        "| Checkpointer `restore()` (cold cache) |",
    ):
        assert row in md, row
    assert "| full GCs inside: count, s (a run) |" in md
    profile = (tmp_path / "out" / "checkpoint-many-profile.txt").read_text()
    assert "1 sync saves profiled" in profile and "agent/checkpoint" in profile, profile[:2000]
    loop = many["gc_loop"]
    assert sorted(loop) == ["async", "sync"] and all(len(saves) == 2 for saves in loop.values()), loop
    for save in loop["sync"] + loop["async"]:
        assert len(save["collections"]) == len(save["seconds"]) == 3 and min(save["collections"]) >= 0, save
        assert save["promoted"] >= 0 and min(save["seconds"]) >= 0.0, save
    assert "| objects moved into the oldest generation, a save (median) |" in md
    assert "| 2 sync |" in md and "| 2 async |" in md


@pytest.mark.slow
def test_notice_to_commit_on_each_backend(tmp_path: Path) -> None:
    """Pins behaviour that already worked (about 14 s on 2 cores): one repetition of a 12.6 MB state on the
    filesystem, moto's S3 and fake-gcs-server, without the per-step check (2 torchrun ranks, about
    25 s more)."""
    data, md = run_bench(
        "notice", tmp_path / "out", "--sizes", "0.01", "--repeat", "1", "--skip-check",
        "--scratch", str(tmp_path / "scratch"),
    )  # fmt: skip
    assert [r["backend"] for r in data["notice"]] == ["file", "s3", "gs"]
    for row in data["notice"]:
        assert len(row["idle_s"]) == len(row["busy_s"]) == len(row["floor_s"]) == 1, row
        # The clock stops at the commit the flush reported to the agent; step() returns after it
        # (rank 0 applies keep first), timed beside it.
        for case in ("idle", "busy"):
            assert 0 < row[f"{case}_s"][0] <= row[f"{case}_returned_s"][0], row
    assert len(data["notice"][1]["floor_checked_s"]) == 1  # S3's second floor, with the full-object CRC32C
    # The S3 floor moves the bytes as spotjob's store does: below its multipart threshold (64 MiB)
    # one PUT, not boto3's default of 8 MiB parts, 10 at once (which gave the floor parallelism
    # spotjob's upload of the same 12.6 MB never has).
    from agent.storage._transfer import TransferSettings

    s3_row = data["notice"][1]
    assert s3_row["state_bytes"] < TransferSettings().multipart_threshold
    assert s3_row["floor_upload_parts"] == 1, s3_row
    assert "### Notice to commit" in md and "floor with full-object CRC32C" in md
    assert "| idle, `step()` returned |" in md
    for backend in ("file", "s3", "gs"):
        assert f"| {backend} | 12.60 MB |" in md, backend


def test_goodput_says_which_setting_to_change_when_the_first_notice_comes_too_early() -> None:
    """A small ``--scale`` can put the first notice before the first attempt trains (found with
    ``--scale 0.1``): the run, minutes long, must then say so and name the setting, not only that it
    "trained too little". The timeline is written by hand: what the run's ``timeline.jsonl`` held then."""
    from bench.goodput import analyse
    from orchestrator.backends.local_timeline import EventKind, TimelineEvent

    events = [
        TimelineEvent(100.0, EventKind.RUN_STARTED, {}),
        TimelineEvent(101.0, EventKind.WORKER_STARTED, {"attempt": 0}),
        TimelineEvent(107.0, EventKind.STEP, {"attempt": 0, "step": 3}),
        TimelineEvent(107.4, EventKind.NOTICE, {}),
        TimelineEvent(108.0, EventKind.STEP, {"attempt": 0, "step": 10}),
    ]
    with pytest.raises(RuntimeError, match=r"first notice came 7\.4 s after the start.*raise --scale"):
        analyse(events, horizon=45.0)


def goodput_refusal(argv: list[str], out_dir: Path, monkeypatch: pytest.MonkeyPatch) -> int | str | None:
    """``bench.goodput.main(argv)`` in this process (``python -m bench.goodput`` calls it with its
    arguments), its results folder ``out_dir``: the exit status it stopped with (stderr: capsys).
    A process of its own only added an interpreter's start to a refusal."""
    import bench._common
    import bench.goodput

    monkeypatch.setattr(bench._common, "OUT_DIR", out_dir)
    monkeypatch.setattr(bench.goodput, "OUT_DIR", out_dir)
    with pytest.raises(SystemExit) as stopped:
        bench.goodput.main(argv)
    return stopped.value.code


def test_goodput_refuses_a_horizon_that_holds_no_notice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--horizon 35 --scale 0.1`` used to run its whole horizon (and, with the spotjob strategy, the
    restart floor) and report a goodput under "notices at  s": a run that measured no preemption.
    It must refuse before starting anything, and say which setting to raise."""
    argv = ["--horizon", "35", "--scale", "0.1", "--only", "none", "--out", str(tmp_path / "goodput.md")]
    code = goodput_refusal(argv, tmp_path, monkeypatch)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "holds no notice" in err and "raise --horizon" in err, err
    assert not (tmp_path / "goodput.md").exists() and not list(tmp_path.glob("goodput-runs-*"))


def test_notice_refuses_a_backend_it_does_not_know(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--backends gcs`` (GCS is ``gs`` here) used to run the filesystem benchmark and report it as
    ``file``: a user asking for GCS got the local disk's numbers. It must refuse and list the names.
    Run in this process through ``main``, which ``python -m bench.notice`` calls with its arguments:
    a process of its own spent its time importing torch for a refusal that never reaches it."""
    import bench._common
    import bench.notice

    monkeypatch.setattr(bench._common, "OUT_DIR", tmp_path)
    monkeypatch.setattr(bench.notice, "OUT_DIR", tmp_path)
    argv = ["--sizes", "0.01", "--repeat", "1", "--skip-check", "--backends", "gcs", "--scratch", str(tmp_path / "s")]
    with pytest.raises(SystemExit) as stopped:
        bench.notice.main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2, err
    assert "--backends takes file, s3 and gs" in err and "'gcs'" in err, err
    assert not list(tmp_path.glob("notice-*.json")) and not (tmp_path / "s").exists()


@pytest.mark.parametrize("module", ["checkpoint", "notice"])
@pytest.mark.parametrize("sizes", ["-1", "0", "0.1,nan", "abc"])
def test_sizes_that_are_no_state_are_refused_before_anything_runs(
    module: str, sizes: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--sizes -1`` (or 0) used to run the whole benchmark at the smallest state and report it;
    ``bench.notice --sizes abc`` ended in a ValueError traceback. Each is a usage error naming the
    option, and nothing is measured or written."""
    import importlib

    import bench._common

    bench_module = importlib.import_module(f"bench.{module}")
    monkeypatch.setattr(bench._common, "OUT_DIR", tmp_path)
    monkeypatch.setattr(bench_module, "OUT_DIR", tmp_path)
    with pytest.raises(SystemExit) as stopped:
        bench_module.main(["--sizes", sizes, "--scratch", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert stopped.value.code == 2, err
    assert "argument --sizes: expected comma-separated numbers of GB" in err and repr(sizes) in err, err
    assert not list(tmp_path.iterdir()), "nothing was measured nor written"


@pytest.mark.parametrize(
    "argv", [["--scale", "0"], ["--scale", "nan"], ["--horizon", "-5"], ["--every-steps", "0"], ["--step-sleep", "-1"]]
)
def test_goodput_refuses_settings_that_measure_nothing(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A scale of 0, a save every 0 steps or a negative step pacing used to start the strategies'
    torchrun jobs (minutes) on settings that fail inside them or measure nothing."""
    out = tmp_path / "goodput.md"
    code = goodput_refusal([*argv, "--out", str(out)], tmp_path, monkeypatch)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--scale and --horizon must be above 0, --every-steps >= 1 and --step-sleep >= 0" in err, err
    assert not out.exists() and not list(tmp_path.glob("goodput-*"))


def test_goodput_refuses_a_strategy_it_does_not_know(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--only spotjb`` (a typo) used to run nothing and still write a results table with no row,
    by default over the tracked ``bench/goodput-results.md``. It must refuse and list the strategies."""
    out = tmp_path / "goodput.md"
    code = goodput_refusal(["--only", "spotjb", "--out", str(out)], tmp_path, monkeypatch)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--only takes spotjob, periodic, none" in err and "'spotjb'" in err, err
    assert not out.exists() and not list(tmp_path.glob("goodput-*"))


def test_full_collections_counts_generation_2_collections_only_while_entered() -> None:
    """``bench._common.FullCollections``, which the benchmarks' "full GCs inside" column reads: a
    full collection inside is counted with its time, a young one is not, and none after it is left."""
    import gc

    from bench._common import FullCollections

    with FullCollections() as inside:
        gc.collect(0)
        gc.collect()
        gc.collect()
    gc.collect()
    assert inside.count == 2 and inside.seconds > 0.0, (inside.count, inside.seconds)
    assert inside._callback not in gc.callbacks
