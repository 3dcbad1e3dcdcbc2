"""The simulated cloud of a local run: spot nodes provisioned on demand, each with its own metadata
emulator of the run's cloud (``CLOUDS``: AWS's IMDS, and in a run that plans a host maintenance a
GCE metadata emulator too; GCE's metadata; Azure's Scheduled Events) and folder, and
how every process of a node (or of a worker, or of a run) is found and killed: each carries a
marker variable in its environment."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

from agent.notices.emulators import AzureScheduledEventsEmulator, GceMetadataEmulator, ImdsEmulator
from agent.process_tree import marked, stop_processes
from orchestrator.backends.base import Placement

log = logging.getLogger(__name__)

ENV_NODE = "SPOTJOB_LOCAL_NODE"
"""``<run id>/<node name>`` on every process of a node: what a node's termination kills."""
ENV_WORKER = "SPOTJOB_LOCAL_WORKER"
"""``<run id>/<worker name>`` on every process of a worker: what ``stop_workers`` stops."""
ENV_RUN = "SPOTJOB_LOCAL_RUN"
"""The run folder (absolute) on every process of the run's workers, whichever process drives it:
how ``spotjob status`` counts what still runs and ``spotjob run --resume`` finds what a killed
driver left behind (``run_pids``)."""

CLOUDS = ("aws", "gcp", "azure")
"""The clouds a local run simulates (``spotjob run --cloud``); aws, the first, is the default."""

AZURE_MAINTENANCE_EVENT = "Redeploy"
"""The Scheduled Event of a planned host maintenance in a run that simulates Azure: the VM moves to
another host, so the node stops (a local node never comes back)."""


def notice_name(cloud: str, *, maintenance: bool = False) -> str:
    """What a notice of the simulated ``cloud`` is called in the run's log, timeline and views."""
    if cloud == "gcp":
        return "GCE TERMINATE_ON_HOST_MAINTENANCE" if maintenance else "GCE preempted"
    if cloud == "azure":
        return f"Azure {AZURE_MAINTENANCE_EVENT}" if maintenance else "Azure Preempt"
    return "host maintenance" if maintenance else "spot interruption"


def cloud_text(cloud: str) -> str:
    """The cloud a run simulates, as the views name it (with the notices it sends)."""
    return {
        "aws": "aws (simulated IMDSv2: spot instance-action)",
        "gcp": "gcp (simulated GCE metadata: instance/preempted, maintenance-event)",
        "azure": f"azure (simulated Scheduled Events: Preempt, {AZURE_MAINTENANCE_EVENT})",
    }[cloud]


ZONES = ("local-a", "local-b", "local-c")
INSTANCE_TYPES = ("local.cpu-small", "local.cpu-large")


@dataclass
class LocalNode:
    """A simulated spot instance."""

    name: str
    zone: str
    instance_type: str
    path: str
    imds: ImdsEmulator | None
    """Its AWS IMDS; None on a node of a run that simulates GCP or Azure."""
    marker: str
    worker: str | None = None
    """The worker placed here, until ``stop_workers`` removes it."""
    gce: GceMetadataEmulator | None = None
    """Its GCE metadata server: where a run that simulates GCP announces its notices, and where one
    that simulates AWS announces a host maintenance; None in an AWS run that plans none
    (``SimulatedCloud(maintenance=False)``) and in an Azure run."""
    azure: AzureScheduledEventsEmulator | None = None
    """Its Azure Scheduled Events (a run that simulates Azure), where a notice is an event."""
    event_id: str | None = None
    """The Scheduled Event of the notice on (Azure): its agent's acknowledgement stops the node early."""
    noticed_at: float | None = None
    deadline: float | None = None
    """Unix time the node goes away (a notice is on); None: no notice."""
    maintenance: bool = False
    """The notice on is a host maintenance (its agent holds it), not a spot interruption."""
    terminated: bool = False

    def stop_emulators(self) -> None:
        for emulator in (self.imds, self.gce, self.azure):
            if emulator is not None:
                emulator.stop()

    @property
    def acknowledged(self) -> bool:
        """Its agent acknowledged the Scheduled Event of its notice (Azure may act at once)."""
        return self.azure is not None and self.event_id is not None and self.event_id in self.azure.start_requests

    @property
    def noticed(self) -> bool:
        return self.deadline is not None


class SimulatedCloud:
    """The spot nodes of one run, provisioned on demand. Not locked: ``LocalBackend`` calls it under
    its own lock, and terminates nodes (with what runs on them) itself."""

    def __init__(self, root: str, run_id: str, *, maintenance: bool = False, cloud: str = "aws") -> None:
        if cloud not in CLOUDS:
            raise ValueError(f"cloud {cloud!r}: expected one of {', '.join(CLOUDS)}")
        self.root = root
        self.run_id = run_id
        self.cloud = cloud
        self.maintenance = maintenance
        """A host maintenance is planned: on AWS, each node also serves GCE's metadata (it is announced there)."""
        self.nodes: dict[str, LocalNode] = {}
        # A run driven again (spotjob run --resume) names its nodes past the ones its folder holds.
        self._count = _next_node_index(os.path.join(root, "nodes"))

    def place(self, placement: Placement, taken: set[str]) -> LocalNode:
        """A free node that is not avoided (preferring unavoided zones and types), else a new one."""
        free = [
            n
            for n in self.nodes.values()
            if n.worker is None
            and not n.noticed
            and not n.terminated
            and n.name not in placement.avoid_nodes
            and n.name not in taken
        ]
        preferred = [
            n
            for n in free
            if n.zone not in placement.avoid_zones and n.instance_type not in placement.avoid_instance_types
        ]
        if preferred:
            return preferred[0]
        combos = [(z, t) for t in INSTANCE_TYPES for z in ZONES]
        start = self._count % len(combos)
        ordered = combos[start:] + combos[:start]
        good = [
            (z, t) for z, t in ordered if z not in placement.avoid_zones and t not in placement.avoid_instance_types
        ]
        if free and not good:
            return free[0]  # avoided zones and types are preferences, never a reason to strand the job
        zone, instance_type = (good or ordered)[0]
        return self.provision(zone, instance_type)

    def provision(self, zone: str, instance_type: str) -> LocalNode:
        name = f"local-node-{self._count}"
        self._count += 1
        path = os.path.join(self.root, "nodes", name)
        os.makedirs(path, exist_ok=True)
        # Nobody reads back what the node's agent asked (a poll a second for as long as the node
        # lives, and every terminated node stays listed): count it, keep none of it.
        imds = gce = azure = None
        if self.cloud == "aws":
            imds = ImdsEmulator(instance_id=f"i-{self.run_id}{self._count:04x}", history=0).start()
        if self.cloud == "gcp" or (self.cloud == "aws" and self.maintenance):
            gce = GceMetadataEmulator(instance_name=name, history=0).start()
        if self.cloud == "azure":
            azure = AzureScheduledEventsEmulator(vm_name=name, history=0).start()
        node = LocalNode(name, zone, instance_type, path, imds, marker=f"{self.run_id}/{name}", gce=gce, azure=azure)
        self.nodes[name] = node
        servers = [
            f"{what} {e.url}"
            for what, e in (("its IMDS is", imds), ("its GCE metadata server", gce), ("its Azure IMDS", azure))
            if e is not None
        ]
        log.info("provisioned %s (%s, %s); %s", name, zone, instance_type, ", ".join(servers))
        return node


def _next_node_index(nodes_dir: str) -> int:
    taken = [-1]
    with contextlib.suppress(OSError):
        for entry in os.listdir(nodes_dir):
            prefix, _, index = entry.rpartition("-")
            if prefix == "local-node" and index.isdigit():
                taken.append(int(index))
    return max(taken) + 1


def run_pids(run_folder: str) -> list[int]:
    """Live processes of any worker of the run in ``run_folder``, whichever driver started them."""
    return marked_pids(ENV_RUN, os.path.abspath(run_folder))


def marked_pids(variable: str, value: str) -> list[int]:
    """Live processes whose environment holds ``variable=value`` (wherever they were re-parented)."""
    return [p.pid for p in marked(variable, value)]


def kill_marked(variable: str, value: str, *, grace: float, reason: str, give_up: float = 10.0) -> int:
    """SIGTERM every marked process (none if ``grace`` is 0), SIGKILL what is left; how many were found
    (``agent.process_tree.stop_processes``, quietly: the caller logs what it stopped)."""
    return stop_processes(lambda: marked(variable, value), grace=grace, reason=reason, give_up=give_up, verbose=False)
