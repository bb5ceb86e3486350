"""Paper 22's own scaffolding (GRIP-VLM): the toy task module ``keep_items`` (its frozen reader and the
leave-one-in saliency teacher).

``README.md`` is the paper page, ``paper.toml`` its manifest; the modules register on import
(``registry.load_all``), e.g. ``importlib.import_module("groupwise.papers.22_grip_vlm.keep_items")``."""
