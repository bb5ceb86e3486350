"""Sampled held-out metrics: the unbiased pass@k estimator and mean@n.

"Evaluating Large Language Models Trained on Code", Mark Chen, Jerry Tworek et al., 2021,
https://arxiv.org/abs/2107.03374, §2.1: with ``n`` samples of a prompt of which ``c`` are correct,

    pass@k = 1 − C(n − c, k) / C(n, k) = 1 − Π_{i = n−c+1}^{n} (1 − k / i)      (1 when n − c < k)

is unbiased for the chance that at least one of ``k`` fresh samples is correct; the product form
avoids the large binomials. ``mean@n`` is the share of all samples that are correct (pass@1's
estimate). The trainer averages each over the held-out prompts (``eval.samples = n``).
"""

from __future__ import annotations


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss
