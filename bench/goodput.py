"""Goodput benchmark: how much training survives one preemption trace, with and without spotjob.

One trace of spot notices — gaps drawn uniformly from 60-120 s, each with a 30 s window before the
node is reclaimed — replayed by ``spotjob run --trace`` (local mode: real agents, torchrun, 2 DDP
ranks, IMDSv2 emulators, the reconciler) for three strategies, one after the other, each for the
same wall-clock horizon:

- ``spotjob``: periodic async checkpoints every K steps, and a flush on every notice (the agent
  hears the IMDS notice, the controller POSTs /flush; the job moves as soon as the flush commits);
- ``periodic``: the same periodic checkpoints, nobody listening for notices (``--ignore-notices``):
  the node dies at the end of its window and the job resumes from the last periodic checkpoint;
- ``none``: no checkpoints and no notices: every preemption restarts from step 0.

Time is scaled by ``--scale`` (default 0.5: gaps 30-60 s, 15 s windows) to keep the whole run near
9 minutes on a 2-core machine; the job's restart cost (process start, torch import, rendezvous,
restore: ~10 s here) is what this machine gives and is not scaled.

Measured from each run's timeline (``spotjob-runs/<name>/timeline.jsonl``):

- *progress*: the step the job's lineage holds at the horizon (the newest attempt's last step; if
  it has not restored yet, the newest committed step);
- *goodput*: progress over what an uninterrupted run reaches by the horizon, ``rate x (horizon -
  first start-up)``, with the rate and start-up measured on the same run's first attempt (before
  any notice), so a busy machine slows the reference too;
- *steps lost per preemption*: at each restart, the last step the stopped attempt reported minus
  the newest step committed before the restart (status.json reports about once a second, so a
  few steps more may be lost than shown);
- the reconciler's own goodput estimate (``JobStatus.goodput``) and its flushing/restarting time.

``python -m bench.goodput [--horizon 170] [--scale 0.5] [--seed 3]``; the table goes to
``bench/goodput-results.md``, raw numbers to ``bench/out/goodput-*.json``, each run's folder (logs,
timeline, plot) to ``bench/out/goodput-runs-<stamp>/``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench._common import OUT_DIR, describe_machine, log, write_results
from orchestrator.backends.local_timeline import EventKind, Timeline, TimelineEvent

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"
PROBE = REPO / "bench" / "_restart_probe.py"
"""examples/train.py's job with a clock at every phase (start, torch imported, rendezvous, restore,
each step): what every strategy runs, so each restart can be broken down."""
RESULTS_MD = Path(__file__).resolve().parent / "goodput-results.md"

REAL_GAP_S = (60.0, 120.0)
REAL_WINDOW_S = 30.0
SETTLE_S = 25.0
"""No notice in the last window + this many seconds of the horizon: by the horizon every strategy has
moved off its last preempted node, so what it holds then is what it keeps."""


@dataclass(frozen=True)
class Strategy:
    name: str
    description: str
    args: tuple[str, ...]


def strategies(every_steps: int) -> list[Strategy]:
    every = ("--every-steps", str(every_steps))
    return [
        Strategy("spotjob", f"async checkpoints every {every_steps} steps + flush on notice", every),
        Strategy("periodic", f"checkpoints every {every_steps} steps, no flush (notices unheard)",
                 (*every, "--ignore-notices")),
        Strategy("none", "no checkpoints, no flush", ("--ignore-notices",)),
    ]  # fmt: skip


def make_trace(seed: int, scale: float, until: float) -> list[float]:
    """Notice times (seconds since the start) before ``until``: gaps uniform in ``REAL_GAP_S x scale``."""
    rng = random.Random(seed)
    times: list[float] = []
    t = 0.0
    while True:
        t += rng.uniform(*REAL_GAP_S) * scale
        if t >= until:
            return times
        times.append(round(t, 1))


@dataclass
class Outcome:
    strategy: str
    description: str
    progress: int
    reference: float
    goodput: float
    notices: int
    restarts: int
    lost_per_restart: list[int]
    reconciler_goodput: float | None
    flushing_seconds: float
    restarting_seconds: float
    first_startup_seconds: float
    rate: float
    run_folder: str
    restarts_detail: list[dict[str, float]] | None = None
    """Per restart of the first notices: the phases of the restart overhead (``restart_phases``)."""

    @property
    def lost_per_preemption(self) -> float | None:
        return sum(self.lost_per_restart) / len(self.lost_per_restart) if self.lost_per_restart else None


def analyse(events: list[TimelineEvent], horizon: float) -> dict[str, Any]:
    """Progress at the horizon, the uninterrupted reference, and the steps lost at each restart."""
    t0 = next(e.t for e in events if e.kind == EventKind.RUN_STARTED)
    end = t0 + horizon
    events = [e for e in events if e.t <= end]
    notices = [e.t for e in events if e.kind == EventKind.NOTICE]
    first_notice = notices[0] if notices else end
    steps = [e for e in events if e.kind == EventKind.STEP]
    warm = [e for e in steps if e.data["attempt"] == 0 and e.data.get("state") != "starting" and e.t <= first_notice]
    if len(warm) < 2:
        raise RuntimeError(
            f"the first notice came {first_notice - t0:.1f} s after the start, before the first attempt had "
            f"trained long enough to measure its step rate ({len(warm)} step report(s)): the trace's first gap is "
            f"{REAL_GAP_S[0]:g}-{REAL_GAP_S[1]:g} s times --scale, so raise --scale (or pick another --seed)"
        )
    rate = (warm[-1].data["step"] - warm[0].data["step"]) / (warm[-1].t - warm[0].t)
    # Back-extrapolate to the step-0 moment: start-up ends where the steady line meets step 0.
    startup = warm[0].t - t0 - warm[0].data["step"] / rate
    reference = rate * (horizon - startup)

    starts = {e.data["attempt"]: e.t for e in events if e.kind == EventKind.WORKER_STARTED}
    commits = [(e.t, int(e.data["step"])) for e in events if e.kind == EventKind.COMMIT]

    def committed_before(t: float) -> int:
        return max((s for ct, s in commits if ct <= t), default=0)

    def last_step(attempt: int) -> int | None:
        mine = [int(e.data["step"]) for e in steps if e.data["attempt"] == attempt]
        return mine[-1] if mine else None

    newest = max(starts)
    progress = last_step(newest)
    if progress is None:
        progress = committed_before(end)
    lost = []
    for attempt in sorted(starts):
        if attempt == 0:
            continue
        before = last_step(attempt - 1)
        if before is not None:
            lost.append(max(0, before - committed_before(starts[attempt])))
    return {
        "progress": progress,
        "reference": reference,
        "rate": rate,
        "startup": startup,
        "notices": len(notices),
        "restarts": len(starts) - 1,
        "lost": lost,
    }


def read_timings(folder: Path) -> list[dict[str, Any]]:
    """Every rank's probe records (``bench/_restart_probe.py``), in time order."""
    out: list[dict[str, Any]] = []
    for path in sorted(folder.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a torn last line of a killed rank
    return sorted(out, key=lambda r: r["t"])


PHASES = (
    ("flush", "notice heard → flush committed (last step before the notice to the loop stopping)"),
    ("handover", "commit → the next attempt's workers started (agent exit, reconciler, new agent)"),
    ("launch", "workers started → the training script runs (the agent, its launcher, a Python interpreter)"),
    ("import", "import torch"),
    ("rendezvous", "init_process_group"),
    ("restore", "Checkpointer() + restore()"),
    ("first_step", "the first step after the restore"),
)


def restart_phases(
    events: list[TimelineEvent], timings: list[dict[str, Any]], horizon: float
) -> list[dict[str, float]]:
    """For each notice followed by a restore: the restart overhead (the last step before the notice to
    the first step after the resume, from rank 0's own clock) and its phases (``PHASES``)."""
    t0 = next(e.t for e in events if e.kind == EventKind.RUN_STARTED)
    notices = [e.t for e in events if e.kind == EventKind.NOTICE and e.t <= t0 + horizon]
    starts = sorted(e.t for e in events if e.kind == EventKind.WORKER_STARTED)
    rank0 = [r for r in timings if r.get("rank") == 0]
    out: list[dict[str, float]] = []
    for notice in notices:
        before = [r for r in rank0 if r["t"] <= notice and r["event"] == "step"]
        later_starts = [t for t in starts if t > notice]
        if not before or not later_starts:
            continue
        attempt_start = later_starts[0]

        def first(event: str, after: float) -> float | None:
            return next((r["t"] for r in rank0 if r["event"] == event and r["t"] > after), None)

        stopped = next((r["t"] for r in rank0 if r["t"] > notice and r["event"] in ("stop",)), None)
        launched = first("start", attempt_start - 0.001)
        if launched is None:
            continue
        torch_at, rdzv = first("torch", launched), first("rendezvous", launched)
        ck, restored = first("checkpointer", launched), first("restored", launched)
        stepped = first("step", launched)
        if None in (torch_at, rdzv, ck, restored, stepped):
            continue
        last = before[-1]["t"]
        flush_end = stopped if stopped is not None else attempt_start
        assert torch_at and rdzv and restored and stepped
        out.append(
            {
                "overhead": stepped - last,
                "flush": max(0.0, flush_end - last),
                "handover": max(0.0, attempt_start - flush_end),
                "launch": launched - attempt_start,
                "import": torch_at - launched,
                "rendezvous": rdzv - torch_at,
                "restore": restored - rdzv,
                "first_step": stepped - restored,
            }
        )
    return out


def restart_floor(uri: str, job: str, repeat: int, folder: Path, launcher: str = "direct") -> dict[str, Any]:
    """The restart's floor, timed alone: 2 fresh ranks import torch, meet, restore ``uri``'s newest checkpoint.

    ``launcher``: who starts the ranks. ``direct``, as the spotjob strategy's agents do
    (``spotjob-agent --launcher direct``: ``agent.ranks``, which imports no torch), or ``torchrun``.
    The floor's total starts when the ranks do; the launcher's own start is its ``launch`` row."""
    import socket
    import statistics

    from agent.torchrun import direct_launch

    runs: list[dict[str, float]] = []
    for i in range(repeat):
        timings = folder / f"floor-{launcher}-{i}"
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTJOB_", "TORCHELASTIC_"))}
        env.update(OMP_NUM_THREADS="1", SPOTJOB_CHECKPOINT_URI=uri, SPOTJOB_JOB_NAME=job)
        argv = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2", "--master-port", str(port),
                str(PROBE), "--restore-only", "--timings", str(timings)]  # fmt: skip
        if launcher == "direct":
            spec = direct_launch(argv, env)
            assert not isinstance(spec, str), spec
            argv = [sys.executable, "-m", "agent.ranks", spec.to_json()]
        launched = time.time()  # the ranks' clocks are wall clocks too
        subprocess.run(argv, cwd=REPO, env=env, check=True, capture_output=True, timeout=300)
        recs = read_timings(timings)
        per_rank = {}
        for rank in (0, 1):
            mine = {r["event"]: r["t"] for r in recs if r["rank"] == rank}
            per_rank[rank] = mine
        start = min(r["start"] for r in per_rank.values())
        runs.append(
            {
                # Not part of the floor as the issue defines it: the launcher's own start (torchrun
                # imports torch before it starts the ranks; the agent's launcher does not).
                "launch": start - launched,
                "import": max(r["torch"] - r["start"] for r in per_rank.values()),
                "rendezvous": max(r["rendezvous"] for r in per_rank.values())
                - max(r["torch"] for r in per_rank.values()),
                "restore": max(r["restored"] for r in per_rank.values())
                - max(r["rendezvous"] for r in per_rank.values()),
                "total": max(r["restored"] for r in per_rank.values()) - start,
            }
        )
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]} | {"runs": runs}


def run_strategy(
    strategy: Strategy, *, runs_dir: Path, trace_file: Path, window: float, horizon: float, step_sleep: float, seed: int
) -> Outcome:
    name = f"goodput-{strategy.name}"
    argv = [
        str(Path(sys.executable).with_name("spotjob")), "run", "--name", name, "--runs-dir", str(runs_dir),
        "--trace", str(trace_file), "--notice", f"{window:g}", "--seed", str(seed), "--no-live",
        "--plot", str(runs_dir / name / "timeline.png"), *strategy.args,
        str(PROBE), "--timings", str(runs_dir / name / "timings"),
        "--steps", "10000000", "--step-sleep", f"{step_sleep:g}",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTJOB_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    timeline_path = runs_dir / name / "timeline.jsonl"
    log("%s: %s for %.0f s", strategy.name, strategy.description, horizon)
    with open(runs_dir / f"{name}.log", "wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        t0 = None
        while t0 is None:
            if proc.poll() is not None:
                raise RuntimeError(f"spotjob run exited {proc.returncode}; see {runs_dir / (name + '.log')}")
            started = [e for e in Timeline.read(str(timeline_path)) if e.kind == EventKind.RUN_STARTED]
            t0 = started[0].t if started else None
            time.sleep(0.2)
        while time.time() < t0 + horizon:
            if proc.poll() is not None:
                raise RuntimeError(f"spotjob run ended early ({proc.returncode}); see {runs_dir / (name + '.log')}")
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)  # the horizon: spotjob run stops every process of the run
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    numbers = analyse(Timeline.read(str(timeline_path)), horizon)
    summary = json.loads((runs_dir / name / "summary.json").read_text())
    outcome = Outcome(
        strategy=strategy.name,
        description=strategy.description,
        progress=numbers["progress"],
        reference=numbers["reference"],
        goodput=numbers["progress"] / numbers["reference"],
        notices=numbers["notices"],
        restarts=numbers["restarts"],
        lost_per_restart=numbers["lost"],
        reconciler_goodput=summary.get("goodput"),
        flushing_seconds=summary["flushing_seconds"],
        restarting_seconds=summary["restarting_seconds"],
        first_startup_seconds=numbers["startup"],
        rate=numbers["rate"],
        run_folder=str(runs_dir / name),
        restarts_detail=restart_phases(
            Timeline.read(str(timeline_path)), read_timings(runs_dir / name / "timings"), horizon
        ),
    )
    log(
        "%s: step %d of %.0f uninterrupted (goodput %.0f%%); %d notice(s), %d restart(s), steps lost %s",
        strategy.name, outcome.progress, outcome.reference, 100 * outcome.goodput, outcome.notices,
        outcome.restarts, outcome.lost_per_restart,
    )  # fmt: skip
    return outcome


def render_restarts(outcomes: list[Outcome], floor: dict[str, Any] | None) -> list[str]:
    """The restart overhead of the spotjob strategy, phase by phase, against its floor."""
    import statistics

    spotjob = next((o for o in outcomes if o.strategy == "spotjob"), None)
    if spotjob is None or not spotjob.restarts_detail:
        return []
    rows = spotjob.restarts_detail
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    lines = [
        "",
        "## Restart overhead (spotjob strategy)",
        "",
        "From the last step before the notice to the first step after the resume, on rank 0's own clock "
        f"(`bench/_restart_probe.py`), median of {len(rows)} restarts. The floor is a fresh pair of ranks "
        "started by the agent's launcher (`spotjob-agent --launcher direct`, as in the runs) that import torch, "
        "rendezvous and restore the same checkpoint, timed alone after the runs (median of 3).",
        "",
        "| phase | median s | floor s |",
        "|---|---:|---:|",
    ]
    for key, label in PHASES:
        f = floor.get(key) if floor and key in ("launch", "import", "rendezvous", "restore") else None
        lines.append(f"| {label} | {med[key]:.2f} | {'' if f is None else f'{f:.2f}'} |")
    total = floor["total"] if floor else None
    ratio = f"{med['overhead'] / total:.1f}x the floor (target ≤ 1.5x)" if total else ""
    lines.append(
        f"| **restart overhead** | **{med['overhead']:.2f}** | **{total:.2f}** |"
        if total
        else f"| **restart overhead** | **{med['overhead']:.2f}** | |"
    )
    lines += [
        "",
        f"Restart overhead: {ratio}. Each restart: " + ", ".join(f"{r['overhead']:.1f} s" for r in rows) + ".",
    ]
    if floor and "launch" in floor:
        with_launch = total + floor["launch"]
        lines += [
            "",
            f"The floor's total leaves out the launcher's own start ({floor['launch']:.2f} s in its row); with it "
            f"the floor is {with_launch:.2f} s, and the restart {med['overhead'] / with_launch:.2f}x that.",
        ]
    torchrun = (floor or {}).get("torchrun")
    if torchrun:
        lines += [
            "",
            f"The same floor under torchrun (`--launcher torchrun`), timed alongside: torchrun's own start "
            f"{torchrun['launch']:.2f} s (it imports torch before it starts the ranks), import "
            f"{torchrun['import']:.2f} s, rendezvous {torchrun['rendezvous']:.2f} s, restore "
            f"{torchrun['restore']:.2f} s, total {torchrun['total']:.2f} s.",
        ]
    return lines


def render(
    outcomes: list[Outcome], settings: dict[str, Any], machine: dict[str, Any], floor: dict[str, Any] | None = None
) -> str:
    s = settings
    lines = [
        "# Goodput under one preemption trace",
        "",
        f"`python -m bench.goodput` on {machine.get('cores', '?')} cores "
        f"({machine.get('cpu_model') or 'unknown CPU'}), {time.strftime('%Y-%m-%d')}; "
        "examples/train.py on 2 DDP ranks (gloo, CPU) under `spotjob run` (local mode), "
        f"paced at {s['step_sleep']:g} s per step (load average at the start: "
        f"{', '.join(f'{x:.1f}' for x in machine.get('load_average_at_start', ()))}).",
        "",
        f"Trace: notices with gaps drawn uniformly from {REAL_GAP_S[0]:g}-{REAL_GAP_S[1]:g} s and "
        f"{REAL_WINDOW_S:g} s windows, scaled by {s['scale']:g} (gaps {REAL_GAP_S[0] * s['scale']:g}-"
        f"{REAL_GAP_S[1] * s['scale']:g} s, {s['window']:g} s windows), seed {s['seed']}: notices at "
        f"{', '.join(f'{t:g}' for t in s['trace'])} s (none in the last {s['window'] + SETTLE_S:g} s); each strategy "
        f"runs for {s['horizon']:g} s of wall time. "
        "Restart cost (start-up, rendezvous, restore) is this machine's and is not scaled.",
        "",
        "| strategy | progress at the horizon (steps) | uninterrupted would reach | goodput | notices | restarts "
        "| steps lost per preemption | reconciler's goodput | time flushing / restarting |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for o in outcomes:
        each = ", ".join(map(str, o.lost_per_restart))
        lost = "-" if o.lost_per_preemption is None else f"{o.lost_per_preemption:.0f} ({each})"
        reconciler = "-" if o.reconciler_goodput is None else f"{o.reconciler_goodput:.0%}"
        lines.append(
            f"| **{o.strategy}**: {o.description} | {o.progress} | {o.reference:.0f} | {o.goodput:.0%} | {o.notices} "
            f"| {o.restarts} | {lost} | {reconciler} | {o.flushing_seconds:.1f} s / {o.restarting_seconds:.1f} s |"
        )
    lines += [
        "",
        "How to read it:",
        "",
        "- *goodput* = progress / (the first attempt's step rate x (horizon - its start-up)): the share of an "
        "uninterrupted run's progress that the strategy kept. Rate and start-up come from each run's own first "
        "attempt, before any notice.",
        "- *steps lost per preemption*: at each restart, the stopped attempt's last reported step minus the newest "
        "committed step (status.json is written about once a second, so up to a second of steps more may be lost "
        "than shown). In brackets, each restart.",
        "- *reconciler's goodput* is `JobStatus.goodput` when the run was stopped: (wall - flushing - restarting - "
        "retraining) / wall from the first time the workers trained, where retraining is the lost steps it saw at "
        "its passes over the observed step rate. It is the controller's own estimate, from coarser observations.",
        "- With the flush, spotjob stops at the notice and starts the next attempt while the old node's window is "
        "still open; the baselines keep training on a node that is about to die and restart only when it is gone.",
        "- The periodic baseline saves as often as spotjob does (every ~15 s here), so it loses little per "
        "preemption; restart cost dominates both. Its loss grows with the save interval (up to one interval per "
        "preemption), while the flush keeps spotjob's near zero whatever the interval.",
        "",
        f"Raw numbers: `bench/out/goodput-latest.json`; each run's logs, timeline and plot: `{s['runs_dir']}`. "
        + (f"The benchmark took {s['elapsed_seconds'] / 60:.1f} minutes." if "elapsed_seconds" in s else ""),
        *render_restarts(outcomes, floor),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__.split("\n\n")[0])
    p.add_argument("--horizon", type=float, default=170.0, help="wall seconds each strategy runs (default 170)")
    p.add_argument("--scale", type=float, default=0.5, help="time scale of the trace (default 0.5)")
    p.add_argument("--seed", type=int, default=3, help="the trace's seed (default 3)")
    p.add_argument("--every-steps", type=int, default=100, help="periodic checkpoint interval (default 100)")
    p.add_argument("--step-sleep", type=float, default=0.15, help="step pacing in seconds (default 0.15)")
    p.add_argument("--only", help="comma-separated strategies to run (default: all)")
    p.add_argument("--out", default=str(RESULTS_MD), help="the Markdown results file")
    args = p.parse_args(argv)
    if not (args.scale > 0 and args.horizon > 0 and args.every_steps >= 1 and args.step_sleep >= 0):
        p.error(
            "--scale and --horizon must be above 0, --every-steps >= 1 and --step-sleep >= 0; got "
            f"--scale {args.scale:g} --horizon {args.horizon:g} --every-steps {args.every_steps} "
            f"--step-sleep {args.step_sleep:g}"
        )

    started = time.monotonic()
    chosen = strategies(args.every_steps)
    if args.only:
        wanted = {w.strip() for w in args.only.split(",") if w.strip()}
        names = [s.name for s in chosen]
        if not wanted or wanted - set(names):
            p.error(f"--only takes {', '.join(names)}, comma-separated; got {args.only!r}")
        chosen = [s for s in chosen if s.name in wanted]
    window = REAL_WINDOW_S * args.scale
    trace = make_trace(args.seed, args.scale, args.horizon - window - SETTLE_S)
    if not trace:
        p.error(
            f"--horizon {args.horizon:g} holds no notice: the trace ends {window + SETTLE_S:g} s before the horizon "
            f"and its first gap (seed {args.seed}) is longer than what is left, so the run would measure no "
            "preemption; raise --horizon"
        )
    stamp = time.strftime("%Y%m%dT%H%M%S")
    runs_dir = OUT_DIR / f"goodput-runs-{stamp}"
    runs_dir.mkdir(parents=True)
    trace_file = runs_dir / "trace.json"
    trace_file.write_text(json.dumps(trace))
    log("trace: notices at %s s, %.0f s windows, horizon %.0f s", trace, window, args.horizon)
    outcomes = [
        run_strategy(
            s, runs_dir=runs_dir, trace_file=trace_file, window=window, horizon=args.horizon,
            step_sleep=args.step_sleep, seed=args.seed,
        )
        for s in chosen
    ]  # fmt: skip
    floor = None
    if any(o.strategy == "spotjob" for o in outcomes):
        log("restart floor: fresh ranks import torch, rendezvous and restore, timed alone")
        uri, job = str(runs_dir / "goodput-spotjob" / "checkpoints"), "local/goodput-spotjob"
        floor = restart_floor(uri, job, 3, runs_dir)
        log("restart floor: %.2f s (import %.2f, rendezvous %.2f, restore %.2f; the launcher's own start %.2f)",
            floor["total"], floor["import"], floor["rendezvous"], floor["restore"], floor["launch"])  # fmt: skip
        under_torchrun = restart_floor(uri, job, 3, runs_dir, launcher="torchrun")
        floor["torchrun"] = {k: v for k, v in under_torchrun.items() if k != "runs"}
        log(
            "the same under torchrun: %.2f s, torchrun's own start %.2f",
            under_torchrun["total"],
            under_torchrun["launch"],
        )
    settings = {
        "horizon": args.horizon,
        "scale": args.scale,
        "seed": args.seed,
        "window": window,
        "trace": trace,
        "every_steps": args.every_steps,
        "step_sleep": args.step_sleep,
        "runs_dir": os.path.relpath(runs_dir, REPO),
        "elapsed_seconds": round(time.monotonic() - started, 1),
    }
    machine = describe_machine(str(runs_dir))
    path = write_results("goodput", {"settings": settings, "machine": machine, "restart_floor": floor,
                                     "outcomes": [asdict(o) for o in outcomes]})  # fmt: skip
    Path(args.out).write_text(render(outcomes, settings, machine, floor))
    log("results: %s and %s", args.out, path)
    print(Path(args.out).read_text())
    return 0


if __name__ == "__main__":
    if shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None:
        sys.exit("bench.goodput: torchrun is not installed next to this interpreter; run `make venv`")
    sys.exit(main())
