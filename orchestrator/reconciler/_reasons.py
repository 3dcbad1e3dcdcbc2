"""Why a job is where it is: each Reason is a CamelCase name (status reason, condition reason, Event
reason) next to its message, and whether its Event is a Warning; and the condition types."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reason:
    """A CamelCase reason and the message that goes with it (``str.format`` fields)."""

    name: str
    template: str
    warning: bool = False

    def message(self, **fields: object) -> str:
        return self.template.format(**fields)


WORKERS_STARTED = Reason(
    "WorkersStarted", "started {replicas} worker(s) of attempt {attempt} from {resume}, avoiding {avoid}"
)
WORKER_NOT_STARTING = Reason(
    "WorkerNotStarting",
    "{worker} of attempt {attempt} is not starting: {reason}{detail} (told once per attempt; "
    "status.attempt.notStarting follows it)",
    warning=True,
)
WORKERS_RUNNING = Reason("WorkersRunning", "every worker of attempt {attempt} is running")
COMPLETED = Reason("Completed", "every worker exited 0 ({seen})")
SPOT_INTERRUPTED = Reason("SpotInterrupted", "{signal}: flushing the gang and moving it")
NODE_LOST = Reason("NodeLost", "{signal}: flushing what is left of the gang and moving it")
AGENT_PREEMPTED = Reason("AgentPreempted", "the agent of {worker} on node {node} heard a notice itself and exited 75")
AGENT_FLUSH_FAILED = Reason(
    "AgentFlushFailed",
    "the agent of {worker} on node {node} exited 76: its flush committed nothing{detail}",
    warning=True,
)
NOTICE_HELD = Reason(
    "NoticeHeld",
    "the agent of {worker} on node {where} holds {source}'s {kind} notice ({detail}), due at {deadline}: "
    "training goes on, and it starts the flush at {flush_at} (status.heldNotices)",
)
WORKER_LOST = Reason("WorkerLost", "worker {worker} {where} is gone without an exit code or a notice")
FLUSH_REQUESTED = Reason("FlushRequested", "{count} agent(s) accepted the request to flush by {deadline}: {workers}")
FLUSH_REQUEST_FAILED = Reason(
    "FlushRequestFailed", "could not ask the agent of {worker} to flush: {error}", warning=True
)
FLUSH_FAILED = Reason(
    "FlushFailed", "the agent of {worker} exited 76: its flush committed nothing{detail}", warning=True
)
FLUSH_COMMITTED = Reason("FlushCommitted", "step {step} committed at {uri} {after}")
"""``after``: ``FLUSH_AFTER_NOTICE``, ``FLUSH_AFTER_REQUEST`` for a flush a person asked for (no
notice came), or ``FLUSH_UNWATCHED`` for a flush committed before the pass that saw its notice (or
the worker's loss): how long it took is not known here."""
FLUSH_AFTER_NOTICE = "{seconds:.1f}s after the notice"
FLUSH_AFTER_REQUEST = "{seconds:.1f}s after the request"
FLUSH_UNWATCHED = (
    "while nothing watched: its agent flushed before the reconciler saw the notice, so how long after it "
    "is not known here (the agent's log says, `from notice to commit`)"
)
WORKERS_EXITED = Reason(
    "WorkersExited", "no worker is left to flush and {nothing} was committed{meanwhile}; resuming from {resume}"
)
FLUSH_TIMED_OUT = Reason(
    "FlushTimedOut",
    "{nothing} committed within {timeout:.0f}s{meanwhile}; resuming from {resume}{workers}",
    warning=True,
)
"""``nothing`` and ``meanwhile`` (``_recovery._committed_instead``): "nothing newer than step N",
"nothing" with no checkpoint before the notice, or "no flush" and " (a save committed step M
meanwhile)" when a save that is not the flush committed a newer step, which the job resumes from."""
RESCHEDULED = Reason(
    "Rescheduled", "stopped attempt {attempt} ({cause}); attempt {next} starts in {delay:.0f}s, avoiding {avoid}"
)
RESCHEDULED_WHEN_DRIVEN = Reason(
    "Rescheduled",
    "stopped attempt {attempt} ({cause}); attempt {next} starts once the job is driven again "
    "(spotjob run --resume), avoiding {avoid}",
)
"""``Rescheduled`` after the process that drives the job stopped its gang (``Reconciler.driver_stopped``):
nothing starts the next attempt until something drives the job again."""
WORKER_FAILED = Reason(
    "WorkerFailed",
    "worker {worker} exited with code {code}; restart {restarts} of {max_restarts}{detail}",
    warning=True,
)
RESTART_BUDGET_EXHAUSTED = Reason(
    "RestartBudgetExhausted",
    "worker {worker} exited with code {code} and all {max_restarts} restart(s) are used{detail}",
    warning=True,
)
WORKER_INFRA_ERROR = Reason(
    "WorkerInfraError",
    "the agent of {worker} on node {node} exited {code}: an infrastructure error, not the user's code "
    "({why}); restarting after the infrastructure backoff, no restart counted",
    warning=True,
)
INVALID_CHECKPOINT_URI = Reason("InvalidCheckpointURI", "{error}", warning=True)
CHECKPOINT_URI_OWNED = Reason("CheckpointURIOwned", "{error}", warning=True)
CHECKPOINT_UNUSABLE = Reason(
    "CheckpointUnusable",
    "step {recorded}, the newest checkpoint this job had recorded, {problem}: the job resumes from {resume}",
    warning=True,
)
ATTEMPT_RENUMBERED = Reason(
    "AttemptRenumbered",
    "storage records attempt {recorded} of this job already (an earlier job of this name): the next attempt is "
    "{attempt}",
)
STORAGE_UNREACHABLE = Reason("StorageUnreachable", "cannot read checkpoints at {uri}: {error}", warning=True)
STORAGE_REFUSED = Reason(
    "StorageRefused",
    "storage refuses to list checkpoints at {uri}: {error}; the running workers are left alone, but no attempt "
    "can start until the bucket or the credentials are fixed",
    warning=True,
)
STORAGE_REFUSED_FAILED = Reason(
    "StorageRefused",
    "storage refuses the checkpoint URI {uri}: {error}. Nothing was started: fix the URI, the bucket or the "
    "credentials, then submit the job again",
    warning=True,
)
BACKEND_UNAVAILABLE = Reason("BackendUnavailable", "the backend failed: {error}", warning=True)
HEALTHY = Reason("Healthy", "storage and the backend answer")
INVALID_SPEC = Reason("InvalidSpec", "{problems}; {remedy}", warning=True)
SPEC_REMEDY = "nothing is done for this job until its spec is fixed"
NAME_REMEDY = (
    "nothing is done for this job, and no edit changes a name: delete it and create it again under another name"
)
SPEC_VALID = Reason("SpecValid", "the spec is valid")
UNKNOWN_VARIABLES = Reason(
    "UnknownVariables",
    "spec.env: {variables} (told once per spec generation; the job runs without them)",
    warning=True,
)
FALLBACK_NULLS_DROPPED = Reason(
    "FallbackNullsDropped",
    "{paths}: null in kubectl apply's last-applied configuration, absent from the stored spec (client-side "
    "kubectl apply sends no null), so the fallback's attempts keep what spec.template has there. To remove it "
    "on the fallback, send the null with kubectl create -f or kubectl replace -f, or give it a value (told once "
    "per spec generation)",
    warning=True,
)
SPEC_CHANGE_IGNORED = Reason(
    "SpecChangeIgnored",
    "spec generation {generation} seen, but the job has ended ({phase}): the change runs nothing; "
    "create a new SpotJob to train again",
)
INVALID_STATUS = Reason(
    "InvalidStatus",
    "the stored status cannot be read ({problems}); the job is left alone rather than restarted from nothing",
    warning=True,
)

CAPACITY_UNAVAILABLE = Reason(
    "CapacityUnavailable",
    "{workers} found no capacity within startTimeoutSeconds ({timeout:.0f}s): {why}; {then}",
    warning=True,
)
GANG_INCOMPLETE = "GangIncomplete"
"""The reason (in ``status.restartHistory`` and the ``Rescheduled`` Event; no Event of its own: the
``CapacityUnavailable`` one says it) of a restart with ``Cause.CAPACITY`` that stops a gang only
partly placed past ``startTimeoutSeconds`` with no fallback to move to: its placed workers would
hold their nodes in the rendezvous for nothing."""
CAPACITY_FOUND = Reason("CapacityFound", "every worker of attempt {attempt} runs on {capacity} capacity")
RETURNING_TO_SPOT = Reason(
    "ReturningToSpot",
    "{seconds:.0f}s on the fallback capacity without a preemption (fallback.returnAfterSeconds {period:.0f}s): "
    "attempt {attempt} uses the job's own template again",
)
FLUSH_REQUESTED_BY_USER = Reason(
    "FlushRequestedByUser", "flush request {id} (restart{reason}): flushing the gang and restarting it"
)
CHECKPOINT_REQUESTED_BY_USER = Reason(
    "CheckpointRequestedByUser", "flush request {id} (checkpoint{reason}): {count} agent(s) asked for a checkpoint"
)
FLUSH_REQUEST_COMMITTED = Reason("FlushRequestCommitted", "flush request {id} ({mode}): step {step} committed")
FLUSH_REQUEST_NOT_COMMITTED = Reason("FlushRequestNotCommitted", "flush request {id} ({mode}): {why}", warning=True)
FLUSH_REQUEST_SKIPPED = Reason("FlushRequestSkipped", "flush request {id} ({mode}): {why}")
SAVE_REQUEST_FAILED = Reason(
    "SaveRequestFailed", "could not ask the agent of {worker} for a checkpoint: {error}", warning=True
)
FLUSH_REQUEST_INVALID = Reason(
    "FlushRequestInvalid", "{problem}; the request is ignored (write a new one with a new id)", warning=True
)

READY = "Ready"
FLUSHING = "Flushing"
DEGRADED = "Degraded"
INVALID = "Invalid"
CAPACITY = "CapacityUnavailable"
