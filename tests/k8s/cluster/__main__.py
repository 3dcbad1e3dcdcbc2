"""Start the test cluster by hand, to try kubectl, the chart's objects, the controller and
``kubectl spotjob`` against it (README "Testing the Kubernetes controller").

    .venv/bin/python -m tests.k8s.cluster [--nodes N] [--crd] [--root DIR]

prints ``export KUBECONFIG=...`` (an admin user) and the kubeconfig of a user for the controller,
then serves until Ctrl-C or SIGTERM, when it stops every pod's processes. Nodes are named
``node-0``, ``node-1``, ... (spot capacity, zones us-east-1a/b/c); ``--crd`` installs the chart's
SpotJob CRD. Timings are the tests' short ones (a node NotReady after 4 s without a heartbeat).
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import threading
from pathlib import Path

from .cluster import TestCluster


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.k8s.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2, help="test nodes to add (default 2)")
    parser.add_argument("--crd", action="store_true", help="install the chart's SpotJob CRD")
    parser.add_argument("--root", type=Path, help="folder for its kubeconfigs, nodes and logs (default: a new one)")
    args = parser.parse_args()
    if args.nodes < 0:
        parser.error(f"--nodes {args.nodes}: must be 0 or more")
    root = args.root or Path(tempfile.mkdtemp(prefix="spotjob-test-cluster-"))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster = TestCluster(root).start()
    try:
        for i in range(args.nodes):
            cluster.add_node(f"node-{i}", zone=f"us-east-1{'abc'[i % 3]}")
        if args.crd:
            from tests.k8s.spotjob_crd import install_crd

            install_crd(cluster)
        print(f"export KUBECONFIG={cluster.kubeconfig}")
        print(f"# the controller's own user: --kubeconfig {cluster.kubeconfig_for('spotjob-controller')}")
        print(f"# pods' logs: {root}/kubelet/nodes/NODE/pods/NAMESPACE_POD_*/logs/CONTAINER.log", flush=True)
        stop.wait()
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
