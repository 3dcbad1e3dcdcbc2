"""A stand-in for ``torchrun train.py`` that talks to spotjob-agent exactly as the ranks will. No torch.

Launcher role (what torchrun does): start ``--nproc`` workers, each in a session of its own
(``start_new_session=True``, as torch elastic does), with RANK / WORLD_SIZE / LOCAL_RANK; wait
for all; exit 0 if all did, else the first failing worker's code (1 if it died of a signal, as
torchrun reports a ChildFailedError). The launcher does not forward signals: if it is killed, its
workers live on, which is exactly what the agent has to cope with.

Worker role, through ``ControlDir`` only: each step rank 0 writes ``status.json``; a
``save.json`` gets an early "save"; when ``flush.json`` appears rank 0 commits (``flushed.json``)
or fails (``flush-failed.json``) and every rank leaves. ``--mode``:

- ``flush``              flush on request, exit 0
- ``fail``               the flush fails: flush-failed.json, exit 1
- ``abort-after-flush``  flushed.json, then os.abort() (the interpreter-exit abort)
- ``ignore-flush``       never answers flush.json (the agent must kill it at the deadline)
- ``hang-after-flush``   flushed.json, then hangs (the agent must kill it after --exit-timeout)
- ``orphan``             as hang-after-flush, and rank 0 first starts a grandchild in its own
                         session that ignores SIGTERM (only SIGKILL stops it); its pid goes to --pid-file
- ``finish``             run --steps steps, mark closed, exit 0
- ``crash``              run --steps steps, exit --exit-code without closing (a failed job)
- ``finish-abort``       run --steps steps, mark closed on every rank, then os.abort()
- ``finish-hold``        run --steps steps, mark closed on every rank, then wait for --hold-file
                         before exiting 0 (work a script does after close(): an export, an eval)
- ``infra``              after --steps steps rank 0 reports an infrastructure error (storage
                         unreachable) and every rank exits 1, as the Checkpointer does during restore

``--hold-file PATH``: rank 0 waits for PATH to exist before committing a flush (lets a test send
a second notice while the first flush is surely in progress). ``--events PATH``: rank 0 appends
one line per flush / early save it handled. ``--launcher-exits-on-flush``: the launcher exits 1 as
soon as ``flush.json`` appears, its workers flushing on (a torchrun that died).
``--launcher-waits-for PATH``: once every worker exited, the launcher records ``ranks exited`` in
``--events`` and waits for PATH (torchrun in its exit barrier, waiting for another node's).
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import subprocess
import sys
import time

from agent.control_channel import ENV_CHECKPOINT_URI, ENV_CONTROL_DIR, ControlDir, FlushResult, RankStatus

STEP_SECONDS = 0.02


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--mode", default="flush")
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--exit-code", type=int, default=0)
    p.add_argument("--hold-file")
    p.add_argument("--events")
    p.add_argument("--pid-file")
    p.add_argument("--launcher-exits-on-flush", action="store_true")
    p.add_argument("--launcher-waits-for")
    return p.parse_args()


def launcher(args: argparse.Namespace) -> int:
    workers = []
    for rank in range(args.nproc):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(args.nproc),
            "LOCAL_WORLD_SIZE": str(args.nproc),
        }
        workers.append(
            subprocess.Popen([sys.executable, __file__, "--worker", *sys.argv[1:]], env=env, start_new_session=True)
        )
    if args.launcher_exits_on_flush:
        control = ControlDir(os.environ[ENV_CONTROL_DIR])
        while not control.flush_requested():
            time.sleep(0.01)
        return 1
    codes = [w.wait() for w in workers]
    if args.launcher_waits_for:
        record(args, "ranks exited")
        while not os.path.exists(args.launcher_waits_for):
            time.sleep(0.01)
    failed = [c for c in codes if c != 0]
    if not failed:
        return 0
    return 1 if failed[0] < 0 else failed[0]


def record(args: argparse.Namespace, line: str) -> None:
    if args.events:
        with open(args.events, "a") as f:
            f.write(line + "\n")


def start_orphan(pid_file: str) -> None:
    code = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"open({pid_file!r} + '.tmp', 'w').write(str(os.getpid()))\n"
        f"os.replace({pid_file!r} + '.tmp', {pid_file!r})\n"
        "time.sleep(600)\n"
    )
    subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    while not os.path.exists(pid_file):
        time.sleep(0.01)


def abort() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the test's folder
    sys.stdout.flush()
    os.abort()


def worker(args: argparse.Namespace) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    control = ControlDir(os.environ[ENV_CONTROL_DIR])
    uri = os.environ.get(ENV_CHECKPOINT_URI, "file:///nowhere")
    if args.mode == "orphan" and rank == 0:
        start_orphan(args.pid_file)
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    status = RankStatus(state="training", world_size=world, local_world_size=local_world, last_save_seconds=0.1)
    step = 0
    while True:
        step += 1
        status.step = step
        if rank == 0:
            save = control.save_request()
            if save is not None:
                status.last_committed_step, status.last_committed_uri = step, f"{uri}/step-{step:09d}"
                control.clear_save_request()
                record(args, f"save {save.id}")
            control.write_status(status)
        if control.flush_requested() and args.mode != "ignore-flush":
            return flush(args, control, rank, step, uri, status)
        if args.steps and step >= args.steps:
            if args.mode == "crash":
                return args.exit_code
            if args.mode == "infra":
                if rank == 0:
                    control.report_infra_error(rank, "storage unreachable: simulated outage")
                return 1
            control.mark_closed(rank)
            if args.mode == "finish-abort":
                abort()
            if args.mode == "finish-hold":
                if rank == 0:
                    record(args, "closed")
                while not os.path.exists(args.hold_file):
                    time.sleep(0.01)
            return 0
        time.sleep(STEP_SECONDS)


def flush(args: argparse.Namespace, control: ControlDir, rank: int, step: int, uri: str, status: RankStatus) -> int:
    request = control.flush_request()
    assert request is not None
    if rank == 0:
        while args.hold_file and not os.path.exists(args.hold_file):
            time.sleep(0.01)
        record(args, f"flush {request.id}")
        took = time.time() - request.requested_at
        if args.mode == "fail":
            control.write_flush_result(FlushResult(None, None, request.id, None, error="simulated storage outage"))
            status.state = "flush-failed"
        else:
            committed = f"{uri}/step-{step:09d}"
            control.write_flush_result(FlushResult(step, committed, request.id, took))
            status.state, status.last_committed_step, status.last_committed_uri = "flushed", step, committed
        control.write_status(status)
    else:
        while control.flush_result() is None:  # the other ranks wait for rank 0's commit, as in a collective
            time.sleep(0.01)
    if args.mode == "fail":
        return 1
    if args.mode == "abort-after-flush":
        abort()
    if args.mode in ("hang-after-flush", "orphan"):
        while True:
            time.sleep(1)
    return 0


def main() -> int:
    args = parse()
    if args.worker:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        return worker(args)
    return launcher(args)


if __name__ == "__main__":
    sys.exit(main())
