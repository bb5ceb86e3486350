"""Phase ``average_init``: start from the parameter average of earlier runs' final weights (M8).

In a pipeline (``groupwise pipeline``) a stage can begin from the merge of earlier stages, e.g. a
student initialised as the mean of per-task teachers (Flow-OPD's cold start by merging, [CODE
README] https://github.com/CostaliyA/Flow-OPD ``scripts/merge.py``; design note §3 "45 Flow-OPD")::

    phases = [{ name = "average_init", paths = ["${teacher_a}/final", "${teacher_b}/final"] }]

**Math**: θ = Σ_i w_i θ_i with w_i = ``weights[i]`` / Σ weights (default: uniform), for every
parameter tensor of the policy (a toy kind's net and extra tensors; an LM's module weights).

Each path is a folder a run's ``final/`` holds: a toy kind's ``<policy_file>`` (``flow_policy.pt``:
its config and weights) or a full-weight LM's folder (``config.json``, ``model.safetensors``). Every one
must be the same kind and shape as the run's policy (the same saved config for a toy kind, the same tensor names and
shapes for an LM); anything else is refused naming the path and what differs. The phase is of kind
``sft`` (it changes the policy; its result is saved under ``phases/`` and the reference is reset to
it) and reads no labels (``reads_labels = False``: a pipeline's label ledger counts no row for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from groupwise.errors import ConfigError
from groupwise.registry import register


def _load(policy: Any, path: Path) -> dict[str, torch.Tensor]:
    """The parameter tensors saved in ``path``, checked against ``policy``'s kind and shapes."""
    own_file = getattr(policy, "policy_file", None)
    if own_file is not None:  # a toy kind: its saved config must be this policy's
        file = path / own_file
        if not file.is_file():
            raise ConfigError(f"average_init: {file} does not exist (a {type(policy).__name__}'s final/ holds it)")
        state = torch.load(file, map_location="cpu", weights_only=False)
        if state.get("config") != policy.config:
            raise ConfigError(
                f"average_init: {path} holds a policy saved from {state.get('config')}, the run's policy is "
                f"{policy.config}; only weights of the same kind and shape can be averaged"
            )
        return {**{f"net.{k}": v for k, v in state["net"].items()}, **{n: state[n] for n in policy.extra_tensors}}
    module = getattr(policy, "module", None)
    if module is None or hasattr(module, "disable_adapter"):
        raise ConfigError(
            f"average_init: the {type(policy).__name__} policy has neither a toy kind's policy_file nor full LM "
            "weights (a LoRA run's adapters are not averaged)"
        )
    from transformers import AutoModelForCausalLM

    if not (path / "config.json").is_file():
        raise ConfigError(f"average_init: {path / 'config.json'} does not exist (an LM run's final/ holds it)")
    state = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict()  # tied weights too
    own = module.state_dict()
    wrong = sorted(k for k in own if k not in state or state[k].shape != own[k].shape)
    extra = sorted(set(state) - set(own))
    if wrong or extra:
        raise ConfigError(
            f"average_init: {path} is another architecture than the run's model: tensors missing or of another "
            f"shape {wrong[:3]}, unknown {extra[:3]}"
        )
    return {f"module.{k}": v for k, v in state.items()}


@register("phase", "average_init")
@dataclass
class AverageInit:
    """The policy's weights become the (weighted) average of the final weights at ``paths``."""

    kind = "sft"
    reads_labels = False  # a parameter average reads no rows
    paths: list = field(default_factory=list)  # folders of final weights (in a pipeline: "${stage}/final")
    weights: list = field(default_factory=list)  # one per path (normalised to sum 1); empty: uniform

    def __post_init__(self) -> None:
        if len(self.paths) < 2 or not all(isinstance(p, str) and p for p in self.paths):
            raise ConfigError(f"average_init.paths must name at least two folders of final weights, got {self.paths!r}")
        if self.weights and (len(self.weights) != len(self.paths) or sum(self.weights) <= 0):
            raise ConfigError(
                f"average_init.weights must give one weight per path ({len(self.paths)}) with a positive sum, "
                f"got {self.weights!r}"
            )

    def __call__(self, ctx: Any) -> dict:
        policy = ctx.policy
        weights = [float(w) for w in self.weights] or [1.0] * len(self.paths)
        weights = [w / sum(weights) for w in weights]
        states = [_load(policy, Path(p)) for p in self.paths]
        mean: dict[str, torch.Tensor] = {
            k: torch.stack([w * s[k].double() for w, s in zip(weights, states, strict=True)]).sum(0) for k in states[0]
        }  # each [*shape] float64
        with torch.no_grad():
            if getattr(policy, "policy_file", None) is not None:
                for name, t in policy.net.state_dict().items():
                    t.copy_(mean[f"net.{name}"].to(t.dtype))
                for name in policy.extra_tensors:
                    getattr(policy, name).copy_(mean[name].to(getattr(policy, name).dtype))
            else:
                for name, t in policy.module.state_dict().items():
                    t.copy_(mean[f"module.{name}"].to(t.dtype))
        ctx.say(f"phase 'average_init': the policy is the average of {len(self.paths)} runs' weights {weights}")
        return {"summary": {"paths": list(self.paths), "weights": weights}}
