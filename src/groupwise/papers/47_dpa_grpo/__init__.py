"""Paper 47's own scaffolding (DPA-GRPO): the toy task module ``verify_game``.

``README.md`` is the paper page, ``paper.toml`` its manifest; the modules register on import
(``registry.load_all``), e.g. ``importlib.import_module("groupwise.papers.47_dpa_grpo.verify_game")``."""
