"""spotjob's controller half: the recovery state machine, its backends, and the command line.

Layering (``.importlinter``, docs/architecture.md "Layers"): this package imports the agent's
torch-free modules (``agent.storage``, ``agent.manifest``, ``agent.catalog``, ``agent.ownership``,
``agent.control_channel``, the agent's parsers such as ``agent.launcher_cli``), never its underscore
modules; only ``backends/k8s.py`` and the ``k8s`` package import ``kubernetes``. ``spotjob ckpt
export`` and ``verify --deep`` are the only commands that need torch, imported lazily.
"""
