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
([B,G,S], entry t = turn t) for the ``pair`` advantage (``advantages/pair.py``: ``A_t = (r_t − mean_t r) + group-normalised total``).

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from groupwise.registry import ConfigError, register
from groupwise.types import Need, Rollout, StepInfo

TURN_REWARD = "pair_turn_reward"  # the segment extra [B,G,S]: r_t of turn t (NaN past a row's turns)


def tclip(p: Tensor, temperature: float = 2.0, eps: float = 0.05) -> Tensor:
    """clamp(σ(logit(p)/T), eps, 1−eps), elementwise (p clamped into (0, 1) before the logit)."""
    p = p.double().clamp(1e-12, 1 - 1e-12)
    return torch.sigmoid(torch.logit(p) / temperature).clamp(eps, 1 - eps)


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


def pair_turn_rewards(s_final, alpha: float = 5.0, T: float = 2.0, eps: float = 0.05, momentum: bool = True,
                      clip_negative: bool = False) -> Tensor:
    """[n] turn rewards from the probe's raw turn scores: tclip, then the momentum bonus (or s̃ itself)."""
    s_tilde = tclip(torch.as_tensor(s_final, dtype=torch.float64), T, eps)  # [n]
    return momentum_rewards(s_tilde, alpha, clip_negative) if momentum else s_tilde


def attention_stats(A: Tensor, s: int, e: int) -> Tensor:
    """[4·heads] (max, std, prefix ratio, self ratio per head) of attention rows ``A`` [heads,Q,K]
    over keys 0..K−1, the turn's keys being ``[s, e)``."""
    A = A.double()  # [heads,Q,K]
    total = A.sum(-1).clamp(min=1e-30)  # [heads,Q]
    max_attn = A.max(-1).values.mean(-1)  # [heads]
    std_attn = A.std(-1, unbiased=False).mean(-1)  # [heads]
    prefix = (A[..., :s].sum(-1) / total).mean(-1) if s > 0 else torch.zeros(A.shape[0], dtype=torch.float64)  # [heads]
    own = (A[..., s:e].sum(-1) / total).mean(-1)  # [heads]
    return torch.cat([max_attn, std_attn, prefix, own])  # [4·heads]


def pair_features(hidden_states: list[Tensor], attentions: list[Tensor], span: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """The spec's interface: (h [D], a [4·H·L]) of the turn ``span = (s, e)`` of a full dialog from
    per-layer states [S,D] and attentions [H,S,S] (queries and keys both dialog positions)."""
    s, e = span
    if not 0 <= s < e:
        raise ValueError(f"pair_features: a turn span needs 0 <= s < e, got {span}")
    h = hidden_states[-1][e - 1].double()  # [D]
    a = torch.cat([attention_stats(A[:, s:e, :], s, e) for A in attentions]) if attentions else torch.zeros(0, dtype=torch.float64)
    return h, a  # [D], [4·H·L]


def turn_spans(row_mask: Tensor, segment_id: Tensor | None = None) -> list[tuple[int, int]]:
    """A row's turns [s, e), in order: the maximal runs of tokens of ``row_mask`` [T] with one
    ``segment_id`` [T] (its turn), or without segments the maximal runs of True in ``row_mask``."""
    flags = row_mask.bool().tolist()
    ids = segment_id.tolist() if segment_id is not None else [0] * len(flags)
    keys = [i if on else None for on, i in zip(flags, ids)] + [None]
    spans, start = [], None
    for t, key in enumerate(keys):
        if start is not None and key != keys[start]:
            spans.append((start, t))
            start = None
        if key is not None and start is None:
            start = t
    return spans


# ---------------------------------------------------------------------------------------------- the probe
def _standardise(X: Tensor) -> tuple[Tensor, Tensor]:
    mean = X.mean(0)  # [F]
    scale = X.std(0, unbiased=False)  # [F]
    return mean, torch.where(scale > 1e-12, scale, torch.ones_like(scale))  # a constant feature: scale 1 (as sklearn)


def fit_logistic(X: Tensor, y: Tensor, C: float = 0.01, max_iter: int = 200) -> tuple[Tensor, Tensor]:
    """(w [F], b) minimising mean_i logloss(σ(w·x_i + b), y_i) + ‖w‖² / (2·C·n): sklearn's L2
    ``LogisticRegression(C)`` objective divided by C·n, so the same optimum. Full-batch L-BFGS, float64."""
    X, y = X.double(), y.double()  # [n,F], [n]
    n, F = X.shape
    w = torch.zeros(F + 1, dtype=torch.float64, requires_grad=True)  # [F+1] weights, then the bias
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=max_iter, tolerance_grad=1e-12, tolerance_change=1e-14, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        z = X @ w[:F] + w[F]  # [n]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z, y) + (w[:F] ** 2).sum() / (2 * C * n)
        loss.backward()
        return loss

    opt.step(closure)
    return w[:F].detach(), w[F].detach()


@dataclass
class PairProbe:
    """Two-stage probe: stage 1 on h, stage 2 on [a ; tclip(s_bc)]; each a standardised L2 logistic regression."""

    C: float = 0.01
    temperature: float = 2.0
    eps: float = 0.05
    params: dict = field(default_factory=dict)

    def fit(self, H: Tensor, A: Tensor, y: Tensor) -> "PairProbe":
        """H [n,D], A [n,F], y [n] (1 = clean turn); stage 2 trains on stage 1's in-sample probabilities [CODE]."""
        H, A, y = H.double(), A.double().reshape(len(H), -1), y.double()
        if len(H) < 2 or y.min() == y.max():
            raise ValueError(f"PairProbe.fit: need turns of both labels, got {len(H)} turns with labels {sorted(set(y.tolist()))}")
        m1, sc1 = _standardise(H)
        w1, b1 = fit_logistic((H - m1) / sc1, y, self.C)
        s_bc = torch.sigmoid((H - m1) / sc1 @ w1 + b1)  # [n] in-sample
        X2 = torch.cat([A, s_bc[:, None]], 1)  # [n,F+1]
        m2, sc2 = _standardise(X2)
        w2, b2 = fit_logistic((X2 - m2) / sc2, y, self.C)
        self.params = {"mean1": m1, "scale1": sc1, "w1": w1, "b1": b1, "mean2": m2, "scale2": sc2, "w2": w2, "b2": b2}
        return self

    def score(self, h: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
        """(s_bc [n], s_final [n]) of turns h [n,D], a [n,F]; stage 2 reads tclip(s_bc) [CODE]."""
        p = self.params
        h, a = h.double(), a.double().reshape(len(h), -1)
        s_bc = torch.sigmoid((h - p["mean1"]) / p["scale1"] @ p["w1"] + p["b1"])  # [n]
        x2 = torch.cat([a, tclip(s_bc, self.temperature, self.eps)[:, None]], 1)  # [n,F+1]
        s_final = torch.sigmoid((x2 - p["mean2"]) / p["scale2"] @ p["w2"] + p["b2"])  # [n]
        return s_bc, s_final

    def state(self) -> dict:
        return {"C": self.C, "temperature": self.temperature, "eps": self.eps, **{k: v.clone() for k, v in self.params.items()}}

    @classmethod
    def from_state(cls, state: dict) -> "PairProbe":
        keys = ("mean1", "scale1", "w1", "b1", "mean2", "scale2", "w2", "b2")
        return cls(state["C"], state["temperature"], state["eps"], {k: torch.as_tensor(state[k], dtype=torch.float64) for k in keys})


def row_turn_features(hidden: Tensor, attns: list[Tensor], row_mask: Tensor, prompt_length: int, length: int,
                      segment_id: Tensor | None = None) -> tuple[list, Tensor, Tensor]:
    """(spans, h [n,D], a [n,4·heads·L]) of one row's turns (``turn_spans``) from its ``hidden_at(l)``
    [T,D] and ``attn_at(l)`` [T,heads,S] quantities (Notes 2-3); ``length`` = its completion tokens."""
    spans = turn_spans(row_mask, segment_id)
    K = prompt_length + length
    h = torch.stack([hidden[e - 1].double() for _, e in spans]) if spans else torch.zeros(0, hidden.shape[-1], dtype=torch.float64)
    rows = [torch.cat([attention_stats(A[s:e, :, :K].transpose(0, 1), prompt_length + s, prompt_length + e) for A in attns])
            if attns else torch.zeros(0, dtype=torch.float64) for s, e in spans]
    a = torch.stack(rows) if rows else torch.zeros(0, 0, dtype=torch.float64)
    return spans, h, a


@register("reward", "pair")
@dataclass
class PairReward:
    """Dense per-turn reward from the frozen base's two-stage probe on the policy's own hidden states and attention (PAIR)."""

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
            raise ConfigError(f"reward pair: need temperature > 0 (got {self.temperature}), eps in [0, 0.5) (got {self.eps}), "
                              f"a finite alpha >= 0 (got {self.alpha})")
        if self.hidden_layer < 0 or any(l < 1 for l in self.attn_layers) or len(set(self.attn_layers)) != len(self.attn_layers):
            raise ConfigError(f"reward pair: hidden_layer must be >= 0 (got {self.hidden_layer}) and attn_layers distinct layers >= 1 "
                              f"(got {list(self.attn_layers)}); use the model's, e.g. hidden_layer=4, attn_layers=[1, 2, 3, 4]")
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
            raise ConfigError(f"reward pair: the probe {name!r} was fitted on hidden_at({made[0]}) and attn_at{list(made[1])}, but the reward reads "
                              f"hidden_at({self.hidden_layer}) and attn_at{list(self.attn_layers)}; give both the same hidden_layer and attn_layers")
        self._probe = PairProbe.from_state(value["probe"])
        self._probe.temperature, self._probe.eps = self.temperature, self.eps

    def score_rollout(self, rollout: Rollout, info: StepInfo) -> Tensor:
        if self._probe is None:
            raise ValueError(f"reward pair: no probe; add the offline phase pair_probe (artifact {self.artifact!r}) to `phases`")
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
                spans, h, a = row_turn_features(hidden[b, g], [x[b, g] for x in attns], row_mask[b, g], P, int(lengths[b][g]), seg)
                _, s_final = self._probe.score(h, a)  # [n]
                r = pair_turn_rewards(s_final, self.alpha, self.temperature, self.eps, self.momentum, self.clip_negative)  # [n]
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
