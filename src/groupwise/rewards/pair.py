"""PAIR: a dense per-turn reward from linear probes on the agent's own hidden states and attention.

"PAIR: Prefix-Aware Internal Reward" (dense turn-level reward from the agent's own internals),
2026, https://arxiv.org/abs/2605.17877 — spec 03; authors' code https://github.com/wonjoong-kim/PAIR
(``grpo/rewards/pair.py``, ``grpo/rewards/features.py``, ``probing/train_pair.py``), read through the
spec's transcription (formulas only; this is our own code).

**Change vs GRPO**: a rollout scorer. Each assistant turn of a multi-turn transcript (a run of the
policy's own tokens between environment holes) is scored by a two-stage linear probe, fitted once
offline on the frozen base (phase ``pair_probe``, artifact ``pair_probe``), as clean (1) vs
contaminated (0); the softened score with a logit-space momentum bonus is the turn's reward ``r_t``.
The row's reward is ``Σ_t r_t``; the per-turn rewards go to the segment extra ``pair_turn_reward``
([B,G,S], entry t = turn t) for the ``pair`` advantage (``advantages/pair.py``:
``A_t = (r_t − mean_t r) + group-normalised total``).

**Math** (turn t = completion tokens ``[s, e)``; ``P`` = the row's prompt length; the quantities
``hidden_at(l)`` / ``attn_at(l)`` sit at each token's own position, ``providers/forward.py``)::

    h_t      = hidden_at(hidden_layer)[e−1]                           # [D] the state at the turn's last token
    A_l      = attn_at(l)[s:e] as [heads, Q=e−s, K=P+n]  (the queries at the turn's tokens, keys of the row)
    stats_l  = [ mean_q max_k A, mean_q std_k A, mean_q Σ_{k<P+s} A / Σ_k A, mean_q Σ_{P+s≤k<P+e} A / Σ_k A ]
    a_t      = concat_l stats_l                                       # [4·heads·L]
    s_bc     = σ(w1ᵀ z1(h_t) + b1)                                    # stage 1 (z = standardised)
    s_final  = σ(w2ᵀ z2([a_t ; tclip(s_bc)]) + b2)                    # stage 2
    tclip(p) = clamp(σ(logit(p) / T), eps, 1 − eps);  s̃_t = tclip(s_final_t)
    r_0 = s̃_0;  r_t = σ(logit(s̃_t) + alpha · Δ_t),  Δ_t = s̃_t − mean(s̃_0..s̃_{t−1})  (max(0, Δ_t) with clip_negative)
    score    = Σ_t r_t                                                # [B,G]

**Defaults**

- ``alpha = 5.0``, ``temperature = 2.0``, ``eps = 0.05``, ``momentum = True``,
  ``clip_negative = False`` [CODE] (``PAIRMomentumReward``, paper Eq. 7).
- features: last layer, last token of the turn; attention statistics over every layer [CODE].
  ``hidden_layer = 4``, ``attn_layers = (1, 2, 3, 4)``: the embedded model's 4 layers, so
  ``hidden_at(4)`` is its ``hidden_states[-1]`` (after the final norm) as in the code [CODE]; set
  them to the model's (they must equal the phase's, checked when the artifact arrives).
- ``attn_layers = ()`` turns the attention head off [INFERRED option]: stage 2 then sees tclip(s_bc) only.
- ``weight = 1.0`` [INFERRED] the run's only weighted reward (``env_return`` logged at weight 0).

**Notes**

1. Turns are the segments of ``rollout.segment_id`` within ``rollout.row_mask`` (``episodes``
   numbers each action's tokens with its turn); a rollout without ``segment_id`` falls back to the
   maximal runs of ``row_mask`` (``episodes`` transcripts leave the environment's tokens as holes),
   so a row without holes is one turn.
2. Positions as the spec's: the state AT the turn's last token (its EOS for a finished turn) and
   the attention rows of the queries AT its tokens (``hidden(l)``, the state *predicting* each
   token, would show the probe only the state before an empty turn's EOS, never the action).
3. ``std_k`` is the population std over the row's key positions ``0..P+n−1`` (future keys count as
   0, as in the spec's full-dialog matrix) [INFERRED]; ``self_ratio = 1 − prefix_ratio`` under
   causal attention, kept for the spec's feature layout.
4. Invalid rows and rows without a turn score 0 and have no ``pair_turn_reward`` entries (NaN,
   as every segment extra past a row's segments). The probe runs in
   float64; scores are finite for any finite features (standardisation guards a zero scale).
5. No gradient: the needs are no-grad quantities of the policy's own forward (``model = "policy"``,
   the agent's current internals, as the authors' reward reads them).
6. The probe is a learned reward fitted once: a policy can move to turns it over-rates. On the
   reach toy it does (empty or garbage actions score near the clean first moves; docs/claims.md,
   03-pair); keeping the outcome in the reward (``env_return`` at weight 1) is an option, not the paper's.
7. Layout: this module is the reward (turn rewards, momentum, the scorer); the turn features are in
   ``rewards/_pair_features.py`` and the probe (``tclip``, ``fit_logistic``, ``PairProbe``) in
   ``rewards/_pair_probe.py``, all importable from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rewards._pair_features import attention_stats, pair_features, row_turn_features, turn_spans
from groupwise.rewards._pair_probe import PairProbe, fit_logistic, tclip
from groupwise.types import Need, Rollout, StepInfo

__all__ = [
    "TURN_REWARD",
    "PairProbe",
    "PairReward",
    "attention_stats",
    "fit_logistic",
    "momentum_rewards",
    "pair_features",
    "pair_turn_rewards",
    "row_turn_features",
    "tclip",
    "turn_spans",
]

TURN_REWARD = "pair_turn_reward"  # the segment extra [B,G,S]: r_t of turn t (NaN past a row's turns)


def momentum_rewards(s_tilde: Tensor, alpha: float = 5.0, clip_negative: bool = False) -> Tensor:
    """[n] r from softened turn scores s̃ [n]: r_0 = s̃_0, r_t = σ(logit(s̃_t) + α·(s̃_t − mean s̃_<t))."""
    s = s_tilde.double()  # [n]
    if s.numel() == 0:
        return s
    past = torch.cumsum(s, 0)[:-1] / torch.arange(1, s.numel(), dtype=torch.float64)  # [n−1] mean(s̃_0..s̃_{t−1})
    delta = s[1:] - past  # [n−1]
    if clip_negative:
        delta = delta.clamp(min=0.0)
    rest = torch.sigmoid(torch.logit(s[1:].clamp(1e-12, 1 - 1e-12)) + alpha * delta)  # [n−1]
    return torch.cat([s[:1], rest])  # [n]


def pair_turn_rewards(
    s_final, alpha: float = 5.0, T: float = 2.0, eps: float = 0.05, momentum: bool = True, clip_negative: bool = False
) -> Tensor:
    """[n] turn rewards from the probe's raw turn scores: tclip, then the momentum bonus (or s̃ itself)."""
    s_tilde = tclip(torch.as_tensor(s_final, dtype=torch.float64), T, eps)  # [n]
    return momentum_rewards(s_tilde, alpha, clip_negative) if momentum else s_tilde


@register("reward", "pair")
@dataclass
class PairReward:
    """Dense per-turn reward from the frozen base's two-stage probe on the policy's own hidden states and attention
    (PAIR)."""

    alpha: float = 5.0
    temperature: float = 2.0
    eps: float = 0.05
    momentum: bool = True
    clip_negative: bool = False
    hidden_layer: int = 4
    attn_layers: tuple = (1, 2, 3, 4)
    artifact: str = "pair_probe"
    weight: float = 1.0

    def __post_init__(self) -> None:
        self.attn_layers = tuple(int(l) for l in self.attn_layers)
        if self.temperature <= 0 or not 0.0 <= self.eps < 0.5 or self.alpha < 0 or not math.isfinite(self.alpha):
            raise ConfigError(
                f"reward pair: need temperature > 0 (got {self.temperature}), eps in [0, 0.5) (got {self.eps}), "
                f"a finite alpha >= 0 (got {self.alpha})"
            )
        if (
            self.hidden_layer < 0
            or any(l < 1 for l in self.attn_layers)
            or len(set(self.attn_layers)) != len(self.attn_layers)
        ):
            raise ConfigError(
                f"reward pair: hidden_layer must be >= 0 (got {self.hidden_layer}) and "
                f"attn_layers distinct layers >= 1 (got {list(self.attn_layers)}); use "
                "the model's, e.g. hidden_layer=4, attn_layers=[1, 2, 3, 4]"
            )
        self._probe: PairProbe | None = None
        self._stats: dict[str, float] = {}

    @property
    def needs(self) -> tuple[Need, ...]:
        return (Need(f"hidden_at({self.hidden_layer})"), *(Need(f"attn_at({l})") for l in self.attn_layers))

    @property
    def artifacts(self) -> tuple[str, ...]:
        return (self.artifact,)

    def use_artifact(self, name: str, value: dict) -> None:
        made = (int(value["hidden_layer"]), tuple(int(l) for l in value["attn_layers"]))
        if made != (self.hidden_layer, self.attn_layers):
            raise ConfigError(
                f"reward pair: the probe {name!r} was fitted on hidden_at({made[0]}) and "
                f"attn_at{list(made[1])}, but the reward reads hidden_at({self.hidden_layer}) and "
                f"attn_at{list(self.attn_layers)}; give both the same hidden_layer and attn_layers"
            )
        self._probe = PairProbe.from_state(value["probe"])
        self._probe.temperature, self._probe.eps = self.temperature, self.eps

    def score_rollout(self, rollout: Rollout, info: StepInfo) -> Tensor:
        if self._probe is None:
            raise ValueError(
                f"reward pair: no probe; add the offline phase pair_probe (artifact {self.artifact!r}) to `phases`"
            )
        B, G, T = rollout.shape
        hidden = rollout.extras[f"hidden_at({self.hidden_layer})"]  # [B,G,T,D]
        attns = [rollout.extras[f"attn_at({l})"] for l in self.attn_layers]  # each [B,G,T,heads,S]
        row_mask = rollout.row_mask.bool()  # [B,G,T]
        lengths = rollout.mask.sum(-1).tolist()  # [B][G]
        per_row: dict[tuple[int, int], list[float]] = {}  # (b, g) -> r_t of each turn
        total = torch.zeros(B, G, dtype=torch.float32)  # [B,G]
        finals, turns = [], 0
        for b in range(B):
            for g in range(G):
                if not bool(row_mask[b, g].any()):
                    continue
                P = len(rollout.ctx[b][g]) if rollout.ctx else len(rollout.prompt_ids[b])
                seg = rollout.segment_id[b, g] if rollout.segment_id is not None else None  # [T]
                spans, h, a = row_turn_features(
                    hidden[b, g], [x[b, g] for x in attns], row_mask[b, g], P, int(lengths[b][g]), seg
                )
                _, s_final = self._probe.score(h, a)  # [n]
                r = pair_turn_rewards(
                    s_final, self.alpha, self.temperature, self.eps, self.momentum, self.clip_negative
                )  # [n]
                per_row[(b, g)] = r.tolist()
                total[b, g] = float(r.sum())
                finals += s_final.tolist()
                turns += len(spans)
        turn_reward = torch.full((B, G, max((len(r) for r in per_row.values()), default=0)), float("nan"))  # [B,G,S]
        for (b, g), r in per_row.items():
            turn_reward[b, g, : len(r)] = torch.tensor(r, dtype=torch.float32)
        rollout.set_extra(TURN_REWARD, turn_reward, "segment")
        valid = int(rollout.group_valid.sum())
        self._stats = {"pair/s_final": sum(finals) / max(1, len(finals)), "pair/turns_per_row": turns / max(1, valid)}
        return total  # [B,G]

    def step_stats(self) -> dict[str, float]:
        return dict(self._stats)
