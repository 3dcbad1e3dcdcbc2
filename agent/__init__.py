"""spotjob's in-job half: checkpoints (``Checkpointer``), storage, manifests and the agent.

``Checkpointer`` is imported lazily so that ``agent.storage`` and ``agent.manifest`` stay
importable without torch (the controller's image carries none).
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.checkpoint import Checkpointer

__all__ = ["Checkpointer"]


def __getattr__(name: str) -> Any:
    if name == "Checkpointer":
        from agent.checkpoint import Checkpointer

        return Checkpointer
    raise AttributeError(f"module 'agent' has no attribute {name!r}")
