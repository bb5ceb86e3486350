"""Format reward: 1.0 when the completion matches a regular expression, else 0.0.

DeepSeek-R1 ("DeepSeek-R1: Incentivizing Reasoning Capability in LLMs via Reinforcement
Learning", DeepSeek-AI, 2025, https://arxiv.org/abs/2501.12948) adds a "format reward" for
putting the reasoning between ``<think>`` tags; open-r1's ``format_reward``
(https://github.com/huggingface/open-r1, ``src/open_r1/rewards.py``) and TRL's
``think_format_reward`` (``trl/rewards/format_rewards.py``) implement it as a regex match over the
completion. Here the pattern is the user's.

**Change vs GRPO**: none — standard practice (R1's format reward), a rule-based reward; it only
fills the reward column that GRPO's advantage estimator then centres and scales.

**Math** (``regex = re.compile(pattern, re.DOTALL)``, compiled once at build time)::

    score = 1.0 if regex.fullmatch(completion) else 0.0     (search=False)
    score = 1.0 if regex.search(completion) else 0.0        (search=True)

**Defaults**

- ``pattern``: required, no default — e.g. R1's
  ``r"<think>.*?</think>\\s*<answer>.*?</answer>"``.
- ``search = False`` (the whole completion must match) [CODE] open-r1's ``format_reward`` and TRL's
  ``think_format_reward`` anchor their patterns at both ends (``^…$``).
- ``re.DOTALL`` always, so ``.`` crosses lines [CODE] open-r1 and TRL pass ``re.DOTALL`` too.
- ``weight = 1.0`` [CODE] TRL ``GRPOConfig.reward_weights = None`` weighs every reward 1.0.

**Notes**

1. A missing or invalid pattern is an error at build time, naming the pattern: ``None``, a
   non-string or an empty string, or one that does not compile (``ConfigError``).
2. ``re.MULTILINE`` is not set. open-r1 and TRL set it, under which their ``$`` may match at any line
   end; with ``fullmatch`` text after the last tag makes the completion score 0.
3. Every completion gets a verdict (never ``None``); dataset columns are ignored.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from groupwise.errors import ConfigError
from groupwise.registry import register


@register("reward", "format")
@dataclass
class Format:
    """1.0 if ``pattern`` matches the whole completion (``search=True``: anywhere), else 0.0."""

    pattern: str | None = None
    search: bool = False
    weight: float = 1.0
    _regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.pattern is None or not isinstance(self.pattern, str) or self.pattern == "":
            raise ConfigError(
                f"reward 'format' needs `pattern`, a non-empty regular expression string (got {self.pattern!r})"
            )
        try:
            self._regex = re.compile(self.pattern, re.DOTALL)
        except re.error as err:
            raise ConfigError(
                f"reward 'format': pattern {self.pattern!r} is not a valid regular expression: {err}"
            ) from err

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float | None]:
        match = self._regex.search if self.search else self._regex.fullmatch
        return [1.0 if match(text) else 0.0 for text in completions]
