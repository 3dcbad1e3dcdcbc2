"""One worker of a local run (``LocalWorker``): its agent's process, its control folder and log,
and what the backend has seen of it; what it is now, as the reconciler sees it
(``observe_worker``); and the calls to its agent's control API (``post_to_agent``)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from agent.control_api import is_loopback
from agent.control_channel import (
    AGENT_FILE,
    EXIT_FLUSH_FAILED,
    EXIT_INFRA_ERROR,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    STATUS_FILE,
    read_json,
)
from agent.exit_codes import flush_answered
from orchestrator.backends.base import (
    RANKS_NOT_MEETING,
    BackendError,
    WorkerObservation,
    held_notice,
    ranks_not_meeting,
    ranks_state,
    restored,
)
from orchestrator.backends.local_cloud import LocalNode
from orchestrator.backends.local_failure import agent_exit_line, agent_exit_words, failure_detail
from orchestrator.model import JobKey, WorkerPhase

log = logging.getLogger("orchestrator.backends.local")  # its lines as they were before the split

_AGENT_EXIT_CODES = (0, EXIT_PREEMPTED, EXIT_FLUSH_FAILED, EXIT_INFRA_ERROR, EXIT_STOPPED)
"""Exits that are not a failure of the script (its log has no cause to tell)."""

FLUSH_REQUEST_TIMEOUT = 5.0
STOP_REQUEST_TIMEOUT = 5.0


@dataclass
class LocalWorker:
    """One worker: its ``spotjob-agent`` process on ``node``, and what the monitor has seen of it."""

    name: str
    job: JobKey
    attempt: int
    index: int
    node: LocalNode
    proc: subprocess.Popen[bytes]
    control_dir: str
    log_path: str
    marker: str
    lost: bool = False
    """Its node was terminated while it ran: no exit code, as a pod on a vanished node."""
    stopping: bool = False
    stop_flush: bool = True
    """How the stop under way began: SIGTERM (the agent flushes), or POST /stop first (no flush)."""
    exit_seen: bool = False
    training_seen: bool = False
    last_step: int | None = None
    last_step_sample: float = 0.0
    first_step_sample: float | None = None
    """When its first step was sampled: the age its sampling interval grows with."""
    last_commit: int | None = None
    commits: int = 0
    """Commits its rank 0 reported so far (``status.json``'s counter)."""
    detail: str | None = None
    """Why it failed (``failure_detail``), read once after it exited with a failure; or, for an agent
    that exited 74 or 76, its own line saying why (``agent_exit_line``; "" when it said none)."""
    answered: str | None = None
    """For an agent that exited 75: what its flush answered, from its exit line, read once ("":
    its line does not say)."""

    def exit_code(self) -> int | None:
        code = self.proc.poll()
        if code is None:
            return None
        return 128 - code if code < 0 else code

    def killed_by(self) -> int | None:
        """The signal that ended its agent itself (a SIGKILL by hand or by the OOM killer), if one did."""
        code = self.proc.poll()
        return -code if code is not None and code < 0 else None

    @property
    def alive(self) -> bool:
        return not self.lost and self.proc.poll() is None

    def rank_status(self) -> dict[str, Any] | None:
        return read_json(os.path.join(self.control_dir, STATUS_FILE))

    def agent_says(self) -> dict[str, Any]:
        """Its agent's ``agent.json`` (the control API's address, ``ranks_not_meeting``, the notice
        it holds); empty before the agent wrote it and after it exited."""
        return read_json(os.path.join(self.control_dir, AGENT_FILE)) or {}


def observe_worker(w: LocalWorker) -> WorkerObservation:
    """What the reconciler sees of ``w`` now (the phases: ``orchestrator.backends.local``'s
    docstring); the first look after a failure reads why from its log into ``w.detail``."""
    status = w.rank_status()
    step = status.get("step") if status else None
    code = w.exit_code()
    if w.lost:
        phase, code = WorkerPhase.FAILED, None
    elif code is not None:
        phase = WorkerPhase.SUCCEEDED if code == 0 else WorkerPhase.FAILED
    elif status is not None and status.get("state", "starting") != "starting":
        phase = WorkerPhase.RUNNING
    else:
        phase = WorkerPhase.PENDING
    if code is not None and code not in _AGENT_EXIT_CODES and w.detail is None:
        w.detail = failure_detail(w.log_path, w.killed_by())
    elif code in (EXIT_INFRA_ERROR, EXIT_FLUSH_FAILED) and w.detail is None:
        w.detail = agent_exit_line(w.log_path, code) or ""  # why, in the agent's words ("": it said none)
    elif code == EXIT_PREEMPTED and w.answered is None:
        words = agent_exit_words(w.log_path, code)
        w.answered = (flush_answered(words) if words else None) or ""
    agent = w.agent_says() if phase in (WorkerPhase.PENDING, WorkerPhase.RUNNING) else {}
    return WorkerObservation(
        name=w.name,
        attempt=w.attempt,
        index=w.index,
        phase=phase,
        node=w.node.name,
        zone=w.node.zone,
        instance_type=w.node.instance_type,
        exit_code=code,
        step=step if isinstance(step, int) else None,
        ranks_state=ranks_state(status.get("state")) if status and phase is WorkerPhase.RUNNING else None,
        restored=restored(status.get("restored_step"), status.get("restore_passed_over")) if status else None,
        detail=w.detail or None,
        flush_answered=w.answered or None,
        not_starting=not_meeting(agent) if phase is WorkerPhase.PENDING else None,
        # The reconciler records it (status.heldNotices, a NoticeHeld Event) for a running worker.
        held_notice=held_notice(agent) if phase is WorkerPhase.RUNNING else None,
    )


def not_meeting(agent: dict[str, Any]) -> tuple[str, str] | None:
    """``RanksNotMeeting`` and the agent's words (its ``agent.json``), while its ranks have not
    connected past its ``--rank-connect-timeout``: they wait in init_process_group, or build no
    Checkpointer."""
    said = ranks_not_meeting(agent.get("ranks_not_meeting"))
    return (RANKS_NOT_MEETING, f"its agent: {said}") if said is not None else None


def post_to_agent(
    w: LocalWorker, token: str, path: str, body: dict[str, Any], timeout: float = FLUSH_REQUEST_TIMEOUT
) -> dict[str, Any] | None:
    """POST ``body`` to the worker's agent with the run's token; its JSON answer, or None for 409
    (the command has ended). ``BackendError`` when the agent cannot be reached or refuses."""
    info = read_json(os.path.join(w.control_dir, AGENT_FILE))
    if info is None or "url" not in info:
        raise BackendError(f"the agent of {w.name} has not started its control API yet")
    url = info["url"]
    # The run's token goes only to an agent on this machine's loopback, as spotjob's agents
    # listen: not to whatever a file in the run folder names (another host, a file:// URL).
    parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme != "http" or not is_loopback(parts.hostname or ""):
        raise BackendError(f"the agent of {w.name} names no loopback control API in its {AGENT_FILE}")
    request = urllib.request.Request(
        f"{url}{path}",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            answer = json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        if e.code == 409:
            detail = e.read()[:200].decode(errors="replace")
            log.info("the agent of %s has nothing left to %s: %s", w.name, path.strip("/"), detail)
            return None
        raise BackendError(f"POST {path} to the agent of {w.name} answered {e.code}") from e
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise BackendError(f"POST {path} to the agent of {w.name} failed: {e}") from e
    return answer if isinstance(answer, dict) else {}
