"""Paper 37's own scaffolding (Newton's Lantern): the 2-bus power-flow toy ``powerflow`` (snapshots,
Newton–Raphson, the tasks) and its rewards ``nr_rewards``.

``README.md`` is the paper page, ``paper.toml`` its manifest; the modules register on import
(``registry.load_all``), e.g. ``importlib.import_module("groupwise.papers.37_newtons_lantern.powerflow")``."""
