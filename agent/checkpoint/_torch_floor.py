"""The torch floor of the Checkpointer, checked when ``agent.checkpoint`` is imported, and the first
import of torch's DCP.

An older torch would import and then fail inside DCP at the first save, a step count into the
job; here it is an ``ImportError`` that names the version found and the one needed.

Some torch releases (2.9.1; not 2.13) make a temporary folder while DCP is imported
(``torch.distributed.nn.jit.instantiator``, reached through ``torch.distributed._shard``); with no
writable temporary folder (a read-only root filesystem) that import failed with tempfile's
``FileNotFoundError`` before the Checkpointer could say which folder to give. Here it is a
``StagingFolderError`` that says so.
"""

import re

import torch

from agent.restore_cache import StagingFolderError, no_temp_folder

MIN_TORCH = (2, 9)
"""The floor of the ``torch`` extra in pyproject.toml (a test keeps the two equal): DCP's
``DefaultStager``, ``StagingOptions`` and ``dcp.async_save(async_stager=...)`` first shipped in 2.9.
Compared on the release numbers only, so a pre-release build of 2.9 (NGC's ``2.9.0a0+...``) passes."""


def torch_release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (``2.9.1+cu128``, ``2.10.0a0+git1234``)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else (0, 0)


if torch_release(str(torch.__version__)) < MIN_TORCH:
    _need = ".".join(map(str, MIN_TORCH))
    raise ImportError(
        f"spotjob's Checkpointer needs torch>={_need} (DCP's DefaultStager and async_save(async_stager=...) "
        f"first shipped in {_need}); this Python has torch {torch.__version__}: install torch {_need} or later "
        "(the CUDA build your image needs) and spotjob beside it"
    )


try:
    # What the modules of this package import next; imported here only to name what fails.
    import torch.distributed.checkpoint
except FileNotFoundError as e:
    if not no_temp_folder(e):
        raise
    raise StagingFolderError(
        f"no writable temporary folder: torch {torch.__version__} makes one when its distributed checkpoint "
        f"module is imported, and found none ({e.strerror}: a read-only root filesystem?). Set TMPDIR to a "
        "folder on a writable volume (an emptyDir on Kubernetes). The default staging folder of an object "
        "store's saves and restores goes there too, unless Checkpointer(staging_dir=...), SPOTJOB_STAGING_DIR "
        "or spotjob-agent --staging-dir gives another"
    ) from e
