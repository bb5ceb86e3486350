"""Paper 20's own scaffolding (Semantic-reward GRPO): the toy task module ``number_words``.

``README.md`` is the paper page, ``paper.toml`` its manifest; the modules register on import
(``registry.load_all``), e.g. ``importlib.import_module("groupwise.papers.20_semantic_reward_grpo.number_words")``."""
