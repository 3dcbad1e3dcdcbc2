"""Simulated spotjob agents for the controller's scale benchmark: the real control API, no training.

The benchmark's pods run on test nodes that start no processes (a hundred torchrun gangs do not fit
on two cores), so nothing would answer the controller on the pods' IPs. This module does, in a
process of its own (so the timing of the test API server's process does not leak into it): one
``agent.control_api.ControlApi`` per pod — the same HTTP server, bearer-token check, request
bodies and status codes as ``spotjob-agent`` — bound to the pod's IP and the agents' port, with a
``SimulatedAgent`` behind it instead of ``agent.launcher``:

- ``GET /readyz``: ready (rank 0 "trains" from the start);
- ``GET /status``: state ``running`` and a step that advances ``steps_per_second`` from the step
  the attempt resumed from (the newest valid checkpoint in storage, read at start as a restore
  reads it); ``flushing`` / ``flushed`` once a flush came;
- ``POST /flush``: 202 the first time (the receipt time is reported to the benchmark), 200 after,
  as the agent answers; ``flush_seconds`` later "rank 0" commits a checkpoint at the next step to
  the job's checkpoint URI — one per-rank file, then MANIFEST.json create-only, with the job's
  identity, the attempt and ``trigger: flush``, which is what ``latest_valid`` and the
  reconciler's flush check accept;
- ``POST /stop``: 202, then 200.

What is not simulated: torchrun and its ranks, the size and duration of a real save (a few bytes,
after a fixed delay), the agent's exit with 75 after its flush (the pod stays Running until the
controller deletes it, which the controller does once storage shows the commit — the order a real
agent and controller may also take), the agent's own notices (IMDS, SIGTERM), liveness probes.

Driven over a ``multiprocessing`` pipe: ``("start", pod_uid, ip, port, token, job, attempt, uri)``,
``("stop", pod_uid)``, ``("quit",)``; it reports ``("flush", pod_uid, monotonic time)`` and
``("committed", pod_uid, step, monotonic time)`` on a queue. ``time.monotonic()`` is the system's
CLOCK_MONOTONIC on Linux, so the benchmark compares it with its own.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from multiprocessing.queues import Queue
from typing import Any

from agent.catalog import folder_name, latest_valid
from agent.control_api import (
    ControlApi,
    FlushBody,
    FlushInfo,
    ReadyResponse,
    StatusResponse,
    StopBody,
    StopInfo,
)
from agent.crc32c import crc32c_bytes, to_hex
from agent.manifest import MANIFEST_NAME, FileEntry, Manifest, rank_file_name
from agent.storage import AlreadyExistsError, StorageError, open_storage

log = logging.getLogger(__name__)


@dataclass
class SimulatedAgent:
    """What ``spotjob-agent`` answers through its control API, for one pod; see the module docstring."""

    pod_uid: str
    job: str
    attempt: int
    uri: str
    reports: Any
    steps_per_second: float = 10.0
    flush_seconds: float = 0.2
    started: float = field(default_factory=time.monotonic)
    resumed_step: int = 0
    flush: FlushInfo | None = None
    committed_step: int | None = None
    stop: StopInfo | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def restore(self) -> None:
        """Read the newest valid checkpoint, as ``Checkpointer.restore()`` would, to resume after it."""
        storage = open_storage(self.uri)
        try:
            found = latest_valid(storage)
        finally:
            storage.close()
        self.resumed_step = found.ref.step if found is not None else 0

    def step(self) -> int:
        with self.lock:
            if self.committed_step is not None:
                return self.committed_step
        return self.resumed_step + int((time.monotonic() - self.started) * self.steps_per_second)

    # -- the ControlHandler protocol

    def status(self) -> StatusResponse:
        with self.lock:
            state = "running" if self.flush is None else ("flushed" if self.committed_step is not None else "flushing")
        step = self.step()
        return StatusResponse(
            state=state,  # type: ignore[arg-type]
            pid=0,
            command_pid=None,
            uptime_seconds=time.monotonic() - self.started,
            job_name=self.job,
            control_dir="",
            checkpoint_uri=self.uri,
            attempt=self.attempt,
            rank_state="training",
            rank_checkpoint_uri=self.uri,
            step=step,
            world_size=1,
            last_committed_step=self.committed_step,
            last_committed_uri=None,
            last_save_seconds=self.flush_seconds,
            status_updated_at=time.time(),
            ranks_connected=True,
            problems=[],
            notice=None,
            flush=self.flush,
            deadline=None,
            seconds_left=None,
            window_ok=True,
            window_message="",
            flush_result=None,
            stop=self.stop,
            infra_error=None,
            command_exit_code=None,
        )

    def ready(self) -> ReadyResponse:
        return ReadyResponse(ready=True, reason="rank 0 is training (simulated)")

    def request_flush(self, body: FlushBody) -> tuple[FlushInfo, bool]:
        received = time.monotonic()
        with self.lock:
            if self.flush is not None:
                return self.flush, False
            self.flush = FlushInfo(id=f"{self.pod_uid}-flush", reason=body.reason, deadline=body.deadline,
                                   requested_at=time.time())  # fmt: skip
            flush = self.flush
        self.reports.put(("flush", self.pod_uid, received))
        timer = threading.Timer(self.flush_seconds, self._commit)
        timer.daemon = True
        timer.start()
        return flush, True

    def request_stop(self, body: StopBody) -> tuple[StopInfo, bool]:
        with self.lock:
            if self.stop is not None:
                return self.stop, False
            self.stop = StopInfo(reason=body.reason, requested_at=time.time())
            return self.stop, True

    # -- rank 0's commit

    def _commit(self) -> None:
        step = self.step() + 1
        storage = open_storage(self.uri)
        try:
            shard = f"{self.job} attempt {self.attempt} step {step}".encode()
            folder = folder_name(step)
            storage.put_bytes(f"{folder}/{rank_file_name(0)}", shard)
            manifest = Manifest(
                step=step,
                world_size=1,
                created_at=datetime.now(UTC),
                torch_version="simulated",
                job=self.job,
                attempt=self.attempt,
                state_keys=["model"],
                files=[FileEntry(path=rank_file_name(0), size=len(shard), crc32c=to_hex(crc32c_bytes(shard)))],
                trigger="flush",
            )
            storage.put_bytes_if_absent(f"{folder}/{MANIFEST_NAME}", manifest.to_json())
        except (AlreadyExistsError, StorageError) as e:
            log.warning("simulated agent of %s: the flush commit failed: %s", self.job, e)
            return
        finally:
            storage.close()
        with self.lock:
            self.committed_step = step
        self.reports.put(("committed", self.pod_uid, step, time.monotonic()))


def serve(commands: Connection, reports: Queue[Any], steps_per_second: float, flush_seconds: float) -> None:
    """The agents' process: start and stop a control API per pod as the benchmark says."""
    logging.basicConfig(level=logging.WARNING)
    agents: dict[str, ControlApi] = {}
    while True:
        message = commands.recv()
        kind = message[0]
        if kind == "quit":
            break
        if kind == "start":
            _, pod_uid, ip, port, token, job, attempt, uri = message
            if pod_uid in agents:
                continue
            agent = SimulatedAgent(pod_uid, job, attempt, uri, reports, steps_per_second, flush_seconds)
            try:
                agent.restore()
                api = ControlApi(agent, host=ip, port=port, token=token)
                api.start()
            except (OSError, StorageError) as e:
                reports.put(("error", pod_uid, f"cannot start the agent on {ip}:{port}: {e}"))
                continue
            agents[pod_uid] = api
            reports.put(("started", pod_uid, time.monotonic()))
        elif kind == "stop":
            api_ = agents.pop(message[1], None)
            if api_ is not None:
                api_.stop()
    for api_ in agents.values():
        api_.stop()
