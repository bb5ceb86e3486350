"""SSOPD: distil a shortest-correct-hinted self-teacher into the policy on the longest wrong completion's prefixes.

"SSOPD: Self-Supervised On-Policy Distillation" (shortest-correct → longest-wrong), arXiv
2605.17497, 2026 — https://arxiv.org/abs/2605.17497; only the abstract and introduction were
available, the announced code (github.com/tzq1999/SSOPD) was not. Spec: specs/07.

**Change vs GRPO**: an auxiliary objective term beside GRPO's surrogate (``objective.terms =
[ppo_clip, ssopd]``). In a mixed group (correct and wrong rows both present) the shortest correct
completion y⁺ is a hint for a stop-gradient copy of the policy (the teacher: the same weights,
prompt re-written by the view ``sibling_hint``); the teacher's next-token distribution is distilled
into the policy on every prefix of the longest wrong completion y⁻, weighted per prompt by a
frontier weight that vanishes when the group is all right or all wrong.

**Math** (group b, ``p̂`` = share of correct rows among those with a verdict; token t of row y⁻ with
``logp = logprobs[b,y⁻,t]`` the student's [V] log-distribution under x ⊕ y⁻_<t, ``logq`` the
teacher's under hint(x, y⁺) ⊕ y⁻_<t, no gradient)::

    pos, neg, valid, w = select_witness_pairs(lengths, correct, members)     # [B] x4
    valid[b]  = ∃ correct ∧ ∃ wrong;   w[b] = 4 p̂ (1 − p̂) on valid groups, else 0
    q         = softmax(logq / tau)                                           # [V]
    fkl:  ℓ_t = Σ_v q (log q − log p)          (∂ℓ/∂logits_student = p − q)
    rkl:  ℓ_t = Σ_v p (log p − log q)
    jsd:  ℓ_t = ½ Σ_v q (log q − log m) + ½ Σ_v p (log p − log m),  m = (p + q) / 2
    L[b]      = w[b] · mean_{t < max_prefix, t a loss token of y⁻} ℓ_t   (0 when not valid)
    loss      = L broadcast to the group's rows      # [b,G]; agg "group_mean" = mean over prompts
    total     = GRPO + coef · mean_x L               (coef = λ)

**Defaults**

- ``kind = "fkl"`` [INFERRED] KL(teacher ‖ student) (a third-party note's reading); ``"rkl"``,
  ``"jsd"`` are the spec's options.
- ``max_prefix = 0`` [INFERRED] every prefix of y⁻ (no cap L_max); n > 0 keeps the first n tokens.
- ``frontier = "bernoulli"`` [INFERRED] w = 4 p̂ (1 − p̂); ``"none"`` is w ≡ 1 on mixed groups
  (the spec's ablation).
- ``coef = 1.0`` [INFERRED] λ; ``tau = 1.0`` [INFERRED] the teacher's temperature.
- ``threshold = 1.0`` [INFERRED] a row is correct when its reward is ≥ 1; it must equal the
  view's ``views.sibling_hint.threshold`` (both default 1.0).
- ``view = "sibling_hint"`` [INFERRED] the teacher's context (the spec's example hint_template,
  ``views/sibling_hint.py``);
  ``agg = "group_mean"`` [INFERRED] the spec's mean over prompts.

**Notes**

1. All-correct, all-wrong, single-row and empty groups have ``valid = False``: their loss is exactly
   0, with exactly 0 gradient (a ``where``, never ``0 · x``). Rows without a verdict (NaN reward,
   padding) are neither correct nor wrong and do not enter p̂.
2. Ties: the first row (lowest index) among the shortest correct / the longest wrong
   (``views.sibling_hint.pick_row``); lengths count the row's completion tokens, EOS included.
3. Teacher log-probs are read from the rollout (a no-grad need, computed once per step): they carry
   no gradient. The student's are the grad need ``logprobs`` of the micro-batch, [b,G,T,V].
4. Only y⁻'s tokens that are loss tokens (``loss_tokens``: mask, valid row, not removed by a token
   weight) count; inputs are neutralised outside them before any ``exp``, so padding — even NaN —
   reaches neither the value nor the gradient. A y⁻ without tokens gives 0. A vocabulary entry of
   probability 0 (log −inf) adds 0 (0 · log 0 = 0), not NaN.
5. Group-level term (``couples = "group"``): every row of group b carries L[b]; under another
   aggregation a group weighs by its rows or tokens. Token weights do not scale it (``token_weights =
   "exempt"``): the frontier weight is its own.
6. ``on_policy_reinforce = False``: a distillation gradient, not −A·∇logp.
7. Statistics, per row (every row of group b carries its group's value; the objective averages
   them over the step's rows): ``ssopd_div`` = mean ℓ_t over y⁻'s prefix tokens (0 off valid
   groups), ``ssopd_pair`` = 1 on valid groups, ``ssopd_weight`` = w. ``ssopd_div / ssopd_pair`` is
   the mean divergence on the wrong prefixes of the mixed groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import loss_tokens, required
from groupwise.masked import masked_sum
from groupwise.registry import register
from groupwise.types import Need, Rollout, StepInfo
from groupwise.views.sibling_hint import pick_row, verdicts

KINDS = ("fkl", "rkl", "jsd")
FRONTIERS = ("bernoulli", "none")


def select_witness_pairs(
    lengths: Tensor, correct: Tensor, members: Tensor | None = None, frontier: str = "bernoulli"
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(pos_idx [B], neg_idx [B] long, valid [B] bool, frontier_w [B] float32): shortest correct, longest
    wrong (ties → first, −1 where none), mixed group, 4 p̂ (1 − p̂) (``frontier="none"``: 1) on valid groups."""
    members = torch.ones_like(correct, dtype=torch.bool) if members is None else members.bool()  # [B,G]
    correct = correct.bool() & members  # [B,G]
    wrong = members & ~correct  # [B,G]
    pos, neg = pick_row(lengths, correct, "shortest"), pick_row(lengths, wrong, "longest")  # [B] x2
    valid = (pos >= 0) & (neg >= 0)  # [B]
    p_hat = correct.sum(1).float() / members.sum(1).clamp(min=1).float()  # [B]
    if frontier == "bernoulli":
        w = 4.0 * p_hat * (1.0 - p_hat)  # [B]
    elif frontier == "none":
        w = torch.ones_like(p_hat)  # [B]
    else:
        raise ValueError(f"ssopd: frontier must be one of {', '.join(FRONTIERS)}, got {frontier!r}")
    return pos, neg, valid, torch.where(valid, w, torch.zeros(()))  # [B] x4


def token_divergence(logp: Tensor, logq: Tensor, mask: Tensor, kind: str = "fkl", tau: float = 1.0) -> Tensor:
    """[...] float32 divergence per position between student log-probs ``logp`` [...,V] and teacher
    log-probs ``logq`` [...,V] (detached; tempered by ``tau``); exactly 0 outside ``mask`` [...]."""
    m = mask.bool()[..., None]  # [...,1]
    logp = torch.where(m, logp.float(), torch.zeros(()))  # [...,V] padding neutralised (Note 4)
    logq = torch.where(m, logq.detach().float(), torch.zeros(()))  # [...,V]
    logq = torch.log_softmax(logq / tau, dim=-1)  # [...,V] tempered teacher (padding -> uniform)
    logp = torch.log_softmax(logp, dim=-1)  # [...,V] a no-op on a log-distribution (padding -> uniform)
    p, q = logp.exp(), logq.exp()  # [...,V] x2

    def plogp(w: Tensor, log_w: Tensor, log_other: Tensor) -> Tensor:  # Σ_v w (log w − log other), 0·log 0 = 0
        return torch.where(w > 0, w * (log_w - log_other), torch.zeros((), dtype=w.dtype)).sum(-1)  # [...]

    if kind == "fkl":
        ell = plogp(q, logq, logp)  # [...]
    elif kind == "rkl":
        ell = plogp(p, logp, logq)  # [...]
    elif kind == "jsd":
        logm = torch.logaddexp(logp, logq) - math.log(2.0)  # [...,V]
        ell = 0.5 * plogp(q, logq, logm) + 0.5 * plogp(p, logp, logm)  # [...]
    else:
        raise ValueError(f"ssopd: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return torch.where(mask.bool(), ell, torch.zeros((), dtype=ell.dtype))  # [...]


def ssopd_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor,
    frontier_w: Tensor,
    kind: str = "fkl",
    tau: float = 1.0,
) -> Tensor:
    """Scalar mean over the B pairs of w · mean_t ℓ_t (spec interface): logits [B,T,V] of y⁻ under the
    student and the teacher (detached), ``mask`` [B,T] its prefix tokens, ``frontier_w`` [B]."""
    if teacher_logits.requires_grad:
        raise ValueError(
            "ssopd_loss: teacher_logits must carry no gradient (detach them: the teacher is a stop-gradient copy)"
        )
    logq = torch.log_softmax(teacher_logits.float() / tau, dim=-1)  # [B,T,V]
    ell = token_divergence(torch.log_softmax(student_logits.float(), dim=-1), logq, mask, kind)  # [B,T]
    m = mask.bool()  # [B,T]
    per = masked_sum(ell, m, dim=-1) / m.sum(-1).clamp(min=1)  # [B]
    per = torch.where(m.any(-1), frontier_w.float() * per, torch.zeros(()))  # [B]
    return per.mean() if per.numel() else per.sum()  # []


@register("objective", "ssopd")
@dataclass
class SSOPD:
    """Distillation from a shortest-correct-hinted self-teacher on the longest wrong row's prefixes (SSOPD, spec 07)."""

    kind: str = "fkl"
    tau: float = 1.0
    max_prefix: int = 0
    frontier: str = "bernoulli"
    threshold: float = 1.0
    view: str = "sibling_hint"
    coef: float = 1.0
    agg: str | None = "group_mean"

    couples = "group"
    binary_rewards = True  # reads right/wrong verdicts (test fixtures give such terms 0/1 rewards)
    token_weights = "exempt"  # Note 5
    on_policy_reinforce = False  # Note 6

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"ssopd: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.frontier not in FRONTIERS:
            raise ValueError(f"ssopd: frontier must be one of {', '.join(FRONTIERS)}, got {self.frontier!r}")
        if not self.tau > 0:
            raise ValueError(f"ssopd: tau must be > 0 (the teacher's temperature), got {self.tau}")
        if isinstance(self.max_prefix, bool) or not isinstance(self.max_prefix, int) or self.max_prefix < 0:
            raise ValueError(
                "ssopd: max_prefix must be an integer >= 0 (0 = every "
                f"prefix of the wrong row), got {self.max_prefix!r}"
            )
        if not math.isfinite(self.threshold):
            raise ValueError(
                f"ssopd: threshold must be finite (a row is correct when its reward >= threshold), got {self.threshold}"
            )

    @property
    def needs(self) -> tuple[Need, ...]:
        return (Need("logprobs", grad=True), Need("logprobs", view=self.view))

    def _parts(self, mb: Rollout, out: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(L [b], mean ℓ [b], valid [b], w [b]) of the micro-batch's groups."""
        teacher_key = Need("logprobs", view=self.view).key
        if teacher_key not in mb.extras:
            raise ValueError(
                f"ssopd needs the teacher's log-probs {teacher_key!r} (the trainer fills the declared need)"
            )
        student, teacher = out["logprobs"], mb.extras[teacher_key]  # [b,G,T,V] x2
        tokens = loss_tokens(mb)  # [b,G,T]
        b, G, T = tokens.shape
        members, correct = verdicts(required(mb, "rewards", "ssopd"), mb.group_valid, self.threshold)  # [b,G] x2
        _, neg, valid, w = select_witness_pairs(mb.mask.sum(-1), correct, members, self.frontier)  # [b] x4
        on_neg = (torch.arange(G)[None, :] == neg[:, None]) & valid[:, None]  # [b,G] the y⁻ row of valid groups
        prefix = torch.arange(T)[None, None, :] < (self.max_prefix or T)  # [1,1,T]
        sel = tokens & on_neg[..., None] & prefix  # [b,G,T]
        ell = token_divergence(student, teacher, sel, self.kind, self.tau)  # [b,G,T]
        n = sel.sum((1, 2))  # [b]
        mean = masked_sum(ell, sel, dim=(1, 2)) / n.clamp(min=1)  # [b]
        keep = valid & (n > 0)  # [b]
        loss = torch.where(keep, w * mean, torch.zeros(()))  # [b] exactly 0 off mixed groups (Note 1)
        return loss, mean, keep, w

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        loss, _, _, _ = self._parts(mb, out)
        return loss[:, None].expand(mb.group_valid.shape)  # [b,G]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        with torch.no_grad():
            _, mean, keep, w = self._parts(mb, out)
        G = mb.group_valid.shape[1]
        return {
            "ssopd_div": torch.where(keep, mean, torch.zeros(()))[:, None].expand(-1, G),  # [b,G]
            "ssopd_pair": keep.float()[:, None].expand(-1, G),
            "ssopd_weight": w[:, None].expand(-1, G),
        }  # [b,G] x2
