"""One registry per stage of the GRPO loop.

A component is a small dataclass whose fields are its hyper-parameters::

    @register("advantage", "grpo")
    @dataclass
    class GRPO:
        '''Group mean/std normalised advantage (Shao et al. 2024).'''
        scale: str = "group"

``build("advantage", "grpo", scale="none")`` constructs it, rejecting unknown
parameter names and suggesting close registry names for typos.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any

from groupwise.errors import ConfigError
from groupwise.validate import check_type

STAGES = (
    "sampling",  # which prompts next
    "rollout",  # how completions are produced
    "reward",  # how a completion is scored
    "advantage",  # how scores become credit
    "weight",  # per-token weights / masks, reaching each objective term as it declares (objective.py)
    "objective",  # per-token or per-row loss terms
    "kl",  # KL estimators, usable in the objective or the reward
    "aggregation",  # how per-token losses become a scalar
    "update",  # how the gradient moves the weights
    "pipeline",  # several models, roles or phases
    "schedule",  # coefficients that follow the step or a batch statistic
    "view",  # edited contexts that rows are re-scored under (Need.view)
    "provider",  # quantities the trainer computes for Needs (Need.quantity)
    "phase",  # what runs before the RL steps: sft, offline jobs producing artifacts (groupwise.phases)
    "env",  # multi-turn environments a rollout strategy plays (rollout/env.py)
)

_REGISTRY: dict[str, dict[str, type]] = {stage: {} for stage in STAGES}
_LOADED = False


def register(stage: str, name: str) -> Callable[[type], type]:
    """Class decorator adding a component to ``stage`` under ``name``."""
    if stage not in _REGISTRY:
        raise ConfigError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")

    def deco(cls: type) -> type:
        table = _REGISTRY[stage]
        if name in table and table[name] is not cls:
            builtin = [c for c in (table[name], cls) if c.__module__.startswith("groupwise.")]
            if len(builtin) == 1:  # a plug-in (plugins.py) takes a built-in's name, whichever was imported first
                plugin = cls if builtin[0] is table[name] else table[name]
                raise ConfigError(
                    f"{plugin.__module__}.{plugin.__qualname__} takes the name {name!r} of the built-in "
                    f"{stage} component ({builtin[0].__module__}); register it under another name"
                )
            raise ConfigError(
                f"{stage} component {name!r} is registered twice ({table[name].__module__}, {cls.__module__})"
            )
        cls.registry_name = name
        cls.stage = stage
        table[name] = cls
        return cls

    return deco


# Filling the tables means importing every component module, each of which imports this one; resolving
# "module:Class" means importing a user's module through the plug-in loader. Both live above every
# component (groupwise/discovery.py, groupwise/plugins.py) and are handed to this ground-floor table by the
# package's __init__, which Python runs before any groupwise module: nothing here imports upward.
_discover: Callable[[], None] | None = None
_resolve: Callable[[str, dict[str, type], str], type] | None = None


def install(discover: Callable[[], None], resolve: Callable[[str, dict[str, type], str], type]) -> None:
    """Hand the registry its discovery (imports every component module) and its ``module:Class`` resolver."""
    global _discover, _resolve
    _discover, _resolve = discover, resolve


def load_all() -> None:
    """Import every component module so that its ``@register`` runs (``discovery.import_components``)."""
    global _LOADED
    if _LOADED:
        return
    if _discover is None:
        raise RuntimeError("groupwise.registry has no discovery installed; import groupwise first")
    _LOADED = True
    _discover()


def names(stage: str) -> list[str]:
    load_all()
    return sorted(_REGISTRY[stage])


def lookup(stage: str, name: str) -> type:
    load_all()
    if stage not in _REGISTRY:
        raise ConfigError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")
    table = _REGISTRY[stage]
    if name not in table and isinstance(name, str) and ":" in name and _resolve is not None:
        return _resolve(stage, table, name)  # "module:Class", a plug-in (plugins.resolve)
    if name not in table:
        close = difflib.get_close_matches(name, list(table), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"unknown {stage} component {name!r}{hint} (known: {', '.join(sorted(table))})")
    return table[name]


def param_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init] if dataclasses.is_dataclass(cls) else []


def build(stage: str, name: str, **params: Any) -> Any:
    """Construct component ``name`` of ``stage``; unknown parameters are an error naming the valid ones.

    A parameter given as a table with a ``schedule`` key (``coef = {schedule = "linear", end = 0.04}``)
    becomes a schedule (``groupwise.schedules``): the component is constructed with its start value
    and the schedule is kept in ``component.schedules[param]``, resolved by the trainer every step."""
    cls = lookup(stage, name)
    valid = param_names(cls)
    for key in params:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{stage} {name!r} has no parameter {key!r}{hint}; valid: {', '.join(valid) or 'none'}")
    schedules = {}
    for key, value in list(params.items()):
        if isinstance(value, dict) and "schedule" in value:
            spec = dict(value)
            schedules[key] = build("schedule", spec.pop("schedule"), **spec)
            params[key] = schedules[key].start()
    annotations = {f.name: f.type for f in dataclasses.fields(cls)}
    for key, value in params.items():
        check_type(f"{stage} {name!r} parameter {key}", annotations[key], value)
    component = cls(**params)
    if schedules:
        component.schedules = schedules
    return component


# keys of a stage's entry that the composition reads, not the component: an objective term's row filter
# (``rows``, read by ``objective.Objective.from_config``)
ENTRY_KEYS = {"objective": ("rows",)}


def build_spec(stage: str, spec: Any) -> Any:
    """Build from a config value: a name, or a table ``{name = ..., <params>}`` (its ``key`` and the
    stage's ``ENTRY_KEYS`` are the entry's, not parameters)."""
    if isinstance(spec, str):
        return build(stage, spec)
    if isinstance(spec, dict):
        if "name" not in spec:
            raise ConfigError(f"a {stage} entry needs a 'name' key, got {spec!r}")
        entry = ("name", "key", *ENTRY_KEYS.get(stage, ()))  # `key` only names the entry for overrides
        params = {k: v for k, v in spec.items() if k not in entry}
        return build(stage, spec["name"], **params)
    raise ConfigError(f"a {stage} entry must be a name or a table with 'name', got {spec!r}")


def describe(cls: type) -> str:
    """The component's summary: the first paragraph of its docstring, on one line."""
    doc = (cls.__doc__ or "").strip()
    return " ".join(doc.split("\n\n")[0].split())


def entries() -> list[tuple[str, str, type]]:
    load_all()
    return [(stage, name, cls) for stage in STAGES for name, cls in sorted(_REGISTRY[stage].items())]
