"""SS-GRPO (registered as ``rubricem``): stage-structured group-relative advantages —
each stage's tokens get their own stage's advantage.

"RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards", arXiv
2605.10899, 2026 (spec 39; known from a summary, no code: every form is [INFERRED] from the spec).
Stage scores: one reward per stage (``rewards/stage_rubric.py``, a rubric judge); stage map:
``textspans.segment_ids``; the reflection bank: ``groupwise/rubric_bank.py``.

**Change vs GRPO**

- GRPO broadcasts one terminal advantage to every token of a completion. SS-GRPO normalises each
  stage's score within the group on its own, and the tokens inside stage k's tags get stage k's
  advantage: a trajectory with a poor plan but a right answer gets negative credit on its plan
  tokens and positive credit on its answer tokens, which one terminal reward cannot express.
- Returns a per-token advantage [B,G,T]; the loss is the usual surrogate (``ppo_clip``, ``gspo``).

**Math** (``s`` [B,G,K]: column ``stage_parts[k]`` of ``rollout.reward_parts`` for stage k; rows
without a verdict from stage k's judge do not enter its statistics; std population, ``std``)::

    A_{i,k}  = (s_{i,k} − mean_j s_{j,k}) / (std_j s_{j,k} + eps)          per group, per stage
    A_{i,k} ← (1 − λ)·A_{i,k} + λ·A_{i,f}          λ = mix_final, f = final (the Answer stage)
    adv_tok[i,t] = A_{i,k}     t inside stage k's tags (stage_tags[k]; first pair wins on overlap)
    adv_tok[i,t] = A_{i,f}     t outside every stage (tags, EOS, text between), outside = "final"

**Defaults**

- ``stage_tags = [["<p>","</p>"], ["<r>","</r>"], ["<a>","</a>"]]`` [INFERRED] the ``evidence``
  task's stages (plan / compute / answer), the spec's Plan → … → Answer with K = 3.
- ``stage_parts = []`` [INFERRED] empty = columns 0..K−1 of ``reward_parts`` (the first K rewards
  listed, in the order of ``stage_tags``).
- ``mix_final = 0.0`` [PAPER-SUMMARY] the spec's option λ (0 = pure stage credit, 1 = terminal GRPO
  on the final stage's score).
- ``final = -1`` [INFERRED] the final score is the last stage's (the spec's "Answer-stage score").
- ``outside = "final"`` [INFERRED] tokens in no stage get A_{i,f}; ``"zero"`` gives them 0;
  ``"mean"`` the mean of the row's K stage advantages.
- ``std = "population"``, ``eps = 1e-6`` [INFERRED] the spec's unit test (pop std, 1.2247).

**Notes**

1. Invalid rows (``group_valid`` False, a NaN total) get exactly 0 on every token; a stage whose
   scores are all equal in a group (or that has one verdict) gives that stage 0 (``group_normalize``).
2. A NaN stage score (no verdict) keeps that row out of stage k's statistics and gives it
   A_{i,k} = 0 (before the mix).
3. A rollout without ``reward_parts``, or with one reward and ``stage_parts = []``, scores every
   stage with the total reward, so SS-GRPO is then GRPO (population std) on every token. An
   explicit ``stage_parts`` naming a column the run lacks, or fewer rewards than stages, is an error.
4. Tokens off ``row_mask`` (padding, env tokens) get exactly 0. Stage maps read token texts
   (``use_vocabulary``); the map is over the sequence ``mask`` (a prefix).
5. Runs once per step on the whole batch (DESIGN §2). ``step_stats()``: ``rubricem/stage_frac``
   (loss tokens inside a stage), ``rubricem/disagree`` (valid rows whose stage advantages do not all
   share the final stage's sign, among rows with a non-zero final advantage).
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
from groupwise.textspans import check_tags, segment_ids
from groupwise.types import Rollout, StepInfo

_DDOF = {"unbiased": 1, "population": 0}
OUTSIDE = ("final", "zero", "mean")


def stage_masks(
    actions: Tensor, mask: Tensor, token_text: Sequence[str], stage_tags: Sequence[Sequence[str]]
) -> Tensor:
    """The spec's interface: actions, mask [N,T] -> [N,K,T] bool, token t of row n inside stage k's tags."""
    seg = segment_ids(actions, mask, token_text, stage_tags)  # [N,T] k+1 inside stage k, 0 other, -1 off the mask
    K = len(stage_tags)
    return seg[:, None, :] == torch.arange(1, K + 1)[None, :, None]  # [N,K,T]


def ss_grpo_advantages(
    scores: Tensor, valid: Tensor, mix_final: float = 0.0, final: int = -1, ddof: int = 0, eps: float = 1e-6
) -> Tensor:
    """The spec's interface: stage scores [B,G,K] (valid [B,G,K] bool: rows with a verdict) ->
    A [B,G,K] float64 (Math)."""
    K = scores.shape[-1]
    adv = torch.stack(
        [
            group_normalize(torch.nan_to_num(scores[..., k].double()), valid[..., k], "group", ddof, eps)
            for k in range(K)
        ],
        dim=-1,
    )  # [B,G,K]
    adv = torch.where(valid, adv, torch.zeros((), dtype=adv.dtype))  # [B,G,K]
    if mix_final:
        adv = (1.0 - mix_final) * adv + mix_final * adv[..., final : final + 1 or None]  # [B,G,K]
    return adv


def stage_to_token_adv(adv: Tensor, masks: Tensor, outside: Tensor | None = None) -> Tensor:
    """The spec's interface: adv [N,K], masks [N,K,T] -> [N,T]: A_{n,k} on stage k's tokens,
    ``outside`` [N] (or 0) elsewhere."""
    inside = masks.any(1)  # [N,T]
    first = masks.double().argmax(1)  # [N,T] the stage of each token (stages do not overlap)
    tok = adv.gather(1, first)  # [N,T]
    rest = torch.zeros_like(tok) if outside is None else outside[:, None].to(tok.dtype).expand_as(tok)  # [N,T]
    return torch.where(inside, tok, rest)  # [N,T]


@register("advantage", "rubricem")
@dataclass
class RubricEMAdvantage:
    """Stage-structured GRPO: each stage's score normalised in its group, each stage's tokens get its advantage
    (RubricEM, spec 39)."""

    group_relative = True

    stage_tags: list = field(default_factory=lambda: [["<p>", "</p>"], ["<r>", "</r>"], ["<a>", "</a>"]])
    stage_parts: list = field(default_factory=list)
    mix_final: float = 0.0
    final: int = -1
    outside: str = "final"
    std: str = "population"
    eps: float = 1e-6
    _token_text: Any = field(default=None, init=False, repr=False)
    _stats: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stage_tags, str) or not self.stage_tags:
            raise ConfigError(
                "advantage rubricem: stage_tags must be a non-empty "
                f"list of [open, close] pairs, got {self.stage_tags!r}"
            )
        for k, tags in enumerate(self.stage_tags):
            check_tags(tags, f"advantage rubricem: stage_tags[{k}]", need_open=True)
        K = len(self.stage_tags)
        if self.stage_parts and (
            len(self.stage_parts) != K or not all(isinstance(c, int) and c >= 0 for c in self.stage_parts)
        ):
            raise ConfigError(
                f"advantage rubricem: stage_parts={self.stage_parts!r} must list one "
                f"reward column index (>= 0) per stage ({K}), or be [] for 0..{K - 1}"
            )
        if not 0.0 <= self.mix_final <= 1.0:
            raise ConfigError(f"advantage rubricem: mix_final={self.mix_final} must be in [0, 1]")
        if not -K <= self.final < K:
            raise ConfigError(
                f"advantage rubricem: final={self.final} must index one of the {K} stages (-{K}..{K - 1})"
            )
        if self.outside not in OUTSIDE:
            raise ConfigError(f"advantage rubricem: outside must be one of {OUTSIDE}, got {self.outside!r}")
        if self.std not in _DDOF:
            raise ConfigError(f"advantage rubricem: std must be one of {tuple(_DDOF)}, got {self.std!r}")
        if not self.eps >= 0:
            raise ConfigError(f"advantage rubricem: eps must be >= 0, got {self.eps}")

    def use_vocabulary(self, token_text: list[str]) -> None:
        self._token_text = list(token_text)

    def _stage_scores(self, rollout: Rollout) -> tuple[Tensor, Tensor]:
        """(scores [B,G,K] float64, valid [B,G,K] bool) from ``reward_parts`` (Note 3 without it)."""
        r, valid = valid_rows(rollout)  # [B,G], [B,G]
        K = len(self.stage_tags)
        # one reward (Note 3)
        if rollout.reward_parts is None or (rollout.reward_parts.shape[-1] == 1 and not self.stage_parts):
            scores = r.double()[..., None].expand(*r.shape, K)  # [B,G,K]
        else:
            cols = list(self.stage_parts) or list(range(K))
            have = rollout.reward_parts.shape[-1]
            if max(cols) >= have:
                raise ValueError(
                    f"advantage rubricem: stage_parts {cols} need reward column {max(cols)}, but the run has "
                    f"{have} rewards; list one reward per stage (reward stage_rubric) in the order of stage_tags"
                )
            scores = rollout.reward_parts[..., cols].double()  # [B,G,K]
        return scores, valid[..., None] & torch.isfinite(scores)  # [B,G,K]

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        if self._token_text is None:
            raise ValueError(
                "advantage rubricem has no vocabulary: it needs a text "
                "policy (the trainer calls use_vocabulary at build)"
            )
        B, G, T = rollout.shape
        K = len(self.stage_tags)
        scores, valid = self._stage_scores(rollout)  # [B,G,K]
        adv = ss_grpo_advantages(scores, valid, self.mix_final, self.final, _DDOF[self.std], self.eps)  # [B,G,K]
        masks = stage_masks(
            rollout.actions.reshape(B * G, T), rollout.mask.reshape(B * G, T), self._token_text, self.stage_tags
        )  # [N,K,T]
        flat = adv.reshape(B * G, K)  # [N,K]
        # [N]
        rest = None if self.outside == "zero" else (flat[:, self.final] if self.outside == "final" else flat.mean(-1))
        tok = stage_to_token_adv(flat, masks, rest).reshape(B, G, T)  # [B,G,T]
        row_mask = rollout.row_mask.bool() & valid_rows(rollout)[1][..., None]  # [B,G,T]
        out = torch.where(row_mask, tok, torch.zeros((), dtype=tok.dtype))  # [B,G,T]
        inside = masks.any(1).reshape(B, G, T) & row_mask  # [B,G,T]
        fin = adv[..., self.final]  # [B,G]
        rows = valid_rows(rollout)[1] & (fin != 0)  # [B,G]
        differ = ((adv * fin[..., None]) < 0).any(-1) & rows  # [B,G] a stage credited against the final sign
        self._stats = {
            "rubricem/stage_frac": float(inside.sum()) / max(int(row_mask.sum()), 1),
            "rubricem/disagree": float(differ.sum()) / max(int(rows.sum()), 1),
        }
        return to_float32(out)  # [B,G,T]

    def step_stats(self) -> dict[str, float]:
        """The last batch's share of loss tokens inside a stage and of rows with stage credit against the final sign."""
        return dict(self._stats)
