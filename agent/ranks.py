"""spotjob-agent's own launcher: one node's training ranks started as torchrun would, without torch.

``spotjob-agent --launcher direct -- torchrun …`` runs ``python -m agent.ranks SPEC`` in
torchrun's place when ``agent.torchrun.direct_launch`` can read the command (SPEC is its JSON).
torchrun imports torch before it starts any rank, which is a second or more of every start and
every restart; this module imports nothing but the standard library.

Each rank gets the environment torchrun's static rendezvous gives its workers (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, the ``TORCHELASTIC_*`` values,
``OMP_NUM_THREADS=1`` when several ranks share the node and it is unset) and torchrun's command
for it (its interpreter with ``-u``). Two differences: torchrun hosts the rendezvous store itself
(``TORCHELASTIC_USE_AGENT_STORE=True``); here nobody does before the ranks start, so rank 0's
``init_process_group`` hosts it at ``MASTER_ADDR:MASTER_PORT``, as with a plain ``env://`` start
(``TORCHELASTIC_USE_AGENT_STORE=False``). And no ``TORCHELASTIC_ERROR_FILE``: a rank's ``@record``
logs its error instead of writing it for torchrun's report.

Like torchrun: the first rank to fail (a non-zero exit, or a signal) has the others sent SIGTERM,
then SIGKILL after ``STOP_GRACE`` seconds, and this process exits with that rank's code (a shell's
128 + N for signal N; torchrun would say 1). SIGTERM, SIGINT or SIGHUP sent here are passed on to
every rank, and this process exits once they have.
"""

from __future__ import annotations

import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

from agent.exit_codes import command_exit_code, describe_exit
from agent.torchrun import DirectLaunch

STOP_GRACE = 30.0
"""Seconds the other ranks get after one failed, before SIGKILL (torchrun waits as long)."""
_POLL = 0.05

_DROPPED = ("TORCHELASTIC_ERROR_FILE",)
"""torchrun's per-rank error file for ``@record``: without it, ``@record`` logs the error instead."""


def _say(message: str) -> None:
    print(f"spotjob-agent launcher: {message}", file=sys.stderr, flush=True)


_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_BELOW_EPHEMERAL = 16384
"""How many ports under the kernel's ephemeral range ``free_port`` draws from."""


def _ephemeral_low() -> int:
    """The first port the kernel hands out for ``bind(0)`` and outgoing connections."""
    try:
        with open(_EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default, and below the IANA range macOS uses (49152-65535)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "") -> int:
    """A TCP port for a rendezvous, free now and chosen where no one else is handed ports.

    A port from ``bind(0)`` (what torchrun's ``--standalone`` does) is let go before the ranks
    bind it, and in that gap the kernel may give the same port to any other process's outgoing
    connection or ``bind(0)``: the ranks then cannot meet (seen on a busy test machine; the agent
    exits 74 and the attempt is retried). Ports under the ephemeral range go only to whoever asks
    for them by number, so one drawn at random there that binds now is still free when the ranks
    start, short of another program picking the same number. Falls back to ``bind(0)``.
    """
    low = _ephemeral_low()
    start = max(1024, low - _BELOW_EPHEMERAL)
    for _ in range(64 if low > start else 0):
        port = start + secrets.randbelow(low - start)
        if _bindable(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_env(spec: DirectLaunch, local_rank: int, base: dict[str, str], port: int) -> dict[str, str]:
    """One rank's environment: ``base`` plus what torchrun's static rendezvous sets."""
    env = {k: v for k, v in base.items() if k not in _DROPPED}
    rank = spec.node_rank * spec.nproc + local_rank
    world = spec.nnodes * spec.nproc
    env.update(
        {
            "LOCAL_RANK": str(local_rank),
            "RANK": str(rank),
            "GROUP_RANK": str(spec.node_rank),
            "ROLE_RANK": str(rank),
            "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(spec.nproc),
            "WORLD_SIZE": str(world),
            "GROUP_WORLD_SIZE": str(spec.nnodes),
            "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": spec.master_addr,
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": spec.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "False",  # rank 0 hosts the store
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        }
    )
    if spec.nproc > 1 and "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = "1"
    return env


class Ranks:
    """The ranks of one node, started together; ``wait()`` returns the launcher's exit code."""

    def __init__(self, spec: DirectLaunch, env: dict[str, str] | None = None) -> None:
        self.spec = spec
        base = dict(os.environ if env is None else env)
        port = spec.master_port or free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self._signalled: int | None = None
        try:
            for local_rank in range(spec.nproc):
                command = [a.replace("${local_rank}", str(local_rank)) for a in spec.command]
                self.procs.append(subprocess.Popen(command, env=rank_env(spec, local_rank, base, port)))
        except BaseException:
            self._stop(f"could not start rank {len(self.procs)}")
            raise

    def on_signal(self, signum: int, frame: FrameType | None = None) -> None:
        """SIGTERM/SIGINT/SIGHUP: passed on to every rank still running."""
        self._signalled = signum
        for proc in self.procs:
            if proc.poll() is None:
                _kill(proc, signal.SIGTERM)

    def wait(self) -> int:
        exits = _Exits(self.procs)
        try:
            while True:
                running = [p for p in self.procs if p.returncode is None]
                failed = next((p for p in self.procs if p.returncode not in (None, 0)), None)
                if failed is not None and self._signalled is None:
                    rank = self.spec.node_rank * self.spec.nproc + self.procs.index(failed)
                    code = command_exit_code(failed.returncode or 0)
                    why = f"rank {rank} (pid {failed.pid}) {describe_exit(failed.returncode or 0)}"
                    if running:
                        self._stop(why)
                    else:
                        _say(why)
                    return code
                if not running:
                    return 128 + self._signalled if self._signalled is not None else 0
                exits.wait(running)
        finally:
            exits.close()

    def _stop(self, why: str) -> None:
        running = [p for p in self.procs if p.poll() is None]
        if not running:
            return
        _say(f"{why}: stopping the other {len(running)} rank(s) (SIGTERM, then SIGKILL after {STOP_GRACE:g} s)")
        for proc in running:
            _kill(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        while any(p.poll() is None for p in running) and time.monotonic() < deadline:
            time.sleep(_POLL)
        for proc in running:
            if proc.poll() is None:
                _kill(proc, signal.SIGKILL)
                proc.wait()


class _Exits:
    """Waits for the ranks' exits, and only theirs.

    Never ``waitpid(-1)``: that reaps whichever child exited, and a child that is not a rank (of a
    process that runs ``Ranks`` among children of its own) would lose its exit status: its
    ``Popen`` then finds no child to wait for and reports 0. And a rank reaped that way, if the
    signal handler's ``poll()`` comes first, reads 0 too. Each rank is collected by its own
    ``Popen`` (which serialises its waits); a pidfd per rank (Linux 5.3+) turns readable when it
    exits, so the wait blocks until then (a signal's handler runs meanwhile) and the last rank's
    exit ends this process at once. Without pidfds, each rank is polled every ``_POLL`` s.
    """

    def __init__(self, procs: Sequence[subprocess.Popen[bytes]]) -> None:
        self._fds: dict[int, int] = {}
        open_pidfd = getattr(os, "pidfd_open", None)
        if open_pidfd is None:
            return
        for proc in procs:
            try:
                self._fds[proc.pid] = open_pidfd(proc.pid)
            except OSError:  # pidfds refused here (an old kernel, a sandbox): poll every rank
                self.close()
                return

    def wait(self, running: Sequence[subprocess.Popen[bytes]]) -> None:
        """Return once one of ``running`` may have exited, with its ``returncode`` set."""
        fds = [self._fds[p.pid] for p in running if p.pid in self._fds]
        if len(fds) == len(running):
            poller = select.poll()  # not select(): a descriptor past 1023 is fine
            for fd in fds:
                poller.register(fd, select.POLLIN)
            poller.poll()
        else:
            time.sleep(_POLL)
        for proc in running:
            proc.poll()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _kill(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        _say("usage: python -m agent.ranks SPEC (SPEC: the JSON spotjob-agent --launcher direct writes)")
        return 2
    try:
        spec = DirectLaunch.from_json(args[0])
    except (ValueError, TypeError) as e:
        _say(f"cannot read the launch spec: {e}")
        return 2
    ranks: Ranks | None = None
    early: list[int] = []  # signals that came while the ranks were being started

    def handle(signum: int, frame: FrameType | None) -> None:
        if ranks is not None:
            ranks.on_signal(signum, frame)
        else:
            early.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, handle)
    try:
        ranks = Ranks(spec)
    except OSError as e:
        _say(f"cannot start {spec.command[0]}: {e}")
        return 127 if isinstance(e, FileNotFoundError) else 126
    if early:
        ranks.on_signal(early[-1])
    return ranks.wait()


if __name__ == "__main__":
    sys.exit(main())
