"""spotjob-agent: run the training command, hear preemption notices, tell the ranks to flush.

``spotjob-agent [OPTIONS] -- torchrun ... train.py ...`` (any command works).

In order, on the main thread: refuse a control folder another running agent uses (exit 2), then
reset it; start the control API and write ``agent.json``; start the notice sources; start the
command in a session of its own, with the ``SPOTJOB_*`` variables ``Checkpointer.from_env()``
reads (or, with ``--launcher direct``, its ranks through ``agent.ranks``); start the prefetch of
the newest checkpoint into the node's restore cache in the background (``agent.restore_cache``,
``--prefetch``); then watch until it ends, and exit.

In parallel: notice sources (threads) and control-API requests call ``on_notice`` /
``request_flush``, which take the agent's lock. The first notice that means "this node is going"
writes ``flush.json`` once; later ones only log (and may bring the kill time forward). The ranks
do the flush and report through the control folder (``agent.control_channel``); the agent never
touches a checkpoint.

The watch loop, every 0.1 s: look for ``flushed.json`` / ``flush-failed.json`` (then acknowledge
to the cloud and give the command ``--exit-timeout`` to leave), and kill the whole process tree
when that time or the notice's deadline passes, or at once after ``POST /stop``. Every 0.5 s it
also notes new descendants (``agent.process_tree``), checks that a rank has
connected (``status.json``) and writes where the agent said (a warning, an error), and, with
``--exit-with-parent``, that the process that started it is still its parent (if not: a notice
from the source ``driver``). When the command ends, stray descendants are stopped too. Once a
flush has committed under torchrun, the loop ticks every 0.02 s, looking only at the ranks it
knows, and ends torchrun as soon as they are gone.

Before starting a torchrun command, the rendezvous port this host must bind is checked
(``agent.torchrun``): taken means exit 74 without starting anything. So does a control-API port
taken by another process; a ``--control-host`` that is no address of this machine (or a port it
may not bind) exits 2, the code of every other bad option.

Exit code: 75 (EXIT_PREEMPTED) if a flush committed; else 79 (EXIT_STOPPED) after ``POST /stop``;
else 74 (EXIT_INFRA_ERROR) if a rank reported an infrastructure error, or torchrun failed before
any rank reported while another process holds its rendezvous port; else 76 if the flush failed;
else 0 if the command succeeded or every rank wrote ``closed-rank-<r>`` (a finished job whose
interpreter aborted at exit is not a failure; not when the agent killed the command while more
than torchrun was left of it: work after ``close()``); else 76 (EXIT_FLUSH_FAILED) if a flush was asked
for; else the command's own code — 1 if that is one of 74/75/76/79, which mean what the agent saw.

The rest of spotjob-agent, each in its own module:

- ``agent.launcher_requests``: the agent's state and what changes it from any thread (``on_notice``,
  the control API's requests, ``/status``, the flush window): ``AgentRequests``, which ``Agent``
  extends with the running of the command here;
- ``agent.launcher_sources``: which notice sources run (``build_sources``);
- ``agent.launcher_cli``: the command line (``AgentConfig``, ``parse_args``);
- ``agent.exit_codes``: the exit-code rule (``decide_exit_code``).

Their public names stay importable from here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, NoReturn

import psutil

from agent.control_api import ENV_AGENT_TOKEN, ControlApi, ControlApiBindError, load_token, safe
from agent.control_channel import (
    AGENT_FILE,
    ENV_CONTROL_DIR,
    EXIT_FLUSH_FAILED,
    EXIT_INFRA_ERROR,
    EXIT_PREEMPTED,
    ControlDir,
    RankStatus,
    read_json,
    write_json_atomic,
)
from agent.exit_codes import EXIT_COMMAND_USED_RESERVED as EXIT_COMMAND_USED_RESERVED
from agent.exit_codes import EXIT_USAGE, PEER_FLUSH, command_exit_code, decide_exit_code
from agent.exit_codes import RESERVED_EXIT_CODES as RESERVED_EXIT_CODES
from agent.launcher_cli import ENV_AWS_METADATA_URL as ENV_AWS_METADATA_URL
from agent.launcher_cli import ENV_AZURE_METADATA_URL as ENV_AZURE_METADATA_URL
from agent.launcher_cli import ENV_GCP_METADATA_URL as ENV_GCP_METADATA_URL
from agent.launcher_cli import NOTICE_SOURCES as NOTICE_SOURCES
from agent.launcher_cli import AgentConfig as AgentConfig
from agent.launcher_cli import RebalancePolicy as RebalancePolicy
from agent.launcher_cli import build_parser as build_parser
from agent.launcher_cli import checkpoint_variables, parse_args
from agent.launcher_requests import MAX_SAVE_IDS as MAX_SAVE_IDS
from agent.launcher_requests import AgentRequests, infra_error_text
from agent.launcher_requests import Window as Window
from agent.launcher_requests import flush_window as flush_window
from agent.launcher_sources import build_sources
from agent.notices.base import Notice, NoticeKind, format_deadline
from agent.notices.sigterm import DEFAULT_SIGNALS, SignalSource, ignored_by_starter
from agent.process_tree import ENV_AGENT_ID, ProcessTree, become_subreaper
from agent.settings import unknown_variables
from agent.storage import Storage, open_storage, parse_uri
from agent.streams import log_fields, log_to_stderr, tolerate_unencodable_output
from agent.torchrun import (
    DirectLaunch,
    direct_launch,
    in_place_restart_warning,
    local_rendezvous,
    meeting_point,
    node_ranks,
    port_taken,
    probe_meeting_point,
    standalone_command,
    torchrun_nproc,
)

log = logging.getLogger(__name__)

_SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None

WATCH_TICK = 0.1
TREE_SCAN_EVERY = 0.5
AFTER_COMMIT_TICK = 0.02
"""The watch loop's tick between a committed flush and the ranks' exit (torchrun commands)."""


class Agent(AgentRequests):
    """One command under one agent. ``run()`` on the main thread; the rest (``AgentRequests``) is
    thread-safe."""

    keep_signal_handlers = False
    """``run()`` leaves its signal handlers in place when it returns (``main()``: the process exits
    right after). Restored, a second SIGTERM or Ctrl-C in the last milliseconds would kill the
    agent and turn its exit code (75 after a committed flush) into 143 or 130."""

    # -- running (main thread) -----------------------------------------------------------------
    def run(self) -> int:
        """Start everything, watch the command, clean up; the agent's exit code."""
        tree = ProcessTree(self.agent_id)
        if not become_subreaper():
            log.warning("not a subreaper: orphaned descendants are found through %s only", ENV_AGENT_ID)
        previous_handlers = self._install_fallback_signals()
        try:
            in_use = self._control_dir_in_use()
            if in_use is not None:
                return self._cannot_start(EXIT_USAGE, in_use)
            self.control.reset()
            api = ControlApi(self, host=self.config.control_host, port=self.config.control_port, token=self.token)
            try:
                api.start()
            except ControlApiBindError as e:
                return self._cannot_start(EXIT_USAGE if e.usage else EXIT_INFRA_ERROR, str(e))
            self.api = api
            self._write_agent_file()
            for source in self.sources:
                source.start(self.on_notice)
            child = self._start_command()
            if isinstance(child, int):
                return child
            self._prefetch()
            tree.command_pid = child.pid
            returncode = self._watch(child, tree)
            return self._finish(returncode, tree)
        finally:
            self._shutdown(tree)
            if not self.keep_signal_handlers:
                for sig, handler in previous_handlers.items():
                    signal.signal(sig, handler)

    def _cannot_start(self, code: int, why: str) -> int:
        """``code`` for a command that was never started, and why, in the log."""
        log.error("exiting %d: %s", code, why)
        with self._lock:
            self._state = "exited"
        return code

    def _start_command(self) -> subprocess.Popen[bytes] | int:
        """The running command, or the exit code for one that cannot start: the shell's 127/126,
        or 74 (EXIT_INFRA_ERROR) when the rendezvous port this host must bind is taken."""
        self._rendezvous = local_rendezvous(self.config.command, self.env)
        if self._rendezvous is not None and self.api is not None and self._rendezvous.port == self.api.port:
            # Taken by this agent's own control API: not another process (74 would be retried as an
            # infrastructure error on every attempt), but two options that name one port.
            return self._cannot_start(
                EXIT_USAGE,
                f"--control-port {self.api.port} is also torchrun's rendezvous port ({self._rendezvous.how}): "
                "the control API holds it, so torchrun could not bind it; give them different ports",
            )
        if self._rendezvous is not None and port_taken(self._rendezvous.port):
            log.error(
                "exiting %d: torchrun's rendezvous port %d (%s) is taken by another process on this host, "
                "so its ranks could not meet; free the port or choose another (--master-port / --rdzv-endpoint), "
                "or let torchrun pick one with --standalone on a single node",
                EXIT_INFRA_ERROR,
                self._rendezvous.port,
                self._rendezvous.how,
            )
            with self._lock:
                self._state = "exited"
            return EXIT_INFRA_ERROR
        env = dict(self.env)
        env.pop(ENV_AGENT_TOKEN, None)  # the ranks never need the API token
        env.update(self.rank_env())
        env[ENV_AGENT_ID] = self.agent_id
        command, direct = self.config.command, self._direct_launch()
        restarts = in_place_restart_warning(self.config.command, self.env)
        if restarts is not None:
            log.warning("%s", restarts)
        if direct is not None:
            command = [sys.executable, "-m", "agent.ranks", direct.to_json()]
            self._runner = "the agent's launcher"
        elif (standalone := standalone_command(command, self.env)) is not None:
            log.info(
                "torchrun runs one node with neither --master-port nor --rdzv-endpoint: adding --standalone, "
                "so that it picks a free port as torchrun 2.12 and later do themselves (2.9 to 2.11 bind 29500)"
            )
            command = standalone
        try:
            # A session of its own: a Ctrl-C or SIGTERM meant for the agent does not reach the
            # ranks directly; the agent decides (flush first).
            child = subprocess.Popen(command, env=env, start_new_session=True)
        except OSError as e:
            log.error("cannot start %s: %s", command[0], why_not_started(command[0], e, env.get("PATH", os.defpath)))
            with self._lock:
                self._state = "exited"
            return 127 if isinstance(e, FileNotFoundError) else 126
        with self._lock:
            self._child = child
            if self._state == "starting":
                self._state = "running"
        if direct is not None:
            log.info(
                "started the %d rank(s) of %s directly, without torchrun's own start (launcher pid %d)",
                direct.nproc,
                " ".join(self.config.command),
                child.pid,
            )
        else:
            log.info("started %s (pid %d)", " ".join(command), child.pid)
        return child

    def _direct_launch(self) -> DirectLaunch | None:
        """With ``--launcher direct``: how ``agent.ranks`` starts the command's ranks, or None (run it as written)."""
        if self.config.launcher != "direct":
            return None
        launch = direct_launch(self.config.command, self.env)
        if isinstance(launch, str):
            log.warning("--launcher direct: running the command as written, because %s", launch)
            return None
        return launch

    def _prefetch(self) -> None:
        """While torchrun starts and the ranks import torch and meet, fetch the newest checkpoint
        into the node's restore cache (``agent.restore_cache``): their restore then finds it there.
        ``--prefetch node``: only the files this node's ranks read, where the torchrun command
        says which ranks it runs; ``all``: every file; ``off``: nothing."""
        uri = self.checkpoint_uri
        if not uri or self.config.prefetch == "off":
            return
        # Imported here, once the command runs: the checksum and catalog modules it needs are not
        # on the way to starting torchrun.
        from agent.restore_cache import prefetch_in_background, staging_root

        job = self.config.job_name

        def open_store() -> Storage:
            return open_storage(uri)

        def staging(storage: Storage) -> str:
            return staging_root(storage, job, self.config.staging_dir)

        def restored() -> bool:
            """The node's first rank trains (past its restore, which removed the cache)."""
            status = self.control.status()
            return status is not None and status.state != "starting"

        ranks = node_ranks(self.config.command, self.env) if self.config.prefetch == "node" else None
        prefetch_in_background(open_store, staging, restored=restored, ranks=ranks)

    def rank_env(self) -> dict[str, str]:
        """What ``Checkpointer.from_env()`` reads."""
        return {ENV_CONTROL_DIR: self.control.path, **checkpoint_variables(self.config)}

    def _watch(self, child: subprocess.Popen[bytes], tree: ProcessTree) -> int:
        next_scan = 0.0
        waiting_logged = False
        while True:
            if self._suspend_requested:
                self._suspend(tree)
            now = time.monotonic()
            if now >= next_scan:
                tree.refresh(reap=True)
                self._check_ranks(now)
                self._check_parent()
                self._check_held()
                next_scan = now + TREE_SCAN_EVERY
            returncode = child.poll()
            self.release_held()
            self._check_flush_result()
            with self._lock:
                flush = self._flush
                pending = flush is not None and flush.result is None
                kill_at = flush.kill_at if flush is not None else self._peer_kill_at
                kill_reason = (
                    flush.kill_reason
                    if flush is not None
                    else f"--exit-timeout {self.config.exit_timeout:g} s after another node's flush committed"
                )
            if returncode is not None:
                # torchrun gone, ranks (own sessions) still flushing: let them finish, up to the kill
                # time, unless a stop (or a SIGTERM with signals not taken as notices) says otherwise.
                if pending and kill_at is not None and tree.refresh():
                    halt = self._halt_reason()
                    if halt is None and now >= kill_at:
                        # The agent stops them, as it would have stopped torchrun with them: not
                        # a command that "ended by itself" during the flush (the user's failure).
                        halt = kill_reason
                    if halt is not None:
                        with self._lock:
                            self._state = "stopping"
                            self._killed = True
                        tree.stop_all(self.config.kill_grace, f"{halt}, the command gone, its ranks still flushing")
                        return returncode
                    if not waiting_logged:
                        log.warning("the command exited (%d) while its ranks are still flushing: waiting", returncode)
                        waiting_logged = True
                    time.sleep(WATCH_TICK)
                    continue
                with self._lock:
                    self._returncode = returncode  # from now on a stop or a flush is answered 409: nothing runs
                return returncode
            alone = self._torchrun_alone(child, tree)
            if alone:
                # Its ranks are gone and the flush committed: what torchrun does next (report the
                # failed workers, close its rendezvous, exit; 0.5-1 s) would only delay the restart.
                log.info("the ranks exited after the committed flush: ending %s (pid %d) now", self._runner, child.pid)
                child.kill()  # not waited for yet: its pid is still its own
                return child.wait()
            halt = self._halt_reason()
            if halt is not None:
                kill_reason, kill_at = halt, now
            if kill_at is not None and now >= kill_at:
                with self._lock:
                    self._state = "stopping"
                    self._killed = True
                    self._killed_at_work = not self._launcher_alone(child, tree)
                if alone is not None:
                    # The flush committed and the ranks are on their way out: torchrun's own
                    # SIGTERM handling (stop the ranks, wait, report, close its rendezvous; 0.7 s
                    # here) holds nothing of the job's. The ranks get SIGTERM and the grace.
                    log.info("the flush committed: ending %s (pid %d) at once", self._runner, child.pid)
                    child.kill()  # not waited for yet: its pid is still its own
                tree.stop_all(self.config.kill_grace, f"{kill_reason}, command still running")
                return child.wait()
            # Between a committed flush and the ranks' exit, the restart waits on this loop noticing.
            time.sleep(WATCH_TICK if alone is None else AFTER_COMMIT_TICK)

    def _suspend(self, tree: ProcessTree) -> None:
        """Ctrl-Z (SIGTSTP, which reaches the agent alone: the command has a session of its own):
        every process of the command stops, then the agent; ``fg`` or ``bg`` (SIGCONT) resumes the
        agent, which resumes them. Left to the default, the agent alone stopped and the ranks
        trained on with nobody to hear a notice."""
        self._suspend_requested = False
        paused = tree.signal_all(signal.SIGSTOP)
        log.info("SIGTSTP: paused the command's %d process(es) and the agent; fg or SIGCONT resumes them", paused)
        os.kill(os.getpid(), signal.SIGSTOP)  # returns once continued
        resumed = tree.signal_all(signal.SIGCONT)
        log.info("continued: resumed the command's %d process(es)", resumed)

    def _halt_reason(self) -> str | None:
        """Why the command's processes must be stopped now, whatever the flush: ``POST /stop``, a
        SIGQUIT, or a SIGTERM/SIGINT/SIGHUP/SIGUSR1/SIGUSR2 with signals not taken as notices; None if none came."""
        with self._lock:
            stop = self._stop
        if stop is not None:
            return f"stop requested: {stop.reason}"
        if self._terminate_requested == signal.SIGQUIT:
            return "SIGQUIT (quit: stop without a flush)"
        if self._terminate_requested is not None:
            return f"{signal.Signals(self._terminate_requested).name} with notices from signals off"
        return None

    def _torchrun_alone(self, child: subprocess.Popen[bytes], tree: ProcessTree) -> bool | None:
        """Whether torchrun is the only process of the command still running (its ranks exited:
        nothing of the job's is left in it); None unless the command is torchrun and a flush
        committed: this agent's, or another node's agent's (``_peer_result``). On a node of a
        multi-node job whose agent heard no notice, torchrun would otherwise wait in its exit
        barrier for the notified node's torchrun, which that node's agent has ended: 300 s.

        Looks first at the processes already known (a few ``/proc/<pid>/stat`` reads), and walks
        every process only once none of them is left.
        """
        with self._lock:
            flush = self._flush
            result = flush.result if flush is not None else self._peer_result
        if result is None or result.error is not None:
            return None
        if not self._torchrun:
            return None
        if tree.known_alive(besides=child.pid):
            return False
        return [p.pid for p in tree.refresh()] == [child.pid]

    def _launcher_alone(self, child: subprocess.Popen[bytes], tree: ProcessTree) -> bool:
        """Whether only torchrun (or the agent's launcher) is left of the command: its ranks have
        exited, and torchrun waits on something of its own (its exit barrier, for another node's
        torchrun). False for any other command, whose own process may be the rank, and for a
        torchrun whose ranks never ran (still in its rendezvous, waiting for another node: killed
        there, it did not end by itself)."""
        if not self._torchrun or tree.known_alive(besides=child.pid):
            return False
        alone = [p.pid for p in tree.refresh()] == [child.pid]
        return alone and (tree.seen_below_command or self._rank_seen or bool(self.control.closed_ranks()))

    def _check_ranks(self, now: float) -> None:
        """Warn when no rank connected in time (the ranks have not met, or build no Checkpointer),
        and when the ranks write somewhere else."""
        rank = self.control.status()
        if rank is None:
            waited = now - self._started_monotonic
            if not self._rank_seen and waited >= self._connect_check_at and not self._connect_checking.is_set():
                self._connect_check_at = waited + self.config.rank_connect_timeout
                self._warn_not_connected(waited)
            return
        if not self._rank_seen:
            with self._lock:
                self._rank_seen = True
                said = self._problems.pop("connect", None)
            if said:
                log.info("a rank has connected to the control folder after all")
                self._write_agent_file()
        self._check_uri(rank)

    def _warn_not_connected(self, waited: float) -> None:
        """The warning of ``_check_ranks``, every ``--rank-connect-timeout`` while no rank connected
        (logged again only when what it found changed): what the ranks may wait for and the usual
        causes. Where the command says where its ranks meet, a thread tries that address (a dropped
        connection takes seconds to tell, which the watch loop must not wait for)."""
        message = (
            f"no rank has connected to the control folder {waited:.0f} s after the start: the ranks are still "
            f"starting (importing torch), or wait in init_process_group for peers that do not come, or the script "
            f"builds no spotjob Checkpointer (Checkpointer.from_env(), after init_process_group; it joins the agent's "
            f"channel through {ENV_CONTROL_DIR}). Until one connects a notice cannot reach the ranks, so nothing "
            f"would be flushed"
        )
        point = meeting_point(self.config.command, self.env)
        if point is None:
            self._say_not_connected(message, "")
            return
        host, port = point
        # Under torchrun, a node that is not the store's host waits in torchrun's own rendezvous,
        # before any rank starts; with the agent's launcher its ranks wait in init_process_group.
        timeout = (
            "torchrun's rendezvous timeout (--rdzv-conf timeout=SECONDS, 600 by default) or init_process_group's"
            if self._runner == "torchrun"
            else "init_process_group's timeout"
        )
        message += (
            f". They meet at {host}:{port}: ranks that never meet (a wrong --master-addr or --master-port, a "
            f"firewall or NetworkPolicy between the nodes, a node that never started) wait there until "
            f"{timeout}, then fail"
        )

        def check() -> None:
            try:
                found = probe_meeting_point(host, port)
                self._say_not_connected(f"{message}. Checked from this host: {found}", found)
            finally:
                self._connect_checking.clear()

        self._connect_checking.set()
        threading.Thread(target=check, name="spotjob-rendezvous-check", daemon=True).start()

    def _say_not_connected(self, message: str, found: str) -> None:
        with self._lock:
            if self._rank_seen:
                return
            self._problems["connect"] = message
            again = self._connect_found == found
            self._connect_found = found
        if not again:
            log.warning("%s", message)
        with contextlib.suppress(OSError):
            self._write_agent_file()

    def _check_uri(self, rank: RankStatus) -> None:
        mine = self.checkpoint_uri
        theirs = rank.checkpoint_uri
        if not mine or not theirs or canonical_uri(mine) == canonical_uri(theirs):
            return
        message = (
            f"the ranks write checkpoints to {safe(theirs)} but this agent was given {safe(mine)}: the controller "
            f"watches the agent's URI, so it will not see these checkpoints commit; pass the same URI to both "
            f"(or build the Checkpointer with Checkpointer.from_env())"
        )
        if self._problems.get("uri") != message:
            self._problems["uri"] = message
            log.error("%s", message)

    def _check_parent(self) -> None:
        """With --exit-with-parent: the driver that started the agent is gone → flush, then exit."""
        if not self.config.exit_with_parent or self._parent_gone:
            return
        parent = os.getppid()
        if parent == self._parent_pid:
            return
        # The notice is marked seen only once delivered: a failed delivery is retried next scan.
        self.on_notice(
            Notice(
                source="driver",
                kind=NoticeKind.TERMINATE,
                deadline=time.time() + self.config.parent_grace,
                detail=f"the process that started the agent (pid {self._parent_pid}) is gone",
            )
        )
        self._parent_gone = True

    def _check_flush_result(self) -> None:
        with self._lock:
            flush = self._flush
        if flush is None:
            self._check_peer_flush()
            return
        if flush.result is not None:
            return
        result = self.control.flush_result()
        if result is None:
            return
        with self._lock:
            flush.result = result
            flush.kill_at = min(flush.kill_at, time.monotonic() + self.config.exit_timeout)
            flush.kill_reason = f"--exit-timeout {self.config.exit_timeout:g} s after the flush result"
            if self._state not in ("stopping", "exited"):
                self._state = "flushed" if result.error is None else "flush-failed"
        own = time.monotonic() - flush.notice.received_monotonic
        if result.error is None:
            log.info(
                "flush %s committed step %s at %s: %.2f s from notice to commit (ranks: %s)",
                flush.request.id,
                result.step,
                result.uri,
                own,
                f"{result.notice_to_commit_seconds:.2f} s" if result.notice_to_commit_seconds is not None else "n/a",
            )
        else:
            log.error("flush %s failed after %.2f s: %s", flush.request.id, own, result.error)
        for source in self.sources:
            source.flush_finished()

    def _check_peer_flush(self) -> None:
        """No notice here, yet this node's ranks may have committed a flush: on a node of a
        multi-node job, another node's agent asked and every rank flushed at the same step. Seen
        once, it counts as this agent's own committed flush for ending the command (the ranks'
        exit, ``--exit-timeout``)."""
        with self._lock:
            if self._peer_result is not None:
                return
        result = self.control.flush_result()
        if result is None or result.error is not None:
            return
        with self._lock:
            self._peer_result = result
            self._peer_kill_at = time.monotonic() + self.config.exit_timeout
            if self._state not in ("stopping", "exited"):
                self._state = "flushed"
            # Kept, not flushed (release_held): this node goes at its deadline all the same, and a
            # controller reading /status (or agent.json) before the agent exits avoids it then.
            held = self._held
        if held is not None:
            log.info(
                "the %s notice held for %s needs no flush of its own; still reported until the agent exits",
                held.source,
                format_deadline(held.deadline),
            )
        log.info(
            "the ranks committed step %s at %s for a flush another node's agent asked for (%s): "
            "ending the command once they exit",
            result.step,
            result.uri,
            # A notice held here is one, said just above: "no notice here" contradicted it.
            "no notice here" if held is None else "no flush of its own",
        )

    def _finish(self, returncode: int, tree: ProcessTree) -> int:
        with self._lock:
            self._returncode = returncode
        self._check_flush_result()
        stray = tree.refresh(scan_environ=True)
        if stray:
            log.warning("the command exited but %d of its processes are still running: stopping them", len(stray))
            tree.stop_all(self.config.kill_grace, "stray processes after the command exited")
        with self._lock:
            flush = self._flush
            self._state = "exited"
            killed = self._killed
        if flush is not None and flush.result is None:
            # The job is gone either way: nothing is left for the cloud to wait for.
            for source in self.sources:
                source.flush_finished()
        # The files decide, not only what this agent saw: flushed.json present after the command
        # exited means a committed checkpoint, whoever asked for it.
        result = flush.result if flush is not None and flush.result is not None else self.control.flush_result()
        with self._lock:
            stop = self._stop
        code, why = decide_exit_code(
            returncode,
            flush_requested=flush is not None or self.control.flush_requested(),
            result=result,
            closed_ranks=self.control.closed_ranks(),
            expected_ranks=self._expected_ranks(),
            killed=killed and self._killed_at_work,
            stopped=stop.reason if stop is not None else None,
            infra_error=self._infra_error(returncode),
            sigkilled_by_agent=self.config.kill_grace if tree.sigkilled else None,
            # What began this agent's flush (a later notice met it under way and began none), one line
            # whatever a cloud's detail held; with no flush of its own, a peer's.
            answered=" ".join(flush.request.reason.split()) if flush is not None else PEER_FLUSH,
        )
        if code == EXIT_FLUSH_FAILED and result is None and not self._rank_seen and self.control.status() is None:
            why += (
                "; no rank had connected to the control folder yet, so none heard the flush (the notice came "
                "while the ranks were starting: importing torch, meeting, restoring; or the script does not use "
                "spotjob's Checkpointer)"
            )
        with self._lock:
            terminate = self._terminate_requested
        quit_ = terminate == signal.SIGQUIT
        if terminate is not None and not quit_ and killed and stop is None and code not in (0, EXIT_PREEMPTED):
            # Said only "the command exited 143": as if the command had failed by itself.
            name = signal.Signals(terminate).name
            why += (
                f"; spotjob-agent stopped the command without a flush on {name}, which it does not take as a "
                f"notice (its --notices leave out sigterm, or --no-sigterm)"
            )
        real = command_exit_code(returncode)
        quiet = code == EXIT_PREEMPTED or (code == 0 and real == 0)
        # A JSON line of a committed flush also carries what it answered as fields of its own.
        fields = {"flush_source": flush.notice.source, "flush_kind": flush.notice.kind.value} if flush else {}
        # A flush that committed nothing is at ERROR whatever ended it (the deadline, the command, a
        # rank's error): at WARNING, `--log-level error` printed nothing at all for it.
        level = logging.INFO if quiet else logging.ERROR if code == EXIT_FLUSH_FAILED else logging.WARNING
        with log_fields(**(fields if code == EXIT_PREEMPTED else {})):
            log.log(level, "exiting %d: %s", code, why)
        return code

    def _infra_error(self, returncode: int) -> str | None:
        """What says the command failed for a reason that is not the user's, if anything.

        A rank's own report (``infra-error.json``), or torchrun failing before any rank reported
        while its rendezvous port is held by a process that is not this job's (by now every
        process of the job has been stopped, so whoever holds the port is someone else).
        """
        reported = infra_error_text(self.control.infra_error())
        if reported is not None:
            return reported
        rdzv = self._rendezvous
        if (
            rdzv is not None
            and returncode != 0
            and not self._rank_seen
            and self.control.status() is None
            and port_taken(rdzv.port)
        ):
            return (
                f"torchrun failed before any rank started and its rendezvous port {rdzv.port} ({rdzv.how}) "
                f"is held by another process on this host"
            )
        return None

    def _expected_ranks(self) -> int | None:
        """How many ``closed-rank-<r>`` marks make this node's job finished: ``--expected-ranks``,
        else the local world size the ranks report, else torchrun's ``--nproc-per-node``; None
        when nothing says (then no abort at exit is forgiven).

        Never the world size: on a node of a multi-node job it counts the other nodes' ranks too,
        whose marks are in their own control folders, and the job would never count as finished.
        """
        if self.config.expected_ranks:
            return self.config.expected_ranks
        rank = self.control.status()
        if rank is not None and rank.local_world_size:
            return rank.local_world_size
        return torchrun_nproc(self.config.command, self.env)

    def _shutdown(self, tree: ProcessTree) -> None:
        with self._lock:
            child = self._child
            finished = self._state == "exited"  # _finish stopped what was left of the command
            self._state = "exited"
        if child is not None and child.poll() is None:
            # Only reached when the agent itself failed: never leave the ranks orphaned.
            log.error("agent stopping with the command still running: stopping it")
            tree.stop_all(self.config.kill_grace, "agent error")
            child.wait()
        elif child is not None and not finished and tree.refresh(scan_environ=True):
            # The agent failed after torchrun exited, its ranks (sessions of their own) still at
            # work, as while they flush on: they would train on with nobody to hear a notice.
            log.error("agent stopping with the command's processes still running: stopping them")
            tree.stop_all(self.config.kill_grace, "agent error")
        for source in self.sources:
            if self.keep_signal_handlers and isinstance(source, SignalSource):
                continue  # its handlers stay (a signal now is a notice refused: the command has ended)
            try:
                source.stop()
            except Exception:
                log.exception("stopping the %s notice source failed", source.name)
        if self.api is not None:
            self.api.stop()
            # Only this agent's: another agent's (a control folder refused as in use) stays.
            with self._agent_file_lock, contextlib.suppress(FileNotFoundError):
                self._agent_file_removed = True  # a check still under way writes it no more
                os.unlink(os.path.join(self.control.path, AGENT_FILE))

    def _check_held(self) -> None:
        """``agent.json`` again when the notice held, or the second its flush starts at, changed
        since it was written (local mode's controller reads them there, as it reads
        ``ranks_not_meeting``)."""
        if self._held_for_file() != self._agent_file_held:
            with contextlib.suppress(OSError):
                self._write_agent_file()

    def _held_for_file(self) -> tuple[dict[str, Any] | None, int | None]:
        info, flush_at = self.held_report()
        return (
            info.model_dump(mode="json") if info is not None else None,
            round(flush_at) if flush_at is not None else None,
        )

    def _write_agent_file(self) -> None:
        """``agent.json``; written again when ``ranks_not_meeting`` (the warning of
        ``_check_ranks``, which local mode's controller reads here) comes or goes, and
        when the notice held changes (``_check_held``)."""
        if self.api is None:
            return
        with self._lock:
            not_meeting = self._problems.get("connect")
        with self._agent_file_lock:
            if self._agent_file_removed:
                return
            self._write_agent_json(not_meeting)

    def _write_agent_json(self, not_meeting: str | None) -> None:
        assert self.api is not None
        held = self._held_for_file()
        write_json_atomic(
            os.path.join(self.control.path, AGENT_FILE),
            {
                "pid": os.getpid(),
                "agent_id": self.agent_id,
                "host": self.api.host,
                "port": self.api.port,
                "url": self.api.url,
                "auth": self.api.auth_required,
                "control_dir": self.control.path,
                "job_name": self.config.job_name,
                "started_at": self._started_at,
                "hostname": socket.gethostname(),
                "ranks_not_meeting": not_meeting,
                # As /status says them: the notice held and when its flush starts (unix time).
                "held_notice": held[0],
                "flush_at": held[1],
            },
        )
        self._agent_file_held = held

    def _control_dir_in_use(self) -> str | None:
        """Why the control folder is not this agent's to use: another agent still running on this
        machine wrote its ``agent.json`` there (two jobs given one ``--control-dir``). Clearing its
        files and sharing its ``flush.json`` would let a notice to either job stop both. None for a
        file an agent left behind (gone, or its pid reused since), or one from another machine
        (nothing here can tell whether that agent still runs)."""
        info = read_json(os.path.join(self.control.path, AGENT_FILE)) or {}
        pid, started = info.get("pid"), info.get("started_at")
        if type(pid) is not int or pid == os.getpid() or not isinstance(started, int | float):
            return None
        if info.get("hostname", socket.gethostname()) != socket.gethostname():
            return None
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE or proc.create_time() > started + 1:
                return None
        except psutil.Error:
            return None
        return (
            f"--control-dir {self.control.path} is in use by another agent (pid {pid}, job "
            f"{info.get('job_name') or 'unnamed'!r}) still running on this machine: sharing it, each job's ranks "
            "would act on the other's notices. Give each agent a folder of its own, or leave --control-dir out "
            "for a fresh one"
        )

    def _install_fallback_signals(self) -> dict[signal.Signals, _SignalHandler]:
        """Signals that are no notice stop the command (no flush) instead of killing the agent and
        orphaning the ranks in their own sessions, where they would train on with nobody to hear
        a notice: SIGQUIT (Ctrl-\\), and SIGTERM/SIGINT/SIGHUP/SIGUSR1/SIGUSR2 with no signal source. A SIGHUP or
        SIGQUIT the agent was started ignoring (nohup, a shell's background job) stays ignored. And
        SIGTSTP (Ctrl-Z) pauses the command with the agent (``_suspend``), unless started ignored
        or PID 1."""
        signals = [signal.SIGQUIT]
        if not any(isinstance(s, SignalSource) for s in self.sources):
            signals = [*DEFAULT_SIGNALS, *signals]
        signals = [sig for sig in signals if not ignored_by_starter(sig)]  # nohup's SIGHUP stays ignored

        def handle(signum: int, frame: FrameType | None) -> None:
            self._terminate_requested = signum

        def suspend(signum: int, frame: FrameType | None) -> None:
            self._suspend_requested = True

        previous: dict[signal.Signals, _SignalHandler] = {}
        for sig in signals:
            previous[sig] = signal.signal(sig, handle)
        # An inherited ignore stays. As PID 1 (a container without an init) the kernel ignores the
        # agent's SIGSTOP to itself, so a pause could not hold: Ctrl-Z stays ignored, as by an init.
        if signal.getsignal(signal.SIGTSTP) != signal.SIG_IGN and os.getpid() != 1:
            previous[signal.SIGTSTP] = signal.signal(signal.SIGTSTP, suspend)
        return previous


def why_not_started(program: str, error: OSError, path: str) -> str:
    """Why ``program`` could not be started, and what to do, in the user's words. A script whose
    ``#!`` interpreter is missing fails as ENOENT too: the message must not say the script is."""
    found = program if os.sep in program else shutil.which(program, mode=os.F_OK, path=path)
    if isinstance(error, FileNotFoundError):
        if found is None:
            here = f"; the one in the working folder is ./{program}" if os.path.exists(program) else ""
            return f"not found on PATH ({path}); install it, or give its path{here}"
        if not os.path.exists(found):
            return f"{found} does not exist"
        try:
            with open(found, "rb") as f:
                first = f.readline(256).decode("utf-8", "replace").strip()
        except OSError:
            first = ""
        if first.startswith("#!"):
            return (
                f"{found} exists, but the interpreter its first line names ({first[2:].strip()}) does not; "
                f"install it or correct the #! line"
            )
        return f"{found} exists but could not be run: {error.strerror}"
    if isinstance(error, PermissionError):
        if found is not None and os.path.isdir(found):
            return f"{found} is a folder, not a program"
        return f"{found or program} is not executable; make it so (chmod +x) or run it through its interpreter"
    return f"{error.strerror or error}; a script needs a #! line naming its interpreter"


def canonical_uri(uri: str) -> str:
    """One spelling per location, to compare two URIs: ``s3://b/p``, ``gs://b/p``, ``file:///abs``."""
    try:
        scheme, bucket, path = parse_uri(uri)
    except ValueError:
        return uri
    if scheme == "file":
        return "file://" + os.path.normpath(os.path.abspath(path))
    prefix = "/".join(part for part in path.split("/") if part)
    return f"{scheme}://{bucket}/{prefix}".rstrip("/")


def main(argv: Sequence[str] | None = None) -> int:
    tolerate_unencodable_output()
    env = dict(os.environ)
    config, level = parse_args(sys.argv[1:] if argv is None else argv, env)
    job = f" job={config.job_name}" if config.job_name else ""
    fields: dict[str, object] = {"command": "spotjob-agent", "pid": os.getpid()}
    if config.job_name:
        fields["job"] = config.job_name
    log_to_stderr(
        level,
        f"%(asctime)s %(levelname)s spotjob-agent[%(process)d]{job.replace('%', '%%')} %(name)s: %(message)s",
        kind=config.log_format,
        fields=fields,
    )
    for line in unknown_variables(env):
        log.warning("%s", line)
    try:
        token = load_token(config.token_file, env)
    except (OSError, ValueError) as e:
        log.error("cannot read the API token: %s", e)
        return EXIT_USAGE
    own_dir = config.control_dir is None
    try:
        path = config.control_dir or tempfile.mkdtemp(prefix="spotjob-agent-")
    except OSError as e:  # no writable temporary folder at all: a read-only root filesystem
        log.error(
            "no writable temporary folder for the folder shared with the ranks (%s: a read-only root "
            "filesystem?); pass --control-dir on a writable volume (an emptyDir on "
            "Kubernetes), or set TMPDIR",
            e.strerror or e,
        )
        return EXIT_USAGE
    try:
        control = ControlDir(path)
    except OSError as e:  # a regular file there, no permission, a read-only filesystem
        log.error(
            "--control-dir %s: cannot use it as the folder shared with the ranks (%s); pass a folder this user "
            "can create or write, or leave the option out for a fresh temporary one",
            path,
            "a file, not a folder" if os.path.exists(path) and not os.path.isdir(path) else e.strerror or e,
        )
        return EXIT_USAGE
    try:
        sources = build_sources(config, env)
        agent = Agent(config, control, sources, token=token, env=env)
        agent.keep_signal_handlers = True
        return agent.run()
    finally:
        if own_dir:
            shutil.rmtree(path, ignore_errors=True)


def cli() -> NoReturn:
    """The ``spotjob-agent`` command: ``main()``, then exit without the interpreter's teardown.

    By the time ``main()`` returns, everything the agent owns has stopped (the command and every
    process of it, the control API, the notice threads; only daemon threads are left, which die at
    exit either way) and its files are written. What remains is Python freeing its modules, 0.1 s
    here, which every restart waits for: the controller starts the next attempt once the old agents
    are gone. The logs and the standard streams are flushed first. An exception leaves the normal
    way, with its traceback.
    """
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    cli()
