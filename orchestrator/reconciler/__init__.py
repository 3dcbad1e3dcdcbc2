"""The recovery state machine every backend shares. It knows nothing of Kubernetes or processes.

One ``reconcile(key)`` is one pass for one job (``JobKey``): observe (the backend's workers and
signals, the newest valid checkpoint in storage), decide from the job's spec, those observations
and the persisted status, act through the backend, write the status once — only if it changed —
then emit the pass's Events (``orchestrator.events.EventSink``) and metrics (``JobMetrics``). It
never sleeps; it returns when to look again. Everything it decided lives in the status, so a new
``Reconciler`` reading it carries on, and a pass whose status write is lost is replayed safely:
every action is idempotent (deterministic worker names per attempt, agents keep their first flush
request) and every counter moves in the same write as the phase that counted it. Stopping the
gang, the one action that destroys evidence (a failed worker and its exit code), happens only
after the write that records why: a pass whose write is lost stopped nothing, and the next one
decides the same failure again rather than finding the gang vanished (a preemption). A Failed
job's workers are stopped until none is alive; those that exited are kept (a pod for
``kubectl logs``), unless a sidecar keeps them on their node. Events and metrics follow the write (Karpenter): a
pass whose write failed tells nothing.

No status churn: a pass whose decisions change nothing writes nothing. The numbers that move
without a decision — goodput, the workers' step hints, the attempt's highest observed step — are
written with the next change, or on their own at most every ``status_refresh_seconds`` (60 s), so
``kubectl get sj`` stays current without a write per pass. ``observedGeneration`` is the spec
generation the pass acted on.

An invalid job — a stored spec that does not validate, a name too long for its pods' names, a
``spec.checkpoint.uri`` other than the ``status.checkpointUri`` its first pass recorded (the URI
is immutable: its checkpoints are there), or a spec the backend says it cannot run
(``Backend.spec_problems``) — gets ``Invalid=True`` naming
the field and a Warning Event (``InvalidSpec``); nothing else happens to it (its workers, if any,
are left as they are) until its spec changes, and every other job is served as usual.

Transitions (``*`` once the next attempt's workers were started)::

    from                        to            when                                            reason
    (new)                       Pending       storage answers; attempt 0 started              WorkersStarted
    Pending, Rescheduling*      (same)        a worker does not start (an image it cannot     WorkerNotStarting
                                              pull, no node, its ranks not meeting):          (Event, once
                                              status.attempt.notStarting; a Warning Event     per attempt)
                                              (no node: after 10 minutes)
    Pending, Rescheduling*      Running       every worker of the attempt runs                WorkersRunning
    Running, Flushing           Succeeded     every worker exited 0                           Completed
    Pending, Running, Resch.*   Flushing      a preemption signal names a node of the attempt SpotInterrupted
                                              a signal says a node of the attempt is gone     NodeLost
                                              a worker's agent exited 75                      AgentPreempted
                                              a worker's agent exited 76                      AgentFlushFailed
                                              a worker vanished or died without exit code     WorkerLost
    Flushing                    Rescheduling  storage holds a manifest newer than before      FlushCommitted
                                              no worker is left running to flush              WorkersExited
                                              flushTimeoutSeconds passed                      FlushTimedOut
    Running                     Flushing      a person asked for a restart (flush request)    FlushRequestedByUser
    Pending, Running, Resch.*   Rescheduling  the process driving the job stopped its gang    the driver's:
                                              on purpose (an interrupted spotjob run:         InterruptFlush-
                                              Reconciler.driver_stopped); cause Requested,    Committed, ...
                                              nothing counted; the next attempt starts once
                                              the job is driven again
    Pending, Rescheduling*      Rescheduling  the attempt's workers stayed unschedulable      CapacityUnavailable
                                              past startTimeoutSeconds; spec.fallback is next
    Pending, Running, Resch.*   Rescheduling  a worker's agent exited 74                      WorkerInfraError
                                Rescheduling  a worker exited non-zero (not 74/75/76/79)      WorkerFailed
                                Failed        … and maxRestarts restarts are used             RestartBudgetExhausted
    any                         Failed        the checkpoint URI names no store               InvalidCheckpointURI
    any                         Failed        another job owns the checkpoint URI             CheckpointURIOwned
    Pending, Rescheduling       Failed        storage refuses for good before the attempt     StorageRefused
                                              starts (no such bucket, access denied)

The package, one concern a module (``Reconciler`` joins them, each a layer on the one before):

- ``_pass``: one pass's working state (``_Pass``), the clock, the options, the verdicts shared by
  every concern (which exit is a failure, whether a stop may flush).
- ``_reasons``: every Reason (CamelCase name and message) and condition type.
- ``_base``: what every concern writes into a pass: phase, conditions, Events, the end of a recovery.
- ``_requests``: a person's flush requests (``spotjob.dev/flush-request``).
- ``_recovery``: preemptions, failures, the flush and the restart (Flushing, Rescheduling).
- ``_capacity``: ``startTimeoutSeconds`` and ``spec.fallback``.
- ``_reconciler``: ``Reconciler``: the pass (observe, decide, write once, then tell), ownership
  and fencing, starting an attempt, infrastructure health, goodput.
"""

from orchestrator.controller_loop import Controller as Controller  # its home before it had its own module
from orchestrator.reconciler._pass import (
    BeforeStop,
    Clock,
    ReconcileResult,
    ReconcilerOptions,
    SystemClock,
    job_identity,
)
from orchestrator.reconciler._reasons import (
    CHECKPOINT_URI_OWNED,
    INVALID,
    INVALID_CHECKPOINT_URI,
    RESTART_BUDGET_EXHAUSTED,
)
from orchestrator.reconciler._reconciler import Reconciler

__all__ = [
    "CHECKPOINT_URI_OWNED",
    "INVALID",
    "INVALID_CHECKPOINT_URI",
    "RESTART_BUDGET_EXHAUSTED",
    "BeforeStop",
    "Clock",
    "Controller",
    "ReconcileResult",
    "Reconciler",
    "ReconcilerOptions",
    "SystemClock",
    "job_identity",
]
