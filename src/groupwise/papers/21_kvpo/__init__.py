"""Paper 21's own scaffolding (KVPO): the toy trajectory task ``traj2d`` (and its demonstrations
``traj2d_fit``) and the rewards ``traj_local`` and ``traj_global`` (``traj2d.py``).

``README.md`` is the paper page, ``paper.toml`` its manifest; the module registers on import
(``registry.load_all``), e.g. ``importlib.import_module("groupwise.papers.21_kvpo.traj2d")``."""
