"""The policy a run trains, by kind: ``build_policy(model_cfg, perf)`` for ``model.policy`` = ``lm``,
``flow`` or ``unified`` (``policy/__init__.py``)."""

from __future__ import annotations

from typing import Any

from groupwise.errors import ConfigError

KINDS = ("lm", "flow", "unified")


def build_policy(model_cfg: Any, perf: Any) -> Any:
    if model_cfg.policy == "lm":
        from groupwise.policy.lm import LMPolicy

        return LMPolicy(model_cfg, perf)
    if model_cfg.policy in ("flow", "unified"):
        from groupwise.modalities.flow import FlowPolicy
        from groupwise.modalities.unified import UnifiedPolicy

        if getattr(model_cfg, "device", "cpu") not in ("cpu", "auto"):
            raise ConfigError(
                f'model.device={model_cfg.device!r}: the flow toy runs on the CPU; use model.device="cpu"'
            )
        try:
            return (FlowPolicy if model_cfg.policy == "flow" else UnifiedPolicy)(**model_cfg.params)
        except TypeError as err:
            raise ConfigError(f"model.params for the flow policy: {err}") from None
        except ValueError as err:
            raise ConfigError(str(err)) from None
    raise ConfigError(f"model.policy={model_cfg.policy!r} is not a policy kind; kinds: {', '.join(KINDS)}")
