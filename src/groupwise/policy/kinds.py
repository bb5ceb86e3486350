"""The policy a run trains, by kind: ``build_policy(model_cfg, perf)`` for ``model.policy`` = ``lm``,
``flow``, ``unified``, ``planner``, ``gaussian``, ``mdlm``, ``subset`` or ``ar_flow`` (``policy/__init__.py``).
A toy kind with ``model.path`` other than ``"default"`` loads ``<path>/<file>`` (``flow_policy.pt``,
``planner_policy.pt``, ``gaussian_policy.pt``, ``mdlm_policy.pt``, ``subset_policy.pt``,
``ar_flow_policy.pt``: config and weights, what its ``save`` writes; a bare name such as
``"mdlm_sum_pairs"`` is the folder shipped in ``groupwise/models/``): a fitted toy is then a warm
start, a frozen role (``roles.NAME.model``) or a teacher. ``model.params`` may change sampling
settings (``sde``, ``sde_window``, the mdlm's ``estimator``) but not the saved architecture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from groupwise.errors import ConfigError

SHIPPED = Path(__file__).resolve().parents[1] / "models"  # the package's shipped models
KINDS = ("lm", "flow", "unified", "planner", "gaussian", "mdlm", "subset", "ar_flow")
TOY_FILES = {
    "flow": "flow_policy.pt",
    "unified": "flow_policy.pt",
    "planner": "planner_policy.pt",
    "gaussian": "gaussian_policy.pt",
    "mdlm": "mdlm_policy.pt",
    "subset": "subset_policy.pt",
    "ar_flow": "ar_flow_policy.pt",
}


def build_policy(model_cfg: Any, perf: Any) -> Any:
    if model_cfg.policy == "lm":
        from groupwise.policy.lm import LMPolicy

        return LMPolicy(model_cfg, perf)
    if model_cfg.policy in TOY_FILES:
        from groupwise.modalities.ar_flow import ARFlowPolicy
        from groupwise.modalities.flow import FlowPolicy
        from groupwise.modalities.gaussian import GaussianPolicy
        from groupwise.modalities.mdlm import MDLMPolicy
        from groupwise.modalities.planner import PlannerPolicy
        from groupwise.modalities.subset import SubsetPolicy
        from groupwise.modalities.unified import UnifiedPolicy

        if getattr(model_cfg, "device", "cpu") not in ("cpu", "auto"):
            raise ConfigError(
                f'model.device={model_cfg.device!r}: the {model_cfg.policy} toy runs on the CPU; use model.device="cpu"'
            )
        cls = {
            "flow": FlowPolicy,
            "unified": UnifiedPolicy,
            "planner": PlannerPolicy,
            "gaussian": GaussianPolicy,
            "mdlm": MDLMPolicy,
            "subset": SubsetPolicy,
            "ar_flow": ARFlowPolicy,
        }[model_cfg.policy]
        saved = _saved_toy(model_cfg)
        params = dict(model_cfg.params) if saved is None else {**saved["config"], **model_cfg.params}
        try:
            policy = cls(**params)
        except TypeError as err:
            raise ConfigError(f"model.params for the {model_cfg.policy} policy: {err}") from None
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if saved is not None:
            if policy.config != saved["config"]:
                raise ConfigError(
                    f"model.params {dict(model_cfg.params)} change the architecture saved in {model_cfg.path!r} "
                    f"({saved['config']}); leave those keys out (sampling settings such as sde may differ)"
                )
            policy.load_state_dict(saved)
        return policy
    raise ConfigError(f"model.policy={model_cfg.policy!r} is not a policy kind; kinds: {', '.join(KINDS)}")


def _saved_toy(model_cfg: Any) -> dict | None:
    """The saved state of a toy policy at ``model.path`` (``<path>/<TOY_FILES[kind]>``, what the toy's
    ``save`` writes: its config and weights); None for ``path = "default"`` (fresh weights)."""
    if model_cfg.path in ("", "default"):
        return None
    file = Path(model_cfg.path) / TOY_FILES[model_cfg.policy]
    shipped = SHIPPED / model_cfg.path / TOY_FILES[model_cfg.policy]
    if not file.is_file() and "/" not in model_cfg.path and shipped.is_file():
        file = shipped  # a bare name of a model shipped in the package (models/mdlm_sum_pairs)
    if not file.is_file():
        raise ConfigError(
            f"model.path={model_cfg.path!r}: no {file.name} there; a {model_cfg.policy} policy loads the folder "
            f'its save wrote (a run\'s final/ folder); path = "default" starts from fresh weights'
        )
    state = torch.load(file, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or "config" not in state or "net" not in state:
        raise ConfigError(f"model.path={model_cfg.path!r}: {file} is not a saved toy policy (no config and net)")
    return state
