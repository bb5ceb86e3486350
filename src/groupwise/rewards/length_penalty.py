"""Linear length penalty: every generated token costs ``1 / L`` of the reward.

A plain length penalty, the "length-penalty GRPO" baseline that ProFIL is compared with
(specs/34: "compare against length-penalty GRPO at matched average length"). Length rewards of
this shape are common in reasoning-RL (e.g. Kimi k1.5, arXiv 2501.12599, §2.3.3, uses a
group-relative variant); the form here is the simplest one and is not taken from any paper.

**Change vs GRPO**: GRPO has no length term. This reward is added to the task reward, so shorter
completions score higher by ``weight / L`` per token.

**Math** (``length`` = tokens generated, EOS included; ``L`` = ``max_length`` or the generation
budget ``max_new_tokens``)::

    penalty = − length / L            ∈ [−1, 0]      (the run adds weight · penalty)

**Defaults**

- ``max_length = None`` → ``L = max_new_tokens`` [INFERRED] a penalty in [−1, 0] whatever the budget.
- ``weight = 1.0`` [INFERRED] as every reward; set the strength with ``weight`` (the ``profil``
  claim's baseline uses 0.5: see claim ``34-profil``).

**Notes**

1. The penalty depends on the length only, never on correctness; compare the soft, budget-end
   ramp of ``overlong`` (DAPO), which is 0 until the last ``overlong_buffer`` tokens.
2. A ``None`` length scores ``None`` (no verdict); a missing ``completion_lengths`` column or
   ``max_new_tokens`` is a ``RewardError`` naming it; ``max_length <= 0`` a ``ConfigError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rewards._common import get_column, get_scalar


@register("reward", "length_penalty")
@dataclass
class LengthPenalty:
    """−length / L for every completion: a linear per-token cost."""

    max_length: int | None = None
    weight: float = 1.0

    def __post_init__(self) -> None:
        if self.max_length is not None and self.max_length <= 0:
            raise ConfigError(f"reward 'length_penalty': max_length must be positive, got {self.max_length}")

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float | None]:
        lengths = get_column(columns, "completion_lengths", len(completions), "length_penalty")
        L = (
            self.max_length
            if self.max_length is not None
            else int(get_scalar(columns, "max_new_tokens", "length_penalty"))
        )
        return [None if n is None else -float(n) / L for n in lengths]
