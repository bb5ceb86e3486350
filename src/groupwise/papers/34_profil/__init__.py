"""Paper 34's own scaffolding (ProFIL): the toy task module ``theater``.

``README.md`` is the paper page, ``paper.toml`` its manifest; the modules register on import
(``registry.load_all``), e.g. ``importlib.import_module("groupwise.papers.34_profil.theater")``."""
