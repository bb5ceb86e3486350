"""EDAS: reshape the wrong rollouts' advantages by the diversity of their final answers.

"Leveraging Error Diversity in Group Rollouts for Reinforcement Learning" (EDAS, Error Diversity
Advantage Shaping), 2026. https://arxiv.org/abs/2605.17333 (spec: specs/08). Reference code (verl):
https://github.com/EDAS-jd/EDAS, ``verl/trainer/ppo/core_algos.py::_apply_branch_advantage_adjustment``.

**Change vs GRPO**

- A shaper after the estimator; correct rows are untouched.
- The wrong rows W of a group are split into classes by their final answer. One class (every wrong
  rollout gave the same answer: error perseveration) adds a uniform extra penalty; several classes
  push common wrong answers down harder and rare ones less (relative surprisal, zero-sum over W).
- A κ-clip bounds each change by |A_i|/κ, so no advantage changes sign.

**Math** (per group; ``adv`` [B,G] from the estimator; ``W`` = valid, wrong, format-ok rows with an answer)::

    N_w = |W|;  no change if N_w <= 1                                   (branch A)
    S   = mean_{i in W} |adv_i|
    K   = number of answer classes in W, n_k their sizes
    K == 1:  delta_i = -beta · S                                        (branch B)
    K >= 2:  p_i = n_{k(i)} / N_w,  I_i = -ln p_i,  H = -Σ_k (n_k/N_w) ln(n_k/N_w)
             C_i = (I_i - H) / ln N_w,  delta_i = alpha · S · C_i       (branch C; Σ_W C_i = 0)
    adv_i  <- adv_i + sign(delta_i) · min(|delta_i|, |adv_i| / kappa)   (i in W)

**Defaults**

- ``alpha = 0.4`` [CODE] the paper's scripts (the code's default is 0.2); ``beta = 0.2`` [CODE]
  (0.3 in the paper's DAPO runs); ``kappa = 2.0`` [CODE].
- Answers normalised as ``str(a).strip().lower()`` [CODE]; ``equiv = "exact"`` [CODE] the
  reference's fallback (string equality); ``"math"`` merges math-verify-equivalent answers (the
  reference uses mathruler's ``grade_answer``, not installed here) [CODE, grader substituted].
- ``answers = "completion"`` [INFERRED] the completion text is the final answer (true of the
  exact-match tasks); ``"info:COLUMN"`` reads ``rollout.info[b][g]["extra"][COLUMN]``, which a
  reward writes through ``log_extra`` (``exact``/``math`` with ``log_answer = true`` write
  ``final_answer``). The reference reads the answer from its reward manager's output.
- Correct = ``reward >= correct_threshold = 0.5`` on the total reward, or on ``reward_parts``
  column ``correct_part`` [INFERRED] (the reference reads an ``acc`` field of its reward).
- ``format_part = None`` [CODE] optional format flag: rows whose ``reward_parts[..., format_part]``
  is < 0.5 are left out of W (a NaN part counts as no flag, as the code's ``None``).

**Notes**

1. On an all-wrong group GRPO's advantages are 0, so S = 0 and nothing changes: EDAS creates no
   signal on all-fail groups (as in the reference).
2. kappa must be > 1: then |change| ≤ |adv_i|/kappa < |adv_i| and the sign is kept.
3. Classes are built over the group's distinct normalised strings in sorted order (each joins the
   first class whose first member ``equiv`` accepts), so row order never changes the result.
4. Rows with ``group_valid`` False or a NaN reward get exactly 0; valid rows outside W keep their
   advantage. A valid wrong row with no logged answer stays out of W; if no valid row of the batch
   has one, the configuration is wrong and the shaper says so.
5. The reference's linear warm-up of the shaping scale (``warmup_start``, ``warmup_steps``) is a
   schedule here: ``alpha = {schedule = "linear", ...}`` (any numeric parameter takes one).
6. ``step_stats`` logs ``edas/groups_b`` and ``edas/groups_c`` (share of groups with a valid row
   that took branch B / C), ``edas/unique_wrong`` (mean K over groups with a wrong row: the
   spec's behavioural measure), ``edas/unique_wrong_frac`` (mean K/N_w where N_w ≥ 2) and
   ``edas/clipped_frac`` (share of shaped rows the κ-clip bounded). With ``alpha = beta = 0`` the
   shaper is the identity and only logs: a GRPO baseline measured the same way.
7. Sequence advantages [B,G] only (the reference shapes scalars); put token-level shapers after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.masked import finite_or_zero, to_float32
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

EQUIVS = ("exact", "math")


def normalise(answer: Any) -> str:
    return str(answer).strip().lower()


def answer_classes(answers: list[Any], equiv_fn: Callable[[str, str], bool] | None = None) -> list[int]:
    """A class id per answer: equal normalised strings share one; ``equiv_fn`` merges distinct ones (Note 3)."""
    norm = [normalise(a) for a in answers]
    firsts: list[str] = []  # each class's first member
    cls: dict[str, int] = {}
    for u in sorted(set(norm)):
        cls[u] = next((k for k, rep in enumerate(firsts) if equiv_fn is not None and equiv_fn(rep, u)), len(firsts))
        if cls[u] == len(firsts):
            firsts.append(u)
    return [cls[a] for a in norm]


def edas_shape(
    adv: Tensor,
    wrong: Tensor,
    answers: list[list[Any]],
    alpha: float = 0.4,
    beta: float = 0.2,
    kappa: float = 2.0,
    equiv_fn: Callable[[str, str], bool] | None = None,
    valid: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """(adv [B,G] float64, stats): ``adv`` [B,G] shaped on the rows of ``wrong`` [B,G] (the set W:
    valid, wrong, format-ok, answered) from their ``answers`` [B][G] (see the module's Math);
    ``valid`` [B,G] only counts the groups the branch shares are over (default: all B)."""
    adv = adv.double()  # [B,G]
    B, G = adv.shape
    size = torch.zeros(B, G, dtype=torch.float64)  # [B,G] size of the row's answer class (0 outside W)
    K = torch.zeros(B, 1, dtype=torch.float64)  # [B,1] number of classes in W
    for b in wrong.any(1).nonzero().flatten().tolist():  # only the answer strings need Python
        rows = wrong[b].nonzero().flatten().tolist()
        ids = answer_classes([answers[b][g] for g in rows], equiv_fn)
        counts = [ids.count(k) for k in range(max(ids) + 1)]
        size[b, rows] = torch.tensor([float(counts[k]) for k in ids], dtype=torch.float64)
        K[b] = len(counts)
    n_w = wrong.sum(1, keepdim=True).double()  # [B,1]
    shaped = wrong & (n_w >= 2)  # [B,G] branch A (N_w <= 1) keeps its advantages
    S = torch.where(wrong, adv.abs(), 0.0).sum(1, keepdim=True) / n_w.clamp(min=1)  # [B,1] mean |A| over W
    surprisal = torch.where(wrong, -(size / n_w.clamp(min=1)).log(), 0.0)  # [B,G] I_i = −ln p_i
    H = surprisal.sum(1, keepdim=True) / n_w.clamp(min=1)  # [B,1] entropy = mean_W I_i
    C = (surprisal - H) / n_w.clamp(min=2).log()  # [B,G] in [−1, 1], zero-sum over W
    delta = torch.where(K == 1, -beta * S, alpha * S * C)  # [B,G] branch B | branch C
    cap = adv.abs() / kappa  # [B,G]
    # [B,G] sign kept for kappa > 1
    out = torch.where(shaped, adv + delta.sign() * torch.minimum(delta.abs(), cap), adv)
    groups = max(int(valid.any(1).sum()) if valid is not None else B, 1)
    some, many = wrong.any(1), n_w[:, 0] >= 2  # [B], [B]
    nan = float("nan")
    stats = {
        "edas/groups_b": float((many & (K[:, 0] == 1)).sum()) / groups,
        "edas/groups_c": float((many & (K[:, 0] > 1)).sum()) / groups,
        "edas/unique_wrong": float(K[some].mean()) if some.any() else nan,
        "edas/unique_wrong_frac": float((K[:, 0] / n_w[:, 0])[many].mean()) if many.any() else nan,
        "edas/clipped_frac": float((shaped & (delta.abs() > cap)).sum()) / max(int(shaped.sum()), 1),
    }
    return out, stats


@register("advantage", "edas")
@dataclass
class EDAS:
    """Shape wrong rollouts' advantages by the diversity of their final answers, κ-clipped (EDAS, arXiv 2605.17333)."""

    alpha: float = 0.4
    beta: float = 0.2
    kappa: float = 2.0
    answers: str = "completion"  # "completion" | "info:COLUMN" (a reward's log_extra column)
    equiv: str = "exact"  # "exact" | "math" (math-verify equivalence)
    correct_threshold: float = 0.5
    correct_part: int | None = None  # reward_parts column deciding correctness; None: the total reward
    format_part: int | None = None  # reward_parts column of a format flag (< 0.5 leaves the row out of W)
    math_timeout_s: float = 5.0
    _pool: Any = field(default=None, init=False, repr=False, compare=False)

    shaper = True  # reshapes an estimator's advantages (advantage.shapers), never estimates alone

    @property
    def reads_completions(self) -> bool:
        return self.answers == "completion"

    @property
    def row_info(self) -> tuple[str, ...]:
        """The info extra columns read per row (a reward's ``log_extra``)."""
        return () if self.answers == "completion" else (self.answers[5:],)

    def __post_init__(self) -> None:
        if not self.kappa > 1.0:
            raise ConfigError(
                f"edas: kappa={self.kappa} must be > 1 (the clip |delta| "
                "<= |A|/kappa keeps signs only then); the paper uses 2.0"
            )
        if self.alpha < 0 or self.beta < 0:
            raise ConfigError(f"edas: alpha={self.alpha} and beta={self.beta} must be >= 0 (0 turns a branch off)")
        if self.equiv not in EQUIVS:
            raise ConfigError(f"edas: equiv={self.equiv!r}; choose one of {EQUIVS}")
        if self.answers != "completion" and not (self.answers.startswith("info:") and self.answers[5:]):
            raise ConfigError(
                f"edas: answers={self.answers!r}; use 'completion' or 'info:COLUMN' (a reward's log_extra column, "
                f"e.g. 'info:final_answer' with rewards exact/math log_answer=true)"
            )
        self._stats: dict[str, float] = {}

    def _equiv_fn(self) -> Callable[[str, str], bool] | None:
        if self.equiv == "exact":
            return None
        if self._pool is None:
            from groupwise.rewards._math_pool import MathVerifierPool

            self._pool = MathVerifierPool(self.math_timeout_s, 1)
        return lambda a, b: self._pool.verify([(a, b)])[0] == 1.0

    def _part(self, rollout: Rollout, k: int, what: str) -> Tensor:
        parts = rollout.reward_parts
        if parts is None or not -parts.shape[-1] <= k < parts.shape[-1]:
            have = "none" if parts is None else parts.shape[-1]
            raise ConfigError(
                f"edas: {what}={k} but the rollout has {have} reward_parts "
                "columns (one per reward function, in config order)"
            )
        return parts[..., k].double()  # [B,G]

    def _answers(self, rollout: Rollout) -> list[list[Any]]:
        B, G, _ = rollout.shape
        if self.answers == "completion":
            if not rollout.completions:
                raise ValueError("edas answers='completion' needs rollout.completions (the decoded texts)")
            return rollout.completions
        column = self.answers[5:]
        info = rollout.info or [[None] * G for _ in range(B)]
        return [[((info[b][g] or {}).get("extra") or {}).get(column) for g in range(G)] for b in range(B)]

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        if rollout.advantages is None:
            raise ValueError(
                "edas is a shaper: configure an advantage estimator before it (rollout.advantages is None)"
            )
        B, G, _ = rollout.shape
        if tuple(rollout.advantages.shape) != (B, G):
            raise ValueError(
                f"edas shapes sequence advantages [B,G] = {(B, G)}, got {tuple(rollout.advantages.shape)}; "
                f"put token-level shapers after it"
            )
        valid = rollout.group_valid.bool() & torch.isfinite(rollout.rewards)  # [B,G]
        score = (
            rollout.rewards.double()
            if self.correct_part is None
            else self._part(rollout, self.correct_part, "correct_part")
        )  # [B,G]
        wrong = valid & ~(score >= self.correct_threshold)  # [B,G] a NaN part is not a correct verdict
        if self.format_part is not None:
            fmt = self._part(rollout, self.format_part, "format_part")  # [B,G]
            wrong = wrong & ~(fmt < 0.5)  # [B,G] NaN: no flag, kept
        answers = self._answers(rollout)
        # [B,G]
        answered = torch.tensor([[answers[b][g] is not None for g in range(G)] for b in range(B)], dtype=torch.bool)
        if valid.any() and not (answered & valid).any():
            raise ValueError(
                f"edas answers={self.answers!r}: no valid row has that info column; set log_answer=true on the "
                f"exact/math reward (it logs 'final_answer') or use answers='completion'"
            )
        adv = finite_or_zero(rollout.advantages.double())  # [B,G]
        out, self._stats = edas_shape(
            adv, wrong & answered, answers, self.alpha, self.beta, self.kappa, self._equiv_fn(), valid
        )  # [B,G]
        return to_float32(torch.where(valid, out, torch.zeros((), dtype=out.dtype)))  # [B,G]

    def step_stats(self) -> dict[str, float]:
        """The last batch's branch shares and answer diversity (whole batch: no reduction over ranks)."""
        return dict(self._stats)

    def __getstate__(self) -> dict[str, Any]:  # a copy starts its own math-verify worker
        return {**self.__dict__, "_pool": None}
