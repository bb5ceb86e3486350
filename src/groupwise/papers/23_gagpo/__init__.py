"""Paper 23's own scaffolding (GAGPO): the toy task module ``keydoor``.

``README.md`` is the paper page, ``paper.toml`` its manifest; the modules register on import
(``registry.load_all``), e.g. ``importlib.import_module("groupwise.papers.23_gagpo.keydoor")``."""
