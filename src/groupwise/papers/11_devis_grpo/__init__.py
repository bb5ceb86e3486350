"""Paper 11's own scaffolding (DEVIS-GRPO / ADEVIS): the toy point-cloud views ``cloud_views`` and
``cloud_views_fit`` and the reward ``chamfer_view`` (``cloud_views.py``).

``README.md`` is the paper page, ``paper.toml`` its manifest; the module registers on import
(``registry.load_all``), e.g. ``importlib.import_module("groupwise.papers.11_devis_grpo.cloud_views")``."""
