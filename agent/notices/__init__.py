"""Where preemption notices come from: AWS, GCP, Azure metadata, termination signals.

Every source turns its cloud's message into one ``Notice`` (see ``agent.notices.base``):
``aws``, ``gcp``, ``azure`` and ``sigterm``, one module each. ``detect`` says which cloud a node is
on; ``shared_vm`` lets the agents of one Azure VM acknowledge an event only once all have flushed.
``agent.notices.emulators`` holds fake metadata servers for tests and the local backend.
"""

from agent.notices.aws import AwsImdsSource
from agent.notices.azure import AzureScheduledEventsSource
from agent.notices.base import Notice, NoticeCallback, NoticeKind, NoticeSource
from agent.notices.detect import Cloud, detect_cloud
from agent.notices.gcp import GceMetadataSource
from agent.notices.sigterm import SignalSource

__all__ = [
    "AwsImdsSource",
    "AzureScheduledEventsSource",
    "Cloud",
    "GceMetadataSource",
    "Notice",
    "NoticeCallback",
    "NoticeKind",
    "NoticeSource",
    "SignalSource",
    "detect_cloud",
]
