"""Paper 26's own scaffolding (DIAL): the toy driving task ``drive2d`` and its rater (``drive2d.py``).

``README.md`` is the paper page, ``paper.toml`` its manifest; the module registers on import
(``registry.load_all``), e.g. ``importlib.import_module("groupwise.papers.26_dial.drive2d")``."""
