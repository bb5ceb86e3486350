"""RSPO: regress the group-centred policy/reference log-ratio onto the advantage target (text, autoregressive form).

"Relative Score Policy Optimization for Diffusion Language Models", Yu, Xu, Jiang, Zhang, Zou, 2026.
https://arxiv.org/abs/2605.10218 — specs/41 (abstract only; no code).

**Change vs GRPO**

- The KL-regularised optimum π* ∝ π_ref·exp(r/β) has log π*(y)/π_ref(y) = (r(y) − V)/β, so the
  advantage is read as a *target* for the sequence log-ratio to the reference, and the loss is the
  squared gap between the (group-centred) log-ratio and that target: the update is driven by the
  gap, not by the advantage alone, so a large reward cannot push a log-ratio without bound.
- No importance ratio and no clip; the reference model's log-probs are needed.

**Math** (per row i of a group; ``mask`` = completion tokens)::

    u_i   = Σ_t mask·(logp - logp_ref)              sequence log-ratio (exact for an AR policy)
    ubar_i = u_i - mean_{j in group} u_j             center = true (cancels V/β and any common offset)
    tau_i = adv_i / beta                             adv from the advantage stage
    gap_i = ubar_i - tau_i
    loss_i = gap_i²                                  (huber_delta = d: gap² if |gap| <= d, else 2d|gap| - d²)

With ``seq_mean_token_mean`` the objective is mean_i loss_i, and ∂L/∂u_i = (2/n)(gap_i − mean_j gap_j).

**Defaults**

- ``beta = 1.0`` [INFERRED] (spec 41).
- ``center = True`` [INFERRED] the group centring of u (spec 41's form; ``false`` regresses u itself).
- ``huber_delta = None`` [INFERRED] the plain squared gap; a number switches to the Huber form.
- ``agg = "seq_mean_token_mean"`` [INFERRED] the mean over rows, each row once.
- The advantage is the advantage stage's. Spec 41's target A_i = r_i − mean_j r_j is ``dr_grpo``
  (recipe ``rspo``); its std-normalised option is ``grpo``.

**Notes**

1. This is the text (autoregressive) form: u is the exact sequence log-ratio, the spec's
   noise-free control. The paper's diffusion-LM form replaces the two sums by coupled Monte-Carlo
   ELBO estimates; groupwise has no masked-diffusion policy yet, so that part is not implemented.
2. Rows: rows with at least one loss token and a finite reward. Other rows (invalid, NaN reward,
   empty completion) get loss 0, exactly zero gradient, and are left out of the group mean. A
   group with one such row has ubar = 0: with ``center`` its loss is tau² with no gradient.
3. Token-level advantages are averaged over the row's loss tokens into one target per row.
4. A constant group (adv = 0) still has loss: its log-ratios are pulled together (ubar → 0).
5. Groups are never split across micro-batches and the row count is whole-batch, so the loss is
   micro-batch invariant.
6. Statistics (per row): ``rspo/log_ratio`` (u), ``rspo/abs_gap`` (|gap|).
7. Token weights: none (``token_weights = "none"``; objective.py): the gap is one value per whole
   sequence and no source weighs its tokens, so a token weight is refused at build.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import loss_tokens, required, row_advantages, scored_rows, seq_ref_log_ratio
from groupwise.masked import masked_mean
from groupwise.registry import register
from groupwise.types import Need, Rollout, StepInfo


def rspo_gap(u: Tensor, adv: Tensor, rows: Tensor, beta: float, center: bool = True) -> Tensor:
    """[B,G] gap (u − mean_group u) − adv/beta on ``rows``, 0 elsewhere."""
    zero = torch.zeros((), dtype=u.dtype)
    u = torch.where(rows, u, zero)  # [B,G]
    if center:
        u = u - masked_mean(u, rows, dim=1)[:, None]  # [B,G]
    return torch.where(rows, u - adv / beta, zero)  # [B,G]


def huber(x: Tensor, delta: float | None) -> Tensor:
    """x² (``delta`` None), else x² for |x| <= delta and 2·delta·|x| − delta² beyond (same value and slope at delta)."""
    if delta is None:
        return x * x
    ax = x.abs()
    return torch.where(ax <= delta, x * x, 2.0 * delta * ax - delta * delta)


@register("objective", "rspo")
@dataclass
class RSPO:
    """Squared gap between the group-centred log-ratio to the reference and adv/beta (RSPO, Yu et al. 2026)."""

    beta: float = 1.0
    center: bool = True
    huber_delta: float | None = None
    coef: float = 1.0
    agg: str | None = "seq_mean_token_mean"

    needs = (Need("logp", model="ref"),)
    token_weights = "none"  # Note 7
    token_weights_reason = "a squared regression of the whole sequence's log-ratio, with no token-weighted form"

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"rspo: beta must be > 0 (the KL temperature; the target is adv/beta), got {self.beta}")
        if self.huber_delta is not None and not self.huber_delta > 0:
            raise ValueError(f"rspo: huber_delta must be > 0 or None (plain squared gap), got {self.huber_delta}")

    def _parts(self, mb: Rollout, out: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        rows = scored_rows(mb, required(mb, "rewards", "rspo").float())  # [b,G]
        u = seq_ref_log_ratio(mb, out, "rspo")  # [b,G]
        adv = row_advantages(mb, loss_tokens(mb), "rspo")  # [b,G]
        return u, rspo_gap(u, adv, rows, self.beta, self.center)  # [b,G], [b,G]

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        _, gap = self._parts(mb, out)  # [b,G]
        return huber(gap, self.huber_delta)  # [b,G]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        u, gap = self._parts(mb, out)
        return {"rspo/log_ratio": u.detach(), "rspo/abs_gap": gap.detach().abs()}  # [b,G]
