"""Soft-Pair-GRPO: binary pairwise-preference rewards inside GRPO.

"A Unified Pair-GRPO Family: From Implicit to Explicit Preference Constraints for Stable and General
RL Alignment", Hao Yu, 2026. https://arxiv.org/abs/2605.06375 (spec: specs/56; abstract only, no
code, full paper not read). The Hard variant is the objective term ``hard_pair`` (losses/hard_pair.py).

**Change vs GRPO**

- The group's scalar scores (the configured reward total) are replaced by binary pairwise
  preferences before GRPO's normalisation: the G rollouts are split into random disjoint pairs and
  each pair's winner gets 1, its loser 0 (a tie 0.5 each). The clipped surrogate and KL are GRPO's.
- Option ``pairing = "all"``: every row is compared with every other, reward = its win rate.

**Math** (per group over its valid rows ``valid = group_valid & isfinite(s)``; ``s`` = ``rewards``)::

    key_g   = hash(seed, step, prompt_index, tokens of row g)        (row_keys)
    order   = valid rows sorted by key;  pairs = (order_0, order_1), (order_2, order_3), …
    random: r_i = 1[s_i > s_j] + ½·1[s_i = s_j]  for the pair (i, j);  an unpaired row r = ½
    all:    r_i = mean_{j valid, j ≠ i} (1[s_i > s_j] + ½·1[s_i = s_j])
    adv     = (r − mean_g(r)) / (std_g(r) + eps)                      (group_normalize, as grpo)

Scores [.9, .2, .5, .4] with pairs (0, 1), (2, 3) → r = [1, 0, 1, 0] → adv = [1, −1, 1, −1]; scalar
GRPO gives [1.568929, −1.176697, 0, −0.392232]. For G = 2 both give [1, −1] (a z-score of two
different values is ±1 whatever they are).

**Defaults**

- Binary pairwise rewards, then GRPO's group normalisation [ABSTRACT].
- ``pairing = "random"`` [INFERRED] random disjoint pairs (G even); ``"all"`` is the spec's
  win-rate option [INFERRED].
- Pairs are drawn per group from a hash of (run seed, step, prompt id, the row's tokens) [INFERRED]:
  random, identical on every rank, and independent of the row order (permuting the rows permutes
  the output; the micro-batch split and world size do not matter).
- ``std = "population"``, ``eps = 0.0`` [INFERRED] the spec's numbers ([1, −1, 1, −1] exactly; |adv|
  ≤ √(G − 1)). Binary rewards need no eps: a group's std is 0 only when every reward is equal,
  and such a group gets exactly 0 (``constant_group``). ``scale = "group"`` [ABSTRACT] the group normalisation the
  abstract keeps (DeepSeekMath's, as ``grpo``);
  ``"batch"``, ``"none"`` as ``grpo``.

**Notes**

1. Invalid rows (``group_valid`` False or a NaN score) are in no pair and get exactly 0. With an odd
   number of valid rows the last row of the key order is unpaired: r = ½, which is the group mean
   of r (every pair sums to 1), so its advantage is exactly 0.
2. A group of equal scores (all ties), or with one valid row, gets exactly 0.
3. ``pairing = "random"`` with an odd group width is refused (the spec's G is even); use
   ``pairing = "all"`` for odd G.
4. Two rows with the same tokens (and so the same score) get the same key: their order, and so the
   pairing, is then decided by their positions — the only place where row order matters.
5. ``row_keys`` and ``disjoint_pairs`` are shared with ``hard_pair``, which pairs the same rows
   (same seed, step and tokens); ``pairwise_binary_rewards`` is the spec's interface.
6. ``step_stats`` logs ``pair_grpo/tie_frac`` (share of compared pairs that tie: no signal) and
   ``pair_grpo/adv_abs_max`` (largest |adv| of the batch, ≤ √(G − 1) under the population std).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.masked import GROUP_SCALES, group_normalize, to_float32, valid_rows
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

PAIRINGS = ("random", "all")
_DDOF = {"unbiased": 1, "population": 0}


def row_keys(rollout: Rollout, info: StepInfo) -> Tensor:
    """[B,G] int64 pseudo-random key of each row from (seed, step, prompt id, the row's tokens)."""
    B, G, _ = rollout.shape
    keys = torch.zeros(B, G, dtype=torch.int64)  # [B,G]
    for b in range(B):
        head = f"{info.seed}|{info.step}|{int(rollout.prompt_index[b])}|".encode()
        for g in range(G):
            tokens = rollout.actions[b, g][rollout.mask[b, g]].contiguous()  # [n] (+ payload)
            digest = hashlib.blake2b(head + tokens.numpy().tobytes(), digest_size=8).digest()
            keys[b, g] = int.from_bytes(digest, "little", signed=True)
    return keys


def disjoint_pairs(keys: Tensor, valid: Tensor) -> Tensor:
    """[B,P,2] long, P = G // 2: the valid rows in key order (position breaks ties) paired in turn; −1 = no pair."""
    B, G = keys.shape
    by_key = torch.sort(keys, dim=1, stable=True).indices  # [B,G]
    # [B,G] valid rows first
    order = by_key.gather(1, torch.sort((~valid).gather(1, by_key).to(torch.int8), dim=1, stable=True).indices)
    P = G // 2
    pairs = torch.stack([order[:, 0 : 2 * P : 2], order[:, 1 : 2 * P : 2]], dim=-1)  # [B,P,2]
    exists = (2 * torch.arange(P) + 1)[None, :] < valid.sum(1, keepdim=True)  # [B,P] both members valid
    return torch.where(exists[..., None], pairs, torch.full((), -1, dtype=pairs.dtype))  # [B,P,2]


def all_pairs(valid: Tensor) -> Tensor:
    """[B,P,2] long, P = G(G − 1)/2: every (i, j), i < j, of valid rows; −1 = no pair."""
    B, G = valid.shape
    i, j = torch.triu_indices(G, G, offset=1)  # [P] x2
    pairs = torch.stack([i, j], dim=-1)[None].expand(B, -1, -1)  # [B,P,2]
    exists = valid[:, i] & valid[:, j]  # [B,P]
    return torch.where(exists[..., None], pairs, torch.full((), -1, dtype=pairs.dtype))  # [B,P,2]


def pair_preference(scores: Tensor, pairs: Tensor) -> Tensor:
    """[B,P] float64 preference of each pair's first row: 1 if it scores higher, 0 lower, ½ a tie (0 for no pair)."""
    idx = pairs.clamp(min=0)  # [B,P,2]
    s = scores.double().gather(1, idx.flatten(1)).view(idx.shape)  # [B,P,2]
    pref = 0.5 * (1 + torch.sign(s[..., 0] - s[..., 1]))  # [B,P]
    return torch.where(pairs[..., 0] >= 0, finite(pref), torch.zeros((), dtype=pref.dtype))  # [B,P]


def finite(x: Tensor) -> Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype))


def pair_rewards(scores: Tensor, pairs: Tensor, valid: Tensor) -> Tensor:
    """[B,G] float64 binary rewards of disjoint ``pairs``: winner 1, loser 0, tie ½ each; an unpaired row ½."""
    r = torch.full(scores.shape, 0.5, dtype=torch.float64)  # [B,G]
    pref = pair_preference(scores, pairs)  # [B,P]
    has = pairs[..., 0] >= 0  # [B,P]
    b = torch.arange(scores.shape[0])[:, None].expand_as(has)[has]  # [N]
    r[b, pairs[..., 0][has]] = pref[has]
    r[b, pairs[..., 1][has]] = 1 - pref[has]
    return torch.where(valid, r, torch.zeros((), dtype=r.dtype))  # [B,G]


def win_rates(scores: Tensor, valid: Tensor) -> Tensor:
    """[B,G] float64 r_i = mean over the other valid rows j of 1[s_i > s_j] + ½·1[s_i = s_j]; ½ with no other row."""
    s = scores.double()  # [B,G]
    G = s.shape[1]
    both = valid[:, :, None] & valid[:, None, :] & ~torch.eye(G, dtype=torch.bool)  # [B,G,G]
    # [B,G,G]
    wins = torch.where(both, 0.5 * (1 + torch.sign(s[:, :, None] - s[:, None, :])), torch.zeros((), dtype=s.dtype))
    n = both.sum(2)  # [B,G]
    r = torch.where(n > 0, wins.sum(2) / n.clamp(min=1), torch.full((), 0.5, dtype=s.dtype))  # [B,G]
    return torch.where(valid, r, torch.zeros((), dtype=r.dtype))  # [B,G]


def pairwise_binary_rewards(
    scores: Tensor,
    pairing: str = "random",
    generator: torch.Generator | None = None,
    valid: Tensor | None = None,
    pairs: Tensor | None = None,
) -> Tensor:
    """The spec's interface: [B,G] float32 binary pairwise rewards of ``scores`` [B,G]. ``random`` pairs
    the rows by keys drawn from ``generator`` unless ``pairs`` [B,P,2] are given; ``all`` gives win rates."""
    valid = torch.isfinite(scores) if valid is None else valid & torch.isfinite(scores)  # [B,G]
    if pairing == "all":
        return win_rates(scores, valid).float()
    if pairing != "random":
        raise ValueError(f"pairwise_binary_rewards: pairing must be one of {PAIRINGS}, got {pairing!r}")
    if pairs is None:
        keys = torch.randint(-(2**62), 2**62, scores.shape, generator=generator)  # [B,G]
        pairs = disjoint_pairs(keys, valid)  # [B,P,2]
    return pair_rewards(scores, pairs, valid).float()  # [B,G]


def rollout_pairs(rollout: Rollout, info: StepInfo, valid: Tensor, pairing: str) -> Tensor:
    """[B,P,2] the pairs compared in ``rollout`` under ``pairing`` (the same for pair_grpo and hard_pair)."""
    if pairing == "all":
        return all_pairs(valid)
    if rollout.shape[1] % 2:
        raise ConfigError(
            f"pairing='random' needs an even group size (the spec's disjoint pairs), got G={rollout.shape[1]}; "
            f"set rollout.group_size even or use pairing='all'"
        )
    return disjoint_pairs(row_keys(rollout, info), valid)


@register("advantage", "pair_grpo")
@dataclass
class PairGRPOAdvantage:
    """GRPO's normalisation of binary pairwise-preference rewards (Soft-Pair-GRPO, Yu 2026)."""

    group_relative = True  # needs G >= 2

    pairing: str = "random"  # "random" | "all"
    scale: str = "group"  # "group" | "batch" | "none"
    std: str = "population"  # "population" | "unbiased"
    eps: float = 0.0

    def __post_init__(self) -> None:
        if self.pairing not in PAIRINGS:
            raise ConfigError(f"pair_grpo: pairing must be one of {PAIRINGS}, got {self.pairing!r}")
        if self.scale not in GROUP_SCALES:
            raise ConfigError(f"pair_grpo: scale must be one of {GROUP_SCALES}, got {self.scale!r}")
        if self.std not in _DDOF:
            raise ConfigError(f"pair_grpo: std must be one of {tuple(_DDOF)}, got {self.std!r}")
        if not self.eps >= 0:
            raise ConfigError(f"pair_grpo: eps must be >= 0, got {self.eps}")
        self._stats: dict[str, float] = {}

    def _binary_rewards(self, rollout: Rollout, info: StepInfo) -> tuple[Tensor, Tensor, Tensor]:
        """([B,G] float64 binary rewards, [B,G] valid, [B,P,2] pairs compared)."""
        s, valid = valid_rows(rollout)  # [B,G], [B,G]
        pairs = rollout_pairs(rollout, info, valid, self.pairing)  # [B,P,2]
        r = win_rates(s, valid) if self.pairing == "all" else pair_rewards(s, pairs, valid)  # [B,G]
        has = pairs[..., 0] >= 0  # [B,P]
        pref = pair_preference(s, pairs)  # [B,P]
        self._stats = {"pair_grpo/tie_frac": float(((pref == 0.5) & has).sum()) / max(int(has.sum()), 1)}
        return r, valid, pairs

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        r, valid, _ = self._binary_rewards(rollout, info)  # [B,G] float64, [B,G]
        adv = group_normalize(r, valid, self.scale, _DDOF[self.std], self.eps)  # [B,G] float64
        adv = torch.where(valid, adv, torch.zeros((), dtype=adv.dtype))  # [B,G]
        self._stats["pair_grpo/adv_abs_max"] = float(adv.abs().max()) if adv.numel() else 0.0
        return to_float32(adv)  # [B,G]

    def step_stats(self) -> dict[str, float]:
        """The last batch's share of tied pairs and largest |advantage| (whole batch)."""
        return dict(self._stats)
