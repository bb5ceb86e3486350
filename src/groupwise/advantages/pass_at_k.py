"""Pass@k advantages: credit each row for the group's pass@k, not for its own pass@1.

"Pass@k Training for Adaptively Balancing Exploration and Exploitation of Large Reasoning Models",
Zhipeng Chen, Xiaobo Qin, Youbin Wu, Yue Ling, Qinghao Ye, Wayne Xin Zhao, Guang Shi, 2025.
https://arxiv.org/abs/2508.10751 (§2.4 eqs. 11–15, App. B; reference code: github
RUCAIBox/Passk_Training ``code/passk_adv.py``, ``calc_adv``). Option ``form="pkpo"``: "Pass@K
Policy Optimization: Solving Harder Reinforcement Learning Problems", Christian Walder, Deep
Karkhanis, 2025. https://arxiv.org/abs/2505.15201 (§2.2 eq. 8, §4.3 eq. 33, §5.2).

**Change vs GRPO**

- The group's N rewards are replaced by the pass@k rewards of all its C(N, k) subsets of k rows (a
  subset passes when it holds a correct row). ``"chen"`` normalises those subset rewards as GRPO
  does and gives each row the mean advantage of the subsets it is in (the exact limit of Chen et
  al.'s bootstrap groups): a wrong row that shares subsets with correct rows is penalised less,
  and mostly-solved groups get less weight than under GRPO.
- ``"pkpo"``: each row gets its unbiased share of the pass@k policy gradient with the pass@(k−1)
  leave-one-out baseline (PKPO's s^(loo−1)); on binary rewards only correct rows get credit.

**Math** (per group: N valid rows, c correct ones (reward >= correct_at), k' = min(k, N))::

    form="chen"  (Chen et al. eqs. 11, 12, 14, 15)
      R̄ = 1 − C(N−c, k') / C(N, k')          σ = sqrt(R̄ · (1 − R̄))
      adv_correct = (1 − R̄) / (σ + eps)
      adv_wrong   = (1 − R̄ − C(N−c−1, k'−1) / C(N−1, k'−1)) / (σ + eps)
    form="pkpo"  (Walder & Karkhanis eq. 33 on 0/1 rewards; k' = 1: their eq. 26)
      k' >= 2:  adv_correct = C(N−c, k'−1) / C(N, k')       adv_wrong = 0
      k' == 1:  adv_i = r_i − (c − r_i) / (N − 1)            (r_i ∈ {0, 1}; this is ``rloo``)

**Defaults**

- ``k = 4`` [INFERRED] Chen et al. §3.4 train with k ∈ {4, 8, 16} at N = 32 and find larger k
  slower at a fixed learning rate; App. A.2 (N = 32) states no single k. PKPO §5.2 uses n = 16.
- ``form = "chen"`` [INFERRED] the primary reference; ``"pkpo"`` is PKPO's recommended s^(loo−1)
  [PAPER] §5.2 ("which we favour due to Figure 4").
- ``correct_at = 1.0`` [PAPER] Chen et al. use R_neg = 0, R_pos = 1 (§2.1, App. A.2); [CODE]
  ``calc_adv`` tests ``val == 1``; the ``>=`` threshold is [INFERRED], as in ``rollout/hora.py``.
- ``eps = 1e-6`` [CODE] ``calc_adv`` divides by ``sigma + 1e-6`` (the paper's eqs. have none).

**Notes**

1. k = 1 reduces ``"chen"`` to GRPO with the population std: R̄ = c/N is the group mean, σ the
   population std of the 0/1 rewards, and adv_wrong = (1 − p − 1)/σ = −p/σ. It equals
   ``grpo(std="population", eps=1e-6)`` to float32 rounding, NOT the default ``grpo`` (Bessel std,
   eps = 1e-4): for N = 4, c = 1 this gives +√3 / −1/√3 (1.7321 / −0.5774), the default ``grpo``
   1.4997 / −0.4999. ``"pkpo"`` at k = 1 is ``rloo`` (PKPO's k_opt = 1 baseline, §5.2).
2. ``"chen"`` sums to 0 over a group: (N−c)·C(N−c−1, k−1)/C(N−1, k−1) = N·C(N−c, k)/C(N, k) =
   N(1 − R̄), using m·C(m−1, k−1) = k·C(m, k) and C(N−1, k−1) = (k/N)·C(N, k). ``"pkpo"`` does
   not: for k' >= 2, Σ_i adv_i = k'·(ρ(N, c, k') − ρ(N, c, k'−1)) >= 0 with ρ(n, c, k) = 1 − C(n−c, k)/C(n, k)
   (every (k'−1)-subset is I \\ i for N − k' + 1 rows i), 0 only for degenerate groups.
3. Exactly 0: all-correct and all-wrong groups, a single valid row, and (``"chen"``) every group with
   N − c < k' — all its k-subsets pass, R̄ = 1, σ = 0, so its wrong rows get 0 too (the reference
   code gives 0 / (0 + 1e-6) = 0 there as well).
4. k > N (a ragged group, or ``rollout.group_size < k``): k is clamped to N [INFERRED]. The
   reference code divides by C(N, k) = 0 there, and no unbiased pass@k estimator exists for n < k
   (PKPO Cor. 2). With k' = N, ``"chen"`` gives 0 to every group (pass@N of the group is 0 or 1);
   ``"pkpo"`` credits a lone correct row with 1 and gives 0 otherwise (PKPO's n = k case).
5. Rewards are thresholded, so any reward below ``correct_at`` counts as wrong (``calc_adv`` maps
   only exact 1 and 0 and leaves other values as they are). PKPO's continuous max_g@k transform
   (§3, eq. 19) and its s^(loo) baseline (eq. 29) are not offered.
6. Invalid rows (``group_valid`` False or a non-finite reward) get exactly 0 and are not counted in
   N; N is each group's own valid count (ragged groups).
7. The binomials are exact integers (``math.comb``) combined as Fractions; one (correct, wrong) pair
   is computed per distinct (N, c) of the batch, rounded once to float64, returned as float32.
8. Scale: ``"pkpo"`` keeps the paper's Σ_i convention, values O(k/N) for k >= 2 but O(1) at k = 1
   (eq. 26), so the step size jumps between k = 1 and k = 2; ``"chen"`` values shrink as k grows
   (Chen et al. §3.4 raise the learning rate for k = 8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.masked import to_float32, valid_rows
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

FORMS = ("chen", "pkpo")


def chen_pair(n: int, c: int, k: int, eps: float = 1e-6) -> tuple[float, float]:
    """(correct, wrong) advantage of Chen et al. eqs. 14–15 for n valid rows, c correct, k clamped to n."""
    k = min(k, n)
    if n < 1:
        return 0.0, 0.0
    mean = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))  # R̄, eq. 11
    var = mean * (1 - mean)  # σ², eq. 12
    if var == 0:  # every k-subset passes, or none does
        return 0.0, 0.0
    sigma = math.sqrt(float(var))
    share = Fraction(math.comb(n - c - 1, k - 1), math.comb(n - 1, k - 1))  # var > 0 ⇒ n − c >= k >= 1
    return float(1 - mean) / (sigma + eps), float(1 - mean - share) / (sigma + eps)


def pkpo_pair(n: int, c: int, k: int) -> tuple[float, float]:
    """(correct, wrong) s^(loo−1) of PKPO eq. 33 on 0/1 rewards (eq. 26 at k = 1), k clamped to n."""
    k = min(k, n)
    if n < 2 or c in (0, n):
        return 0.0, 0.0
    if k == 1:  # leave-one-out mean centring
        return float(1 - Fraction(c - 1, n - 1)), float(-Fraction(c, n - 1))
    # a k-subset holding correct row i adds max_I − max_{I∖i} = 1 iff its other k − 1 rows are wrong
    return float(Fraction(math.comb(n - c, k - 1), math.comb(n, k))), 0.0


@register("advantage", "pass_at_k")
@dataclass
class PassAtKAdvantage:
    """Pass@k-optimising group advantage for binary rewards (Chen et al. 2025; PKPO, Walder & Karkhanis 2025)."""

    group_relative = True  # needs G >= 2 (and G > k for form="chen"): smaller groups get 0

    k: int = 4
    form: str = "chen"  # "chen" | "pkpo"
    correct_at: float = 1.0
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ConfigError(f"pass_at_k: k must be an integer >= 1, got {self.k!r}")
        if self.form not in FORMS:
            raise ConfigError(f"pass_at_k: form must be one of {FORMS}, got {self.form!r}")
        if not math.isfinite(self.correct_at):
            raise ConfigError(f"pass_at_k: correct_at must be a finite number, got {self.correct_at!r}")
        if not self.eps >= 0:
            raise ConfigError(f"pass_at_k: eps must be >= 0, got {self.eps!r}")

    def _pair(self, n: int, c: int) -> tuple[float, float]:
        """(correct-row, wrong-row) advantage of a group with n valid rows, c of them correct."""
        return chen_pair(n, c, self.k, self.eps) if self.form == "chen" else pkpo_pair(n, c, self.k)

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        r, valid = valid_rows(rollout)  # [B,G] float64, [B,G]
        hit = valid & (r >= self.correct_at)  # [B,G] correct rows
        groups = list(zip(valid.sum(1).tolist(), hit.sum(1).tolist()))  # B × (N, c)
        table = {key: self._pair(*key) for key in set(groups)}
        # [B,2]
        values = torch.tensor([table[key] for key in groups], dtype=torch.float64, device=r.device).reshape(-1, 2)
        adv = torch.where(hit, values[:, :1], values[:, 1:])  # [B,G]
        return to_float32(torch.where(valid, adv, torch.zeros((), dtype=adv.dtype)))  # [B,G]
