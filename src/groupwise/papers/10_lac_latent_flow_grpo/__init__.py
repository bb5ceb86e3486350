"""Paper 10's own scaffolding (LAC / Latent-Flow GRPO): the toy task ``flow_binding``, its reward
``binding_reward`` and the closed-form Gaussian KL of the stage-1 alignment (``binding.py``); the
policy is the planner kind (``modalities/planner.py``).

``README.md`` is the paper page, ``paper.toml`` its manifest; the module registers on import
(``registry.load_all``), e.g. ``importlib.import_module("groupwise.papers.10_lac_latent_flow_grpo.binding")``."""
