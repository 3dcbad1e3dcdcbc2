"""spotjob's controller half: the recovery state machine, its backends, and the command line.

Layering: this package may import ``agent.storage``, ``agent.manifest``, ``agent.catalog`` and
``agent.control_channel`` (none of which import torch); only ``backends/k8s.py`` imports
``kubernetes``. ``spotjob ckpt export`` is the one command that needs torch, imported lazily.
"""
