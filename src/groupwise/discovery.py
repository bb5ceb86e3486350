"""Discovery: import every component module so that its ``@register`` runs.

The stage folders are walked (every module not starting with ``_``), then ``kl_estimators``, then every
module of every paper folder that is a package (``papers.module_names``). ``registry.load_all`` calls
this on the first lookup; the package's ``__init__`` installs it there, so the registry (ground floor)
imports nothing that registers into it.
"""

from __future__ import annotations

import importlib
import pkgutil

STAGE_FOLDERS = (
    "sampling",
    "rollout",
    "rewards",
    "advantages",
    "weights",
    "losses",
    "updates",
    "schedules",
    "views",
    "providers",
    "tasks",
    "modalities",
    "phases",
)


def import_components() -> None:
    """Import the stage folders' modules, the KL estimators and the paper folders' modules."""
    import groupwise.kl_estimators  # noqa: F401 (registers the estimators)
    from groupwise.papers import module_names

    for sub in STAGE_FOLDERS:
        pkg = importlib.import_module(f"groupwise.{sub}")
        for info in pkgutil.iter_modules(pkg.__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"groupwise.{sub}.{info.name}")
    for name in module_names():  # the paper folders' own modules (toy tasks, their rewards and envs)
        importlib.import_module(name)
