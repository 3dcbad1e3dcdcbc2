"""What ``spotjob run`` is told (``RunConfig``), checked up front: a bad option exits 2 before
anything exists, naming the option (``JobSpec``'s own complaints are said of the option too)."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import uuid
from dataclasses import dataclass, field

from pydantic import ValidationError

from agent.catalog import reserved_uri_problem
from agent.storage import parse_uri
from agent.torchrun import Launcher
from orchestrator.backends.local_cloud import CLOUDS
from orchestrator.backends.local_plan import PreemptionPlan
from orchestrator.model import (
    MAX_DURATION_SECONDS,
    MAX_FLUSH_SECONDS,
    MAX_NAME_LENGTH,
    BackoffSpec,
    CheckpointSpec,
    JobKey,
    JobSpec,
    job_name_problem,
)
from orchestrator.run_folder import RUNS_DIR

PLOT_FORMATS = frozenset({"png", "pdf", "svg", "svgz", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp"})
"""The file types ``--plot`` writes (matplotlib's Agg, PDF, SVG and PS backends)."""


@dataclass(frozen=True)
class RunConfig:
    """Everything ``spotjob run`` was told; checked up front (``JobSpec`` checks the rest)."""

    script: str
    """The training script, as torchrun takes it (made absolute)."""
    args: list[str]
    """The script's own arguments."""
    name: str
    runs_dir: str = RUNS_DIR
    """Where run folders go (``./spotjob-runs``)."""
    nproc: int = 2
    """Ranks per node (torchrun --nproc-per-node)."""
    checkpoint_uri: str | None = None
    """None: ``<runs_dir>/<name>/checkpoints``."""
    every_steps: int | None = None
    every_seconds: float | None = None
    keep: int = 3
    max_restarts: int = 3
    """Restarts after failures of the user's code (preemptions never consume it)."""
    flush_timeout: float = 120.0
    """How long the reconciler waits for a flush to commit before restarting from what is there."""
    notice: float = 30.0
    """The window of each injected notice, from the notice to the node's termination."""
    restart_backoff: float = 1.0
    """The first restart's delay (doubling, capped at max(this, 60 s)); a local node is there at once."""
    preempt_every: float | None = None
    preempt_jitter: float = 0.25
    preempt_at_steps: list[int] = field(default_factory=list)
    trace: list[float] = field(default_factory=list)
    seed: int | None = None
    maintenance_at_steps: list[int] = field(default_factory=list)
    """A host maintenance (GCE TERMINATE_ON_HOST_MAINTENANCE) announced at each of these steps."""
    maintenance_notice: float = 20.0
    """From a host maintenance's notice to its node's stop (the agents' --gcp-maintenance-seconds)."""
    flush_lead: float = 10.0
    """The agents' --flush-lead: a maintenance is held until this long before its deadline."""
    interrupt_deadline: float = 30.0
    """The deadline a Ctrl-C or SIGTERM gives the training workers' flush (``--interrupt-deadline``);
    ``orchestrator.run_interrupt.INTERRUPT_FLUSH_SECONDS`` unless told. This driver's: --resume
    may give another."""
    ignore_notices: bool = False
    """A baseline: nobody listens for notices; a noticed node just dies when its window ends."""
    launcher: Launcher = "direct"
    """How each agent starts the ranks (spotjob-agent --launcher): direct, or torchrun itself."""
    cloud: str = "aws"
    """The cloud the nodes simulate (``--cloud``): how a notice is announced and which source hears it."""
    plot: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problem = next((p for p in self.problems()), None)
        if problem is not None:
            raise ValueError(problem)

    def problems(self) -> list[str]:
        """What is wrong with the numbers and the name, each naming its option."""
        out = [
            _at_least("--nproc", self.nproc, 1),
            _at_least("--every-steps", self.every_steps, 1),
            _positive("--every-seconds", self.every_seconds),
            _at_least("--keep", self.keep, 1),
            _at_least("--max-restarts", self.max_restarts, 0),
            _positive("--flush-timeout", self.flush_timeout, _MAX_FLUSH),
            _positive("--notice", self.notice, _MAX_FLUSH),
            _not_negative("--restart-backoff", self.restart_backoff),
            _positive("--preempt-every", self.preempt_every),
            None
            if math.isfinite(self.preempt_jitter) and 0 <= self.preempt_jitter < 1
            else f"--preempt-jitter must be at least 0 and below 1, got {self.preempt_jitter:g}",
            None if all(s >= 0 for s in self.preempt_at_steps) else "--preempt-at-step takes steps >= 0",
            None if all(math.isfinite(t) and t >= 0 for t in self.trace) else "--trace times must be >= 0 seconds",
            None if all(s >= 0 for s in self.maintenance_at_steps) else "--maintenance-at-step takes steps >= 0",
            _positive("--maintenance-notice", self.maintenance_notice, _MAX_FLUSH),
            _positive("--flush-lead", self.flush_lead, _MAX_FLUSH),
            self._lead_problem(),
            _positive("--interrupt-deadline", self.interrupt_deadline, _MAX_FLUSH),
            None if self.cloud in CLOUDS else f"--cloud {self.cloud!r}: expected one of {', '.join(CLOUDS)}",
            name_problem(self.name),
        ]
        return [p for p in out if p is not None]

    def _lead_problem(self) -> str | None:
        """A planned maintenance must be held: its agents' --flush-lead shorter than its notice."""
        lead, notice = self.flush_lead, self.maintenance_notice
        if not self.maintenance_at_steps or not math.isfinite(lead) or lead < notice:
            return None
        return (
            f"--flush-lead ({self.flush_lead:g} s) must be shorter than --maintenance-notice "
            f"({self.maintenance_notice:g} s): each agent would flush as soon as it hears of the maintenance "
            "and hold nothing; give a shorter --flush-lead or a longer --maintenance-notice"
        )

    @property
    def path(self) -> str:
        return os.path.abspath(os.path.join(self.runs_dir, self.name))

    @property
    def key(self) -> JobKey:
        """The job's key: ``local/<name>`` (``orchestrator.model.LOCAL_NAMESPACE``)."""
        return JobKey.local(self.name)

    def job_spec(self) -> JobSpec:
        """The job's spec; ``ValueError`` naming the option when one does not fit it."""
        uri = self.checkpoint_uri or os.path.join(self.path, "checkpoints")
        if "://" not in uri:
            uri = os.path.abspath(uri)
        try:
            return JobSpec(
                command=[self.script, *self.args],
                env=self.env,
                replicas=1,
                nproc_per_node=self.nproc,
                checkpoint=CheckpointSpec(
                    uri=uri, every_steps=self.every_steps, every_seconds=self.every_seconds, keep=self.keep
                ),
                max_restarts=self.max_restarts,
                flush_timeout_seconds=self.flush_timeout,
                notice_seconds=self.notice,
                restart_backoff=BackoffSpec(
                    initial_seconds=self.restart_backoff, max_seconds=max(self.restart_backoff, 60.0)
                ),
            )
        except ValidationError as e:
            raise ValueError(describe_option_error(e)) from None

    def plan(self) -> PreemptionPlan:
        return PreemptionPlan(
            every=self.preempt_every,
            jitter=self.preempt_jitter,
            at_steps=list(self.preempt_at_steps),
            trace=list(self.trace),
            seed=self.seed,
            maintenance_at_steps=list(self.maintenance_at_steps),
        )


RANKS_PER_CPU = 4
"""``--nproc`` at most this many ranks per CPU of the machine: every rank is a process of its own
(and a PyTorch import), so more only compete for the CPUs, and a mistyped ``--nproc 20000`` would
start processes until the machine gives out."""


def nproc_within_machine(nproc: int) -> str | None:
    """What is wrong with a new run's ``--nproc`` on this machine. Not a check of ``RunConfig``:
    a run made on a larger machine is resumed with the spec it has, which --resume cannot change."""
    cpus = os.cpu_count() or 1
    limit = RANKS_PER_CPU * cpus
    if nproc <= limit:
        return None
    return f"--nproc must be at most {limit} ({RANKS_PER_CPU} ranks per CPU; this machine has {cpus}), got {nproc}"


def _at_least(option: str, value: int | None, low: int) -> str | None:
    return None if value is None or value >= low else f"{option} must be at least {low}, got {value}"


def _positive(option: str, value: float | None, most: tuple[float, str] | None = None) -> str | None:
    """``most``: the largest value and how it is said (default: ``MAX_DURATION_SECONDS``)."""
    limit, said = most or (MAX_DURATION_SECONDS, _MAX_DURATION)
    if value is None or (math.isfinite(value) and 0 < value <= limit):
        return None
    return f"{option} must be a positive number of seconds, at most {said}, got {value:g}"


def _not_negative(option: str, value: float) -> str | None:
    if math.isfinite(value) and 0 <= value <= MAX_DURATION_SECONDS:
        return None
    return f"{option} must be a number of seconds >= 0, at most {_MAX_DURATION}, got {value:g}"


_MAX_DURATION = f"{MAX_DURATION_SECONDS} (one year)"
_MAX_FLUSH = (MAX_FLUSH_SECONDS, f"{MAX_FLUSH_SECONDS} (a day: what spotjob-agent takes)")


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a run (said of ``--name``), or None."""
    if job_name_problem(name) is None:
        return None
    return (
        f"--name {name!r}: a run's name is a DNS label: lowercase letters, digits and '-', starting and ending "
        f"with a letter or digit, at most {MAX_NAME_LENGTH} characters"
    )


_OPTION_OF_FIELD = {
    ("nprocPerNode",): "--nproc",
    ("checkpoint", "uri"): "--checkpoint-uri",
    ("checkpoint", "everySteps"): "--every-steps",
    ("checkpoint", "everySeconds"): "--every-seconds",
    ("checkpoint", "keep"): "--keep",
    ("maxRestarts",): "--max-restarts",
    ("flushTimeoutSeconds",): "--flush-timeout",
    ("noticeSeconds",): "--notice",
    ("restartBackoff", "initialSeconds"): "--restart-backoff",
    ("restartBackoff", "maxSeconds"): "--restart-backoff",
    ("restartBackoff",): "--restart-backoff",
    ("command",): "SCRIPT",
    ("env",): "the environment",
}


def describe_option_error(error: ValidationError) -> str:
    """pydantic's complaint about the spec, said of the option it came from, in plain words."""
    parts = []
    for item in error.errors():
        loc = tuple(str(x) for x in item["loc"])
        option = next(
            (o for fields, o in _OPTION_OF_FIELD.items() if loc[: len(fields)] == fields), ".".join(loc) or "the spec"
        )
        message = str(item["msg"]).removeprefix("Value error, ")
        message = message.replace("Input should be", "must be").replace("Input", "the value")
        parts.append(f"{option} {message}" if message.startswith("must") else f"{option}: {message}")
    return "; ".join(parts)


def checkpoint_uri_problem(uri: str) -> str | None:
    """Why ``--checkpoint-uri`` cannot work, said before anything is created; None if it may.

    Object stores are not contacted here (the reconciler fails the job at once with
    ``StorageRefused`` when the bucket does not exist or access is denied); a path is checked
    on this machine: it must be a folder, or creatable where a folder can be created.
    """
    try:
        scheme, _, path = parse_uri(uri)
    except ValueError as e:
        return f"--checkpoint-uri: {e}"
    reserved = reserved_uri_problem(uri if scheme != "file" else os.path.abspath(path))
    if reserved is not None:
        return f"--checkpoint-uri {reserved}"
    if scheme != "file":
        return None
    folder = os.path.abspath(path)
    if os.path.exists(folder) and not os.path.isdir(folder):
        return (
            f"--checkpoint-uri {uri}: {folder} is a regular file, not a folder; a checkpoint URI names a folder "
            "(a new or an existing one)"
        )
    problem = folder_problem(folder)
    return f"--checkpoint-uri {uri}: {problem}" if problem else None


def plot_problem(path: str) -> str | None:
    """Why ``--plot`` could not be written at the end of the run; None if it can."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        return f"--plot {path}: that is a folder; name the image file (e.g. {os.path.join(path, 'run.png')})"
    kind = os.path.splitext(target)[1].lower().lstrip(".")
    if kind not in PLOT_FORMATS:
        what = f"'.{kind}' file" if kind else "file without an extension"
        others = ", ".join(f".{k}" for k in sorted(PLOT_FORMATS - {"png", "svg", "pdf"}))
        return f"--plot {path}: cannot draw a {what}; use .png, .svg or .pdf (or {others})"
    try:
        import matplotlib  # noqa: F401  (lazily: the controller's image carries no matplotlib)
    except ImportError:
        return "--plot needs matplotlib: pip install 'spotjob[plot]'"
    if os.path.exists(target) and not os.access(target, os.W_OK):
        return f"--plot {path}: permission denied (the file exists and this user may not write it)"
    problem = folder_problem(os.path.dirname(target))
    return f"--plot {path}: {problem}" if problem else None


def folder_problem(folder: str) -> str | None:
    """Why ``folder`` could not be created or written by this process; None if it can. Creates
    nothing that stays: the nearest existing ancestor is probed with a file made and removed."""
    try:
        folder.encode("utf-8")
    except UnicodeEncodeError:
        # Bytes the file-system encoding could not decode (a C locale with PYTHONUTF8=0 and a
        # non-ASCII name): the run's records could not hold the path.
        return (
            f"{folder!r} is not readable text in this locale (file names decoded as "
            f"{sys.getfilesystemencoding()}): run with PYTHONUTF8=1 or a UTF-8 locale (LANG=C.UTF-8), "
            "or use a folder whose name is ASCII"
        )
    existing = folder
    while not os.path.exists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        if existing == folder:
            return f"{folder} is a file, not a folder"
        return f"{existing} is a file, so no folder can be made under it"
    probe = os.path.join(existing, f".spotjob-probe-{uuid.uuid4().hex[:8]}")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as e:
        why = "permission denied" if isinstance(e, PermissionError) else (e.strerror or str(e)).lower()
        return f"cannot write in {existing}: {why}"
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None
