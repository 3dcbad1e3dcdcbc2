"""The simulated cloud of a local run: spot nodes provisioned on demand, each with its own IMDS
emulator (and, in a run that plans a host maintenance, a GCE metadata emulator) and folder, and
how every process of a node (or of a worker, or of a run) is found and killed: each carries a
marker variable in its environment."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

from agent.notices.emulators import GceMetadataEmulator, ImdsEmulator
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

ZONES = ("local-a", "local-b", "local-c")
INSTANCE_TYPES = ("local.cpu-small", "local.cpu-large")


@dataclass
class LocalNode:
    """A simulated spot instance."""

    name: str
    zone: str
    instance_type: str
    path: str
    imds: ImdsEmulator
    marker: str
    worker: str | None = None
    """The worker placed here, until ``stop_workers`` removes it."""
    gce: GceMetadataEmulator | None = None
    """Its GCE metadata server, whose ``maintenance-event`` announces a host maintenance; None in a
    run that plans none (``SimulatedCloud(maintenance=False)``)."""
    noticed_at: float | None = None
    deadline: float | None = None
    """Unix time the node goes away (a notice is on); None: no notice."""
    maintenance: bool = False
    """The notice on is a host maintenance (its agent holds it), not a spot interruption."""
    terminated: bool = False

    def stop_emulators(self) -> None:
        self.imds.stop()
        if self.gce is not None:
            self.gce.stop()

    @property
    def noticed(self) -> bool:
        return self.deadline is not None


class SimulatedCloud:
    """The spot nodes of one run, provisioned on demand. Not locked: ``LocalBackend`` calls it under
    its own lock, and terminates nodes (with what runs on them) itself."""

    def __init__(self, root: str, run_id: str, *, maintenance: bool = False) -> None:
        self.root = root
        self.run_id = run_id
        self.maintenance = maintenance
        """Each node also serves GCE's metadata (a host maintenance is announced there)."""
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
        imds = ImdsEmulator(instance_id=f"i-{self.run_id}{self._count:04x}", history=0).start()
        gce = GceMetadataEmulator(instance_name=name, history=0).start() if self.maintenance else None
        node = LocalNode(name, zone, instance_type, path, imds, marker=f"{self.run_id}/{name}", gce=gce)
        self.nodes[name] = node
        log.info(
            "provisioned %s (%s, %s); its IMDS is %s%s",
            name,
            zone,
            instance_type,
            imds.url,
            f", its GCE metadata server {gce.url}" if gce is not None else "",
        )
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
