"""``kl_to(VIEW)``: full-vocabulary KL between the model's next-token distributions under its own
context and under a view, per completion token, without materialising ``[N,T,V]``.

Infrastructure, no paper of its own. First consumer: GEAR ("GEAR: Granularity-Adaptive Advantage
Reweighting for LLM Agents via Self-Distillation", Li et al., 2026,
https://arxiv.org/abs/2605.11853; specs/32).

**Change vs GRPO**: none — GRPO uses no such quantity. This provider serves variants that compare
the model's distribution under two contexts (GEAR's ground-truth-conditioned self-teacher).

**Math** (``p`` = the model's next-token distribution under the need's own ``(model, view)``,
``q`` = the same model under ``VIEW``; same completion tokens ``y_<t``)::

    kl_to(v)[t] = KL( π(·| ctx, y_<t) ‖ π(·| v(ctx), y_<t) ) = Σ_y p(y) (log p(y) − log q(y))

Both forwards return their final-norm hidden states at the completion positions (``last_hidden``,
[B,G,T,H]); the output head then runs over chunks of tokens (``forward.token_kl``), so the largest
logits tensor is [chunk, V].

**Defaults**: none; the provider has no fields. The chunk is ``token_kl``'s ``chunk_tokens = 1024``
[INFERRED] (a memory bound, not a parameter of the method).

**Notes**

1. No-grad only (``grad_ok = False``): a ``grad=True`` need is a ``ConfigError``.
2. ``check``: the view must be named, e.g. ``kl_to(ground_truth)``; without it a ``ConfigError``.
3. ``plan`` asks for ``last_hidden`` from ``(model, need.view)`` and ``(model, VIEW)``; those passes
   are shared with any other need of the same pair.
4. The KL is 0 outside the own pass's scored tokens (``row_mask``: completion tokens of valid rows).
   A view keeps the token axis (``needs.check_view_rollout``), so token t is the same token in both
   passes.
5. Direction: KL(own ‖ view), with ``p`` from the own context. Both distributions are float32
   ``log_softmax`` of the head's logits (temperature 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.policy.forward import token_kl
from groupwise.registry import register
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
