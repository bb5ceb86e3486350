"""Paper 27's own scaffolding (AlphaGRPO): the toy task modules ``number_attrs``, ``yes_no``, ``flow_attrs``.

``README.md`` is the paper page, ``paper.toml`` its manifest; the modules register on import
(``registry.load_all``), e.g. ``importlib.import_module("groupwise.papers.27_alphagrpo.number_attrs")``."""
