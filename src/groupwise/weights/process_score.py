"""Process-score token weights: step-level scores reshape within-trajectory update strength (spec 50).

"Signal Reshaping for GRPO in Weak-Feedback Agentic Code Repair", arXiv 2605.07276,
https://arxiv.org/abs/2605.07276 (spec: specs/50; abstract only, no code).

**Change vs GRPO**: the group-normalised advantage A_i of trajectory i is kept, but its tokens are
reweighted step by step: each agent step k has a process score s_{i,k} ∈ [0, 1] from executable
signals, computed *outside* the group normalisation (the weights never enter the group mean/std,
they only scale the token update after it). Good steps of good trajectories get more credit, bad
steps of bad trajectories more blame; the weights average 1 over a trajectory's steps.

**Math** (row i; ``segment_id`` [B,G,T] gives token t its step k(t), -1 off the steps;
``s_{i,k}`` = the segment extra ``env/step_scores`` [B,G,S] at (b, g, k), the env's per-step
scores (``rollout/episodes.py`` Note 5); K_i = the steps with a loss token)::

    u_{i,k}  = s_{i,k}         if A_i >= 0  (or sign_aware = False)
             = 1 − s_{i,k}     if A_i < 0
    v_{i,k}  = max(u_{i,k}, w_min)
    w_{i,k}  = v_{i,k} / mean_{k ∈ K_i} v_{i,k}          (mean 1 over the trajectory's steps)
    weight_t = w_{i,k(t)}      so that   adv_tok = A_i · w_{i,k(t)}

**Defaults** — every form is the spec's reconstruction ([ABSTRACT]: "step-level process scores
outside group reward normalization reshape within-trajectory update strength").

- ``sign_aware = True`` [INFERRED] u = 1 − s for a negative advantage; ``False`` uses u = s always.
- ``w_min = 0.1`` [INFERRED] the floor of u, so no step of a trajectory loses its update entirely.
- The scores s come from the env (``compile_fix``: s = (compiled + semantic) / 2) [INFERRED].

**Notes**

1. A_i is the row's advantage ([B,G]); with token advantages [B,G,T] the sign of each token's own
   advantage picks u (equal to the row's sign for any row-level estimator). A_i = 0 reads as
   A_i >= 0; its tokens carry no update either way.
2. A row without step scores (no ``env/step_scores``: single-turn rows, the contract sweeps),
   without ``segment_id``, or whose loss tokens fall on no scored step gets weight 1 on its loss
   tokens. A loss token on a step with no score (k beyond the list, NaN, or k = -1) gets 1 too.
3. Tokens off ``row_mask`` (padding, env tokens, invalid rows) get exactly 0. With ``w_min > 0``
   every loss token gets w > 0 (``scope = "loss"``: nothing leaves a normaliser); with ``w_min = 0``
   and every u = 0 the mean is 0 and the row falls back to 1.
4. Mean-1 is over steps, not tokens (the spec's mean_k): a long step counts once in the mean.
5. Row-local: no whole-batch statistic, so micro-batching and ranks cannot change it.
   ``step_stats()``: ``process/w_mean_tok`` (mean weight over weighted loss tokens),
   ``process/w_max`` and ``process/rows`` (rows that had step scores).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


def process_token_weights(
    step_scores: list[list[float]],
    step_of_token: Tensor,
    adv: Tensor,
    sign_aware: bool = True,
    w_min: float = 0.1,
    mask: Tensor | None = None,
) -> Tensor:
    """w [N,T] float32 for N rows: ``step_scores`` (N lists; NaN = no score), ``step_of_token`` [N,T] long,
    ``adv`` [N] or [N,T], ``mask`` [N,T] bool."""
    N, T = step_of_token.shape
    mask = torch.ones(N, T, dtype=torch.bool) if mask is None else mask.bool()  # [N,T]
    adv = adv.double()
    adv_tok = adv[:, None].expand(N, T) if adv.dim() == 1 else adv  # [N,T]
    w = mask.double()  # [N,T] 1 on loss tokens by default, 0 off the mask
    for i in range(N):
        scores = torch.tensor([float(x) for x in (step_scores[i] or [])], dtype=torch.float64)  # [K]
        if scores.numel() == 0:
            continue
        k = step_of_token[i]  # [T]
        on = mask[i] & (k >= 0) & (k < scores.numel())  # [T] loss tokens on a step of the list
        on &= torch.isfinite(scores[k.clamp(0, scores.numel() - 1)])  # [T] … that has a score
        if not on.any():
            continue
        kk = k[on]  # [M]
        s = scores[kk]  # [M]
        u = torch.where(adv_tok[i][on] >= 0, s, 1.0 - s) if sign_aware else s  # [M]
        v = u.clamp(min=w_min)  # [M]
        steps = torch.unique(kk)  # [K_i] the steps with a loss token
        # [K] (a step's tokens share one sign for row advantages)
        v_step = scores.new_zeros(scores.numel()).index_put_((kk,), v)
        mean = v_step[steps].mean()
        if mean > 0:
            w[i, on] = v / mean
    return w.float()  # [N,T]


STEP_SCORES = "env/step_scores"  # segment extra [B,G,S]: the env's score of each step (NaN: none)


def step_scores_of(rollout: Rollout) -> list[list[float]]:
    """The ``B·G`` rows' step scores, row-major, from the segment extra ``env/step_scores`` (``[]``
    where the batch has none; a row's list ends at its last finite score)."""
    B, G, _ = rollout.shape
    values = rollout.extras.get(STEP_SCORES)
    if values is None:
        return [[] for _ in range(B * G)]
    out: list[list[float]] = []
    for row in values.reshape(B * G, -1).double().tolist():
        last = max((k for k, x in enumerate(row) if x == x), default=-1)  # x == x: finite or inf, not NaN
        out.append(row[: last + 1])
    return out


@register("weight", "process_score")
@dataclass
class ProcessScore:
    """Step-level process-score token weights, mean 1 within a trajectory, sign-aware (spec 50)."""

    sign_aware: bool = True
    w_min: float = 0.1

    needs = ()
    scope = "loss"  # w > 0 on every loss token when w_min > 0: normalisers keep every token

    def __post_init__(self) -> None:
        if not 0.0 <= self.w_min <= 1.0:
            raise ValueError(
                f"process_score: w_min must be in [0, 1] (the floor of a step's score), got {self.w_min!r}"
            )
        self._stats: dict[str, float] = {}

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        if rollout.advantages is None:
            raise ValueError(
                "process_score needs rollout.advantages (configure an advantage estimator; weights run after it)"
            )
        B, G, T = rollout.shape
        mask = rollout.row_mask.bool()  # [B,G,T]
        steps = rollout.segment_id
        if steps is None:  # no step segmentation (a single-turn strategy): every loss token weighs 1
            steps = torch.full((B, G, T), -1, dtype=torch.long)  # [B,G,T]
        scores = step_scores_of(rollout)
        adv = rollout.advantages.float()  # [B,G] or [B,G,T]
        flat_adv = adv.reshape(B * G) if adv.dim() == 2 else adv.reshape(B * G, T)  # [N] or [N,T]
        w = process_token_weights(
            scores, steps.reshape(B * G, T).long(), flat_adv, self.sign_aware, self.w_min, mask.reshape(B * G, T)
        ).view(B, G, T)  # [B,G,T]
        n = max(int(mask.sum()), 1)
        self._stats = {
            "process/w_mean_tok": float(w[mask].sum()) / n,
            "process/w_max": float(w[mask].max()) if mask.any() else 1.0,
            "process/rows": float(sum(bool(s) for s in scores)),
        }
        return w  # [B,G,T]

    def step_stats(self) -> dict[str, float]:
        return dict(self._stats)
