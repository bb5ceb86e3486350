"""Paper 42's own scaffolding (StreamPro): the toy task module ``clue_stream``.

``README.md`` is the paper page, ``paper.toml`` its manifest; the modules register on import
(``registry.load_all``), e.g. ``importlib.import_module("groupwise.papers.42_streampro.clue_stream")``."""
