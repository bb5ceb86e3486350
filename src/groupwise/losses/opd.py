"""On-policy distillation (OPD): per-token reverse KL from the student to a frozen teacher, on the student's samples.

"Beyond GRPO and On-Policy Distillation: An Empirical Sparse-to-Dense Reward Principle for LLM
Post-Training", Sang, Xu, Zhou, He, Wang, Geramifard, arXiv 2605.12483 —
https://arxiv.org/html/2605.12483 (abstract and third-party summaries only; spec: specs/28). The
bridge's stage 2b; its stage 2a is the phase ``fkl_warmup`` (``phases/fkl_warmup.py``), the shaper
``opd_token`` (``advantages/opd_token.py``) gives the sampled form as token advantages.

**Change vs GRPO**: a dense objective term. Each completion token of a student rollout gets the
teacher's opinion of the student's next-token distribution; no reward is needed (rewards may be
computed for logging with weight 0, or the term may sit beside GRPO's surrogate).

**Math** (token t of row i; p_S = the student's next-token distribution at the sampled context
(x, y_<t), p_T = the frozen teacher's at the same context, both over the full vocabulary V)::

    full:     ℓ_t = KL(p_S ‖ p_T) = Σ_v p_S(v) (log p_S(v) − log p_T(v))      exact gradient through p_S
    sampled:  r_t = log p_T(y_t) − log p_S(y_t)                                 (detached token reward)
              Â_t = Σ_{k ≥ t} γ^{k−t} r_k                                       (discount γ; γ = 0: Â_t = r_t)
              ℓ_t = −Â_t · log p_S(y_t)                                         (REINFORCE on Â)

With γ = 1 the sampled form is the single-sample estimator of ∇ KL(π_S ‖ π_T) over whole
sequences (the sum-to-go keeps only the causal terms); ``full`` is the per-position reverse KL
whose gradient ignores how y_t changes later contexts (the standard OPD form).

**Defaults**

- ``form = "full"`` [INFERRED] the standard per-token reverse KL (spec 28: "full-vocab, exact
  gradient"); ``"sampled"`` [INFERRED] the sampled-token estimator of the spec.
- ``discount = 0.0`` [INFERRED] (sampled form only): the per-token reward as the advantage, as
  common OPD implementations do; the spec's "optionally discounted sum-to-go" is γ > 0.
- ``teacher = "teacher"``: the frozen role whose log-probs are the teacher's
  (``roles.teacher = {frozen = true, model = {path = ...}}``).
- ``coef = 1.0``; ``agg = None`` (the objective's aggregation).

**Notes**

1. Padding never reaches a value or a gradient: inputs are neutralised outside the term's mask
   before any ``exp`` (``ssopd.token_divergence``), and a vocabulary entry of probability 0 adds 0.
2. ``on_policy_reinforce = False``: the full form is a distillation gradient, not −A·∇logp; the
   sampled form is −Â·∇logp with Â from the no-grad ``logp_old`` (the sampling policy's log-probs).
3. Token weights scale ℓ_t as for any token term (``token_weights`` absent = ``"token"``).
4. Statistics: ``opd_rkl`` (full form: ℓ_t; sampled form: −r_t, whose mean under π_S is the same
   reverse KL), ``opd_reward`` (r_t, both forms).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import required, term_mask
from groupwise.losses.ssopd import token_divergence
from groupwise.masked import masked_input
from groupwise.registry import register
from groupwise.types import Need, Rollout, StepInfo

FORMS = ("full", "sampled")


def forward_kl_loss(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor) -> Tensor:
    """Scalar Σ_t mask_t Σ_v p_T (log p_T − log p_S) / Σ_t mask_t (spec 28's interface): logits [N,T,V]
    of the student and the teacher (detached), ``mask`` [N,T]. Its gradient in the student's logits
    is (p_S − p_T) / Σ mask per selected position."""
    ell = token_divergence(student_logits.float().log_softmax(-1), teacher_logits.float().log_softmax(-1), mask, "fkl")
    return ell.sum() / mask.sum().clamp(min=1)  # []


def reverse_kl_loss(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor) -> Tensor:
    """Scalar Σ_t mask_t Σ_v p_S (log p_S − log p_T) / Σ_t mask_t: logits [N,T,V], ``mask`` [N,T]."""
    ell = token_divergence(student_logits.float().log_softmax(-1), teacher_logits.float().log_softmax(-1), mask, "rkl")
    return ell.sum() / mask.sum().clamp(min=1)  # []


def opd_token_rewards(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor | None = None) -> Tensor:
    """[...,T] r_t = log p_T(y_t) − log p_S(y_t), detached; 0 outside ``mask`` (padding neutralised first)."""
    if mask is None:
        mask = torch.ones(student_logp.shape, dtype=torch.bool)
    student, teacher = masked_input(student_logp.detach(), mask), masked_input(teacher_logp.detach(), mask)
    return torch.where(mask, teacher - student, torch.zeros(()))  # [...,T]


def sum_to_go(rewards: Tensor, mask: Tensor, discount: float) -> Tensor:
    """[...,T] Â_t = Σ_{k ≥ t, k in mask} γ^{k−t} r_k over each row's masked tokens; 0 outside ``mask``.

    Masked-out positions add nothing (they are padding after the row's last token, or tokens a
    forced prefix holds); γ counts positions, so a gap inside a row still discounts."""
    r = torch.where(mask, rewards.float(), torch.zeros(()))  # [...,T]
    if discount == 0.0:
        return r
    out = torch.zeros_like(r)  # [...,T]
    running = torch.zeros(r.shape[:-1], dtype=r.dtype)  # [...]
    for t in range(r.shape[-1] - 1, -1, -1):  # T is the completion length: a short loop
        running = r[..., t] + discount * running
        out[..., t] = running
    return torch.where(mask, out, torch.zeros(()))  # [...,T]


@register("objective", "opd")
@dataclass
class OPD:
    """Per-token reverse KL to a frozen teacher on the student's own samples (on-policy distillation, spec 28)."""

    form: str = "full"
    discount: float = 0.0
    teacher: str = "teacher"
    coef: float = 1.0
    agg: str | None = None

    on_policy_reinforce = False  # Note 2

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"opd: form must be one of {', '.join(FORMS)}, got {self.form!r}")
        if not 0.0 <= self.discount <= 1.0:
            raise ValueError(f"opd: discount must be in [0, 1] (the sampled form's γ), got {self.discount}")
        if not self.teacher or self.teacher in ("policy", "ref"):
            raise ValueError(
                f"opd: teacher must name a frozen role (roles.NAME with frozen = true), not {self.teacher!r}"
            )

    @property
    def needs(self) -> tuple[Need, ...]:
        if self.form == "full":
            return (Need("logprobs", grad=True), Need("logprobs", model=self.teacher))
        return (Need("logp"), Need("logp", model=self.teacher))

    def _teacher(self, mb: Rollout, quantity: str) -> Tensor:
        key = Need(quantity, model=self.teacher).key
        if key not in mb.extras:
            raise ValueError(f"opd needs the teacher's {quantity} {key!r} (the trainer fills the declared need)")
        return mb.extras[key]

    def _rewards(self, mb: Rollout, mask: Tensor) -> Tensor:
        """[b,G,T] r_t from the sampling policy's and the teacher's log-probs of the sampled tokens."""
        return opd_token_rewards(required(mb, "logp_old", "opd"), self._teacher(mb, "logp"), mask)

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        mask = term_mask(mb)  # [b,G,T]
        if self.form == "full":
            return token_divergence(out["logprobs"], self._teacher(mb, "logprobs"), mask, "rkl")  # [b,G,T]
        adv = sum_to_go(self._rewards(mb, mask), mask, self.discount)  # [b,G,T]
        return -adv * masked_input(out["logp"], mask)  # [b,G,T]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        mask = term_mask(mb)  # [b,G,T]
        with torch.no_grad():
            if self.form == "full":
                student = out["logprobs"].detach()  # [b,G,T,V]
                rkl = token_divergence(student, self._teacher(mb, "logprobs"), mask, "rkl")  # [b,G,T]
                picked = mb.actions[..., None].clamp(min=0, max=student.shape[-1] - 1)  # [b,G,T,1]
                s = masked_input(student.float().log_softmax(-1).gather(-1, picked)[..., 0], mask)  # [b,G,T]
                t = masked_input(self._teacher(mb, "logprobs").float().log_softmax(-1).gather(-1, picked)[..., 0], mask)
                reward = torch.where(mask, t - s, torch.zeros(()))  # [b,G,T]
            else:
                reward = self._rewards(mb, mask)  # [b,G,T]
                rkl = -reward
        return {"opd_rkl": rkl, "opd_reward": reward}  # [b,G,T] x2
