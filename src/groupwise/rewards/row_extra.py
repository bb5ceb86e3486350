"""A row extra as a reward: the value a rollout strategy attached to each row (``Request.extras``).

Used by VSPO (spec 17, ``rollout/vspo.py``) for its cheap behaviour proxy ``beh_reward =
"steer_coef"``: the steering coefficient ``α_g / α_max`` the row was sampled under, which the
strategy labels every row with before it is scored.

**Change vs GRPO**: none to the algorithm; listed beside a task reward it adds
``weight · extras[key]`` to each row's total (the reward stage's weighted sum).

**Math**::

    score_{b,g} = rollout.extras[key][b, g]        (0 on invalid rows)

**Defaults**

- ``key = "steer_coef"`` [INFERRED] the extra VSPO's strategy collects. In a config an entry's
  ``key`` only names the entry (for overrides), so a config names another extra with ``extra``
  (``{name = "row_extra", extra = "game_reward"}``, DPA-GRPO's ``dpa_game``); ``extra = ""`` reads ``key``.
- ``weight = 1.0`` [CODE] TRL ``GRPOConfig.reward_weights = None`` weighs every reward 1.0.

**Notes**

1. A rollout scorer (``score_rollout``) that lists ``key`` in ``rollout_extras``: a run whose rollout
   strategy does not collect that extra fails at build, naming it.
2. Invalid rows (``group_valid`` False) score 0; a non-finite extra value is excluded (NaN verdict).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


@register("reward", "row_extra")
@dataclass
class RowExtra:
    """The row extra ``key`` (set by the rollout strategy before scoring) as each row's score."""

    key: str = "steer_coef"
    weight: float = 1.0
    extra: str = ""  # the row extra to read when set (a config's entry `key` names the entry, not the extra)

    needs = ()

    def __post_init__(self) -> None:
        if not self.key and not self.extra:
            raise ConfigError('reward row_extra: key must name a row extra, e.g. key = "steer_coef" (rollout vspo)')

    @property
    def _column(self) -> str:
        """The row extra this reward reads: ``extra`` when set, else ``key``."""
        return self.extra or self.key

    @property
    def rollout_extras(self) -> tuple[str, ...]:
        return (self._column,)

    def score_rollout(self, rollout: Rollout, info: StepInfo) -> Tensor:
        if self._column not in rollout.extras:
            raise KeyError(
                f"reward row_extra: the rollout has no extra {self._column!r} (extras: {sorted(rollout.extras)})"
            )
        value = rollout.extras[self._column].float()  # [B,G]
        return torch.where(rollout.group_valid.bool(), value, torch.zeros(()))  # [B,G]
