"""groupwise: GRPO and its published variants as composable components of one trainer.

The Python API (``docs/python-api.md``)::

    import groupwise

    summary = groupwise.train("demo", ["train.steps=20", "out=runs/mine"])   # a recipe + overrides
    cfg = groupwise.load_config("demo", ["rollout.group_size=4"])             # the Config dataclass
    run = groupwise.Run.from_config(cfg)                                      # built: run.train(), or
    row = run.trainer.run_step()                                              # the loop, step by step

Importing the package loads nothing heavy: torch and transformers come with the first call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from groupwise import registry as _registry

__version__ = "0.1.0"
__all__ = ["Run", "Trainer", "load_config", "train"]


def _discover() -> None:
    from groupwise.discovery import import_components

    import_components()


def _resolve(stage: str, table: dict, spec: str) -> type:
    from groupwise.plugins import resolve

    return resolve(stage, table, spec)


# the registry's discovery and plug-in resolver sit above every component (registry.install says why)
_registry.install(_discover, _resolve)


def load_config(recipe: str | None = None, overrides: Sequence[str] = ()) -> Any:
    """The run's ``Config``: a recipe (a shipped name or a TOML path; None = the defaults) with
    ``key=value`` overrides applied, checked the way ``groupwise train`` checks them."""
    from groupwise.config import load_config as load

    return load(recipe, list(overrides))[0]


def train(recipe: str | None = "demo", overrides: Sequence[str] = (), resume_allow: Sequence[str] = ()) -> dict:
    """Train as ``groupwise train RECIPE key=value ...`` does and return the run summary
    (``accuracy_before``, ``accuracy_after``, ``steps``, ``wall_seconds``, ...)."""
    from groupwise.run import Run as _Run

    cfg = load_config(recipe, overrides)
    if not cfg.out:
        cfg.out = f"runs/{cfg.name}"
    run = _Run.from_config(cfg)
    from groupwise import dist

    try:
        summary = run.train(resume_allow=list(resume_allow))
        dist.barrier()  # every rank done with its collectives before the group is torn down
        return summary
    finally:
        dist.shutdown()


def __getattr__(name: str) -> Any:
    if name == "Trainer":  # imported on first use: `import groupwise` stays light
        from groupwise.trainer import Trainer

        return Trainer
    if name == "Run":
        from groupwise.run import Run

        return Run
    raise AttributeError(f"module 'groupwise' has no attribute {name!r}")
