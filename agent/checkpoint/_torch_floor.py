"""The torch floor of the Checkpointer, checked when ``agent.checkpoint`` is imported.

An older torch would import and then fail inside DCP at the first save, a step count into the
job; here it is an ``ImportError`` that names the version found and the one needed.
"""

import re

import torch

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
