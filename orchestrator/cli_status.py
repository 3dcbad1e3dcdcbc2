"""``spotjob status`` lists the runs under ``./spotjob-runs``; ``spotjob status NAME`` shows one. A
run whose driver is gone is shown as storage and the processes say it is now, not as its status
last said.

It only reads: the run folder (``orchestrator.run_folder``), its job file and Events, storage, and
the process table (through psutil). It never takes the driver lock but for an instant (a shared ``flock`` to test it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from datetime import UTC

import psutil
from rich.console import Console

from agent.catalog import latest_valid
from agent.storage import StorageError, open_storage
from orchestrator.backends.local_cloud import run_pids
from orchestrator.backends.local_failure import log_excerpt
from orchestrator.events import RecordedEvent, events_path, read_events
from orchestrator.live import RunRecord, render_run_detail, render_run_list
from orchestrator.model import CheckpointInfo, JobKey, JobSpec, job_name_problem
from orchestrator.run_folder import (
    LOG_EXCERPT_LINES,
    RUNS_DIR,
    DriverLock,
    empty_runs_dir_problem,
    failed_worker_logs,
    job_file_gone_problem,
    older_layout_problem,
    read_cloud,
    reported_step,
    run_file_pid,
)
from orchestrator.store import JsonFileJobStore, StoreError

log = logging.getLogger(__name__)

EXIT_USAGE = 2
"""No such run, or a runs folder that cannot be listed: as argparse's own usage errors."""


def _driver_pid(path: str) -> int | None:
    """The pid of the live process driving the run in ``path`` (0: alive, pid unknown), or None."""
    if os.path.exists(os.path.join(path, DriverLock.FILE)):
        return DriverLock.holder(path)
    # A run folder from before the driver lock: the pid in run.json, if it is still a spotjob.
    pid = run_file_pid(path)
    if pid is None:
        return None
    try:
        command = " ".join(psutil.Process(pid).cmdline())  # psutil: /proc on Linux, sysctl on macOS
    except (psutil.Error, OSError):
        return None
    return pid if "spotjob" in command or pid == os.getpid() else None


def _storage_now(spec: JobSpec) -> tuple[CheckpointInfo | None, str | None]:
    """The newest valid checkpoint in storage now, or why it cannot be read."""
    try:
        storage = open_storage(spec.checkpoint.uri)
        found = latest_valid(storage)
    except (StorageError, ValueError) as e:
        return None, str(e)
    if found is None or found.manifest is None:
        return None, None
    return CheckpointInfo(step=found.ref.step, uri=storage.url(found.ref.folder), time=found.manifest.created_at), None


def read_run(runs_dir: str, name: str) -> RunRecord | None:
    """The run folder ``<runs_dir>/<name>`` as ``spotjob status`` shows it; None if it holds no run.

    Never raises for what a folder holds: a run that cannot be read comes back with ``error``
    saying why. A run whose driver is gone is read from storage and the processes as they are now.
    """
    path = os.path.abspath(os.path.join(runs_dir, name))
    if job_name_problem(name) is not None:
        return None
    key = JobKey.local(name)
    store = JsonFileJobStore(path, fsync=False, create=False)
    if not os.path.lexists(store.path(key)):
        if older_layout_problem(path, name) is not None:  # the layout before jobs had namespaces
            return RunRecord(name, path, None, None, False, error="a run folder of an older spotjob (not read)")
        gone = job_file_gone_problem(path, name)
        if gone is not None:  # what a run left, its job file removed: one line saying so, not "no run"
            return RunRecord(name, path, None, None, _driver_pid(path) is not None, error=gone)
        return None
    try:
        return _read_run(path, key, store)
    except Exception as e:  # one folder never takes the whole listing down
        log.debug("reading the run folder %s failed", path, exc_info=True)
        return RunRecord(name, path, None, None, False, error=f"cannot read this run folder: {type(e).__name__}: {e}")


def _read_run(path: str, key: JobKey, store: JsonFileJobStore) -> RunRecord:
    notes: list[str] = []
    try:
        cloud = read_cloud(path)
    except ValueError as e:
        cloud = "aws"
        notes.append(str(e))
    try:
        events = read_events(events_path(path, key))
    except (OSError, ValueError) as e:
        events = []
        notes.append(f"its events cannot be read: {e}")
    events = [e if e.time.tzinfo else _aware(e) for e in events]
    driver = _driver_pid(path)
    try:
        stored = store.get(key)
    except StoreError as e:
        return RunRecord(key.name, path, None, None, driver is not None, error=str(e), events=events, notes=notes)
    if stored is None:
        return RunRecord(key.name, path, None, None, driver is not None, error="its job file is gone", events=events)
    record = RunRecord(
        key.name,
        path,
        stored.spec,
        stored.status,
        driver is not None,
        error=_plain(stored.invalid) if stored.invalid else None,
        events=events,
        driver_pid=driver or None,
        notes=notes,
        cloud=cloud,
    )
    status = stored.status
    if driver is None and status is not None and not status.phase.terminal and stored.spec is not None:
        checkpoint, problem = _storage_now(stored.spec)
        record = record.with_truth(
            processes=len(run_pids(path)),
            checkpoint=checkpoint,
            storage_problem=problem,
            reported_step=reported_step(path, status),
        )
    return record


def _plain(problems: str) -> str:
    """A stored part that does not validate, said without pydantic's turns of phrase."""
    return problems.replace("Input should be", "must be").replace("Value error, ", "")


def _aware(e: RecordedEvent) -> RecordedEvent:
    """An Event whose time was written without a zone: UTC, as spotjob writes them."""
    return RecordedEvent(
        e.time.replace(tzinfo=UTC),
        e.first_time.replace(tzinfo=UTC) if e.first_time.tzinfo is None else e.first_time,
        e.type,
        e.reason,
        e.message,
        e.node,
        e.count,
    )


def list_runs(runs_dir: str) -> list[RunRecord]:
    try:
        names = sorted(e.name for e in os.scandir(runs_dir) if e.is_dir())
    except FileNotFoundError:
        return []
    return [r for r in (read_run(runs_dir, n) for n in names) if r is not None]


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader of stdout left (``| head``): up to ``spotjob``'s main, which exits 141 as
        for every command, instead of rich's own exit 1."""
        self.quiet = True
        raise BrokenPipeError


def status_command(args: argparse.Namespace) -> int:
    # Piped or captured: wide lines rather than rich's 80 columns of ellipses.
    console = _Console() if sys.stdout.isatty() else _Console(width=200)
    empty = empty_runs_dir_problem(args.runs_dir)  # as spotjob run refuses it
    if empty is not None:
        print(f"spotjob status: {empty}", file=sys.stderr)
        return EXIT_USAGE
    if args.name is None:
        if os.path.exists(args.runs_dir) and not os.path.isdir(args.runs_dir):
            print(f"spotjob status: --runs-dir {args.runs_dir} is a file, not a folder", file=sys.stderr)
            return EXIT_USAGE
        try:
            runs = list_runs(args.runs_dir)
        except OSError as e:
            print(f"spotjob status: cannot list {os.path.abspath(args.runs_dir)}: {e}", file=sys.stderr)
            return EXIT_USAGE
        if args.json:
            print(json.dumps([_record_json(r) for r in runs], indent=2))
        elif not runs:
            console.print(f"no runs under {os.path.abspath(args.runs_dir)}")
        else:
            console.print(render_run_list(runs))
        return 0
    record = read_run(args.runs_dir, args.name)
    if record is None:
        print(f"spotjob status: no run named {args.name!r} under {os.path.abspath(args.runs_dir)}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(_record_json(record), indent=2))
    else:
        console.print(render_run_detail(record, failed_logs=_failed_logs(record)))
    return 0


def _failed_logs(r: RunRecord) -> list[tuple[str, list[str]]]:
    """The end of each log of a worker whose own exit failed the current attempt."""
    if r.status is None:
        return []
    return [
        (path, [line[:300] for line in log_excerpt(path, LOG_EXCERPT_LINES)])
        for path in failed_worker_logs(r.path, r.status.workers)
    ]


def _record_json(r: RunRecord) -> dict[str, object]:
    doc: dict[str, object] = {
        "name": r.name,
        "path": r.path,
        "controllerAlive": r.controller_alive,
        "driverPid": r.driver_pid,
        "spec": r.spec.model_dump(mode="json") if r.spec else None,
        "status": r.status.model_dump(mode="json", exclude_none=True) if r.status else None,
        "events": [
            {
                "time": e.time.isoformat(),
                "firstTime": e.first_time.isoformat(),
                "type": str(e.type),
                "reason": e.reason,
                "message": e.message,
                "count": e.count,
                **({"node": e.node} if e.node else {}),
            }
            for e in r.events
        ],
        "error": r.error,
        "notes": list(r.notes),
        "cloud": r.cloud,
    }
    if r.truth is not None:
        t = r.truth
        doc["now"] = {
            "processesAlive": t.processes,
            "reportedStep": t.reported_step,
            "lastCheckpoint": t.checkpoint.model_dump(mode="json") if t.checkpoint else None,
            "storageProblem": t.storage_problem,
        }
    return doc


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    status = sub.add_parser(
        "status",
        help="list local runs, or show one",
        description=f"Without NAME: every run under ./{RUNS_DIR}. With NAME: its phase, conditions and events. "
        "A run whose spotjob run process is gone is shown as storage and its processes are now.",
    )
    status.add_argument("name", metavar="NAME", nargs="?", help="a run's name")
    status.add_argument("--runs-dir", default=RUNS_DIR, help=f"default ./{RUNS_DIR}")
    status.add_argument("--json", action="store_true", help="the stored spec and status as JSON")
    status.set_defaults(func=status_command)
