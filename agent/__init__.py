"""spotjob's in-job half: checkpoints (``Checkpointer``), a DataLoader's place
(``ResumableLoader``), storage, manifests and the agent.

``Checkpointer`` is imported lazily so that ``agent.storage``, ``agent.manifest`` and the agent
(``spotjob-agent``) stay importable without torch (the controller's image carries none). Torch,
NumPy and safetensors come with the ``torch`` extra: ``pip install 'spotjob[torch]'``.
"""

from typing import TYPE_CHECKING, Any

from agent.loader import ResumableLoader

if TYPE_CHECKING:
    from agent.checkpoint import Checkpointer

__all__ = ["Checkpointer", "ResumableLoader"]

_TORCH_EXTRA = ("torch", "numpy", "safetensors")


def torch_extra_missing(e: ImportError, what: str) -> str | None:
    """What to tell a user whose ``what`` failed with ``e`` for want of a package of the ``torch``
    extra (which one, and the pip install that brings it); None when ``e`` is about anything else."""
    missing = (e.name or "").partition(".")[0]
    if missing not in _TORCH_EXTRA:
        return None
    return (
        f"{what} needs {missing}, which is not installed here: pip install 'spotjob[torch]' "
        "(beside the torch this environment already has, if it has one)"
    )


def __getattr__(name: str) -> Any:
    if name == "Checkpointer":
        try:
            from agent.checkpoint import Checkpointer
        except ImportError as e:
            message = torch_extra_missing(e, "spotjob's Checkpointer")
            if message is None:
                raise
            raise ImportError(message, name=e.name) from e
        return Checkpointer
    raise AttributeError(f"module 'agent' has no attribute {name!r}")
