"""GCPO: each rollout's advantage is its Shapley share of the group's DPP log-volume of correct, distinct solutions.

"Breaking Winner-Takes-All: Cooperative Policy Optimization Improves Diverse LLM Reasoning" (GCPO,
Group Cooperative Policy Optimization), Chen, Liang, Zheng, Hu, 2026. https://arxiv.org/abs/2605.11461
(spec: specs/35; abstract and a summary only, the authors' repository has no code).

**Change vs GRPO**

- The group is a team: its value is the log-volume spanned by the reward-weighted embeddings of its
  rollouts, so only correct, mutually non-redundant solutions add value.
- Each rollout is credited with its Shapley value (mean marginal contribution) in that game, then
  group-normalised like GRPO's reward: a unique correct solution outranks duplicated ones.

**Math** (per group; ``valid = group_valid & isfinite(r)``; ``combinatorics in advantages/dpp_shapley.py``)::

    e_i   = normalize(embed(y_i))                  (embedding = "ngram" | "hidden")
    q_i   = max(r_i, 0) on valid rows, 0 elsewhere  φ_i = q_i · e_i          # [B,G,d]   (quality = "clip")
          = r_i − min_{valid j} r_j                                                  (quality = "shift")
    v(S)  = log det(I + Φ_S Φ_Sᵀ),  v(∅) = 0
    ψ_i   = Σ_{S ⊆ N∖i} |S|!(G−|S|−1)!/G! · (v(S ∪ i) − v(S))     Σ_i ψ_i = v(N)
    A_i   = mix · norm(ψ)_i + (1 − mix) · norm(r)_i,   norm(x) = (x − mean x) / (std x + eps) over valid rows

**Defaults**

- The DPP log-det team value, Shapley credit, group normalisation [ABSTRACT]; their exact forms
  as above [INFERRED] (specs/35).
- ``shapley = "auto"``: exact over subsets when a group has at most ``exact_max = 16`` non-null
  players, else Monte-Carlo over ``n_perm = 256`` orders; ``"exact"``/``"mc"`` force one. The spec's
  limit of 10 [INFERRED] left G = 11–16 to 256 orders, off the exact share by up to ~0.1 (unit-norm
  embeddings, q ≤ 3; an audit measured 0.37–0.98 on other inputs): exact solving of 16 players now
  takes ~30 ms (``dpp_shapley.py``), so every group of G ≤ 16 is exact.
- ``std = "population"``, ``eps = 1e-6`` [INFERRED] the spec's worked example uses the population std.
- ``mix = 1.0`` [INFERRED] pure Shapley credit; the spec's option λ blends in GRPO's normalised reward.
- ``embedding = "ngram"`` [INFERRED] the spec's small-scale analogue (no embedding model): a hashed
  (crc32) bag of the character ``ngram = 3``-grams of the stripped completion framed as ``^text$``,
  ``dim = 256`` buckets, L2-normalised. ``"hidden"`` [INFERRED]: the mean over completion tokens of
  ``hidden(layer)`` of the frozen reference (``layer = 4``: the embedded model's last decoder layer).
- ``quality = "clip"`` [INFERRED] q = max(r, 0): a binary verifier's reward as is, graded rewards
  ≥ 0 as is (the spec's q_i = r_i ≥ 0); a negative reward makes a null player, not a negative
  weight (log det(I + ΦΦᵀ) ignores a row's sign, so q = r would count it like a positive one).
  ``"shift"`` [INFERRED] q = r − the group's lowest valid reward: graded rewards of either sign keep
  their order and the worst row is the null player; an all-equal group (all correct too) is all null.

**Notes**

1. Rows with ``group_valid`` False or a NaN reward are null players (φ = 0) and get exactly 0; they
   enter no statistic. Rows with q = 0 (r ≤ 0 under ``"clip"``, the group's lowest reward under
   ``"shift"``) are null players too: ψ = 0, so they sit below every row with q > 0 after normalisation.
2. All-wrong group: ψ ≡ 0 ⇒ A ≡ 0 (with ``mix < 1`` too, r being constant). One valid row, or a
   group whose valid rows have equal ψ (identical texts and rewards tie bit for bit: symmetric
   players get the mean of their values), gets exactly 0.
3. An empty completion (no n-gram) or a fully masked row (``hidden``) has a zero embedding: a null player.
4. The Monte-Carlo orders are seeded from (run seed, step, prompt index, group position) with
   ``seeds.sample_seed``, so a resumed run draws the same orders. Exact solving is over the
   non-null players only (null players change no one's value), so large groups with at most
   ``exact_max`` correct rows stay exact; ``exact_max`` ≤ 16 (2^16 subsets per group).
5. ``step_stats`` logs ``gcpo/team_value`` (mean v(N) over groups with a valid row) and
   ``gcpo/distinct_correct`` (mean number of distinct stripped correct texts per such group).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.advantages.dpp_shapley import dpp_logvol, shapley_values  # noqa: F401  (the spec's interface)
from groupwise.errors import ConfigError
from groupwise.masked import group_normalize, to_float32, valid_rows
from groupwise.registry import register
from groupwise.seeds import sample_seed
from groupwise.types import Need, Rollout, StepInfo

EMBEDDINGS = ("ngram", "hidden")
SHAPLEY = ("auto", "exact", "mc")
QUALITIES = ("clip", "shift")
_DDOF = {"unbiased": 1, "population": 0}


def ngram_embeddings(texts: list[str], n: int = 3, dim: int = 256) -> Tensor:
    """[N,dim] float64 L2-normalised hashed bags of the character n-grams of ``^text.strip()$``."""
    out = torch.zeros(len(texts), dim, dtype=torch.float64)  # [N,dim]
    for row, text in enumerate(texts):
        framed = f"^{text.strip()}$"
        for k in range(len(framed) - n + 1):
            out[row, zlib.crc32(framed[k : k + n].encode()) % dim] += 1.0
    return out / out.norm(dim=1, keepdim=True).clamp(min=1e-300)  # zero rows stay zero


def quality_weights(r: Tensor, valid: Tensor, quality: str = "clip") -> Tensor:
    """q [B,G] float64 ≥ 0, 0 off ``valid``: max(r, 0) ("clip") or r − the group's lowest valid r ("shift")."""
    r = torch.where(valid, r.double(), 0.0)  # [B,G]
    if quality == "clip":
        return r.clamp(min=0.0)  # [B,G]
    if quality != "shift":
        raise ValueError(f"gcpo: quality must be one of {QUALITIES}, got {quality!r}")
    low = torch.where(valid, r, torch.inf).amin(1, keepdim=True)  # [B,1] inf for a group without valid rows
    return torch.where(valid, r - torch.where(torch.isfinite(low), low, 0.0), 0.0)  # [B,G]


def gcpo_advantages(
    embeds: Tensor,
    rewards: Tensor,
    valid: Tensor | None = None,
    mix: float = 1.0,
    exact: bool | None = None,
    n_perm: int = 256,
    seeds: list[int] | None = None,
    ddof: int = 0,
    eps: float = 1e-6,
    exact_max: int = 16,
    quality: str = "clip",
) -> tuple[Tensor, Tensor]:
    """(A [B,G] float64, v(N) [B]) from ``embeds`` [B,G,d] and ``rewards`` [B,G] (see the Math);
    ``valid`` [B,G] defaults to finite rewards; ``seeds`` [B] seed each group's Monte-Carlo orders."""
    r = rewards.double()  # [B,G]
    valid = torch.isfinite(r) if valid is None else valid.bool() & torch.isfinite(r)  # [B,G]
    e = embeds.double()  # [B,G,d]
    e = e / e.norm(dim=-1, keepdim=True).clamp(min=1e-300)  # [B,G,d]
    q = quality_weights(r, valid, quality)  # [B,G]
    phi = q[..., None] * e  # [B,G,d]
    B = r.shape[0]
    psi = (
        torch.stack([shapley_values(phi[b], exact, n_perm, seeds[b] if seeds else b, exact_max) for b in range(B)])
        if B
        else q
    )  # [B,G]
    team = torch.stack([dpp_logvol(phi[b][q[b] > 0]) for b in range(B)]) if B else q.new_zeros(0)  # [B]
    adv = group_normalize(psi, valid, "group", ddof, eps)  # [B,G]
    if mix != 1.0:
        adv = mix * adv + (1.0 - mix) * group_normalize(torch.where(valid, r, 0.0), valid, "group", ddof, eps)  # [B,G]
    return torch.where(valid, adv, 0.0), team  # [B,G], [B]


@register("advantage", "gcpo")
@dataclass
class GCPOAdvantage:
    """Shapley credit of a DPP log-volume over reward-weighted completion embeddings (GCPO, Chen et al. 2026)."""

    group_relative = True  # needs G >= 2: a lone rollout has nothing to be redundant with

    mix: float = 1.0  # λ: A = λ·norm(ψ) + (1 − λ)·norm(r)
    embedding: str = "ngram"  # "ngram" | "hidden" [INFERRED]
    ngram: int = 3
    dim: int = 256
    layer: int = 4  # hidden(layer) of the frozen reference, for embedding = "hidden"
    shapley: str = "auto"  # "auto" | "exact" | "mc"
    exact_max: int = 16
    quality: str = "clip"  # "clip": q = max(r, 0) | "shift": q = r − the group's lowest valid reward
    n_perm: int = 256
    std: str = "population"  # "population" | "unbiased"
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.embedding not in EMBEDDINGS:
            raise ConfigError(f"gcpo: embedding={self.embedding!r}; choose one of {EMBEDDINGS}")
        if self.shapley not in SHAPLEY:
            raise ConfigError(f"gcpo: shapley={self.shapley!r}; choose one of {SHAPLEY}")
        if self.quality not in QUALITIES:
            raise ConfigError(f"gcpo: quality={self.quality!r}; choose one of {QUALITIES}")
        if self.std not in _DDOF:
            raise ConfigError(f"gcpo: std={self.std!r}; choose one of {tuple(_DDOF)}")
        if not 0.0 <= self.mix <= 1.0:
            raise ConfigError(
                f"gcpo: mix={self.mix} must be in [0, 1] (1 = pure Shapley credit, 0 = GRPO's normalised reward)"
            )
        for name, low in (("ngram", 1), ("dim", 1), ("n_perm", 1), ("exact_max", 1), ("layer", 0)):
            if getattr(self, name) < low:
                raise ConfigError(f"gcpo: {name}={getattr(self, name)} must be >= {low}")
        if self.exact_max > 16:
            raise ConfigError(
                f"gcpo: exact_max={self.exact_max} would solve 2^{self.exact_max} "
                "subsets per group; use <= 16 (Monte-Carlo above)"
            )
        if self.eps < 0:
            raise ConfigError(f"gcpo: eps={self.eps} must be >= 0")
        self._stats: dict[str, float] = {}

    @property
    def needs(self) -> tuple[Need, ...]:
        return (Need(f"hidden({self.layer})", model="ref"),) if self.embedding == "hidden" else ()

    @property
    def reads_completions(self) -> bool:
        return True  # the n-gram embeddings; the distinct-correct statistic in both modes

    def _embeddings(self, rollout: Rollout) -> Tensor:
        """[B,G,d] float64 unnormalised embeddings of the completions."""
        B, G, T = rollout.shape
        if self.embedding == "ngram":
            if not rollout.completions:
                raise ValueError("gcpo embedding='ngram' needs rollout.completions (the decoded texts)")
            return ngram_embeddings([t for row in rollout.completions for t in row], self.ngram, self.dim).reshape(
                B, G, -1
            )
        key = Need(f"hidden({self.layer})", model="ref").key
        if key not in rollout.extras:
            raise ValueError(
                f"gcpo embedding='hidden' needs rollout.extras[{key!r}] (declared "
                f"in its needs); extras present: {sorted(rollout.extras)}"
            )
        m = rollout.mask.double()[..., None]  # [B,G,T,1]
        return (rollout.extras[key].double() * m).sum(2) / m.sum(2).clamp(min=1)  # [B,G,H] mean over completion tokens

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        r, valid = valid_rows(rollout)  # [B,G], [B,G]
        B, G, _ = rollout.shape
        exact = {"auto": None, "exact": True, "mc": False}[self.shapley]
        ids = rollout.prompt_index.tolist()  # [B]
        seeds = [sample_seed(info.seed, info.step, int(ids[b]), b) for b in range(B)]
        adv, team = gcpo_advantages(
            self._embeddings(rollout),
            r,
            valid,
            self.mix,
            exact,
            self.n_perm,
            seeds,
            _DDOF[self.std],
            self.eps,
            self.exact_max,
            self.quality,
        )
        present = valid.any(1)  # [B]
        texts = rollout.completions or [[""] * G for _ in range(B)]
        distinct = [
            len({texts[b][g].strip() for g in range(G) if valid[b, g] and r[b, g] > 0}) for b in range(B) if present[b]
        ]
        self._stats = {
            "gcpo/team_value": float(team[present].mean()) if present.any() else float("nan"),
            "gcpo/distinct_correct": sum(distinct) / len(distinct) if distinct else float("nan"),
        }
        return to_float32(adv)  # [B,G]

    def step_stats(self) -> dict[str, float]:
        """The last batch's mean team value v(N) and distinct correct texts per group (whole batch)."""
        return dict(self._stats)
