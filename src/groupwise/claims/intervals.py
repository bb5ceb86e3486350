"""Seed statistics in plain Python: Student-t 95 % intervals, paired effects and verdicts.

**Math**::

    mean = Σ x_k / n
    s    = sqrt(Σ (x_k − mean)² / (n − 1))          sample standard deviation
    half = t_{0.975}(n − 1) · s / sqrt(n)           95 % two-sided half-width (n ≥ 2)
    d_k  = claimed_k − baseline_k                   paired by seed k (both runs present)
    effect = mean(d) ± half(d)

    verdict (direction "greater")   held          if mean(d) − half(d) > 0
                                    contradicted  if mean(d) + half(d) < 0
                                    inconclusive  otherwise (and whenever n < 2)
    (direction "less" swaps held and contradicted)
    with a non-inferiority ``margin`` m > 0, 0 above is −m (greater) or +m (less)

    detectable effect (80 % power, the interval's 95 % two-sided level)
        mde  = (t_{0.975}(n − 1) + t_{0.80}(n − 1)) · s(d) / sqrt(n)
    the smallest true distance from 0 (or from the margin's bound) that n paired seeds with the
    spread s(d) would show with probability about 0.8: the usual normal-theory sample-size formula
    with t quantiles in place of z (a slight underestimate of the exact noncentral-t answer at small n).

    false "held" by chance: each verdict's side is a one-sided test at 0.025 (half the two-sided
    5 %), so m comparisons whose true effect sits exactly at the bound give 0.025 · m expected
    "held" (and as many "contradicted"); at 74 comparisons, 1.85.

**Notes**

1. ``t_{0.975}(ν)`` and ``t_{0.80}(ν)`` are tables for ν = 1..30 (checked in ``tests/test_claims.py``
   against the integrated t density); above 30 the Cornish–Fisher expansion around the normal
   quantile (z = 1.959964, 0.841621) is used (error < 1e-5 for ν > 30).
2. Censoring (a run that never reached the target): its value is the run's budget, a lower
   bound of the true value. A censored claimed run can only push the true ``d`` up, a censored
   baseline run only down; a verdict whose side of 0 such a push could undo becomes
   ``inconclusive`` with the reason given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# 0.975 quantiles of Student's t with ν = 1..30 degrees of freedom
T975 = (
    12.706205,
    4.302653,
    3.182446,
    2.776445,
    2.570582,
    2.446912,
    2.364624,
    2.306004,
    2.262157,
    2.228139,
    2.200985,
    2.178813,
    2.160369,
    2.144787,
    2.131450,
    2.119905,
    2.109816,
    2.100922,
    2.093024,
    2.085963,
    2.079614,
    2.073873,
    2.068658,
    2.063899,
    2.059539,
    2.055529,
    2.051831,
    2.048407,
    2.045230,
    2.042272,
)
Z975 = 1.959963985
# 0.80 quantiles of Student's t with ν = 1..30 (the power term of the detectable effect)
T80 = (
    1.376382,
    1.060660,
    0.978472,
    0.940965,
    0.919544,
    0.905703,
    0.896030,
    0.888890,
    0.883404,
    0.879058,
    0.875530,
    0.872609,
    0.870152,
    0.868055,
    0.866245,
    0.864667,
    0.863279,
    0.862049,
    0.860951,
    0.859964,
    0.859074,
    0.858266,
    0.857530,
    0.856855,
    0.856236,
    0.855665,
    0.855137,
    0.854647,
    0.854192,
    0.853767,
)
Z80 = 0.841621234
ONE_SIDED_LEVEL = 0.025  # each side of a two-sided 95 % interval


def _quantile(table: tuple[float, ...], z: float, dof: int, name: str) -> float:
    if not isinstance(dof, int) or dof < 1:
        raise ValueError(f"{name}: degrees of freedom must be an integer >= 1, got {dof!r}")
    if dof <= len(table):
        return table[dof - 1]
    v = float(dof)  # Cornish–Fisher expansion of the t quantile around the normal one
    return (
        z
        + (z**3 + z) / (4 * v)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3)
    )


def t975(dof: int) -> float:
    """0.975 quantile of Student's t with ``dof`` degrees of freedom (95 % two-sided)."""
    return _quantile(T975, Z975, dof, "t975")


def t80(dof: int) -> float:
    """0.80 quantile of Student's t with ``dof`` degrees of freedom (80 % power)."""
    return _quantile(T80, Z80, dof, "t80")


def detectable_effect(sd: float | None, n: int) -> float | None:
    """Smallest effect n paired seeds with spread ``sd`` detect with ~80 % power at the 95 % interval:
    (t_{0.975}(n − 1) + t_{0.80}(n − 1)) · sd / sqrt(n); None without a spread (n < 2)."""
    if sd is None or n < 2:
        return None
    return (t975(n - 1) + t80(n - 1)) * sd / math.sqrt(n)


def expected_false_held(comparisons: int, level: float = ONE_SIDED_LEVEL) -> float:
    """Expected number of "held" by chance among ``comparisons`` whose true effect is at the bound."""
    return comparisons * level


@dataclass
class Interval:
    """mean ± half over n values; ``half`` is None when n < 2 (no interval)."""

    mean: float | None
    half: float | None
    n: int
    sd: float | None = None
    values: list[float] = field(default_factory=list)

    @property
    def low(self) -> float | None:
        return None if self.half is None else self.mean - self.half

    @property
    def high(self) -> float | None:
        return None if self.half is None else self.mean + self.half

    def format(self, digits: int = 3) -> str:
        if self.n == 0:
            return "no runs"
        if self.half is None:
            return f"{self.mean:.{digits}f} (n=1, no interval)"
        return f"{self.mean:.{digits}f} ± {self.half:.{digits}f}"

    def to_dict(self) -> dict:
        return {
            "mean": self.mean,
            "half": self.half,
            "low": self.low,
            "high": self.high,
            "n": self.n,
            "sd": self.sd,
            "values": self.values,
        }


def mean_interval(values: list[float]) -> Interval:
    """Mean and Student-t 95 % half-width of ``values`` (None entries are an error: filter first)."""
    xs = [float(v) for v in values]
    if any(not math.isfinite(x) for x in xs):
        raise ValueError(f"mean_interval: non-finite value in {xs}")
    n = len(xs)
    if n == 0:
        return Interval(None, None, 0)
    mean = sum(xs) / n
    if n == 1:
        return Interval(mean, None, 1, None, xs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    return Interval(mean, t975(n - 1) * sd / math.sqrt(n), n, sd, xs)


def paired_differences(claimed: dict[int, float], baseline: dict[int, float]) -> dict[int, float]:
    """Per-seed ``claimed − baseline`` over the seeds present (not None) in both."""
    return {
        k: claimed[k] - baseline[k]
        for k in sorted(claimed)
        if k in baseline and claimed[k] is not None and baseline[k] is not None
    }


def paired_effect(claimed: dict[int, float], baseline: dict[int, float]) -> Interval:
    """Mean of the per-seed differences ± its 95 % t interval (n = number of paired seeds)."""
    return mean_interval(list(paired_differences(claimed, baseline).values()))


def verdict(
    effect: Interval, direction: str, claimed_censored: int = 0, baseline_censored: int = 0, margin: float = 0.0
) -> tuple[str, str]:
    """``(held | contradicted | inconclusive, reason)`` for a claimed ``direction`` (greater | less).

    ``margin`` > 0 turns the test into non-inferiority (a paper claiming parity): the interval is
    compared with −margin (direction greater) or +margin (less) instead of 0."""
    if direction not in ("greater", "less"):
        raise ValueError(f"verdict: direction must be 'greater' or 'less', got {direction!r}")
    if margin < 0:
        raise ValueError(f"verdict: margin must be >= 0, got {margin}")
    if effect.n < 2 or effect.half is None:
        return "inconclusive", f"n={effect.n} paired seed(s): no interval"
    bound = -margin if direction == "greater" else margin
    where = "0" if margin == 0 else f"{bound:+g} (non-inferiority margin {margin:g})"
    if effect.low > bound:
        side = "greater"
    elif effect.high < bound:
        side = "less"
    else:
        return "inconclusive", f"the interval contains {where}"
    # censored values are lower bounds: a claimed one can raise the true d, a baseline one lower it
    if side == "greater" and baseline_censored:
        return (
            "inconclusive",
            f"interval above {where}, but {baseline_censored} baseline run(s) "
            "never reached the target (their true values may be larger)",
        )
    if side == "less" and claimed_censored:
        return (
            "inconclusive",
            f"interval below {where}, but {claimed_censored} claimed run(s) "
            "never reached the target (their true values may be larger)",
        )
    if side == direction:
        return "held", f"the interval excludes {where} on the claimed side ({direction})"
    return "contradicted", f"the interval excludes {where} on the other side (claimed {direction})"
