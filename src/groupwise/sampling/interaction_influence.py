"""Interaction-aware influence prompt selection: greedy second-order choice of the next batch from
per-prompt policy-gradient features.

"Interaction-aware influence functions for group attribution" (POSTECH), arXiv 2605.15675,
https://arxiv.org/abs/2605.15675; spec 16. Only the abstract was available; the estimator is the
spec's derivation (``groupwise.influence``) and its use for GRPO prompt selection is [INFERRED].

**Change vs GRPO**: instead of uniform epochs, most of each batch is chosen greedily: the prompt
whose predicted effect on a target loss is best *given the prompts already chosen* — first-order
alignment with the target's descent direction, minus a pairwise penalty for prompts that move the
parameters the same way (redundant) and a self term. The rest is drawn uniformly (unseen first).

**Math** (φ_p = the feature of prompt p from its last observed group; m seen prompts; n = batch)::

    tokens:  φ_p[h(t, y_t)] += A_{i,t} / G_p   over the loss tokens of the group's valid rows
    hidden:  φ_p = (1/G_p) Σ_i A_i · mean_t hidden_l[i,t]
    g̃_p = φ_p / rms_p ‖φ_p‖;   Δθ_p^add = (step_size / n) · g̃_p      (the prompt's share of a GRPO step)
    f = −reward on held-out ≈ train:  ∇f = −mean_p g̃_p;   ∇²f = I | (1/m) Σ_p g̃_p g̃_pᵀ (Gauss–Newton)
    S ← S ∪ argmin_j [ ∇fᵀΔθ_j + Σ_{i∈S} Δθ_iᵀ∇²fΔθ_j + ½ Δθ_jᵀ∇²fΔθ_j ]    (influence.greedy_select)

**Defaults**

- ``feature = "tokens"`` [INFERRED] the policy gradient with respect to a (position, token) logit
  bias, keeping its ``e_y`` part (the ``−π`` part cancels within a group that shares the next-token
  distribution), hashed into ``dim = 512`` [INFERRED] slots; exact, so identical on every rank.
  ``"hidden"`` [INFERRED]: advantage-weighted mean of the layer-``layer`` (4 [INFERRED], the embedded
  model's last) hidden state; floating-point, so ranks may differ in the last bits.
- ``hessian = "gauss_newton"`` [INFERRED] spec 16's GN of the target; ``"identity"`` the damped-identity option.
- ``step_size = 1.0`` [INFERRED]; ``include_self = True`` [ABSTRACT] spec default; ``pair = True``
  (``pair = include_self = False`` is first-order top-k, the ablation).
- ``explore = 0.25`` [INFERRED] share of each batch drawn uniformly (unseen prompts first).
- ``pool = 4`` [INFERRED] the greedy chooses among ``pool·n`` seen prompts drawn uniformly each step
  (the paper selects a subset of a given candidate set); ``0`` = among every seen prompt.

**Notes**

1. ``observe`` (once per step, whole batch, after the update) replaces the features of the batch's
   prompts; a group without a valid row is ignored. A group with constant rewards has φ = 0.
2. ``draw`` is a pure function of the table and (seed, step, round); ties (e.g. zero features) go to
   the earlier prompt of a seeded permutation. Until enough prompts are seen, the rest is uniform.
3. With ``pool = 0`` a prompt keeps being chosen while its stored feature scores well (on the demo
   the top prompts came back nearly every step, and held-out accuracy fell behind uniform's); the
   pool bounds that. A prompt's feature is refreshed each time it is drawn, so a prompt that becomes
   all-solved (φ = 0) loses its place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from groupwise.influence import greedy_select
from groupwise.registry import register
from groupwise.sampling.cgpo import step_generator
from groupwise.types import Need, Rollout, StepInfo


def token_features(actions: Tensor, mask: Tensor, adv: Tensor, dim: int) -> Tensor:
    """[B,dim] per group: Σ over loss tokens of A_{i,t} at slot h(t, y_t), divided by the group's valid rows."""
    B, G, T = actions.shape
    slot = (actions.long() * 1_000_003 + torch.arange(T) * 7_919) % dim  # [B,G,T] hashed (position, token)
    a = torch.where(mask, adv.double(), 0.0)  # [B,G,T]
    rows = mask.any(-1).sum(-1).clamp(min=1)  # [B]
    out = torch.zeros(B, dim, dtype=torch.float64).scatter_add_(1, slot.reshape(B, -1), a.reshape(B, -1))  # [B,dim]
    return out / rows[:, None]  # [B,dim]


def hidden_features(hidden: Tensor, mask: Tensor, adv: Tensor) -> Tensor:
    """[B,H] per group: (1/G_valid) Σ_i mean_t A_{i,t} h_{i,t} over loss tokens."""
    m = mask.double()  # [B,G,T]
    per_row = (hidden.double() * (adv.double() * m)[..., None]).sum(2) / m.sum(-1, keepdim=True).clamp(min=1)  # [B,G,H]
    return per_row.sum(1) / mask.any(-1).sum(-1, keepdim=True).clamp(min=1)  # [B,H]


@register("sampling", "interaction_influence")
@dataclass
class InteractionInfluenceSampler:
    """Greedy second-order (interaction-aware) influence selection of prompts from gradient features (arXiv
    2605.15675)."""

    feature: str = "tokens"
    dim: int = 512
    layer: int = 4
    hessian: str = "gauss_newton"
    step_size: float = 1.0
    include_self: bool = True
    pair: bool = True
    explore: float = 0.25
    pool: int = 4

    max_rounds: ClassVar[int] = 1

    def __post_init__(self) -> None:
        if self.feature not in ("tokens", "hidden") or self.hessian not in ("identity", "gauss_newton"):
            raise ValueError(
                "interaction_influence: feature must be 'tokens' or 'hidden' and hessian "
                f"'identity' or 'gauss_newton'; got {self.feature!r}, {self.hessian!r}"
            )
        if self.dim < 1 or self.layer < 0 or self.step_size <= 0 or not 0 <= self.explore <= 1 or self.pool < 0:
            raise ValueError(
                "interaction_influence: need dim >= 1, layer >= 0, "
                f"step_size > 0, 0 <= explore <= 1, pool >= 0; got {self}"
            )
        self._n_rows: int | None = None
        self._seed = 0
        self._features: dict[int, list[float]] = {}

    @property
    def needs(self) -> tuple[Need, ...]:
        return (Need(f"hidden({self.layer})"),) if self.feature == "hidden" else ()

    def bind(self, n_rows: int, seed: int) -> None:
        if n_rows < 1:
            raise ValueError("interaction_influence: the dataset has no rows")
        if self._features and max(self._features) >= n_rows:
            raise ValueError(
                f"interaction_influence: resumed state has row {max(self._features)}, the dataset has {n_rows} rows"
            )
        self._n_rows, self._seed = int(n_rows), int(seed)

    def draw(self, n: int, info: StepInfo) -> list[int]:
        if self._n_rows is None:
            raise RuntimeError("interaction_influence: call bind(n_rows, seed) before draw")
        if n > self._n_rows:
            raise ValueError(f"interaction_influence: cannot draw {n} distinct prompts from {self._n_rows} rows")
        perm = torch.randperm(
            self._n_rows, generator=step_generator(self._seed, info.step, info.round, salt=16)
        ).tolist()
        seen = [p for p in perm if p in self._features]  # in tie-break order
        candidates = seen[: self.pool * n] if self.pool else seen
        picks = self._select(candidates, min(len(candidates), n - math.ceil(self.explore * n)), n)
        taken = set(picks)
        rest = [p for p in perm if p not in taken and p not in self._features] + [p for p in seen if p not in taken]
        return picks + rest[: n - len(picks)]

    def _select(self, rows: list[int], k: int, n: int) -> list[int]:
        """k of ``rows`` by the greedy second-order rule (ties: earlier in ``rows``)."""
        if k <= 0:
            return []
        F = torch.tensor([self._features[p] for p in rows], dtype=torch.float64)  # [m,F]
        rms = float(F.pow(2).sum(1).mean().sqrt())
        F = F / rms if rms > 0 else F  # [m,F]
        # [F,F]
        hess = F.T @ F / F.shape[0] if self.hessian == "gauss_newton" else torch.eye(F.shape[1], dtype=torch.float64)
        D = -(self.step_size / n) * F  # [m,F] removal shifts: adding p moves θ by +step·g̃_p/n
        chosen = greedy_select(D, -F.mean(0), hess, k, self.include_self, self.pair)
        return [rows[j] for j in chosen]

    def keep(self, rollout: Rollout) -> Tensor:
        return torch.ones(rollout.shape[0], dtype=torch.bool)  # [B]

    def observe(self, rollout: Rollout, info: StepInfo) -> None:
        if self._n_rows is None:
            raise RuntimeError("interaction_influence: call bind(n_rows, seed) before observe")
        if rollout.advantages is None:
            raise ValueError("interaction_influence.observe needs rollout.advantages (a prepared batch)")
        mask = rollout.row_mask  # [B,G,T]
        adv = rollout.advantages.float()  # [B,G] or [B,G,T]
        adv = torch.nan_to_num(adv if adv.dim() == 3 else adv[..., None].expand(mask.shape))  # [B,G,T]
        if self.feature == "tokens":
            feats = token_features(rollout.actions, mask, adv, self.dim)  # [B,F]
        else:
            key = Need(f"hidden({self.layer})").key
            if key not in rollout.extras:
                raise ValueError(
                    f"interaction_influence: feature='hidden' needs rollout.extras[{key!r}] (declared Need({key!r}))"
                )
            feats = hidden_features(rollout.extras[key], mask, adv)  # [B,H]
        for row, valid, f in zip(rollout.prompt_index.tolist(), rollout.group_valid.any(1).tolist(), feats):
            if valid:
                self._features[row] = f.tolist()

    def state_dict(self) -> dict[str, Any]:
        return {
            "n_rows": self._n_rows,
            "seed": self._seed,
            "features": [[p, f] for p, f in sorted(self._features.items())],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        features = {int(p): list(f) for p, f in state["features"]}
        if self._n_rows is not None and features and max(features) >= self._n_rows:
            raise ValueError(f"interaction_influence: state has row {max(features)}, bound to {self._n_rows} rows")
        self._n_rows = self._n_rows or state["n_rows"]
        self._seed, self._features = int(state["seed"]), features
