"""The controller's Kubernetes machinery: the only package (with ``backends/k8s.py``) that imports ``kubernetes``.

Modules, bottom up (each docstring says what runs in order and what in parallel):

- ``api``: config loading and one thin, retried, typed-error client over the official client;
  ``PERMISSIONS`` is the one list of verbs and resources the controller may call.
- ``informer``: list + watch into a thread-safe cache per kind, with re-list on 410 Gone.
- ``workqueue``: keys (namespace/name) to reconcile, one at a time per key, with delays and backoff.
- ``leader``: leader election on a Lease; a leader that loses it exits the process.
- ``events``: Kubernetes Events about a SpotJob or Node, aggregated on repeats.
- ``metrics`` and ``health``: Prometheus metrics and the /healthz, /readyz, /metrics server.
- ``cluster_signals``: Node and Pod objects to ``orchestrator.signals.Signal`` (pure functions).
- ``pods``: the objects a SpotJob owns (worker Pods, Service, token Secret, NetworkPolicy), built
  as JSON (pure functions); ``agents``: the agents' tokens and their control API, in the background.
- ``store``: the ``JobStore`` on SpotJob resources and their status subresource.
- ``controller``, ``wiring`` and ``main``: the ``spotjob-controller`` process that wires them
  together around the shared ``Reconciler`` (with ``orchestrator.backends.k8s``).

This ``__init__`` imports nothing, so that ``metrics``, ``workqueue`` and ``cluster_signals`` (which
do not need ``kubernetes``) can be imported without pulling the client in.
"""
