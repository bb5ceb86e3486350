"""Paper 18's own scaffolding (LA-GRPO (ATLAS)): the toy task module ``op_select``.

``README.md`` is the paper page, ``paper.toml`` its manifest; the modules register on import
(``registry.load_all``), e.g. ``importlib.import_module("groupwise.papers.18_la_grpo.op_select")``."""
