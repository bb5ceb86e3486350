"""Entropy bonus: subtract coef · H(π(·|s_t)) per completion token, to slow the collapse of entropy.

Standard practice since "Asynchronous Methods for Deep Reinforcement Learning", Volodymyr Mnih et al.,
2016, https://arxiv.org/abs/1602.01783 (the entropy regulariser of A3C). Reference implementation:
verl ``verl/workers/actor/dp_actor.py`` ``update_policy`` — ``policy_loss -= agg_loss(entropy,
response_mask, loss_agg_mode) * entropy_coeff`` (``entropy_coeff`` in ``actor.yaml``).

**Change vs GRPO**: GRPO has no entropy term. This one rewards a spread-out next-token distribution
at every completion token; its coefficient may follow the batch entropy (schedule
``target_entropy``, Skywork-OR1's adaptive entropy control)::

    objective.terms = ["ppo_clip", { name = "entropy_bonus", coef = { schedule = "target_entropy", target = 0.2 } }]

**Math** (``H`` = ``out["entropy"]``, the full-vocabulary entropy of the policy at each token, with
gradient through the logits)::

    loss = -H                 (the objective adds coef · agg(loss), i.e. −coef · agg(H))

**Defaults**

- ``coef = 1e-3`` [CODE] verl's former default ``entropy_coeff: 0.001`` (``docs/examples/config.rst``
  of verl ≤ 0.3, as in the Skywork-OR1 fork); current verl ships 0 (off), which a term would not be.
- ``agg = None`` (the objective's default) [CODE] verl aggregates the entropy with the policy loss's
  ``loss_agg_mode``.

**Notes**

1. Needs: ``Need("entropy", grad=True)`` for the loss, and a no-grad ``Need("entropy")`` so that the
   step's whole-batch entropy exists in ``rollout.extras["entropy"]`` before micro-batching, where the
   ``target_entropy`` schedule reads it. (The no-grad one costs a no-grad forward of the batch.)
2. ``token_weights = "exempt"`` [CODE]: verl multiplies only the policy loss by ``rollout_is_weights``, never
   the entropy term; tokens removed by a token weight (``extras["counted"]``) still leave it.
3. The gradient flows only through ``out["entropy"]`` (not through the sampled tokens' log-probs).
4. Padding positions are set to 0 before the sum, so garbage there never reaches the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from groupwise.losses._common import term_mask
from groupwise.masked import masked_input
from groupwise.registry import register
from groupwise.types import Need, Rollout, StepInfo


@register("objective", "entropy_bonus")
@dataclass
class EntropyBonus:
    """−coef·H per completion token, H the policy's full-vocabulary entropy (verl ``entropy_coeff``)."""

    coef: float = 1e-3
    agg: str | None = None

    needs = (Need("entropy", grad=True), Need("entropy"))
    token_weights = "exempt"  # Note 2

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        if "entropy" not in out:
            raise ValueError(
                "entropy_bonus needs out['entropy'] (the grad Need('entropy')); the forward did not return it"
            )
        return -masked_input(out["entropy"], term_mask(mb))  # [b,G,T]
