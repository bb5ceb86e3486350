"""Paper 40's own scaffolding (DGPO): the toy task module ``fobar``.

``README.md`` is the paper page, ``paper.toml`` its manifest; the modules register on import
(``registry.load_all``), e.g. ``importlib.import_module("groupwise.papers.40_dgpo.fobar")``."""
