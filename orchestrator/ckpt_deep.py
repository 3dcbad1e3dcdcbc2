"""What ``spotjob ckpt verify --deep`` finds by reading every byte, on top of the catalog's verdict:
every CRC32C (``agent.catalog.verify_deep``), then what a restore would unpickle (DCP's
``.metadata`` through the allow-list of ``agent.dcp_safe``, each ``rank-*.pt`` with weights_only),
whether ``.metadata`` agrees with MANIFEST.json (``agent.dcp_safe.manifest_disagreements``), and
whether a ``rank-*.pt`` holds what this spotjob does not restore (``agent.rank_state.unknown_entries``,
the rule a restore refuses by: a newer spotjob wrote it). A ``.metadata`` a newer torch wrote naming
what this torch lacks (``NewerTorchError``) is not proven bad either: unproven, as a restore stops
there. Of ``spotjob ckpt``'s modules, the one that imports torch (lazily; the export's torch is
``agent.export``'s)."""

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
    from agent.dcp_safe import NewerTorchError


def _verify_deep(storage: Storage, status: CheckpointStatus) -> list[str]:
    """Every CRC32C (``agent.catalog.verify_deep``), then what a restore would unpickle; what it
    finds is added to ``status``. Returns the per-rank files a newer spotjob wrote (each holding
    what this spotjob does not restore): ``status`` is then ``newer_format`` when nothing else is
    wrong with it, as for a manifest a newer spotjob wrote."""
    assert status.manifest is not None
    manifest = status.manifest
    to_read = sum(f.size for f in manifest.files if f.path not in status.unusable)
    with _progress_bar(f"verifying {status.ref.folder}", to_read) as progress:
        verify_deep(storage, status, progress=progress)
    newer: dict[str, list[str]] = {}
    status.problems += _check_unpickling(storage, status, skip=set(status.unusable), newer=newer)
    if newer and status.undecided:
        # Not proven bad, only unreadable here: a restore stops there too (never going back past it).
        status.newer_format = True
    return list(newer)


def _check_unpickling(
    storage: Storage, status: CheckpointStatus, skip: set[str], newer: dict[str, list[str]] | None = None
) -> list[str]:
    """Load ``.metadata`` (allow-list) and each ``rank-*.pt`` (weights_only) as restore would.

    Files already found missing or corrupt (``skip``) are not read again. Also checks that DCP's
    metadata names only files the manifest lists and agrees with the manifest's tensor index,
    which ``show`` and ``export`` rely on, and that no ``rank-*.pt`` holds what this spotjob does
    not restore (``rank_state.unknown_entries``, as restore checks it): such files, by name with
    those entries, go into ``newer``, and their one problem into ``status.unproven`` (a newer
    spotjob wrote them: nothing proven bad).
    """
    from agent import rank_state
    from agent.dcp_safe import NewerTorchError, UnsafeCheckpointError, manifest_disagreements

    assert status.manifest is not None
    manifest = status.manifest
    problems: list[str] = []
    found: dict[str, list[str]] = {}
    with checkpoint_reader(storage, status) as reader:
        if manifest.file(DCP_METADATA_NAME) is not None and DCP_METADATA_NAME not in skip:
            try:
                metadata = reader.read_metadata()
            except NewerTorchError as e:
                # Not proven bad, only unreadable under this torch: a restore here stops there too.
                problems.append(_newer_torch(e))
                status.unproven.append(problems[-1])
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
                    payload = rank_state.decode(fh.read())
            except (UnsafeCheckpointError, StorageError) as e:
                problems.append(f"file {f.path} is unreadable: {e}")
            except Exception as e:  # torch.load's refusals are UnpicklingError/RuntimeError/ValueError
                problems.append(f"file {f.path} does not load with weights_only (unsafe or damaged): {e}")
            else:
                unknown = rank_state.unknown_entries(payload)
                if unknown:
                    found[f.path] = unknown
    if found:
        problems.append(_newer_rank_state(found))
        status.unproven.append(problems[-1])
    if newer is not None:
        newer.update(found)
    return problems


def _newer_torch(e: NewerTorchError) -> str:
    """Why a ``.metadata`` a newer torch wrote cannot be judged here, naming both torches (the
    restore's words, ``NewerTorchError``'s, speak of the training image; here it is this command's
    torch that is older)."""
    import torch

    return (
        f"file {DCP_METADATA_NAME} was written under torch {e.written_under}, and names {e.name}, which this "
        f"older torch ({torch.__version__}) does not have (a restore under it stops at this checkpoint, "
        "loading nothing): check it with the torch that wrote it or a newer one"
    )


def _newer_rank_state(found: dict[str, list[str]]) -> str:
    """One problem for every per-rank file a newer spotjob wrote (a job of a thousand ranks has a
    thousand of them), worded as restore's refusal and a newer manifest's are."""
    from agent.version import spotjob_version

    names = list(found)
    entries = sorted({e for unknown in found.values() for e in unknown})
    one = len(names) == 1
    files = f"file {names[0]} holds" if one else f"files {names[0]} and {len(names) - 1} more hold"
    more = f" and {len(entries) - 5} more" if len(entries) > 5 else ""
    return (
        f"per-rank {files} {', '.join(entries[:5])}{more}, which this spotjob ({spotjob_version()}) does not "
        f"restore: a newer spotjob wrote {'it' if one else 'them'}, and a restore here stops at this checkpoint, "
        "loading nothing; upgrade spotjob to restore it"
    )
