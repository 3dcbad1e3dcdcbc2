"""The workers' processes of a local run, as ``LocalBackend`` keeps them (``WorkerProcesses``, its
base class): starting one on its node, stopping one as deleting a pod does, terminating a node with
everything on it, signalling them all (Ctrl-Z), and reading each worker's ``status.json`` into the
timeline (its steps, commits, first training step and exit)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time

from agent.process_tree import read_proc
from orchestrator.backends.base import BackendError, worker_name
from orchestrator.backends.local_cloud import ENV_NODE, ENV_RUN, ENV_WORKER, LocalNode, kill_marked
from orchestrator.backends.local_launch import LocalOptions, worker_command, worker_env
from orchestrator.backends.local_timeline import EventKind, Timeline
from orchestrator.backends.local_worker import STOP_REQUEST_TIMEOUT, LocalWorker, post_to_agent
from orchestrator.model import JobKey, JobSpec

log = logging.getLogger("orchestrator.backends.local")  # its lines as they were before the split

STEP_SAMPLE_SECONDS = 0.5
"""At most one step sample per worker this often in the timeline (the plot's resolution)."""
STEP_SAMPLE_FRACTION = 0.001
"""Past its first few minutes, a worker's step samples are at least this fraction of its age apart:
a worker that trains for days adds some thousands of lines (a thousand per e-fold of its age), not
two a second, to the timeline ``spotjob status``, the summary, the plot and a resume read whole."""


def step_sample_interval(age: float) -> float:
    """The least time between two step samples of a worker that has been training ``age`` seconds."""
    return max(STEP_SAMPLE_SECONDS, age * STEP_SAMPLE_FRACTION)


def _until_stopped(workers: list[LocalWorker], seconds: float) -> None:
    """Wait up to ``seconds`` in all for each of ``workers``' agents to have stopped (or exited)."""
    give_up = time.monotonic() + seconds
    for w in workers:
        while time.monotonic() < give_up and w.proc.poll() is None:
            info = read_proc(w.proc.pid)
            if info is None or info.state in ("T", "t"):
                break
            time.sleep(0.02)


class WorkerProcesses:
    """The per-worker half of ``LocalBackend``: its workers' processes, from their start to their
    exit. ``LocalBackend.__init__`` sets the state below; the monitor thread (``_watch``) and the
    reconciler's calls (``start_workers``, ``stop_workers``) share it under ``_lock``."""

    options: LocalOptions
    root: str
    """The run's folder, absolute."""
    run_id: str
    """This backend's id: the first half of every worker's and node's marker."""
    timeline: Timeline
    changed: threading.Event
    """Set when something happened the controller should look at now."""
    _token: str
    """The run's bearer token (its agents' control API)."""
    _lock: threading.RLock
    _workers: dict[str, LocalWorker]

    def signal_workers(self, sig: int, *, until_stopped: float = 0.0) -> int:
        """``sig`` to the agent of every worker still running (SIGTSTP, SIGCONT: ``spotjob run``
        paused with Ctrl-Z and resumed); how many got it. ``until_stopped``: then wait up to that
        many seconds for each agent to have stopped (it pauses its command first), so that a
        SIGCONT sent soon after cannot come before its pause and leave it paused."""
        with self._lock:
            workers = [w for w in self._workers.values() if w.alive]
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.proc.pid, sig)
        _until_stopped(workers, until_stopped)
        return len(workers)

    def continue_workers(self, *, once_stopped: float = 5.0) -> int:
        """SIGCONT to the agent of every worker still running, once each has stopped itself (at most
        ``once_stopped`` seconds): the end of a pause (``signal_workers(SIGTSTP)``). An agent pauses
        its command before it stops itself, so a SIGCONT that came before its stop would leave it
        stopped for good: a pause cut short (an interrupt during it) waits for that here."""
        with self._lock:
            workers = [w for w in self._workers.values() if w.alive]
        _until_stopped(workers, once_stopped)
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.proc.pid, signal.SIGCONT)
        return len(workers)

    def _command(
        self,
        key: JobKey,
        job: JobSpec,
        attempt: int,
        index: int,
        imds_url: str | None,
        control_dir: str,
        port: int,
        gce_url: str | None = None,
        azure_url: str | None = None,
    ) -> list[str]:
        """``worker_command`` with this backend's options: the one seam where tests change a worker's command."""
        return worker_command(self.options, key, job, attempt, index, imds_url, control_dir, port, gce_url, azure_url)

    def _spawn(self, key: JobKey, job: JobSpec, attempt: int, index: int, node: LocalNode, port: int) -> LocalWorker:
        name = worker_name(key, attempt, index)
        control_dir = os.path.join(node.path, name)
        os.makedirs(control_dir, exist_ok=True)
        log_path = os.path.join(self.root, "logs", f"{name}.log")
        env = worker_env(job)
        marker = f"{self.run_id}/{name}"
        env[ENV_NODE], env[ENV_WORKER], env[ENV_RUN] = node.marker, marker, self.root
        urls = [e.url if e is not None else None for e in (node.imds, node.gce, node.azure)]
        command = self._command(key, job, attempt, index, urls[0], control_dir, port, urls[1], urls[2])
        try:
            with open(log_path, "ab") as out:
                out.write(f"# {' '.join(command)}\n".encode())
                out.flush()
                proc = subprocess.Popen(
                    command,
                    cwd=self.options.workdir,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except OSError as e:
            raise BackendError(f"cannot start worker {name} on {node.name}: {e}") from e
        node.worker = name
        log.info("started %s on %s (pid %d, output in %s)", name, node.name, proc.pid, log_path)
        self.timeline.record(EventKind.WORKER_STARTED, worker=name, attempt=attempt, node=node.name)
        return LocalWorker(name, key, attempt, index, node, proc, control_dir, log_path, marker)

    def _stop(self, w: LocalWorker) -> None:
        """(a thread per worker) What deleting a pod does: SIGTERM, the grace period, SIGKILL;
        without a flush, ``POST /stop`` to the agent first (it stops its command and exits 79)."""
        if not w.stop_flush and w.alive:
            try:
                post_to_agent(
                    w, self._token, "/stop", {"reason": "the gang is stopped without a flush"}, STOP_REQUEST_TIMEOUT
                )
                w.proc.wait(timeout=self.options.kill_grace + 10)
            except (BackendError, subprocess.TimeoutExpired) as e:
                log.warning("%s did not stop through its API (%s); terminating it", w.name, e)
        n = kill_marked(ENV_WORKER, w.marker, grace=self.options.kill_grace, reason=f"stopping {w.name}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(timeout=10)
        log.info("stopped %s (%d process(es))", w.name, n)
        with self._lock:
            self._note_exit(w)
            self._remove(w)
        self.changed.set()

    def _remove(self, w: LocalWorker) -> None:
        self._workers.pop(w.name, None)
        if w.node.worker == w.name:
            w.node.worker = None

    def _terminate(self, node: LocalNode, *, acknowledged: bool = False) -> None:
        """The window ended (or, on Azure, its agent acknowledged the event): the instance is
        reclaimed with everything on it."""
        with self._lock:
            victims = [w for w in self._workers.values() if w.node is node and w.alive]
            for w in victims:
                w.lost = True
            node.terminated = True
        n = kill_marked(ENV_NODE, node.marker, grace=0, reason=f"terminating {node.name}")
        node.stop_emulators()
        for w in victims:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=5)
        lost = ", ".join(w.name for w in victims) or "nothing"
        # A warning only where the window's end took something with it; a node left empty by a flush is normal.
        ended = "its agent acknowledged the event, so Azure acted early" if acknowledged else "its notice window ended"
        log.log(
            logging.WARNING if n or victims else logging.INFO,
            "%s is gone (%s): killed %d process(es); lost %s",
            node.name,
            ended,
            n,
            lost,
        )
        # Azure's node says why it stopped when it did: at NotBefore, or early, once acknowledged.
        stopped = {"stopped": "acknowledged" if acknowledged else "NotBefore"} if node.azure is not None else {}
        self.timeline.record(
            EventKind.NODE_TERMINATED, node=node.name, killed=n, lost=[w.name for w in victims], **stopped
        )
        self.changed.set()

    def _note_exit(self, w: LocalWorker) -> None:
        if w.exit_seen or w.alive:
            return
        self._sample(w)  # what it reported last (a flush's commit) before it went
        w.exit_seen = True
        code = None if w.lost else w.exit_code()
        self.timeline.record(EventKind.WORKER_EXITED, worker=w.name, attempt=w.attempt, code=code, lost=w.lost)
        self.changed.set()

    def _watch(self, w: LocalWorker) -> None:
        """Timeline samples from one worker's status.json: steps, commits, the first training step, exit."""
        self._sample(w)
        if not w.alive:
            with self._lock:
                self._note_exit(w)

    def _sample(self, w: LocalWorker) -> None:
        """One look at a worker's status.json (under the lock: the monitor and a stop both look)."""
        status = w.rank_status()
        if status is None:
            return
        with self._lock:
            state = status.get("state")
            step = status.get("step")
            committed = status.get("last_committed_step")
            now = time.monotonic()
            if isinstance(step, int) and step != w.last_step:
                w.last_step = step
                first = w.first_step_sample if w.first_step_sample is not None else now
                if now - w.last_step_sample >= step_sample_interval(now - first) or state == "starting":
                    w.last_step_sample = now
                    w.first_step_sample = first
                    self.timeline.record(EventKind.STEP, worker=w.name, attempt=w.attempt, step=step, state=state)
            if state != "starting" and not w.training_seen:
                w.training_seen = True
                self.changed.set()
            # The counter says how many committed since the last look (several may have). From an
            # agent without it: a restore reports the step it loaded as committed too, but only a
            # save times itself.
            count = status.get("commits")
            if isinstance(count, int) and not isinstance(count, bool):
                new = count - w.commits
            else:
                new = int(committed != w.last_commit and status.get("last_save_seconds") is not None)
            if isinstance(committed, int):
                w.last_commit = committed
            if new > 0 and isinstance(committed, int):
                w.commits += new
                self.timeline.record(EventKind.COMMIT, worker=w.name, attempt=w.attempt, step=committed, count=new)
                self.changed.set()
