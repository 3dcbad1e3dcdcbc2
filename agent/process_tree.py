"""Every process the agent's command started, and how to stop all of them. Through psutil.

Killing the command's process group is not enough: torchrun starts each worker with
``start_new_session=True``, so the workers have process groups (and sessions) of their own, and
a worker may start helpers (dataloader workers, a compile server) that do the same. Three layers
find them, each covering a gap of the one before:

1. The agent makes itself a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``, Linux): an
   orphaned descendant is re-parented to the agent instead of to init, so it stays in the tree.
2. ``refresh()`` walks the parent links down from the command (and from the agent's children
   that were seen below it, or carry its marker) a few times a second and remembers every
   descendant with its creation time (so a recycled pid is never mistaken for one of ours). The
   agent's process's other children are not the command's and are left alone.
3. The command runs with ``SPOTJOB_AGENT_ID=<id>`` in its environment, inherited by everything it
   starts; ``stop_all`` also looks for it in every process's environment (``marked``), which finds
   a process that escaped both of the above (re-parented to init before the agent saw it,
   subreaper unavailable).

``stop_all`` sends SIGTERM to every one, gives them ``grace`` seconds, then SIGKILLs whatever is
left — re-scanning each round, since a dying process may still fork. Signals go through psutil's
``Process``, which refuses to signal a pid that now belongs to another process. The agent reaps
the zombies it inherits as a subreaper (``reap``), but never the command itself: that one's status
belongs to ``subprocess.Popen``. An orphan that exited before any walk saw it (``(helper &)`` in a
shell, a helper that daemonizes) is known by its session, which its zombie keeps: the command's, or
a member's that made a session of its own. As PID 1 of a container the agent is everyone's init,
and reaps every zombie child but the command.

psutil lists the pids, reads each process's environment (telling a vanished process from one we
may not read) and sends the signals; the walk (twice a second in the agent's watch loop,
``agent.launcher.TREE_SCAN_EVERY``, and at each of its ticks while ranks outlive torchrun) reads
``/proc/<pid>/stat`` itself (``read_proc`` says why; where there is no ``/proc``, as on macOS, it
asks psutil too), and the subreaper ``prctl`` is not something psutil offers.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import psutil

log = logging.getLogger(__name__)

ENV_AGENT_ID = "SPOTJOB_AGENT_ID"
"""Marks every process of one agent's command (inherited through fork/exec)."""

STOP_POLL_FIRST = 0.01
STOP_POLL_MAX = 0.05
"""``stop_processes`` looks for what is left after STOP_POLL_FIRST s, doubling up to this."""

ENVIRON_REREAD_PAUSES = (0.002, 0.004, 0.008, 0.016)
"""``marked`` reads an environment that read empty again after each of these pauses (30 ms in all),
while it still reads empty: a process caught inside its exec (see ``environ_of``)."""

_PR_SET_CHILD_SUBREAPER = 36
_PF_KTHREAD = 0x00200000
"""Linux's flag of a kernel thread, in field 9 of ``/proc/<pid>/stat``."""
_KTHREADD_PID = 2
"""Linux's kthreadd, the parent of every other kernel thread."""
_GONE = (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied)


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    state: str
    """One letter from /proc/<pid>/stat; ``Z`` is a zombie (dead, not yet reaped)."""
    start_ticks: int
    """Start time since boot in clock ticks (without ``/proc``: the creation time in microseconds):
    with the pid, a unique identity."""
    comm: str
    session: int = 0
    """Its session id, which a zombie keeps: who it belonged to once its environment is gone."""
    kernel: bool = False
    """A kernel thread (or, without ``/proc``, one of the kernel's own processes): its environment
    reads empty for good, and never holds a marker."""


_procfs: bool | None = None
"""Whether ``/proc/<pid>/stat`` can be read here (Linux); None until first asked."""


def _have_procfs() -> bool:
    global _procfs
    if _procfs is None:
        try:
            with open("/proc/self/stat", "rb"):
                _procfs = True
        except OSError:
            _procfs = False
    return _procfs


BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
"""Linux's id of this boot (the host's, in a container too): a pid or a record from another boot
names something else."""


def boot_id() -> str | None:
    """This boot's id, None where there is none to read (not Linux)."""
    try:
        with open(BOOT_ID_PATH) as f:
            return f.read(100).strip() or None
    except OSError:
        return None


def read_proc(pid: int) -> ProcInfo | None:
    """``/proc/<pid>/stat`` parsed, or None if the process is gone.

    The one thing not through psutil: the watch loop walks every process twice a second, and
    one read of each ``stat`` costs a quarter of what ``psutil.process_iter`` does for the same
    fields here (1.6 ms against 6 ms a pass with ~90 processes: 0.3% of a core against 1.2% while
    nothing happens). Without ``/proc`` (macOS, the BSDs) the same fields come from psutil
    (``_read_psutil``): slower, the same fields.
    """
    if not _have_procfs():
        return _read_psutil(pid)
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm is in parentheses and may itself contain spaces and ')': split at the last one.
    head, _, rest = raw.rpartition(")")
    comm = head.partition("(")[2]
    fields = rest.split()
    try:
        kernel = bool(int(fields[6]) & _PF_KTHREAD)
        return ProcInfo(pid, int(fields[1]), fields[0], int(fields[19]), comm, int(fields[3]), kernel)
    except (IndexError, ValueError):
        return None


def _read_psutil(pid: int) -> ProcInfo | None:
    """``read_proc`` where there is no ``/proc``: psutil's fields, the creation time (in
    microseconds) standing for the start ticks as the process's identity. Only ``Z`` of the state
    matters here; a zombie psutil refuses to read (``ZombieProcess``) counts as gone, since a
    zombie is never signalled, and without ``/proc`` there is no subreaper to reap it either.

    psutil has no process flags: on Linux (where this path runs only with ``/proc`` made unreadable
    to this module) a kernel thread is kthreadd (pid 2, a child of pid 0) or a child of it;
    elsewhere (macOS, the BSDs) pid 0 is the kernel and a child of pid 0 the kernel's own or init.
    None of them ever holds a marker; a process wrongly taken for one is only not read again when
    its environment reads empty (``marked``)."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            status = proc.status()
            ppid = proc.ppid()
            created = proc.create_time()
            name = proc.name()
    except _GONE:
        return None
    state = "Z" if status == psutil.STATUS_ZOMBIE else (status[:1].upper() or "?")
    if sys.platform.startswith("linux"):
        # kthreadd and its children. In a container's own pid namespace no kernel thread is seen,
        # and pid 2 is some other process: hence the name.
        kernel = (pid == _KTHREADD_PID and ppid == 0 and name == "kthreadd") or (
            ppid == _KTHREADD_PID and _name_of(_KTHREADD_PID) == "kthreadd"
        )
    else:
        kernel = pid == 0 or ppid == 0
    return ProcInfo(pid, ppid, state, round(created * 1_000_000), name, kernel=kernel)


def _name_of(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except _GONE:
        return ""


def all_processes() -> list[ProcInfo]:
    out = []
    for pid in psutil.pids():
        info = read_proc(pid)
        if info is not None:
            out.append(info)
    return out


def environ_of(pid: int) -> dict[str, str] | None:
    """The environment of process ``pid``; None if it is gone or not ours to read. Empty for a
    process caught inside its exec: the kernel sets the new program's environment after the exec
    has already closed its close-on-exec files (so after ``Popen`` returned in its parent). Empty
    for good for a kernel thread and for a process started with none (``env -i``)."""
    try:
        return dict(psutil.Process(pid).environ())
    except (*_GONE, OSError):
        return None


def marked(variable: str, value: str, *, among: Iterable[ProcInfo] | None = None) -> list[ProcInfo]:
    """Live (non-zombie) processes, other than this one, whose environment holds ``variable=value``:
    wherever they were re-parented, whichever session they made for themselves.

    Each environment is read once, but one that reads empty (``environ_of``) may be a marked
    process caught inside its exec, not unmarked: a scan that missed it and found nothing else
    would end ``stop_processes`` with it still running. Those are read again after each of
    ``ENVIRON_REREAD_PAUSES`` (30 ms in all) while any still reads empty, so only a scan that saw
    such a process pauses; one that reads empty throughout (started with an empty environment,
    ``env -i``) is taken as unmarked. Kernel threads (``ProcInfo.kernel``), which always read
    empty, are not read again.
    """
    me = os.getpid()
    procs = all_processes() if among is None else among
    live = [p for p in procs if p.state != "Z" and p.pid != me]
    found: set[int] = set()
    empty: list[ProcInfo] = []
    for p in live:
        environ = environ_of(p.pid)
        if environ is None:
            continue
        if environ.get(variable) == value:
            found.add(p.pid)
        elif not environ and not p.kernel:
            empty.append(p)
    for pause in ENVIRON_REREAD_PAUSES:
        if not empty:
            break
        time.sleep(pause)
        still = []
        for p in empty:
            environ = environ_of(p.pid)
            if environ == {}:
                still.append(p)
            elif environ is not None and environ.get(variable) == value:
                found.add(p.pid)
        empty = still
    return [p for p in live if p.pid in found]


def signal_process(info: ProcInfo, sig: int) -> bool:
    """Send ``sig`` to ``info``'s process if it is still that process (same start time); False if
    it is gone or its pid now belongs to another process. ``PermissionError`` if not ours to signal."""
    now = read_proc(info.pid)
    if now is None or now.start_ticks != info.start_ticks:
        return False  # gone, or the pid was recycled: not ours any more
    try:
        psutil.Process(info.pid).send_signal(sig)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied as e:
        raise PermissionError(f"not permitted to signal process {info.pid}") from e
    return True


def become_subreaper() -> bool:
    """Ask Linux to re-parent our orphaned descendants to us. False where unavailable: on another
    kernel (macOS), whose ``prctl``, if it has one, does not take Linux's option numbers."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_CHILD_SUBREAPER) failed: errno %d", ctypes.get_errno())
            return False
    except (OSError, AttributeError) as e:
        log.warning("cannot become a child subreaper: %s", e)
        return False
    return True


class ProcessTree:
    """The command's processes: everything below the command (``command_pid``), the orphans of it
    re-parented to ``root_pid`` (the agent, a subreaper), and the marked ones.

    Another child of the agent's process is none of its business: a process that embeds the agent
    (a test, a user's own launcher) may have started servers of its own, and they are left alone.
    """

    def __init__(self, agent_id: str, root_pid: int | None = None) -> None:
        self.agent_id = agent_id
        self.root_pid = os.getpid() if root_pid is None else root_pid
        self.command_pid: int | None = None
        """Never reaped here: ``subprocess.Popen`` owns its exit status."""
        self._known: dict[int, int] = {}
        """pid → start ticks of every descendant seen so far."""
        self._foreign: set[tuple[int, int]] = set()
        """(pid, start ticks) of the root's children that are not the command's (no marker)."""
        self.sigkilled: set[int] = set()
        """Members ``stop_all`` had to SIGKILL (still running ``grace`` s after its SIGTERM)."""
        self.seen_below_command = False
        """Whether a walk ever found a member other than the command's own process (its ranks,
        under torchrun): told from a torchrun still waiting for its rendezvous, which never had any."""

    def refresh(self, scan_environ: bool = False, *, reap: bool = False) -> list[ProcInfo]:
        """The live (non-zombie) members now; remembers new ones. ``reap``: also collect the exit
        status of inherited orphans (``reap()``) from the same walk of every process, so the watch
        loop reads /proc once a scan, not twice."""
        procs = all_processes()
        by_pid = {p.pid: p for p in procs}
        children: dict[int, list[ProcInfo]] = {}
        for p in procs:
            children.setdefault(p.ppid, []).append(p)
        members: dict[int, ProcInfo] = {}
        # The root's children that are ours: the command, a descendant seen before (re-parented to
        # the root), or one carrying the command's marker (an orphan never seen below it).
        for child in children.get(self.root_pid, []):
            if self._ours(child):
                members[child.pid] = child
        stack = list(members)
        while stack:
            for child in children.get(stack.pop(), []):
                if child.pid not in members and child.pid != self.root_pid:
                    members[child.pid] = child
                    stack.append(child.pid)
        # Seen before under the same identity, but no longer below us (re-parented to init).
        for pid, ticks in self._known.items():
            known = by_pid.get(pid)
            if known is not None and known.start_ticks == ticks:
                members.setdefault(pid, known)
        if scan_environ:
            others = [p for p in procs if p.pid not in members and p.pid != self.root_pid]
            for p in marked(ENV_AGENT_ID, self.agent_id, among=others):
                members[p.pid] = p
        for p in members.values():
            self._known.setdefault(p.pid, p.start_ticks)
            if p.pid != self.command_pid and self.command_pid is not None:
                self.seen_below_command = True
        self._known = {pid: t for pid, t in self._known.items() if pid in by_pid}
        self._foreign = {(pid, t) for pid, t in self._foreign if pid in by_pid}
        if reap:
            self.reap(among=procs)
        return [p for p in members.values() if p.state != "Z"]

    def known_alive(self, besides: int | None = None) -> bool:
        """Whether a member seen before (other than ``besides``) still runs: a look at the few pids
        already known, under the identity they had, without walking every process."""
        for pid, ticks in self._known.items():
            if pid == besides:
                continue
            info = read_proc(pid)
            if info is not None and info.start_ticks == ticks and info.state != "Z":
                return True
        return False

    def _ours(self, child: ProcInfo) -> bool:
        if child.pid == self.command_pid or self._known.get(child.pid) == child.start_ticks:
            return True
        identity = (child.pid, child.start_ticks)
        if identity in self._foreign or child.state == "Z":
            return False
        environ = environ_of(child.pid)
        if environ is not None and environ.get(ENV_AGENT_ID) == self.agent_id:
            return True
        if environ != {}:
            # Not ours, for good. An empty environment is a process caught between fork and exec,
            # whose marker is not there yet: looked at again at the next walk, not taken as foreign.
            self._foreign.add(identity)
        return False

    def reap(self, among: Iterable[ProcInfo] | None = None) -> None:
        """Collect the exit status of inherited orphans (they are our children as a subreaper): the
        zombies among the root's children that were members, or that exited unseen in the session
        of the command or of a member, never another child's status; as PID 1, every zombie child
        but the command (nothing else would ever reap them). ``among``: a walk of every process
        just taken (else one is taken here)."""
        init = self.root_pid == 1
        for p in all_processes() if among is None else among:
            if p.ppid != self.root_pid or p.state != "Z" or p.pid == self.command_pid:
                continue
            if init or self._known.get(p.pid) == p.start_ticks or self._job_session(p.session):
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(p.pid, os.WNOHANG)

    def _job_session(self, session: int) -> bool:
        """Whether ``session`` is the command's (it runs in a session of its own, whose id is its
        pid) or a member's that made one of its own (a torchrun worker)."""
        return session > 0 and (session == self.command_pid or session in self._known)

    def signal_all(self, sig: int) -> int:
        """``sig`` to every member (SIGSTOP, SIGCONT: Ctrl-Z and ``fg``); how many got it. Walks
        again until a walk finds none it has not signalled: a process may fork meanwhile."""
        done: set[int] = set()
        for _ in range(5):
            fresh = [p for p in self.refresh(scan_environ=True) if p.pid not in done]
            if not fresh:
                break
            for p in fresh:
                with contextlib.suppress(PermissionError):
                    signal_process(p, sig)
                done.add(p.pid)
        return len(done)

    def stop_all(self, grace: float, reason: str) -> int:
        """SIGTERM every member, SIGKILL what is left after ``grace`` s; how many were signalled."""

        def alive() -> list[ProcInfo]:
            return self.refresh(scan_environ=True, reap=True)

        stopped = stop_processes(alive, grace=grace, reason=reason, sigkilled=self.sigkilled)
        self.reap()
        return stopped


def stop_processes(
    find: Callable[[], list[ProcInfo]],
    *,
    grace: float,
    reason: str,
    give_up: float = 10.0,
    verbose: bool = True,
    sigkilled: set[int] | None = None,
) -> int:
    """SIGTERM every process ``find()`` returns (none if ``grace`` is 0), SIGKILL what is left after
    ``grace`` s, until ``find()`` returns none or ``give_up`` s after the SIGKILL; how many were found.

    The one way every process of a command, a worker or a node is stopped. Re-scans every round: a
    dying process may still fork, a dying torchrun start or re-parent a rank. A process is signalled
    only while it is still the one found (``signal_process`` checks its creation time). ``verbose``
    logs each round's signals and a process not ours to signal. ``sigkilled`` collects the pids
    sent SIGKILL.
    """
    seen: set[int] = set()
    termed: set[int] = set()
    killed: set[int] = set()
    kill_at = time.monotonic() + grace
    give_up_at = kill_at + give_up
    # Most processes leave within milliseconds of the signal (and every restart waits for the
    # last one): look again soon, then every STOP_POLL_MAX.
    pause = STOP_POLL_FIRST
    while True:
        alive = find()
        if not alive:
            break
        seen.update(p.pid for p in alive)
        now = time.monotonic()
        if now >= give_up_at:
            # D-state (stuck in the kernel) or not ours to signal: nothing more we can do.
            log.error("%s: %s still alive after SIGKILL", reason, _describe(alive))
            break
        escalate = grace <= 0 or now >= kill_at
        done = killed if escalate else termed
        fresh = [p for p in alive if p.pid not in done]
        if fresh:
            sig = signal.SIGKILL if escalate else signal.SIGTERM
            if verbose and escalate:
                log.warning("%s: still running %.1f s after SIGTERM, SIGKILL %s", reason, grace, _describe(fresh))
            elif verbose:
                log.info("%s: SIGTERM %s", reason, _describe(fresh))
            for p in fresh:
                try:
                    signal_process(p, sig)
                except PermissionError:
                    if verbose:
                        log.error("%s: not permitted to signal %s", reason, _describe([p]))
                done.add(p.pid)
            if escalate and sigkilled is not None:
                sigkilled.update(p.pid for p in fresh)
        time.sleep(pause)
        pause = min(pause * 2, STOP_POLL_MAX)
    return len(seen)


def _describe(procs: list[ProcInfo]) -> str:
    return ", ".join(f"{p.pid} ({p.comm})" for p in procs)
