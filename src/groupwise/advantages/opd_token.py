"""OPD's teacher-induced token reward as an advantage shaper: the sampled form of on-policy distillation.

"Beyond GRPO and On-Policy Distillation: An Empirical Sparse-to-Dense Reward Principle for LLM
Post-Training", Sang et al., arXiv 2605.12483 — https://arxiv.org/html/2605.12483 (abstract and
third-party summaries only; spec: specs/28). The term ``opd`` (``losses/opd.py``) holds the maths;
this shaper hands the same dense reward to any policy-gradient term (``reinforce``, ``ppo_clip``),
so it can stand alone (distillation) or sit on top of GRPO's sparse advantage (the paper's
"unifying GRPO and OPD" reading, [INFERRED]).

**Change vs GRPO**: after the estimator, the advantage becomes per token: the teacher's dense
reward replaces (or joins) the sparse one.

**Math** (token t of a row sampled by the student, the policy)::

    r_t  = log p_T(y_t | x, y_<t) − log p_S(y_t | x, y_<t)       (frozen teacher, sampling policy)
    Â_t  = Σ_{k ≥ t} γ^{k−t} r_k                                 (discount γ)
    replace:  A_t = coef · Â_t          add:  A_t = A_i + coef · Â_t

With ``reinforce`` and ``mode = "replace"``, ``coef = 1`` this is exactly ``opd(form = "sampled")``
(``tests/test_opd.py`` checks the gradients agree).

**Defaults**

- ``mode = "replace"`` [INFERRED] pure distillation, the spec's OPD stage; ``"add"`` keeps the
  estimator's (sparse) advantage and adds the dense one.
- ``discount = 0.0`` [INFERRED] the per-token reward (see ``losses/opd.py``); ``coef = 1.0``.
- ``teacher = "teacher"``: the frozen role that scores the rows.

**Notes**

1. Rows with ``group_valid`` False or a non-finite reward get exactly 0 (the contract of every
   estimator), as do tokens outside the mask. Non-finite earlier advantages count as 0.
2. ``step_stats`` logs ``opd_token/reward`` (mean r_t over the step's valid tokens): minus the
   sampled estimate of KL(π_S ‖ π_T) per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses.opd import opd_token_rewards, sum_to_go
from groupwise.masked import finite_or_zero, masked_mean
from groupwise.registry import register
from groupwise.types import Need, Rollout, StepInfo

MODES = ("replace", "add")


@register("advantage", "opd_token")
@dataclass
class OPDToken:
    """Token advantages from a frozen teacher's log-prob gap on the sampled tokens (sampled OPD, spec 28)."""

    mode: str = "replace"
    discount: float = 0.0
    coef: float = 1.0
    teacher: str = "teacher"

    shaper = True  # reshapes an estimator's advantages (advantage.shapers), never estimates alone

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"opd_token: mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 0.0 <= self.discount <= 1.0:
            raise ValueError(f"opd_token: discount must be in [0, 1], got {self.discount}")
        if not self.teacher or self.teacher in ("policy", "ref"):
            raise ValueError(
                f"opd_token: teacher must name a frozen role (roles.NAME with frozen = true), not {self.teacher!r}"
            )
        self._stats: dict[str, float] = {}

    @property
    def needs(self) -> tuple[Need, ...]:
        return (Need("logp"), Need("logp", model=self.teacher))

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        if rollout.advantages is None:
            raise ValueError(
                "opd_token is a shaper: configure an advantage estimator before it (rollout.advantages is None)"
            )
        if rollout.logp_old is None:
            raise ValueError("opd_token needs rollout.logp_old (declared Need('logp'))")
        key = Need("logp", model=self.teacher).key
        if key not in rollout.extras:
            raise ValueError(
                f"opd_token needs the teacher's log-probs rollout.extras[{key!r}] (declared in its needs); "
                f"extras present: {sorted(rollout.extras)}"
            )
        valid = rollout.group_valid.bool()  # [B,G]
        if rollout.rewards is not None:
            valid = valid & torch.isfinite(rollout.rewards)  # [B,G]
        mask = rollout.mask.bool() & valid[..., None]  # [B,G,T]
        r = opd_token_rewards(rollout.logp_old, rollout.extras[key], mask)  # [B,G,T]
        dense = self.coef * sum_to_go(r, mask, self.discount)  # [B,G,T]
        if self.mode == "add":
            adv = finite_or_zero(rollout.advantages.float())  # [B,G] or [B,G,T]
            dense = dense + (adv[..., None] if adv.dim() == 2 else adv)  # [B,G,T]
        self._stats = {"opd_token/reward": float(masked_mean(r, mask))}
        return torch.where(mask, dense, torch.zeros(())).float()  # [B,G,T]

    def step_stats(self) -> dict[str, float]:
        return dict(self._stats)
