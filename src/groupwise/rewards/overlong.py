"""Soft overlong punishment: a length penalty that ramps from 0 to -1 over the last tokens.

"DAPO: An Open-Source LLM Reinforcement Learning System at Scale", Qiying Yu et al., 2025,
https://arxiv.org/abs/2503.14476 (Sec. 3.4, Eq. 13).

**Change vs GRPO**: GRPO has no length term. This reward adds DAPO's soft overlong punishment, a
penalty that grows as a completion runs into the generation budget, to the task reward.

**Math** (``L_max`` the generation budget, ``L_cache`` the punishment buffer, ``length`` the
completion's tokens; ``L_expected = L_max - L_cache`` the longest length with no penalty)::

    penalty = 0                                      if length <= L_max - L_cache
    penalty = (L_max - L_cache - length) / L_cache   if L_max - L_cache < length <= L_max
    penalty = -1                                     if length > L_max

**Defaults**

- ``L_max`` = ``max_new_tokens`` from the columns [PAPER] the maximum number of generated tokens;
  ``max_length`` (default ``None``) overrides it.
- ``overlong_buffer`` (``L_cache``) = 4 tokens [INFERRED] sized for the tiny CPU runs of this
  library. DAPO used ``L_cache = 4096`` with ``L_max = 20480`` [PAPER], i.e. 20% of the budget;
  set ``overlong_buffer`` accordingly at scale.
- ``weight = 1.0`` [PAPER] added unscaled.

**Notes**

1. It is added to the task reward (so give it ``weight=1.0`` next to e.g. ``math``).
2. A completion cut at the budget has ``length == L_max`` and gets -1 when ``overlong_buffer > 0``.
   With ``overlong_buffer = 0`` the ramp is empty: every ``length <= L_max`` scores 0 and only
   ``length > L_max`` scores -1.
3. Lengths come from the ``completion_lengths`` column (tokens generated per completion, the EOS
   token included when one was generated). A ``None`` length scores ``None``.
4. ``overlong_buffer < 0`` or ``max_length <= 0`` is a ``ConfigError`` at build time;
   ``overlong_buffer > L_max`` is a ``RewardError`` when scoring, and so is a missing
   ``completion_lengths`` column or ``max_new_tokens`` value (the message names it).
5. The penalty depends on the length only, not on whether the answer is right. DAPO's other
   length fix, overlong filtering, is the ``mask_truncated`` token weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rewards._common import RewardError, get_column, get_scalar


@register("reward", "overlong")
@dataclass
class Overlong:
    """DAPO soft overlong punishment: 0 up to ``L_max - buffer`` tokens, linear to -1 at ``L_max``."""

    overlong_buffer: int = 4
    max_length: int | None = None
    weight: float = 1.0

    def __post_init__(self) -> None:
        if self.overlong_buffer < 0:
            raise ConfigError(f"reward 'overlong': overlong_buffer must be >= 0, got {self.overlong_buffer}")
        if self.max_length is not None and self.max_length <= 0:
            raise ConfigError(f"reward 'overlong': max_length must be positive, got {self.max_length}")

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float | None]:
        lengths = get_column(columns, "completion_lengths", len(completions), "overlong")
        L_max = (
            self.max_length if self.max_length is not None else int(get_scalar(columns, "max_new_tokens", "overlong"))
        )
        L_cache = self.overlong_buffer
        L_expected = L_max - L_cache  # longest length with no penalty
        if L_expected < 0:
            raise RewardError(f"reward 'overlong': overlong_buffer={L_cache} exceeds the length budget L_max={L_max}")
        penalties: list[float | None] = []
        for length in lengths:
            if length is None:
                penalties.append(None)
            elif length <= L_expected:
                penalties.append(0.0)
            elif length <= L_max:  # here L_cache > 0, since L_expected < length <= L_max
                penalties.append((L_expected - length) / L_cache)
            else:
                penalties.append(-1.0)
        return penalties
