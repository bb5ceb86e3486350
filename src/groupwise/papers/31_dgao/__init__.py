"""Paper 31's own scaffolding (DGAO): the toy task module ``addition_orders``.

``README.md`` is the paper page, ``paper.toml`` its manifest; the modules register on import
(``registry.load_all``), e.g. ``importlib.import_module("groupwise.papers.31_dgao.addition_orders")``."""
