"""The environment's return as a reward: the column a multi-turn rollout strategy fills.

No paper: the reward slot of an environment run (``rollout/env.py``). The env rollout strategies
(``grow``, ``episodes``) play episodes and put each row's return into this reward's column of
``reward_parts`` before the reward stage's ``finish``, so its ``weight``, the rollout scorers
(``kl_penalty``) and the weighted total apply as for any reward.

**Change vs GRPO**: none — GRPO's outcome reward, here the env's return instead of a verifier.

**Math**::

    in an env run:        r_row = g_row   (the strategy's return of that row: outcome or return-to-go)
    scored as text alone: r = env.action_value(row, completion)   (the best return still reachable
                          after that one action from the row's first state; held-out evaluation)

**Defaults**

- ``env = None`` [INFERRED] the env named by the row's ``env`` column (built-in env tasks set it).
- ``env_params = {}`` [INFERRED] the env's own defaults; keep them equal to the strategy's.
- ``weight = 1.0`` [INFERRED] the return as is.

**Notes**

1. Scored as text (held-out evaluation, or a single-turn strategy such as ``sample``), the env
   must define ``action_value(row, action)``; one that does not is an error naming the fix
   (train with ``rollout.name = "grow"`` or ``"episodes"``, evaluate with another ``eval.reward``).
2. An env strategy rejects every other text reward at build: it has no single completion per row
   to give them (``rollout.env.check_env_rewards``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from groupwise.registry import build, register
from groupwise.rewards._common import RewardError, get_column


@register("reward", "env_return")
@dataclass
class EnvReturn:
    """The env's return (filled by an env rollout strategy); as text alone, the env's ``action_value``."""

    env: str | None = None
    env_params: dict = field(default_factory=dict)
    weight: float = 1.0

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float | None]:
        n = len(completions)
        names = [self.env] * n if self.env else get_column(columns, "env", n, "env_return")
        keys = [k for k, v in columns.items() if isinstance(v, (list, tuple)) and len(v) == n]
        envs: dict[str, Any] = {}
        out: list[float | None] = []
        for i, (name, text) in enumerate(zip(names, completions)):
            if name not in envs:
                envs[name] = build("env", name, **self.env_params)
            value = getattr(envs[name], "action_value", None)
            if value is None:
                raise RewardError(
                    "reward 'env_return' scores a lone completion only for an env with "
                    f"action_value(row, action); env {name!r} has none: train with rollout.name='grow' "
                    "or 'episodes' (they fill the return) and set another eval.reward"
                )
            out.append(float(value({k: columns[k][i] for k in keys}, text)))
        return out
