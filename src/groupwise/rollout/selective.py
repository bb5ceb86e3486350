"""Selective Rollout: stop a multi-turn group at env step K when its G partial action sequences barely
differ (predicted zero-variance), and drop it from the GRPO batch.

"Selective Rollout: Mid-Trajectory Termination for Multi-Sample Agent RL", Zhiyuan Zhai, Xin Wang,
2026. https://arxiv.org/abs/2605.05802 — spec 60. Paper source and code read:
https://github.com/zhiyuanZhai20/selective-rollout (``paper/paper.tex``, ``src/divergence.py``,
``src/rollout.py``, ``scripts/19_grpo_onpolicy.py``).

**Change vs GRPO**: trajectory-level GRPO (``episodes``: one row per episode) plays all G episodes
of every task to the end, although a group whose episodes all act alike usually ends with equal
returns: zero advantage, no gradient, and it still counts in the token-mean normaliser, diluting
the useful gradient. Here, after K env steps, the mean pairwise normalised edit distance ``d_K``
of the G action prefixes is measured; a group with ``d_K < d_low`` (or with a share ``>= t_high``
of its episodes already ended) is stopped at once and removed from the batch. The gate runs as the
group hook ``on_step`` of the Env runner (``rollout/env.py``); everything else is ``episodes``.

**Math** (``a_i`` = the action strings of episode i, each one symbol; ``K`` = ``K``)::

    prefix_i  = a_{i,1:K}, padded with "<END>" to length K
    ned(x, y) = Levenshtein(x, y) / max(|x|, |y|)                 (0 for two empty sequences)
    d_K       = mean over the C(G, 2) pairs i < j of ned(prefix_i, prefix_j)
    t_K       = share of episodes with |a_i| <= K − 1             (already ended before step K)
    cut       = d_K < d_low  or  (t_high is set and t_K >= t_high)
    evaluated once, after the K-th env step, for a group in which some episode played K actions

Spec 60's example: K = 3, ``[go a, take x, go b]`` twice and ``[go a, look]`` → the third pads to
``[go a, look, <END>]``; pair distances 0, 2/3, 2/3 → d_K = 0.444444 (not cut at d_low = 0.12);
three identical prefixes → d_K = 0 → cut; ``[a, b, c, d]`` vs ``[b, c, d, a]`` (K = 4) → 0.5.

**Defaults**

- ``K = 10``, ``d_low = 0.12`` [CODE] ``19_grpo_onpolicy.py`` ``--K 10``, ``--d-low 0.12`` (the
  paper's ALFWorld gate).
- ``t_high = 0.9`` [CODE] the on-policy script's termination rule; ``None`` = the edit distance alone.
- ``max_turns = 30`` [PAPER] T_max = 30 (the other fields are ``episodes``' defaults).
- ``strip = True`` [INFERRED] an action string is the decoded action with surrounding whitespace
  removed (``" 3"`` and ``"3"`` are one move); ``False`` compares the raw texts.

**Notes**

1. Where the code differs: the rollout (``src/rollout.py``) gates a group whose loop reached step K
   (some episode acted K times), the trainer's re-check (``build_train_items``) only when the
   *first* trajectory did; this strategy follows the rollout, the one that saves the compute.
2. A gated group is dropped even when all its episodes had already ended (a gate on ``t_K``).
   Ungated groups are played exactly as ``episodes`` plays them (the same seeds): the gate only
   removes groups, it never changes the kept ones.
3. Dilution (the paper's mechanism): with a token-mean loss, zero-advantage rows add tokens to the
   normaliser and nothing to the sum, so dropping them scales the gradient up by 1 / (the kept
   share of tokens) — 2x for half the tokens (``tests/test_selective_rollout.py``).
4. The gate cannot see groups whose episodes all fail along divergent paths (a limitation the paper
   states); such groups are kept and give zero advantage as usual.
5. ``step_stats``: ``episodes``' (``episodes/env_steps``: actions played, the generation cost;
   ``episodes/gated_frac``: share of groups cut), plus ``selective/d_k`` (mean d_K of the groups
   evaluated, NaN if none) and ``selective/evaluated_frac`` (share of groups that reached step K).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rollout.env import Episode
from groupwise.rollout.episodes import Episodes
from groupwise.types import Rollout

END = "<END>"


def normalized_edit_distance(a: Sequence[str], b: Sequence[str]) -> float:
    """Levenshtein distance between two sequences of symbols (insert, delete, substitute: 1 each), over max length."""
    if not a and not b:
        return 0.0
    row = list(range(len(b) + 1))  # distances from a[:0] to every prefix of b
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1] / max(len(a), len(b))


def _prefix(actions: Sequence[str], K: int, end: str) -> list[str]:
    return list(actions[:K]) + [end] * max(0, K - len(actions))


def prefix_edit_distance_mean(actions: list[list[str]], K: int, end: str = END) -> float:
    """d_K: the mean normalised edit distance over all pairs of the K-step action prefixes (padded with ``end``)."""
    if len(actions) < 2 or K < 1:
        raise ValueError(
            f"prefix_edit_distance_mean needs at least 2 action sequences and K >= 1, got {len(actions)} and K={K}"
        )
    prefixes = [_prefix(a, K, end) for a in actions]
    pairs = list(combinations(range(len(prefixes)), 2))
    return sum(normalized_edit_distance(prefixes[i], prefixes[j]) for i, j in pairs) / len(pairs)


def termination_fraction(actions: list[list[str]], K: int) -> float:
    """t_K: the share of sequences that ended before step K (at most K − 1 actions)."""
    return sum(len(a) <= K - 1 for a in actions) / max(1, len(actions))


def selective_gate(actions: list[list[str]], K: int, d_low: float, t_high: float | None = None) -> bool:
    """Cut the group: d_K < d_low, or t_K >= t_high when ``t_high`` is set."""
    return prefix_edit_distance_mean(actions, K) < d_low or (
        t_high is not None and termination_fraction(actions, K) >= t_high
    )


@register("rollout", "selective_rollout")
@dataclass
class SelectiveRollout(Episodes):
    """Trajectory-level GRPO whose groups are stopped at env step K and dropped when their action prefixes barely differ
    (Selective Rollout)."""

    max_turns: int = 30
    K: int = 10
    d_low: float = 0.12
    t_high: float | None = 0.9
    strip: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.K <= self.max_turns:
            raise ConfigError(f"rollout selective_rollout: need 1 <= K <= max_turns={self.max_turns}, got K={self.K}")
        if not 0 <= self.d_low <= 1 or (self.t_high is not None and not 0 < self.t_high <= 1):
            raise ConfigError(
                f"rollout selective_rollout: d_low={self.d_low} must be "
                f"in [0, 1] and t_high={self.t_high} in (0, 1] (or None)"
            )
        self._d: list[float] = []

    def on_step(self, group: list[Episode], k: int) -> str:
        if k != self.K:
            return "continue"
        actions = [[a.strip() if self.strip else a for a in ep.texts] for ep in group]
        self._d.append(prefix_edit_distance_mean(actions, self.K))
        return "cut" if selective_gate(actions, self.K, self.d_low, self.t_high) else "continue"

    def __call__(self, ctx) -> Rollout:
        if ctx.group_size < 2:
            raise ConfigError(
                "rollout selective_rollout: the gate compares episodes, "
                f"so rollout.group_size must be >= 2, got {ctx.group_size}"
            )
        self._d = []
        batch = super().__call__(ctx)
        self._stats["selective/d_k"] = sum(self._d) / len(self._d) if self._d else float("nan")
        self._stats["selective/evaluated_frac"] = len(self._d) / max(1, ctx.batch_size)
        return batch
