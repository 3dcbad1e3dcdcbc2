"""The controller's Kubernetes machinery: the only package (with ``backends/k8s.py``) that may import ``kubernetes``.

Of its modules only ``kubeconfig``, ``api`` and ``plugin_client`` do; the others reach the cluster
through ``api``'s client (objects as JSON dicts), or not at all.

Modules, bottom up (each docstring says what runs in order and what in parallel):

- ``kubeconfig``: where the cluster is and who we are (kubeconfig files, exec plugins, in-cluster),
  read as kubectl reads them.
- ``api``: one thin, retried, typed-error client over the official client;
  ``PERMISSIONS`` is the one list of verbs and resources the controller may call.
- ``informer``: list + watch into a thread-safe cache per kind, with re-list on 410 Gone.
- ``workqueue``: keys (namespace/name) to reconcile, one at a time per key, with delays and backoff.
- ``leader``: leader election on a Lease; a leader that loses it exits the process.
- ``events``: Kubernetes Events about a SpotJob or Node, aggregated on repeats.
- ``metrics`` and ``health``: Prometheus metrics and the /healthz, /readyz, /metrics server.
- ``cluster_signals``: Node and Pod objects to ``orchestrator.signals.Signal`` (pure functions).
- ``interruption_queue``: the leader's reader of spotjob's EC2 interruption queue (SQS), which
  writes each notice onto its Node as an annotation ``cluster_signals`` reads.
- ``pods``: the objects a SpotJob owns (worker Pods, Service, token Secret, NetworkPolicy), built
  as JSON (pure functions); ``agents``: the agents' tokens and their control API, in the background.
- ``store``: the ``JobStore`` on SpotJob resources and their status subresource.
- ``hints``: the newest checkpoint's time and step as annotations on a job's running pods.
- ``controller``, ``wiring`` and ``main``: the ``spotjob-controller`` process that wires them
  together around the shared ``Reconciler`` (with ``orchestrator.backends.k8s``).
- ``plugin_client``: the ``kubectl spotjob`` plugin's side: the user's kubeconfig and context, and
  the plugin's own short list of permissions (not the controller's).

This ``__init__`` imports nothing, so that ``metrics``, ``workqueue`` and ``cluster_signals`` (which
do not need ``kubernetes``) can be imported without pulling the client in.
"""
