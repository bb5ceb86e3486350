"""Paper 12's own scaffolding (HT-GRPO): the toy task module ``layout_paint`` and the premise check
``premise`` (fit small mdlm models on it, then measure when the sampler commits layout vs detail tokens).

``README.md`` is the paper page, ``paper.toml`` its manifest; the modules register on import
(``registry.load_all``), e.g. ``importlib.import_module("groupwise.papers.12_ht_grpo.layout_paint")``."""
