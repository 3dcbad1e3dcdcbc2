"""A test Kubernetes cluster at one seam: the API server, its control plane and a test kubelet.

See ``cluster.py`` for the API the controller's tests use and the README's "Testing the
Kubernetes controller" for what is and is not modeled.
"""

from .apiserver import ApiServer, ValidationFailure
from .client import ApiCallError, RestClient
from .cluster import KUBECONFIG_ENV, NotOnTestServer, TestCluster, write_kubeconfig
from .http import AuditRecord, Fault
from .kubelet import Kubelet, NodeConfig

__all__ = [
    "KUBECONFIG_ENV",
    "ApiCallError",
    "ApiServer",
    "AuditRecord",
    "Fault",
    "Kubelet",
    "NodeConfig",
    "NotOnTestServer",
    "RestClient",
    "TestCluster",
    "ValidationFailure",
    "write_kubeconfig",
]
