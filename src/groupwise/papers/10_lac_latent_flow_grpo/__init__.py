"""Paper 10's own scaffolding (LAC / Latent-Flow GRPO): the toy task ``flow_binding``, its reward
``binding_reward`` and the held-out measure ``greedy_binding`` (``binding.py``), the strategy
``lac_binding`` (``binding_eval.py``); the stage-1 phase is ``phases/lac_align.py``; the policy is the
planner kind (``modalities/planner.py``).

``README.md`` is the paper page, ``paper.toml`` its manifest; the module registers on import
(``registry.load_all``), e.g. ``importlib.import_module("groupwise.papers.10_lac_latent_flow_grpo.binding")``."""
