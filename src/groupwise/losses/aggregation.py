"""Loss aggregations: token mean (DAPO), sequence mean of token means (GRPO), constant (Dr.GRPO),
sequence mean of token sums (verl), group mean (per-prompt mean of the group-level losses).

- GRPO: Shao et al. 2024, "DeepSeekMath", https://arxiv.org/abs/2402.03300 — 1/G Σ_i 1/|o_i| Σ_t.
- DAPO: Qiying Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
  Scale", https://arxiv.org/abs/2503.14476 — token-level policy-gradient loss, 1/Σ_i|o_i| Σ_i Σ_t.
- Dr.GRPO: Zichen Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
  Perspective", https://arxiv.org/abs/2503.20783 — a constant normaliser instead of 1/|o_i|.
- verl (Sheng et al. 2024, "HybridFlow", https://arxiv.org/abs/2409.19256), code
  ``verl/trainer/ppo/core_algos.py`` ``agg_loss`` — ``loss_agg_mode = "seq-mean-token-sum"``; TRL 1.16
  ``loss_type="luspo"`` (``GRPOTrainer._compute_loss``) aggregates the same way.
- group mean: the per-prompt mean of a group-level objective, e.g. LPO's divergence per prompt
  (specs/57, Qu et al. 2026, https://arxiv.org/abs/2605.06139) and ConSPO's InfoNCE per group
  (specs/25, https://arxiv.org/abs/2605.12969).

**Change vs GRPO**: ``seq_mean_token_mean`` is GRPO's; ``token_mean`` and ``constant`` remove its
length bias (per-sequence 1/|o_i| favours short correct and long wrong answers);
``seq_mean_token_sum`` drops the 1/|o_i| altogether, so a row's loss grows with its length;
``group_mean`` weighs every prompt alike, whatever the number of its rows.

**Math** (``mask`` = loss tokens of the *whole step batch*; ``v`` = term values of a micro-batch)::

    token_mean:           Σ_{rows,t} v·mask / Σ_{rows,t} mask
    seq_mean_token_mean:  Σ_rows (Σ_t v·mask / Σ_t mask) / #rows with ≥ 1 loss token
    constant:             Σ_{rows,t} v·mask / (#rows with ≥ 1 loss token · max_len)
    seq_mean_token_sum:   Σ_rows (Σ_t v·mask) / #rows with ≥ 1 loss token
    group_mean:           Σ_groups mean_{rows with ≥ 1 loss token} (Σ_t v·mask / Σ_t mask) / #groups with one

**Defaults**

- ``constant.max_len = None`` → ``info.max_new_tokens`` [PAPER] Dr.GRPO divides by the generation
  budget; [CODE] TRL ``loss_type="dr_grpo"`` uses ``max_completion_length``.
- ``seq_mean_token_sum``: no parameters [CODE] verl ``agg_loss``.
- ``group_mean``: no parameters [INFERRED] the specs' "per-prompt mean" (LPO's interface).

**Notes**

1. Contract: ``normalizer`` runs once per optimiser step on the whole step batch and returns only
   *sums* over rows/tokens (int64 counts), so the trainer can all-reduce them with SUM; ``reduce``
   on each micro-batch returns its share, and the shares add up to the whole-batch loss exactly.
2. Row-level values ``v`` [b,G] (row mask = ``mask.any(-1)``) count once per loss token of their
   row: a row term and the same value broadcast to its tokens aggregate identically everywhere.
3. Rows are counted when they have at least one loss token, i.e. valid rows whose tokens were not
   all removed by token weights. (TRL's ``dr_grpo`` divides by every row of the batch, including
   rows removed by overlong filtering; the normaliser only sees the loss mask, so a row whose
   every token has weight 0 cannot be told apart from a padding row of a ragged group.)
4. Empty normalisers are clamped to 1: an all-masked batch gives loss 0, never NaN.
5. verl's four ``loss_agg_mode`` values map to: ``token-mean`` → ``token_mean``,
   ``seq-mean-token-mean`` → ``seq_mean_token_mean``, ``seq-mean-token-sum`` →
   ``seq_mean_token_sum``, ``seq-mean-token-sum-norm`` (Σ / (rows · ``loss_scale_factor``, default the
   padded response length)) → ``constant`` with ``max_len`` = that length. verl has no ``token-sum``
   mode, so none is registered here.
6. ``seq_mean_token_sum`` counts rows as verl does (``seq_mask = Σ_t mask > 0``); TRL's ``luspo``
   divides by every row of its batch, including rows without loss tokens (see note 3).
7. ``group_mean`` is for group-level terms that give each row its group's loss (a value broadcast
   over the group): the group's row mean is then that loss, and the batch loss the mean over prompts.
   A group counts when one of its rows has a loss token; micro-batches hold whole groups, so the
   shares add up exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from groupwise.masked import masked_mean, masked_sum
from groupwise.registry import register
from groupwise.types import StepInfo


def _token_sum(values: Tensor, mask: Tensor) -> Tensor:
    """Σ over loss tokens; a row value [b,G] counts once per loss token of its row."""
    if values.dim() == 2:
        n_tok = mask.sum(-1).to(values.dtype)  # [b,G]
        return masked_sum(values * n_tok, mask.any(-1))  # []
    return masked_sum(values, mask)  # []


def _row_means(values: Tensor, mask: Tensor) -> Tensor:
    """[b,G] token mean of each row (a row value is its own mean)."""
    if values.dim() == 2:
        return values  # [b,G]
    return masked_mean(values, mask, dim=-1)  # [b,G]


def _den(norm: Tensor, like: Tensor) -> Tensor:
    return norm.to(like.dtype).clamp(min=1)  # []


@register("aggregation", "token_mean")
@dataclass
class TokenMean:
    """Mean over every loss token of the step batch (DAPO token-level loss, Yu et al. 2025)."""

    def normalizer(self, mask: Tensor, info: StepInfo) -> dict[str, Tensor]:
        return {"tokens": mask.sum()}  # [] int64

    def reduce(self, values: Tensor, mask: Tensor, norm: dict[str, Tensor]) -> Tensor:
        return _token_sum(values, mask) / _den(norm["tokens"], values)  # []


@register("aggregation", "seq_mean_token_mean")
@dataclass
class SeqMeanTokenMean:
    """Mean over rows of each row's token mean (GRPO, Shao et al. 2024)."""

    def normalizer(self, mask: Tensor, info: StepInfo) -> dict[str, Tensor]:
        return {"rows": mask.any(-1).sum()}  # [] int64

    def reduce(self, values: Tensor, mask: Tensor, norm: dict[str, Tensor]) -> Tensor:
        row_mean = _row_means(values, mask)  # [b,G]
        return masked_sum(row_mean, mask.any(-1)) / _den(norm["rows"], values)  # []


@register("aggregation", "constant")
@dataclass
class Constant:
    """Token sum over rows × generation budget, no length normalisation (Dr.GRPO, Liu et al. 2025)."""

    max_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_len is not None and self.max_len < 1:
            raise ValueError(f"constant: max_len must be a positive int, got {self.max_len}")

    def normalizer(self, mask: Tensor, info: StepInfo) -> dict[str, Tensor]:
        max_len = self.max_len if self.max_len is not None else int(info.max_new_tokens)
        if max_len < 1:
            raise ValueError(f"constant aggregation needs max_len >= 1 (info.max_new_tokens={info.max_new_tokens})")
        return {"slots": mask.any(-1).sum() * max_len}  # [] int64, Σ_rows max_len

    def reduce(self, values: Tensor, mask: Tensor, norm: dict[str, Tensor]) -> Tensor:
        return _token_sum(values, mask) / _den(norm["slots"], values)  # []


@register("aggregation", "group_mean")
@dataclass
class GroupMean:
    """Mean over groups of the mean over their rows of each row's token mean (per-prompt mean)."""

    def normalizer(self, mask: Tensor, info: StepInfo) -> dict[str, Tensor]:
        return {"groups": mask.any(-1).any(-1).sum()}  # [] int64

    def reduce(self, values: Tensor, mask: Tensor, norm: dict[str, Tensor]) -> Tensor:
        group = masked_mean(_row_means(values, mask), mask.any(-1), dim=-1)  # [b]
        return group.sum() / _den(norm["groups"], values)  # []


@register("aggregation", "seq_mean_token_sum")
@dataclass
class SeqMeanTokenSum:
    """Mean over rows of each row's token sum (verl ``loss_agg_mode="seq-mean-token-sum"``)."""

    def normalizer(self, mask: Tensor, info: StepInfo) -> dict[str, Tensor]:
        return {"rows": mask.any(-1).sum()}  # [] int64

    def reduce(self, values: Tensor, mask: Tensor, norm: dict[str, Tensor]) -> Tensor:
        return _token_sum(values, mask) / _den(norm["rows"], values)  # []
