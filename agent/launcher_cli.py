"""spotjob-agent's command line: its options, checked once into an ``AgentConfig``.

``agent.launcher.main`` parses with ``parse_args`` and runs the ``Agent``; the names here stay
importable from ``agent.launcher``."""

from __future__ import annotations

import argparse
import functools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NoReturn

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent.control_api import ENV_AGENT_TOKEN
from agent.control_channel import (
    ENV_ASYNC,
    ENV_ATTEMPT,
    ENV_CHECKPOINT_URI,
    ENV_EVERY_SECONDS,
    ENV_EVERY_STEPS,
    ENV_JOB_NAME,
    ENV_KEEP,
    ENV_STAGING_DIR,
    ENV_START_FRESH,
)
from agent.notices import aws, azure, gcp
from agent.notices.base import metadata_url_problem
from agent.notices.detect import ENV_CLOUD, Cloud
from agent.ownership import job_name_problem
from agent.restore_cache import staging_dir_problem
from agent.settings import CheckpointerEnv, StorageEnv, load_from
from agent.storage import parse_uri
from agent.streams import ENV_LOG_FORMAT, log_format
from agent.torchrun import ENV_LAUNCHER, LAUNCHERS, Launcher
from agent.version import version_line

ENV_AWS_METADATA_URL = "SPOTJOB_AWS_METADATA_URL"
ENV_GCP_METADATA_URL = "SPOTJOB_GCP_METADATA_URL"
ENV_AZURE_METADATA_URL = "SPOTJOB_AZURE_METADATA_URL"
ENV_POLL_INTERVAL = "SPOTJOB_AGENT_POLL_INTERVAL"
ENV_FLUSH_LEAD = "SPOTJOB_AGENT_FLUSH_LEAD"
ENV_GCP_MAINTENANCE_SECONDS = "SPOTJOB_AGENT_GCP_MAINTENANCE_SECONDS"
ENV_REBALANCE = "SPOTJOB_AGENT_REBALANCE"
ENV_PREFETCH = "SPOTJOB_AGENT_PREFETCH"
ENV_RANK_CONNECT_TIMEOUT = "SPOTJOB_AGENT_RANK_CONNECT_TIMEOUT"
NOTICE_VARIABLES = {
    "flush_lead": ENV_FLUSH_LEAD,
    "gcp_maintenance_seconds": ENV_GCP_MAINTENANCE_SECONDS,
    "rebalance": ENV_REBALANCE,
    "rank_connect_timeout": ENV_RANK_CONNECT_TIMEOUT,
}
"""The notice options a variable also sets (the option wins): on Kubernetes the controller writes
the agent's command line, and a SpotJob's ``env`` is how a user reaches these (an agent older
than the variables ignores them, where an option it lacks would make it exit 2)."""
"""Hidden: a poll interval outside 1-5 s, for tests against emulators."""
MIN_POLL_INTERVAL = 0.01
MAX_POLL_INTERVAL = 60.0
"""The range ``SPOTJOB_AGENT_POLL_INTERVAL`` takes: past a minute, a two-minute notice may be
heard too late to flush; under 10 ms the agent would only spin on the metadata server."""

DEFAULT_RANK_CONNECT_TIMEOUT = 120.0
"""``--rank-connect-timeout``: torch's import and a restore fit in it on a healthy start; ranks that
have not met by then are said to be waiting, not stopped (init_process_group's own timeout does that)."""

MAX_WAIT_SECONDS = 86400.0
"""The longest of the agent's graces, timeouts and deadlines (a day): longer is a typo, and ``inf``
or ``1e300`` seconds would overflow the clock arithmetic of the notice that uses it."""

DEFAULT_FLUSH_LEAD = 300.0
"""``--flush-lead``: five minutes hold a flush of a large state to a slow store with room to spare,
and are only held back from notices that give more (no spot preemption does)."""

NOTICE_SOURCES = ("aws", "gcp", "azure", "sigterm")
RebalancePolicy = Literal["ignore", "save-early", "flush"]
REBALANCE_POLICIES: tuple[RebalancePolicy, ...] = ("ignore", "save-early", "flush")
Prefetch = Literal["node", "all", "off"]
PREFETCH_MODES: tuple[Prefetch, ...] = ("node", "all", "off")


class AgentConfig(BaseModel):
    """Everything ``spotjob-agent`` was told; checked once, at start-up."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    command: list[str] = Field(min_length=1)
    """The command after ``--``, run in a session of its own."""
    checkpoint_uri: str | None = None
    """Passed as SPOTJOB_CHECKPOINT_URI; None keeps the one already in the environment."""
    job_name: str | None = None
    every_steps: int | None = Field(default=None, ge=1)
    every_seconds: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    keep: int | None = Field(default=None, ge=0)
    """Passed as SPOTJOB_KEEP; 0 keeps every checkpoint, as it does for ``Checkpointer.from_env()``."""
    async_save: bool | None = None
    staging_dir: str | None = None
    control_dir: str | None = None
    """None: a fresh temporary folder, removed at exit."""
    control_host: str = "127.0.0.1"
    control_port: int = Field(default=0, ge=0, le=65535)
    token_file: str | None = None
    notices: tuple[str, ...] | None = None
    """Exactly these sources; None: SIGTERM plus the detected cloud, minus the ``--no-*`` ones."""
    disabled: frozenset[str] = frozenset()
    cloud: Cloud | None = None
    """None: auto-detect (or SPOTJOB_CLOUD)."""
    aws_metadata_url: str = aws.DEFAULT_BASE_URL
    gcp_metadata_url: str = gcp.DEFAULT_BASE_URL
    azure_metadata_url: str = azure.DEFAULT_BASE_URL
    poll_interval: float = Field(default=2.0, ge=MIN_POLL_INTERVAL, le=MAX_POLL_INTERVAL, allow_inf_nan=False)
    """Seconds between two polls of a metadata endpoint: ``--poll-interval``, or ``SPOTJOB_AGENT_POLL_INTERVAL``."""
    rebalance: RebalancePolicy = "save-early"
    sigterm_grace: float = Field(default=30.0, gt=0, le=MAX_WAIT_SECONDS, allow_inf_nan=False)
    """The deadline of a SIGTERM, in seconds after it arrives. More than 0: a deadline that has passed
    means "flush now, bounded by --flush-timeout", the longest wait; ``--no-sigterm`` for no flush."""
    gcp_notice_seconds: float = Field(
        default=gcp.PREEMPTION_NOTICE_SECONDS, gt=0, le=MAX_WAIT_SECONDS, allow_inf_nan=False
    )
    gcp_maintenance_seconds: float | None = Field(default=None, gt=0, le=MAX_WAIT_SECONDS, allow_inf_nan=False)
    """The deadline after GCE's maintenance-event turns TERMINATE_ON_HOST_MAINTENANCE; None: an hour
    on a machine with an NVIDIA GPU (what GCE gives GPU VMs), else 60 s."""
    flush_lead: float = Field(default=DEFAULT_FLUSH_LEAD, ge=0, le=MAX_WAIT_SECONDS, allow_inf_nan=False)
    """A cloud notice whose deadline is further away than this is held: training goes on and its
    flush starts this long before the deadline (or as long as the last save x the safety margin,
    if that is longer). 0: every notice flushes at once."""
    safety_margin: float = Field(default=1.5, ge=1.0, allow_inf_nan=False)
    """A flush "fits" when the time left >= last save duration x this."""
    exit_timeout: float = Field(default=30.0, ge=0, le=MAX_WAIT_SECONDS, allow_inf_nan=False)
    """After a flush result, how long the command gets to exit before it is killed."""
    flush_timeout: float = Field(default=600.0, gt=0, le=MAX_WAIT_SECONDS, allow_inf_nan=False)
    """For a flush without a deadline: how long before the agent gives up and kills the command."""
    kill_grace: float = Field(default=5.0, ge=0, le=MAX_WAIT_SECONDS, allow_inf_nan=False)
    """SIGTERM → SIGKILL when killing the command's processes."""
    expected_ranks: int | None = Field(default=None, ge=1)
    """Ranks on this node that must write closed-rank-<r> for a finished job."""
    attempt: int | None = Field(default=None, ge=0)
    """The attempt number the controller recorded before starting this worker (SPOTJOB_ATTEMPT)."""
    start_fresh: bool = False
    """SPOTJOB_START_FRESH=1: the ranks start from step 0 on purpose although checkpoints exist."""
    exit_with_parent: bool = False
    """Flush and stop when the process that started the agent (the driver) is gone."""
    parent_grace: float = Field(default=30.0, gt=0, le=MAX_WAIT_SECONDS, allow_inf_nan=False)
    """The deadline of the flush after the parent is gone, in seconds."""
    rank_connect_timeout: float = Field(
        default=DEFAULT_RANK_CONNECT_TIMEOUT, gt=0, le=MAX_WAIT_SECONDS, allow_inf_nan=False
    )
    """Warn when no rank has written status.json this long after the start (the ranks have not met, or
    the script builds no Checkpointer): a log line, ``/status``'s ``ranks_not_meeting``, ``agent.json``."""
    prefetch: Prefetch = "node"
    """What the agent fetches into the node's restore cache while the ranks start: the files this
    node's ranks read (``node``; every file where the command does not say which ranks the node
    runs), every file (``all``) or nothing (``off``)."""
    launcher: Launcher = "torchrun"
    """``direct``: start a torchrun command's ranks without torchrun, where ``agent.torchrun.direct_launch`` can."""
    log_format: Literal["text", "json"] = "text"
    """The agent's own log lines: text, or one JSON object each (``agent.streams``)."""


def _interval(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        # argparse would say "invalid _interval value", naming this function, not what it takes.
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds; give one from 1 to 5") from None
    if not 1.0 <= seconds <= 5.0:
        raise argparse.ArgumentTypeError("must be between 1 and 5 seconds")
    return seconds


def _notice_list(value: str) -> tuple[str, ...]:
    if not value.replace(",", "").strip():
        # Taken as "none": --notices "$SOURCES" with SOURCES unset left the job deaf to every notice,
        # SIGTERM included, without a word.
        raise argparse.ArgumentTypeError(
            f"{value!r} names no source (an unset variable in --notices=$VAR?): give them "
            f"({','.join(NOTICE_SOURCES)}), 'none' for the control API alone, or leave the option out"
        )
    listed = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in listed if n not in (*NOTICE_SOURCES, "none")]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown source(s) {', '.join(unknown)}; choose from {', '.join(NOTICE_SOURCES)}"
        )
    # Both were taken before: "none,aws" as aws alone (the none dropped without a word), and
    # "azure,azure" as two Azure sources (two pollers, each event acknowledged twice).
    if "none" in listed and len(listed) > 1:
        raise argparse.ArgumentTypeError(
            f"{value!r}: 'none' is no source to list with others; give 'none' alone for the control API "
            "alone, or list the sources without it"
        )
    twice = sorted({n for n in listed if listed.count(n) > 1}, key=listed.index)
    if twice:
        raise argparse.ArgumentTypeError(
            f"{value!r}: {', '.join(twice)} {'is' if len(twice) == 1 else 'are'} listed twice: list each source once"
        )
    return tuple(n for n in listed if n != "none")


class UsageError(ValueError):
    """A usage error ``spotjob-agent`` would exit 2 with, raised instead (``usage_problem``)."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser that, told to, raises ``UsageError`` where it would print the usage and exit 2."""

    raise_errors = False

    def error(self, message: str) -> NoReturn:
        if self.raise_errors:
            raise UsageError(message)
        super().error(message)


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    p = _Parser(
        prog="spotjob-agent",
        usage="spotjob-agent [OPTIONS] -- COMMAND [ARGS...]",
        description="Run a training command (e.g. torchrun ... train.py); on a preemption notice, tell its "
        "ranks to flush a checkpoint. Exits 75 after a committed flush, 76 when a flush could not commit, "
        "74 on an infrastructure error (storage unreachable, rendezvous port taken), 79 when stopped through "
        "POST /stop, else with the command's own code (1 if that is one of these).",
    )
    p.add_argument("--version", action="version", version=version_line("spotjob-agent"))
    ck = p.add_argument_group("checkpoint (passed to the ranks as SPOTJOB_* variables)")
    ck.add_argument("--checkpoint-uri", help=f"where checkpoints go (required unless {ENV_CHECKPOINT_URI} is set)")
    ck.add_argument("--job-name")
    ck.add_argument("--every-steps", type=int, help="save every N steps")
    ck.add_argument("--every-seconds", type=float, help="save every N seconds")
    ck.add_argument("--keep", type=int, help="checkpoints to keep (0: every one)")
    ck.add_argument("--async", dest="async_save", choices=("on", "off"), help="asynchronous saves")
    ck.add_argument(
        "--staging-dir", help="node-local staging folder; each job stages (and prefetches) in a folder of its own in it"
    )
    ck.add_argument(
        "--prefetch",
        default=(env.get(ENV_PREFETCH) or "").strip() or "node",
        help="while the ranks start, fetch the newest checkpoint's files into the node's restore cache: those "
        "this node's ranks read (node, default; every file where the torchrun command does not number its "
        f"nodes), every file (all) or none (off). Also {ENV_PREFETCH}",
    )
    ck.add_argument("--control-dir", help="folder shared with the ranks (default: a fresh temporary folder)")
    ck.add_argument(
        "--expected-ranks",
        type=int,
        help="ranks on this node (default: the local world size the ranks report, else torchrun's --nproc-per-node)",
    )
    ck.add_argument(
        "--attempt", type=int, help=f"the attempt number the controller recorded for this start (sets {ENV_ATTEMPT})"
    )
    ck.add_argument(
        "--start-fresh",
        action="store_true",
        help="where the ranks' restore would refuse (the newest checkpoints do not fit the state, or none loads), "
        f"start from step 0 on purpose instead, retiring them (nothing is deleted); a checkpoint that loads is "
        f"still resumed from, so the option may stay set across restarts (sets {ENV_START_FRESH}=1)",
    )

    p.add_argument(
        "--launcher",
        default=env.get(ENV_LAUNCHER) or "torchrun",
        help="torchrun (default): run the command as written; direct: start a torchrun command's ranks "
        "the way torchrun would, without torchrun's own start (a second or more of every restart), where "
        f"its options allow (single node or static rendezvous, no redirects; else torchrun runs). Also {ENV_LAUNCHER}",
    )

    api = p.add_argument_group("control API")
    api.add_argument("--control-host", default="127.0.0.1", help="default 127.0.0.1; other hosts need a token")
    api.add_argument("--control-port", type=int, default=0, help="0 (default): a free port, written to agent.json")
    api.add_argument("--token-file", help=f"file holding the bearer token (else {ENV_AGENT_TOKEN})")

    no = p.add_argument_group("notices")
    no.add_argument("--notices", type=_notice_list, help=f"exactly these sources: {','.join(NOTICE_SOURCES)}")
    no.add_argument(
        "--cloud",
        choices=("auto", *[c.value for c in Cloud]),
        default=env.get(ENV_CLOUD) or "auto",
        help=f"skip detection (also {ENV_CLOUD})",
    )
    for name in ("aws", "gcp", "azure"):
        no.add_argument(f"--no-{name}", action="store_true", help=f"do not listen for {name} notices")
    no.add_argument(
        "--no-sigterm",
        action="store_true",
        help="SIGTERM/SIGINT/SIGHUP/SIGUSR1/SIGUSR2 are no notices: they stop the command without a flush",
    )
    no.add_argument(
        "--aws-metadata-url",
        help=f"metadata base URL (also {ENV_AWS_METADATA_URL}; default {aws.DEFAULT_BASE_URL})",
    )
    no.add_argument(
        "--gcp-metadata-url",
        help=f"metadata base URL (also {ENV_GCP_METADATA_URL}; default {gcp.DEFAULT_BASE_URL})",
    )
    no.add_argument(
        "--azure-metadata-url",
        help=f"metadata base URL (also {ENV_AZURE_METADATA_URL}; default {azure.DEFAULT_BASE_URL})",
    )
    no.add_argument("--poll-interval", type=_interval, default=2.0, help="metadata poll interval, 1-5 s (default 2)")
    no.add_argument(
        "--rebalance",
        choices=REBALANCE_POLICIES,
        help=f"what an AWS rebalance recommendation does (default save-early; also {ENV_REBALANCE})",
    )
    no.add_argument("--sigterm-grace", type=float, default=30.0, help="deadline after SIGTERM/SIGINT (default 30 s)")
    no.add_argument(
        "--gcp-notice-seconds",
        type=float,
        default=gcp.PREEMPTION_NOTICE_SECONDS,
        help="deadline after GCE preempted=TRUE (default 30 s)",
    )
    no.add_argument(
        "--gcp-maintenance-seconds",
        type=float,
        help="deadline after GCE maintenance-event=TERMINATE_ON_HOST_MAINTENANCE (default: 3600 s on a "
        "machine with an NVIDIA GPU, GCE's notice to GPU VMs, else 60 s; a value already set when the agent "
        "starts, with no record of when, gets at most 60 s, assumed, and flushes at once; also "
        f"{ENV_GCP_MAINTENANCE_SECONDS})",
    )
    no.add_argument(
        "--flush-lead",
        type=float,
        help="a cloud notice whose deadline is further away than this (GCE host maintenance of a GPU VM, an "
        f"Azure Reboot or Redeploy; never a preemption) is held, training goes on, and the flush starts this "
        f"long before the deadline (default {DEFAULT_FLUSH_LEAD:g} s; 0: flush at once; also {ENV_FLUSH_LEAD})",
    )

    st = p.add_argument_group("stopping")
    st.add_argument("--safety-margin", type=float, default=1.5, help="a flush fits if time left >= last save x this")
    st.add_argument(
        "--exit-timeout",
        type=float,
        default=30.0,
        help="after the flush result, seconds the command gets to exit before it is killed (default 30)",
    )
    st.add_argument(
        "--flush-timeout",
        type=float,
        default=600.0,
        help="a flush without a deadline is given up after this (default 600 s)",
    )
    st.add_argument("--kill-grace", type=float, default=5.0, help="SIGTERM to SIGKILL when killing (default 5 s)")
    st.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="when the process that started the agent dies (e.g. a killed `spotjob run`), flush and stop",
    )
    st.add_argument(
        "--parent-grace",
        type=float,
        default=30.0,
        help="the deadline of that flush, in seconds after the parent is found gone (default 30)",
    )
    st.add_argument(
        "--rank-connect-timeout",
        type=float,
        help="warn when no rank has connected to the control folder this long after the start: the ranks have "
        f"not met in init_process_group, or build no Checkpointer (default {DEFAULT_RANK_CONNECT_TIMEOUT:g} s; "
        f"also {ENV_RANK_CONNECT_TIMEOUT})",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,  # in any case, as SPOTJOB_LOG_LEVEL and spotjob-controller's --log-level take it
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="the agent's own log level, in any case (default INFO)",
    )
    p.add_argument(
        "--log-format",
        default=env.get(ENV_LOG_FORMAT) or "text",
        help=f"the agent's log lines as text (default) or one JSON object each; also {ENV_LOG_FORMAT}",
    )
    return p


def _option_given(option: str, args: Sequence[str]) -> bool:
    """Whether ``args`` (the agent's own) give ``option``: in full, or abbreviated as argparse takes
    it (``--pref`` for ``--prefetch``), with its value after it or after ``=``. Otherwise a bad value
    came from the option's variable."""
    return any(
        arg.startswith("--") and len(name := arg.partition("=")[0]) > 2 and option.startswith(name) for arg in args
    )


def usage_problem(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The usage error ``spotjob-agent`` started with ``argv`` in ``env`` would exit 2 with, in its
    own words (``SPOTJOB_AGENT_PREFETCH 'nodes': expected one of node, all, off``); None when
    ``parse_args`` takes them. What a controller checks before it starts any worker: the same
    parsing, not a copy of its rules. Only what ``parse_args`` checks; the agent's later checks of
    its machine (the control folder, the host, the token file) are the machine's. Remembered for
    the command lines and environments seen last: a controller asks on every pass of every job,
    the parser costs milliseconds, and a job's spec rarely changes."""
    return _usage_problem(tuple(argv), tuple(sorted(env.items())))


@functools.lru_cache(maxsize=512)
def _usage_problem(argv: tuple[str, ...], env: tuple[tuple[str, str], ...]) -> str | None:
    try:
        parse_args(argv, dict(env), raise_errors=True)
    except UsageError as e:
        return str(e)
    return None


def parse_args(argv: Sequence[str], env: Mapping[str, str], *, raise_errors: bool = False) -> tuple[AgentConfig, str]:
    """``(config, log level)``; exits 2 with a usage message on bad arguments (``raise_errors``:
    raises ``UsageError`` with that message instead)."""
    parser = build_parser(env)
    if isinstance(parser, _Parser):
        parser.raise_errors = raise_errors
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    ns = parser.parse_args(argv[:split])  # before the check below, so that --help works
    if split == len(argv):
        parser.error("the command goes after '--': spotjob-agent [OPTIONS] -- torchrun ... train.py")
    command = argv[split + 1 :]
    if not command:
        parser.error("no command after '--'")
    if not command[0].strip():
        # Started, it failed as a program found and refused: exit 126, "cannot start :  is not executable".
        parser.error(
            f"the program after '--' is empty ({command[0]!r}: an unset variable in -- \"$CMD\"?): give the "
            "command to run, e.g. -- torchrun ... train.py"
        )
    for option in (
        "checkpoint_uri",
        "job_name",
        "staging_dir",
        "control_dir",
        "token_file",
        "control_host",
        "log_format",
    ):
        if getattr(ns, option) == "":
            # --checkpoint-uri "" fell back to SPOTJOB_CHECKPOINT_URI for the agent's own check, but
            # reached the ranks as SPOTJOB_CHECKPOINT_URI="" over it: they had no URI at all. And
            # --control-host "" bound the API to every interface and wrote http://:PORT to agent.json;
            # --log-format "" was taken as text, over SPOTJOB_LOG_FORMAT=json.
            flag = "--" + option.replace("_", "-")
            parser.error(f"{flag} is empty (an unset variable in {flag}=$VAR?): give it a value, or leave it out")
    if ns.cloud not in ("auto", *[c.value for c in Cloud]):
        parser.error(f"{ENV_CLOUD}={ns.cloud!r}: expected one of auto, {', '.join(c.value for c in Cloud)}")
    try:
        ns.log_format = log_format(ns.log_format)
    except ValueError as e:
        where = "--log-format" if _option_given("--log-format", argv[:split]) else ENV_LOG_FORMAT
        parser.error(f"{where} {e}")
    if ns.launcher not in LAUNCHERS:
        where = "--launcher" if _option_given("--launcher", argv[:split]) else ENV_LAUNCHER
        parser.error(f"{where} {ns.launcher!r}: expected one of {', '.join(LAUNCHERS)}")
    if ns.prefetch not in PREFETCH_MODES:
        where = "--prefetch" if _option_given("--prefetch", argv[:split]) else ENV_PREFETCH
        parser.error(f"{where} {ns.prefetch!r}: expected one of {', '.join(PREFETCH_MODES)}")
    if not ns.checkpoint_uri and not env.get(ENV_CHECKPOINT_URI):
        parser.error(f"--checkpoint-uri is required (or set {ENV_CHECKPOINT_URI})")
    uri_option = "--checkpoint-uri" if ns.checkpoint_uri else ENV_CHECKPOINT_URI
    checkpoint_uri = ns.checkpoint_uri or env[ENV_CHECKPOINT_URI]
    try:
        scheme, _, path = parse_uri(checkpoint_uri)
    except ValueError as e:
        parser.error(f"{uri_option}: {e}")
    if scheme == "file" and not checkpoint_uri.lower().startswith("file:") and not os.path.isabs(path):
        # Resolved once, against the agent's working directory, and passed to the ranks so: a script
        # that changes its own before building its Checkpointer still writes where the agent looks.
        checkpoint_uri = os.path.abspath(path)
    elif not ns.checkpoint_uri:
        checkpoint_uri = None  # the ranks inherit the agent's variable as it is
    job_problem = None if ns.job_name is None else job_name_problem(ns.job_name)
    if job_problem is not None:
        parser.error(f"--job-name: {job_problem}")
    # The variable, too: the ranks stage in it when the option is left out, and each failed at its
    # Checkpointer (a failure of the script's, restarted) where the agent can say it before starting.
    staging_dir, staging_where = (
        (ns.staging_dir, "--staging-dir") if ns.staging_dir is not None else (env.get(ENV_STAGING_DIR), ENV_STAGING_DIR)
    )
    staging_problem = staging_dir_problem(staging_dir)
    if staging_problem is not None:
        parser.error(f"{staging_where} {staging_problem}")
    # Both folders resolved once, against the agent's working directory, as a relative checkpoint
    # path is: a wrapper that changes folder (``sh -c 'cd /x && exec python train.py'``) or a script
    # that does before building its Checkpointer reported in, and staged under, another folder than
    # the agent's. It never heard the flush, was killed at the deadline, and the agent exited 76.
    staging_dir = os.path.abspath(staging_dir) if staging_dir else None
    control_dir = os.path.abspath(ns.control_dir) if ns.control_dir is not None else None
    _check_notice_options(parser, ns)
    from_env = _notice_variables(parser, ns, env)
    disabled = frozenset(n for n in NOTICE_SOURCES if getattr(ns, f"no_{n}"))
    metadata_urls = {cloud: _metadata_url(parser, ns, env, cloud) for cloud in _METADATA_URLS}
    poll_interval = _poll_interval(parser, env) or ns.poll_interval
    try:
        config = AgentConfig(
            command=command,
            checkpoint_uri=checkpoint_uri,
            job_name=ns.job_name,
            every_steps=ns.every_steps,
            every_seconds=ns.every_seconds,
            keep=ns.keep,
            async_save=None if ns.async_save is None else ns.async_save == "on",
            staging_dir=staging_dir,
            control_dir=control_dir,
            control_host=ns.control_host,
            control_port=ns.control_port,
            token_file=ns.token_file,
            notices=ns.notices,
            disabled=disabled,
            cloud=None if ns.cloud == "auto" else Cloud(ns.cloud),
            aws_metadata_url=metadata_urls["aws"],
            gcp_metadata_url=metadata_urls["gcp"],
            azure_metadata_url=metadata_urls["azure"],
            poll_interval=poll_interval,
            rebalance=ns.rebalance or "save-early",
            sigterm_grace=ns.sigterm_grace,
            gcp_notice_seconds=ns.gcp_notice_seconds,
            gcp_maintenance_seconds=ns.gcp_maintenance_seconds,
            flush_lead=DEFAULT_FLUSH_LEAD if ns.flush_lead is None else ns.flush_lead,
            safety_margin=ns.safety_margin,
            exit_timeout=ns.exit_timeout,
            flush_timeout=ns.flush_timeout,
            kill_grace=ns.kill_grace,
            expected_ranks=ns.expected_ranks,
            attempt=ns.attempt,
            start_fresh=ns.start_fresh,
            exit_with_parent=ns.exit_with_parent,
            parent_grace=ns.parent_grace,
            rank_connect_timeout=DEFAULT_RANK_CONNECT_TIMEOUT
            if ns.rank_connect_timeout is None
            else ns.rank_connect_timeout,
            launcher=ns.launcher,
            prefetch=ns.prefetch,
            log_format=ns.log_format,
        )
    except ValidationError as e:
        problems = "; ".join(f"{_where(err['loc'], from_env, env)}: {_plain(err)}" for err in e.errors())
        parser.error(problems)
    # What the ranks will read: every Checkpointer and every store refuses a malformed variable,
    # on every rank, once the script builds one. Refused here instead, before anything starts.
    ranks_env = {**env, **checkpoint_variables(config)}
    for settings in (CheckpointerEnv, StorageEnv):
        try:
            load_from(settings, ranks_env)
        except ValueError as e:
            parser.error(f"{e} (the ranks read it from this environment: fix it or unset it)")
    return config, ns.log_level


def checkpoint_variables(config: AgentConfig) -> dict[str, str]:
    """The checkpoint options as the ``SPOTJOB_*`` variables the ranks read (over the agent's own)."""
    optional: dict[str, object | None] = {
        ENV_CHECKPOINT_URI: config.checkpoint_uri,
        ENV_JOB_NAME: config.job_name,
        ENV_EVERY_STEPS: config.every_steps,
        ENV_EVERY_SECONDS: config.every_seconds,
        ENV_KEEP: config.keep,
        ENV_ASYNC: None if config.async_save is None else ("1" if config.async_save else "0"),
        ENV_STAGING_DIR: config.staging_dir,
        ENV_ATTEMPT: config.attempt,
        ENV_START_FRESH: "1" if config.start_fresh else None,
    }
    return {k: str(v) for k, v in optional.items() if v is not None}


_METADATA_URLS = {
    "aws": (ENV_AWS_METADATA_URL, aws.DEFAULT_BASE_URL),
    "gcp": (ENV_GCP_METADATA_URL, gcp.DEFAULT_BASE_URL),
    "azure": (ENV_AZURE_METADATA_URL, azure.DEFAULT_BASE_URL),
}


def _metadata_url(parser: argparse.ArgumentParser, ns: argparse.Namespace, env: Mapping[str, str], cloud: str) -> str:
    """``--<cloud>-metadata-url``, else its variable, else the cloud's own address; a URL no
    source could poll is a usage error that names where it came from (not a traceback later)."""
    variable, default = _METADATA_URLS[cloud]
    option = f"--{cloud}-metadata-url"
    given = getattr(ns, f"{cloud}_metadata_url")
    url, where = (given, option) if given is not None else (env.get(variable) or None, variable)
    if url is None:
        return default
    problem = metadata_url_problem(url)
    if problem is not None:
        fix = "pass" if where == option else "set it to"
        parser.error(
            f"{where}={url!r}: {problem}; {fix} the metadata server's base URL, "
            f"http(s)://host[:port][/prefix] (the default is {default})"
            + (", or unset it" if where == variable else "")
        )
    return url


def _check_notice_options(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """A usage error where ``--notices`` lists a source a ``--no-*`` option refuses. Taken as "the
    list minus the refused", ``--notices aws --no-aws`` left the agent with no notice source at
    all, SIGTERM included (a SIGTERM stopped the command without a flush), logged at INFO only."""
    if ns.notices is None:
        return
    refused = [n for n in ns.notices if getattr(ns, f"no_{n}")]
    if not refused:
        return
    rest = [n for n in ns.notices if n not in refused]
    no_options = " ".join(f"--no-{n}" for n in refused)
    instead = (
        f"--notices {','.join(rest)}"
        if rest
        else "--notices none for the control API alone (a SIGTERM then stops the command without a flush)"
    )
    parser.error(
        f"--notices {','.join(ns.notices)} and {no_options} contradict each other: pass {instead}, "
        f"or leave out {no_options}"
    )


def _notice_variables(parser: argparse.ArgumentParser, ns: argparse.Namespace, env: Mapping[str, str]) -> set[str]:
    """Fill the notice options not given from their variables (``NOTICE_VARIABLES``); the fields
    so filled. A value no option would take is a usage error naming the variable."""
    filled: set[str] = set()
    for field, variable in NOTICE_VARIABLES.items():
        text = env.get(variable, "").strip()
        if getattr(ns, field) is not None or not text:
            continue
        if field == "rebalance":
            if text not in REBALANCE_POLICIES:
                parser.error(f"{variable}={text!r}: expected one of {', '.join(REBALANCE_POLICIES)}, or unset it")
            value: object = text
        else:
            try:
                value = float(text)
            except ValueError:
                parser.error(f"{variable}={text!r} is not a number of seconds: set it to one, or unset it")
        setattr(ns, field, value)
        filled.add(field)
    return filled


def _where(loc: Sequence[Any], from_env: set[str], env: Mapping[str, str]) -> str:
    """Where a refused setting came from: its option, or the variable that set it."""
    field = "_".join(str(x) for x in loc)
    if field in from_env:
        variable = NOTICE_VARIABLES[field]
        return f"{variable}={env[variable].strip()!r}"
    return "--" + field.replace("_", "-")


def _poll_interval(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> float | None:
    """``SPOTJOB_AGENT_POLL_INTERVAL`` in seconds, None when unset; a usage error when it is no
    number of seconds in range (a non-number, 0 or less, inf, nan, hours)."""
    text = env.get(ENV_POLL_INTERVAL, "").strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not MIN_POLL_INTERVAL <= seconds <= MAX_POLL_INTERVAL:  # nan fails every comparison
        parser.error(
            f"{ENV_POLL_INTERVAL}={env[ENV_POLL_INTERVAL]!r} is not a number of seconds from "
            f"{MIN_POLL_INTERVAL:g} to {MAX_POLL_INTERVAL:g}: set it to one (e.g. 2), or unset it "
            f"and use --poll-interval (1-5 s)"
        )
    return seconds


def _plain(err: Any) -> str:
    """A pydantic error in an operator's words (no "Input should be", no documentation URL)."""
    ctx = err.get("ctx") or {}
    words = {
        "greater_than_equal": "must be at least {ge}",
        "greater_than": "must be more than {gt}",
        "less_than_equal": "must be at most {le}",
        "less_than": "must be less than {lt}",
        "finite_number": "must be a finite number",
    }.get(err.get("type", ""))
    if words is not None:
        return words.format(**ctx)
    return str(err.get("msg", "invalid value")).removeprefix("Value error, ")
