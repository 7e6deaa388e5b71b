"""rltrain's Hydra config tree (``config.yaml`` and one folder per config group).

A package, so that Hydra finds it wherever rltrain is installed:
``hydra.initialize_config_module("rltrain.configs")`` (see docs/python.md).
"""
