"""What ``spotjob ckpt verify --deep`` finds by reading every byte, on top of the catalog's verdict:
every CRC32C (``agent.catalog.verify_deep``), then what a restore would unpickle (DCP's
``.metadata`` through the allow-list of ``agent.dcp_safe``, each ``rank-*.pt`` with weights_only),
and whether ``.metadata`` agrees with MANIFEST.json (``agent.dcp_safe.manifest_disagreements``). Of ``spotjob ckpt``'s
modules, the one that imports torch (lazily; the export's torch is ``agent.export``'s)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from agent.catalog import CheckpointStatus, verify_deep
from agent.export import checkpoint_reader
from agent.manifest import DCP_METADATA_NAME, RANK_FILE_RE
from agent.storage import StorageError
from agent.storage.base import Storage
from orchestrator.ckpt_output import _progress_bar

if TYPE_CHECKING:
    pass


def _verify_deep(storage: Storage, status: CheckpointStatus) -> list[str]:
    """Every CRC32C (``agent.catalog.verify_deep``), then what a restore would unpickle."""
    assert status.manifest is not None
    manifest = status.manifest
    to_read = sum(f.size for f in manifest.files if f.path not in status.unusable)
    with _progress_bar(f"verifying {status.ref.folder}", to_read) as progress:
        verify_deep(storage, status, progress=progress)
    status.problems += _check_unpickling(storage, status, skip=set(status.unusable))
    return list(status.problems)


def _check_unpickling(storage: Storage, status: CheckpointStatus, skip: set[str]) -> list[str]:
    """Load ``.metadata`` (allow-list) and each ``rank-*.pt`` (weights_only) as restore would.

    Files already found missing or corrupt (``skip``) are not read again. Also checks that DCP's
    metadata names only files the manifest lists and agrees with the manifest's tensor index,
    which ``show`` and ``export`` rely on.
    """
    from agent import rank_state
    from agent.dcp_safe import UnsafeCheckpointError, manifest_disagreements

    assert status.manifest is not None
    manifest = status.manifest
    problems: list[str] = []
    with checkpoint_reader(storage, status) as reader:
        if manifest.file(DCP_METADATA_NAME) is not None and DCP_METADATA_NAME not in skip:
            try:
                metadata = reader.read_metadata()
            except (UnsafeCheckpointError, StorageError) as e:
                problems.append(f"file {DCP_METADATA_NAME} is unsafe or unreadable: {e}")
            else:
                problems += manifest_disagreements(manifest, metadata)
        for f in manifest.files:
            if not RANK_FILE_RE.match(f.path) or f.path in skip:
                continue
            try:
                with open(reader.ensure_local(f.path), "rb") as fh, warnings.catch_warnings():
                    # torch warns about pickle protocols while refusing; the refusal is reported below.
                    warnings.simplefilter("ignore")
                    rank_state.decode(fh.read())
            except (UnsafeCheckpointError, StorageError) as e:
                problems.append(f"file {f.path} is unreadable: {e}")
            except Exception as e:  # torch.load's refusals are UnpicklingError/RuntimeError/ValueError
                problems.append(f"file {f.path} does not load with weights_only (unsafe or damaged): {e}")
    return problems
