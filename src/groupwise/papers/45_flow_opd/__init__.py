"""Paper 45's own scaffolding (Flow-OPD): the two-task flow toy ``flow2d_multi`` and its reward ``by_task``
(``multi_task.py``), recipes, pipelines and claims.

``README.md`` is the paper page, ``paper.toml`` its manifest; the module registers on import
(``registry.load_all``), e.g. ``importlib.import_module("groupwise.papers.45_flow_opd.multi_task")``."""
