"""F-GRPO: separate group-relative advantages for the generation and the ranking phase of one completion.

"F-GRPO: Factorized Group-Relative Policy Optimization" (generate-then-rank), Surana, Mundada, Wu,
Li, Jiao, Jin, Zhou, Yu, Sinha, Han, Shang, McAuley, 2026. https://arxiv.org/abs/2605.12995
(spec: specs/24; abstract + a third-party brief only, no code). Rewards: ``rewards/ranking.py``;
the two-phase sequence-level loss: ``losses/f_grpo.py``.

**Change vs GRPO**

- Two reward channels instead of one total: the coverage reward of the generated candidate set
  and the utility of its ranking, each normalised over the group on its own.
- The advantage is per token [B,G,T]: generation-phase tokens get A_gen, ranking-phase tokens
  A_rank, so a rollout that found every relevant item but ranked it badly is credited for the set
  and blamed for the order.

**Math** (``R_gen = reward_parts[..., gen_part]``, ``R_rank = reward_parts[..., rank_part]``)::

    A_gen  = (R_gen  − mean_g R_gen)  / (std_g R_gen  + eps)
    A_rank = (R_rank − mean_g R_rank) / (std_g R_rank + eps)
    m_gen[t]  = token t starts before the end of the candidate segment's close tag (all tokens if none)
    m_rank[t] = the other completion tokens (the ranking and EOS)
    adv[t]    = A_gen · m_gen[t] + rank_coef · A_rank · m_rank[t]                 # [B,G,T]

**Defaults**

- ``gen_part = 0``, ``rank_part = 1`` [INFERRED] the order of ``rewards = ["recall_at_k", "ndcg_at_k"]``.
- ``std = "unbiased"``, ``eps = 1e-4`` [INFERRED] as ``grpo`` (TRL); the spec's hand numbers use
  ``"population"``. ``rank_coef = 1.0`` [INFERRED] the spec's λ_rank = 1.
- ``cand_tags = ["[", "]"]`` [INFERRED] the toy's format (``rewards/ranking.py``); phases split
  at the end of the close tag [INFERRED] (tags belong to the generation phase).

**Notes**

1. A rollout with a single reward column (or none) uses it for both phases: F-GRPO is then GRPO
   with the advantage broadcast to tokens. With several columns both indices must exist.
2. Token texts come from the policy's vocabulary (``use_vocabulary``, given at build to every
   component that defines it); a token belongs to the phase where its first character lies.
3. Invalid rows (``group_valid`` False, a non-finite total reward), masked tokens and rows whose
   phase reward is NaN get exactly 0; a phase's constant group gets 0 (``group_normalize``).
4. ``step_stats``: ``f_grpo/gen_share`` (share of loss tokens in the generation phase) and
   ``f_grpo/disagree`` (share of valid rows where sign(A_gen) ≠ sign(A_rank), both non-zero).
5. ``phase_ids`` is the shared phase map (built on ``textspans.label_tokens``);
   the loss ``f_grpo`` computes the same map in ``prepare``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.masked import group_normalize, to_float32, valid_rows
from groupwise.registry import register
from groupwise.rewards.ranking import phase_boundary
from groupwise.textspans import check_tags, label_tokens
from groupwise.types import Rollout, StepInfo

_DDOF = {"unbiased": 1, "population": 0}


def phase_ids(actions: Tensor, mask: Tensor, token_text: Sequence[str], cand_tags: Sequence[str]) -> Tensor:
    """actions, mask [N,T] -> [N,T] long: 0 generation phase, 1 ranking phase, −1 outside the mask."""

    def label(text: str, starts: list[int]) -> list[int]:
        cut = phase_boundary(text, cand_tags)
        return [0 if cut is None or start < cut else 1 for start in starts]

    return label_tokens(actions, mask, token_text, label)  # [N,T]


def fgrpo_token_adv(A_gen: Tensor, A_rank: Tensor, m_gen: Tensor, m_rank: Tensor) -> Tensor:
    """The spec's interface: A_gen, A_rank [N]; m_gen, m_rank [N,T] -> [N,T] A_gen·m_gen + A_rank·m_rank."""
    return A_gen[:, None] * m_gen.float() + A_rank[:, None] * m_rank.float()  # [N,T]


@register("advantage", "f_grpo")
@dataclass
class FGRPO:
    """Group-normalise the coverage and ranking rewards separately; credit each to its own phase's tokens (F-GRPO,
    Surana et al. 2026)."""

    gen_part: int = 0
    rank_part: int = 1
    rank_coef: float = 1.0
    std: str = "unbiased"  # "unbiased" | "population"
    eps: float = 1e-4
    cand_tags: list = field(default_factory=lambda: ["[", "]"])
    _token_text: Any = field(default=None, init=False, repr=False)
    _stats: dict = field(default_factory=dict, init=False, repr=False)

    group_relative = True

    def __post_init__(self) -> None:
        if self.std not in _DDOF:
            raise ConfigError(f"advantage f_grpo: std must be one of {tuple(_DDOF)}, got {self.std!r}")
        if self.eps < 0 or self.gen_part < 0 or self.rank_part < 0:
            raise ConfigError(
                f"advantage f_grpo: eps={self.eps}, gen_part={self.gen_part}, rank_part={self.rank_part} must be >= 0"
            )
        check_tags(self.cand_tags, "advantage f_grpo: cand_tags", need_open=True)

    def use_vocabulary(self, token_text: list[str]) -> None:
        self._token_text = list(token_text)

    def _phase_rewards(self, rollout: Rollout) -> tuple[Tensor, Tensor]:
        """(R_gen [B,G], R_rank [B,G]) float64 from ``reward_parts`` (Note 1)."""
        parts = rollout.reward_parts
        if parts is None or parts.shape[-1] < 2:
            r = rollout.rewards.double() if parts is None else parts[..., 0].double()  # [B,G]
            return r, r
        K = parts.shape[-1]
        if max(self.gen_part, self.rank_part) >= K:
            raise ConfigError(
                f"advantage f_grpo: gen_part={self.gen_part}, "
                f"rank_part={self.rank_part} but the rollout has {K} reward columns "
                f'(one per entry of `rewards`, in order); e.g. rewards = ["recall_at_k", "ndcg_at_k"]'
            )
        return parts[..., self.gen_part].double(), parts[..., self.rank_part].double()  # [B,G], [B,G]

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        if self._token_text is None:
            raise ValueError(
                "advantage f_grpo has no vocabulary: it needs a text policy (the trainer calls use_vocabulary at build)"
            )
        B, G, T = rollout.shape
        _, valid = valid_rows(rollout)  # [B,G]
        r_gen, r_rank = self._phase_rewards(rollout)  # [B,G], [B,G]
        ok_gen, ok_rank = valid & torch.isfinite(r_gen), valid & torch.isfinite(r_rank)  # [B,G]
        # [B,G] 0 outside ok_gen
        A_gen = group_normalize(torch.nan_to_num(r_gen), ok_gen, "group", _DDOF[self.std], self.eps)
        A_rank = group_normalize(torch.nan_to_num(r_rank), ok_rank, "group", _DDOF[self.std], self.eps)  # [B,G]
        mask = rollout.row_mask & valid[..., None]  # [B,G,T]
        phase = phase_ids(
            rollout.actions.reshape(B * G, T), mask.reshape(B * G, T), self._token_text, self.cand_tags
        ).reshape(B, G, T)  # [B,G,T]
        adv = torch.where(phase == 0, A_gen[..., None], self.rank_coef * A_rank[..., None])  # [B,G,T] float64
        adv = to_float32(torch.where(mask, adv, torch.zeros((), dtype=adv.dtype)))  # [B,G,T]
        n_tok, both = int(mask.sum()), valid & (A_gen != 0) & (A_rank != 0)  # [], [B,G]
        self._stats = {
            "f_grpo/gen_share": float((phase == 0).sum()) / n_tok if n_tok else 0.0,
            "f_grpo/disagree": float((both & (A_gen.sign() != A_rank.sign())).sum()) / max(1, int(valid.sum())),
        }
        return adv  # [B,G,T]

    def step_stats(self) -> dict[str, float]:
        return dict(self._stats)
