"""Layout-paint: a 16-token "image" whose first 4 tokens are a layout set by the prompt and whose
other 12 are a texture painted from the layout — the small analogue of HT-GRPO's sketch-then-paint
premise (spec 12, arXiv 2605.16842; design ``nontext.md`` §3 12; the toy is [INFERRED]).

Prompt ``"layout 5="`` names one of ``N_LAYOUTS`` layouts, a seeded table of 4 digits in 0..7 (the
model must remember it: the layout is the part fixed by the prompt alone). The detail at position
4 + j (j = 0..11) is a texture: the shifted layout token of its column plus a texture draw n_j in
0..W−1 (``TEXTURE = W = 2``), so a detail is never certain, as a real image's fine detail is not,
while the layout is. Whether a confidence-ordered sampler then commits the layout first (the
premise of HT-GRPO) is what ``bench/ht_grpo_premise.py`` measures on fitted models; with W = 1 (details fixed by
the prompt too) it does not (README).

- Task ``layout_paint``: train rows are ``PER_LAYOUT`` rows per layout (``prompt``, ``answer`` = a
  16-digit canvas with its own texture draws, ``layout``); the held-out split is one row per layout (the same
  prompts: a layout cannot be inferred for an unseen name, so the split measures the policy, not
  generalisation).
- Reward ``layout_paint``: 1[the 4 layout tokens are right] + 0.25 · (share of the 12 details that
  follow the rule *from the completion's own layout*), logging ``reward_metric/layout`` (layout
  success) and ``reward_metric/detail`` (detail share).

**Change vs GRPO**: none in the loop; a task and its rule-based reward.

**Math** (layout a = a_0..a_3, the canvas c_0..c_15)::

    c_i = a_i                                          i = 0..3
    c_{4+j} = (a_{j mod 4} + ⌊j/4⌋ + n_j) mod 8,   n_j ~ U{0..W−1} per train row      j = 0..11
    r = 1[c_0..3 = a] + 0.25 · (1/12) Σ_j 1[(c_{4+j} − c_{j mod 4} − ⌊j/4⌋) mod 8 < W]

**Defaults** (all [INFERRED]): ``N_LAYOUTS = 32``, ``PER_LAYOUT = 20``, ``TEXTURE = 2``, the table
drawn from seed 1212, the train rows' texture draws from seed 1213.

**Notes**

1. A completion that is not 16 digits of 0..7 scores 0 on both parts (the mdlm kind with
   ``allowed = "01234567"`` can still emit EOS, which ends the text early).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from groupwise.registry import register
from groupwise.rewards._common import get_column
from groupwise.tasks import Task, register_task

N_LAYOUTS = 32
PER_LAYOUT = 20
LENGTH = 16
TEXTURE = 2
_TABLE_SEED = 1212


@lru_cache(maxsize=1)
def layouts() -> tuple[str, ...]:
    """The layout of each prompt name 0..N_LAYOUTS-1, 4 digits of 0..7 each (distinct layouts)."""
    rng, seen = random.Random(_TABLE_SEED), []
    while len(seen) < N_LAYOUTS:
        layout = "".join(str(rng.randrange(8)) for _ in range(4))
        if layout not in seen:
            seen.append(layout)
    return tuple(seen)


def offsets(digits: Sequence[int]) -> list[int]:
    """(c_{4+j} − c_{j mod 4} − ⌊j/4⌋) mod 8 for j = 0..11: each detail's texture draw."""
    return [(digits[4 + j] - digits[j % 4] - j // 4) % 8 for j in range(LENGTH - 4)]


def canvas(layout: str, rng: random.Random, texture: int = TEXTURE) -> str:
    """The layout, then 12 details painted from it with texture draws in 0..texture-1 from ``rng``."""
    a = [int(c) for c in layout]
    return layout + "".join(str((a[j % 4] + j // 4 + rng.randrange(texture)) % 8) for j in range(LENGTH - 4))


def rows(split: str, n: int, seed: int = 0, texture: int = TEXTURE) -> list[dict]:
    """``n`` rows of ``split`` (``n <= 0``: all). Test: one row per layout in name order; train:
    ``PER_LAYOUT`` rows per layout (texture draws from a fixed stream), ``seed``-shuffled."""
    if split not in ("train", "test"):
        raise ValueError(f"layout_paint has splits 'train' and 'test', not {split!r}")
    rng, copies = random.Random(_TABLE_SEED + 1), 1 if split == "test" else PER_LAYOUT
    pool = [
        {"prompt": f"layout {k}=", "answer": canvas(a, rng, texture), "layout": a}
        for k, a in enumerate(layouts())
        for _ in range(copies)
    ]
    if split == "train":
        random.Random(seed).shuffle(pool)
    return pool[:n] if n > 0 else pool


def score_parts(completion: str, layout: str, texture: int = TEXTURE) -> tuple[float, float]:
    """(layout right: 0/1, share of details within the texture rule of the completion's own layout)."""
    text = str(completion).strip()
    if len(text) != LENGTH or any(c not in "01234567" for c in text):
        return 0.0, 0.0
    digits = [int(c) for c in text]
    detail = sum(o < texture for o in offsets(digits)) / (LENGTH - 4)
    return float(text[:4] == layout), detail


@register("reward", "layout_paint")
@dataclass
class LayoutPaintReward:
    """1[layout right] + ``detail_weight`` · (share of details that follow the texture rule).

    Reads the ``layout`` column; a row without one gets ``None``. Logs ``reward_metric/layout`` and
    ``reward_metric/detail`` (the batch means of the two parts)."""

    detail_weight: float = 0.25  # [INFERRED] spec 12's toy: 0.25 · detail share
    weight: float = 1.0

    def accepts_kwarg(self, name: str) -> bool:
        return name == "log_metric"

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[Any], log_metric: Any = None, **columns: Any
    ) -> list[float | None]:
        targets = get_column(columns, "layout", len(completions), "layout_paint")
        scores: list[float | None] = []
        parts = []
        for completion, layout in zip(completions, targets, strict=True):
            if layout is None:
                scores.append(None)
                continue
            lay, det = score_parts(completion, str(layout))
            parts.append((lay, det))
            scores.append(lay + self.detail_weight * det)
        if log_metric is not None and parts:
            log_metric("layout", sum(p[0] for p in parts) / len(parts))
            log_metric("detail", sum(p[1] for p in parts) / len(parts))
        return scores


register_task(
    Task(
        "layout_paint",
        "a 16-digit canvas: 4 layout digits named by the prompt, 12 details painted from them: 'layout 5=' -> ...",
        rows,
        reward="layout_paint",
    )
)
