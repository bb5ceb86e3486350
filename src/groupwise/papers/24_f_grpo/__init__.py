"""Paper 24's own scaffolding (F-GRPO): the toy task module ``ranking``.

``README.md`` is the paper page, ``paper.toml`` its manifest; the modules register on import
(``registry.load_all``), e.g. ``importlib.import_module("groupwise.papers.24_f_grpo.ranking")``."""
