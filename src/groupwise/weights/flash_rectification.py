"""Flash-GRPO temporal gradient rectification: weight each trained SDE step by 1/c(t), batch-normalised.

"Flash-GRPO: one-step policy optimization for video diffusion", arXiv 2605.15980 (ICML 2026); code
https://github.com/Shredded-Pork/Flash-GRPO (``scripts/train_wanx2_1_flash.py``), spec 14-flash-grpo.md.

**Change vs GRPO**: for a flow policy (``groupwise.modalities.flow``) the gradient of an SDE step's
log-prob with respect to the velocity is ``−c(t)·ε/D``: its scale c(t) depends on the timestep, so
high-noise and low-noise steps would train at different rates. Each trained step's loss is multiplied
by ``coe = 1/c(t)``, normalised by the batch mean, which makes ``coe·∂logp/∂v = −ε/D`` the same at
every timestep. Flash-GRPO also trains one SDE step per rollout at a timestep shared by the prompt
group (``FlowPolicy(sde="one_shared")``, :func:`iso_temporal_indices`) with PPO clip ε = 1e-3.

**Math** (per trained step, from the rollout's token extras; ``mask = rollout.row_mask``)::

    c(t) = √(−dt)/std_t + std_t·√(−dt)·(1 − σ)/(2σ)        dt = σ' − σ  (flow_sigma_next − flow_sigma)
    coe  = 1 / c(t)
    w    = coe / mean_{mask}(coe)      on the mask, 0 elsewhere                            # [B,G,T]

**Defaults**: none; the weight has no fields. Around it, Flash-GRPO uses [CODE] ``ppo_clip`` with
``eps_low = eps_high = 1e-3``, β_KL = 0, lr 1e-4, 20 sampling steps and the SDE index uniform over
the first 10; :func:`flash_grpo_loss` is that loss as a plain function.

**Notes**

1. Reads the token extras ``flow_sigma``, ``flow_sigma_next``, ``flow_std`` that
   ``FlowPolicy.generate`` writes (the contract in ``modalities/flow.py`` Note 2); a rollout without
   them (a text policy) is a ``ValueError``. ``modality = "flow"`` keeps it to the flow kind: the
   planner kind writes the same extras, but its plan positions are trained positions with σ = 0,
   where 1/c(t) is not defined (so it declares a kind, not ``reads_extras``).
2. The mean is over every trained step of the whole step batch (the weight stage sees the whole
   batch, as the authors all-reduce the mean across ranks). With one step per row (Flash-GRPO) that
   is the mean over samples; with ``sde = "all"`` over all trained steps.
3. Invalid rows and masked steps get 0 and do not enter the mean. ``scope = "token"``: zeros occur
   only off the mask, so the scope changes no normaliser.
4. ``sde_step_with_logprob`` and ``rectification_coefficient`` live in ``modalities/flow_sde.py`` (the
   sampler uses them) and are re-exported here with :func:`iso_temporal_indices`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.modalities.flow_sde import rectification_coefficient, sde_step_with_logprob  # noqa: F401  (re-exported)
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

EXTRAS = ("flow_sigma", "flow_sigma_next", "flow_std")


def iso_temporal_indices(prompt_ids: Tensor, num_candidates: int = 10, rng: torch.Generator | None = None) -> Tensor:
    """[N] int64 SDE step per row, uniform over ``range(num_candidates)``, equal for equal prompt ids.

    One draw per distinct prompt id, in ascending id order, from ``rng``."""
    if num_candidates < 1:
        raise ValueError(f"iso_temporal_indices: num_candidates must be >= 1, got {num_candidates}")
    unique, inverse = torch.unique(torch.as_tensor(prompt_ids), return_inverse=True)  # [U], [N]
    draws = torch.randint(num_candidates, (unique.numel(),), generator=rng)  # [U]
    return draws[inverse]  # [N]


def flash_grpo_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, coe: Tensor, clip: float = 1e-3) -> Tensor:
    """Flash-GRPO's loss over N samples: mean(max(−w·A·ρ, −w·A·clip(ρ, 1−clip, 1+clip))), w = coe/mean(coe)."""
    w = coe / coe.mean()  # [N]
    ratio = torch.exp(logp - old_logp)  # [N]
    return torch.maximum(-w * adv * ratio, -w * adv * ratio.clamp(1 - clip, 1 + clip)).mean()


@register("weight", "flash_rectification")
@dataclass
class FlashRectification:
    """Weight each trained SDE step by 1/c(t) over its batch mean (Flash-GRPO temporal gradient rectification)."""

    needs = ()
    scope = "token"
    modality = "flow"  # needs a modalities.flow policy's rollouts; no text policy has its extras

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        missing = [k for k in EXTRAS if k not in rollout.extras]
        if missing:
            raise ValueError(
                f"flash_rectification needs the token extras {missing} of a flow policy (modalities.flow.FlowPolicy); "
                "this rollout has none: use it only with a flow policy"
            )
        mask = rollout.row_mask.bool()  # [B,G,T]
        weight = torch.zeros(mask.shape, dtype=torch.float32)  # [B,G,T]
        if not mask.any():
            return weight
        s, sp, std = (rollout.extras[k][mask].double() for k in EXTRAS)  # [M] each
        if not bool(((s > 0) & (sp < s) & (std > 0)).all()):
            raise ValueError("flash_rectification: every trained step needs sigma > 0, sigma_next < sigma and std > 0")
        coe = 1 / rectification_coefficient(s, sp, std)  # [M]
        weight[mask] = (coe / coe.mean()).float()  # [M]
        return weight
