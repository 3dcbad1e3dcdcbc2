"""spotjob's in-job half: checkpoints (``Checkpointer``), storage, manifests and the agent.

``Checkpointer`` is imported lazily so that ``agent.storage``, ``agent.manifest`` and the agent
(``spotjob-agent``) stay importable without torch (the controller's image carries none). Torch,
NumPy and safetensors come with the ``torch`` extra: ``pip install 'spotjob[torch]'``.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.checkpoint import Checkpointer

__all__ = ["Checkpointer"]

_TORCH_EXTRA = ("torch", "numpy", "safetensors")


def __getattr__(name: str) -> Any:
    if name == "Checkpointer":
        try:
            from agent.checkpoint import Checkpointer
        except ImportError as e:
            missing = (e.name or "").partition(".")[0]
            if missing not in _TORCH_EXTRA:
                raise
            raise ImportError(
                f"spotjob's Checkpointer needs {missing}, which is not installed here: "
                "pip install 'spotjob[torch]' (beside the torch your image already has, if it has one)",
                name=e.name,
            ) from e
        return Checkpointer
    raise AttributeError(f"module 'agent' has no attribute {name!r}")
