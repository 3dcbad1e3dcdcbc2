"""Which notice sources an agent runs: ``--notices`` exactly, else SIGTERM and the detected cloud.

``build_sources`` turns the agent's configuration into the running sources (``agent.notices``):
the cloud's metadata endpoint (AWS IMDS, GCE metadata, Azure Scheduled Events) polled every
``--poll-interval`` (``SPOTJOB_AGENT_POLL_INTERVAL`` overrides it; ``parse_args`` has checked both),
and SIGTERM.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from agent.launcher_cli import AgentConfig
from agent.notices import aws, azure, gcp
from agent.notices.base import NoticeSource
from agent.notices.detect import Cloud, detect_cloud
from agent.notices.sigterm import SignalSource

log = logging.getLogger("agent.launcher")  # the agent's one logger, as before the module was split


def build_sources(config: AgentConfig, env: Mapping[str, str]) -> list[NoticeSource]:
    """The sources to run: ``--notices`` exactly, else SIGTERM + the detected cloud, minus ``--no-*``."""
    if config.notices is not None:
        wanted = [n for n in config.notices if n not in config.disabled]
    else:
        cloud = config.cloud
        if cloud is None:
            # None is "auto", as parse_args settled it from --cloud over SPOTJOB_CLOUD: detect. Read
            # again here, the variable overrode --cloud auto, and a malformed one the option had
            # overridden ended the agent in a traceback.
            cloud = detect_cloud(
                aws_url=config.aws_metadata_url,
                gcp_url=config.gcp_metadata_url,
                azure_url=config.azure_metadata_url,
                env={},
            )
        wanted = ["sigterm"] + ([cloud.value] if cloud is not Cloud.NONE else [])
        wanted = [n for n in wanted if n not in config.disabled]
    interval = config.poll_interval
    sources: list[NoticeSource] = []
    for name in wanted:
        if name == "aws":
            sources.append(
                aws.AwsImdsSource(
                    config.aws_metadata_url, interval=interval, watch_rebalance=config.rebalance != "ignore"
                )
            )
        elif name == "gcp":
            sources.append(
                gcp.GceMetadataSource(
                    config.gcp_metadata_url,
                    notice_seconds=config.gcp_notice_seconds,
                    maintenance_notice_seconds=config.gcp_maintenance_seconds or gcp.maintenance_notice_seconds(),
                    interval=interval,
                )
            )
        elif name == "azure":
            sources.append(azure.AzureScheduledEventsSource(config.azure_metadata_url, interval=interval))
        elif name == "sigterm":
            sources.append(SignalSource(grace_seconds=config.sigterm_grace))
    log.info("notice sources: %s (and the control API)", ", ".join(wanted) or "none")
    return sources
