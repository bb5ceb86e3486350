"""``kl_to(VIEW)``: full-vocabulary KL between the model's next-token distributions under its own
context and under a view, per completion token, without materialising ``[N,T,V]``.

    kl_to(v)[t] = KL( π(·| ctx, y_<t) ‖ π(·| v(ctx), y_<t) ) = Σ_y p(y) (log p(y) − log q(y))

Both forwards return their final-norm hidden states at the completion positions (``last_hidden``,
[B,G,T,H]); the output head then runs over chunks of tokens (``forward.token_kl``), so the largest
logits tensor is [chunk, V]. First consumer: GEAR (specs/32). No-grad only.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from groupwise.policy.forward import token_kl
from groupwise.registry import ConfigError, register
from groupwise.types import Need


@register("provider", "kl_to")
@dataclass
class KLToView:
    """Per-token full-vocabulary KL(π(·|ctx) ‖ π(·|view ctx)) [B,G,T]."""

    grad_ok = False

    def check(self, need: Need) -> None:
        if not need.arg:
            raise ConfigError(f"need {need.quantity!r}: name the view, e.g. kl_to(ground_truth)")

    def plan(self, need: Need) -> dict[tuple[str, str], set[str]]:
        return {(need.model, need.view): {"last_hidden"}, (need.model, need.arg): {"last_hidden"}}

    def finish(self, need: Need, results: dict, model) -> Tensor:
        own = results[(need.model, need.view)]
        other = results[(need.model, need.arg)]
        return token_kl(model, own["last_hidden"], other["last_hidden"], own["scored"])  # [B,G,T]
