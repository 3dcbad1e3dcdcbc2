"""What the agent's side of spotjob reads from the environment, declared once (pydantic-settings).

``CheckpointerEnv``: the ``SPOTJOB_*`` variables spotjob-agent sets for its ranks, which
``Checkpointer`` and ``Checkpointer.from_env()`` read. ``StorageEnv``: the ``SPOTJOB_STORAGE_*``
tuning of transfers and retries, read whenever a store is opened (and the retry policy on every
retried operation, so a variable set after import still counts). An empty variable counts as
unset; a malformed one is a ``ValueError`` that names the variable, its value and what it must be.
Names are matched exactly, as every other reader of ``SPOTJOB_*`` in spotjob (``os.environ``) does:
``spotjob_keep`` is not ``SPOTJOB_KEEP`` (pydantic-settings' own reading ignores case: it read it
on the ranks only, and reported a bad value under the upper-case name the user never set).
``load_from`` reads them from a given mapping (spotjob-agent checks what its ranks will read), and
``unknown_variables`` names the ``SPOTJOB_*`` variables no part of spotjob reads (typos). No torch
import.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from typing import TypeVar

from pydantic import ByteSize, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

S = TypeVar("S", bound=BaseSettings)


def load(cls: type[S]) -> S:
    """``cls`` read from the process's environment now, or a ``ValueError`` in plain words."""
    return load_from(cls, os.environ)


def load_from(cls: type[S], environ: Mapping[str, str]) -> S:
    """``cls`` read from ``environ`` alone (spotjob-agent checks, before it starts anything, what its
    ranks will read), each field from its exact variable name: the classes' own reading of the
    environment is switched off (``_ExactNames``)."""
    values = {}
    for name, field in cls.model_fields.items():
        key = field.validation_alias if isinstance(field.validation_alias, str) else name
        text = environ.get(variable_name(cls, name))
        if text:  # env_ignore_empty
            values[key] = text
    try:
        return cls.model_validate(values)
    except ValidationError as e:
        raise ValueError(_in_words(cls, e)) from None


def variable_name(cls: type[BaseSettings], name: str) -> str:
    """The environment variable field ``name`` of ``cls`` is read from."""
    alias = cls.model_fields[name].validation_alias
    return alias if isinstance(alias, str) else str(cls.model_config.get("env_prefix", "")) + name.upper()


def _in_words(cls: type[BaseSettings], e: ValidationError) -> str:
    prefix = cls.model_config.get("env_prefix", "")
    problems = []
    for err in e.errors():
        name = str(err["loc"][0]) if err["loc"] else "?"
        # A field read under its own alias (SPOTJOB_ASYNC for async_save) is reported by the alias.
        field = cls.model_fields.get(name) or next(
            (f for f in cls.model_fields.values() if f.validation_alias == name), None
        )
        variable = (
            field.validation_alias
            if field is not None and isinstance(field.validation_alias, str)
            else (name if name.startswith(prefix) else prefix + name.upper())
        )
        what = (field.description if field is not None else None) or "a valid value"
        # A field's own check (field_validator) says what is wrong with the value, after what it must be.
        why = f" ({err['ctx']['error']})" if err["type"] == "value_error" and "error" in err.get("ctx", {}) else ""
        problems.append(f"{variable}={err.get('input')!r} is not {what}{why}")
    return "; ".join(problems)


class _ExactNames(BaseSettings):
    """Settings filled by ``load_from`` only: pydantic-settings' own environment source matches
    names case-insensitively (and, made case-sensitive, expects lower-case field names)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


class CheckpointerEnv(_ExactNames):
    """The variables spotjob-agent sets for its ranks (``agent.control_channel``'s ``ENV_*``)."""

    model_config = SettingsConfigDict(env_prefix="SPOTJOB_", env_ignore_empty=True, extra="ignore")

    checkpoint_uri: str | None = Field(None, description="a checkpoint URI")
    job_name: str | None = Field(None, description="a job name: UTF-8 text without control characters")
    every_steps: int | None = Field(None, ge=1, description="a whole number of steps, at least 1")
    every_seconds: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="a positive, finite number of seconds"
    )
    keep: int | None = Field(None, ge=0, description="a whole number, at least 0 (0 keeps every checkpoint)")
    async_save: bool = Field(True, validation_alias="SPOTJOB_ASYNC", description="a boolean (1/0, true/false)")
    staging_dir: str | None = Field(None, description="a folder")
    control_dir: str | None = Field(None, description="a folder")
    attempt: int | None = Field(None, ge=0, description="a whole number, at least 0")
    start_fresh: bool = Field(False, description="a boolean (1/0, true/false)")
    release_staging: bool = Field(False, description="a boolean (1/0, true/false)")
    direct_io: bool | None = Field(None, description="a boolean (1/0, true/false)")

    @field_validator("job_name")
    @classmethod
    def _a_job_name(cls, value: str | None) -> str | None:
        # Checked here, where the error names the variable: CheckpointConfig checks job= again, but
        # says "job: ..." of a name the script never passed.
        from agent.ownership import job_name_problem  # not at import: it brings the stores' modules

        problem = None if value is None else job_name_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value


MAX_TIMEOUT_S = 86400.0
"""The longest connect or read timeout a store accepts: a day without a byte is a dead connection."""

MAX_BACKOFF_S = 3600.0
"""The longest wait between two attempts of a storage operation."""

MAX_TRANSFER_BYTES = 5 << 30
"""The largest download range, S3 part, GCS upload chunk and multipart threshold (5 GiB). S3's own
limit on a part and on a single PUT: a bigger part is refused by S3 (spotjob lowered it silently),
and a bigger threshold acts as 5 GiB (a file above 5 GiB goes up in parts whatever the threshold;
on GCS above 8 MiB). A range or a chunk is the unit a failed request repeats, and a chunk or an S3
part is held whole in memory (as many as ``SPOTJOB_STORAGE_MAX_BUFFER_BYTES`` holds): bigger is a
unit slip (GiB for MiB)."""

MAX_CONCURRENCY = 1024
"""The most parts or ranges in flight per store. Each is a thread and a connection (the memory an
upload's parts hold is bounded by ``SPOTJOB_STORAGE_MAX_BUFFER_BYTES``); 1024 streams of 100 MB/s
each are 800 Gbit/s, more than any NIC carries, and more than a prefix's request rate (S3: 3 500
writes a second) serves. Above it, a typo (10000 for 100)."""

MIN_PART_SIZE = 1 << 20
"""The smallest download range (1 MiB), ``SPOTJOB_STORAGE_PART_SIZE``'s floor. A range streams to
its file in blocks of 1 MiB whatever its size, so a smaller one saves no memory and only multiplies
the requests: at 1 byte, a 400 kB file was some 210 000 range GETs."""

MIN_BUFFER_BYTES = 1 << 20
"""The smallest upload buffer budget of a node, and of a store (1 MiB). Below it a bare number meant
with a unit (``64`` for ``64MiB``): every part, chunk and file would go up alone, one at a time. Also
the floor of a rank's share of the node's budget (``agent.storage._transfer.rank_share``)."""

MAX_BUFFER_BYTES = 5 << 40
"""The largest upload buffer budget of a node (5 TiB): ``MAX_CONCURRENCY`` parts of
``MAX_TRANSFER_BYTES``, more memory than any machine has; a bigger budget bounds nothing."""

MAX_STORAGE_ATTEMPTS = 100
"""The most attempts of one storage operation. At the default cap of 8 s between two, 100 attempts
keep one operation retrying for up to 13 minutes (the README's advice for big jobs is 10); more
only hides an outage, or is a value no one meant (1000000 retries a dead store for days)."""


def local_world_size(environ: Mapping[str, str] | None = None) -> int | None:
    """The training ranks on this node: ``LOCAL_WORLD_SIZE`` as torchrun and spotjob-agent's own
    launcher (``agent.ranks``) set it for every rank. None where it is unset or not a whole number
    above 0 (a process no launcher started: the ``spotjob`` CLI, the controller, spotjob-agent
    itself); ASCII digits only, so a value ``int`` cannot read (``²``) is None too, not an error."""
    text = (os.environ if environ is None else environ).get("LOCAL_WORLD_SIZE", "")
    if text.isascii() and text.isdigit() and int(text) > 0:
        return int(text)
    return None


def _size_up_to_5gib(example: str) -> str:
    return f"a positive size in bytes up to 5GiB ({MAX_TRANSFER_BYTES}), e.g. {example}"


class StorageEnv(_ExactNames):
    """Transfer and retry tuning for every store (``agent.storage``); unset fields keep the defaults
    of ``TransferSettings`` and of the retry policy."""

    model_config = SettingsConfigDict(env_prefix="SPOTJOB_STORAGE_", env_ignore_empty=True, extra="ignore")

    # Upper bounds: agent.settings' MAX_* say why each is where it is.
    part_size: ByteSize | None = Field(
        None,
        ge=MIN_PART_SIZE,
        le=MAX_TRANSFER_BYTES,
        description=f"a size in bytes from 1MiB to 5GiB ({MIN_PART_SIZE} to {MAX_TRANSFER_BYTES}), e.g. 64MiB",
    )
    upload_part_size: ByteSize | None = Field(
        None, gt=0, le=MAX_TRANSFER_BYTES, description=_size_up_to_5gib("8388608 or 8MiB")
    )
    upload_chunk_size: ByteSize | None = Field(
        None, gt=0, le=MAX_TRANSFER_BYTES, description=_size_up_to_5gib("104857600 or 100MiB")
    )
    multipart_threshold: ByteSize | None = Field(
        None, gt=0, le=MAX_TRANSFER_BYTES, description=_size_up_to_5gib("67108864 or 64MiB")
    )
    concurrency: int | None = Field(
        None, ge=1, le=MAX_CONCURRENCY, description=f"a whole number from 1 to {MAX_CONCURRENCY}"
    )
    max_buffer_bytes: ByteSize | None = Field(
        None,
        ge=MIN_BUFFER_BYTES,
        le=MAX_BUFFER_BYTES,
        description=(
            f"a size in bytes from 1MiB to 5TiB ({MIN_BUFFER_BYTES} to {MAX_BUFFER_BYTES}), e.g. 1GiB: the upload "
            "buffers of the whole node, shared equally by its LOCAL_WORLD_SIZE ranks"
        ),
    )
    # Finite and bounded: an infinite timeout or backoff reaches the clients and time.sleep as a
    # timestamp they cannot represent, failing every request (retried forever as a transient fault)
    # instead of being refused here, where the message names the variable.
    connect_timeout_s: float | None = Field(
        None, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False, description="a positive number of seconds up to 86400"
    )
    read_timeout_s: float | None = Field(
        None, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False, description="a positive number of seconds up to 86400"
    )
    s3_checksum_headers: bool | None = Field(None, description="a boolean (1/0, true/false)")
    s3_create_only_check: bool | None = Field(None, description="a boolean (1/0, true/false)")
    max_attempts: int | None = Field(
        None, ge=0, le=MAX_STORAGE_ATTEMPTS, description=f"a whole number from 0 to {MAX_STORAGE_ATTEMPTS}"
    )
    base_backoff_s: float | None = Field(
        None, ge=0, le=MAX_BACKOFF_S, allow_inf_nan=False, description="a number of seconds from 0 to 3600"
    )
    max_backoff_s: float | None = Field(
        None, ge=0, le=MAX_BACKOFF_S, allow_inf_nan=False, description="a number of seconds from 0 to 3600"
    )


OTHER_VARIABLES = frozenset(
    {
        # spotjob-agent (launcher_cli, control_api, notices.detect, torchrun, launcher)
        "SPOTJOB_AGENT_TOKEN",
        "SPOTJOB_CLOUD",
        "SPOTJOB_AGENT_LAUNCHER",
        "SPOTJOB_AWS_METADATA_URL",
        "SPOTJOB_GCP_METADATA_URL",
        "SPOTJOB_AZURE_METADATA_URL",
        "SPOTJOB_AGENT_POLL_INTERVAL",
        "SPOTJOB_AGENT_FLUSH_LEAD",
        "SPOTJOB_AGENT_GCP_MAINTENANCE_SECONDS",
        "SPOTJOB_AGENT_REBALANCE",
        "SPOTJOB_AGENT_PREFETCH",
        "SPOTJOB_AGENT_RANK_CONNECT_TIMEOUT",
        "SPOTJOB_AGENT_ID",
        # spotjob run's workers and their marks (orchestrator.backends.local)
        "SPOTJOB_LOCAL_NODE",
        "SPOTJOB_LOCAL_WORKER",
        "SPOTJOB_LOCAL_RUN",
        # spotjob, spotjob-controller (orchestrator.cli, orchestrator.k8s.main)
        "SPOTJOB_LOG_LEVEL",
        "SPOTJOB_LOG_FORMAT",  # and spotjob-agent
        "SPOTJOB_NAMESPACES",
        "SPOTJOB_LEADER_ELECT",
        "SPOTJOB_LEASE_NAME",
        "SPOTJOB_HTTP_PORT",
        "SPOTJOB_AGENT_PORT",
        "SPOTJOB_NETWORK_POLICY",
        "SPOTJOB_CONTROLLER_POD_LABELS",
        "SPOTJOB_AGENT_TOKEN_KEY_FILE",
        "SPOTJOB_INTERRUPTION_QUEUE_URL",
        "SPOTJOB_REBALANCE",
        "SPOTJOB_NODE_LOST_GRACE_SECONDS",
        "SPOTJOB_WORKERS",
        # the repository's tooling (scripts/get-helm.py, bench/_common.py); its tests' own are _TOOLING_PREFIXES
        "SPOTJOB_HELM",
        "SPOTJOB_BENCH_OUT",
    }
)
"""The ``SPOTJOB_*`` variables read outside the settings classes above, by any part of spotjob."""

_TOOLING_PREFIXES = ("SPOTJOB_TEST_", "SPOTJOB_E2E_", "SPOTJOB_TF_")


def known_variables() -> frozenset[str]:
    """Every ``SPOTJOB_*`` variable some part of spotjob reads."""
    fields = {variable_name(cls, name) for cls in (CheckpointerEnv, StorageEnv) for name in cls.model_fields}
    return OTHER_VARIABLES | fields


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One line per ``SPOTJOB_*`` variable of ``environ`` that no part of spotjob reads (a typo,
    most likely, whose value would otherwise be silently ignored), naming the closest known one."""
    known = known_variables()
    lines = []
    for variable in sorted(environ):
        if variable.upper().startswith("SPOTJOB_") and not variable.startswith("SPOTJOB_"):
            meant = variable.upper()
            reads = meant if meant in known else "upper-case SPOTJOB_* names"
            lines.append(
                f"{variable} is set but spotjob reads only {reads} (variable names are case-sensitive); "
                "spotjob ignores it"
            )
            continue
        if not variable.startswith("SPOTJOB_") or variable in known or variable.startswith(_TOOLING_PREFIXES):
            continue
        close = difflib.get_close_matches(variable, sorted(known), n=1, cutoff=0.75)
        hint = f"did you mean {close[0]}?" if close else "spotjob's variables are listed in its README"
        lines.append(f"{variable} is set but no part of spotjob reads it ({hint}); spotjob ignores it")
    return lines
