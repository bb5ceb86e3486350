"""Paper 50's own scaffolding (Signal reshaping): the toy task module ``compile_fix``.

``README.md`` is the paper page, ``paper.toml`` its manifest; the modules register on import
(``registry.load_all``), e.g. ``importlib.import_module("groupwise.papers.50_signal_reshaping.compile_fix")``."""
