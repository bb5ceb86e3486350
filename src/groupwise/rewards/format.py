"""Format reward: 1.0 when the completion matches a regular expression, else 0.0.

DeepSeek-R1 (DeepSeek-AI 2025, https://arxiv.org/abs/2501.12948) adds a "format reward" for
putting the reasoning between ``<think>`` tags; TRL's and open-r1's ``format_reward``
(https://github.com/huggingface/open-r1, ``src/open_r1/rewards.py``) implement it as a regex
match over the whole completion. Here the pattern is the user's:

    score = 1.0 if re.fullmatch(pattern, completion, re.DOTALL) else 0.0     (search=False)
    score = 1.0 if re.search(pattern, completion, re.DOTALL) else 0.0        (search=True)

Defaults: ``pattern`` is required (no default) — e.g. R1's
``r"<think>.*?</think>\\s*<answer>.*?</answer>"``; ``search=False`` (whole completion must match,
as in open-r1) [CODE]; ``re.DOTALL`` always, so ``.`` crosses lines [CODE]; ``weight=1.0``.

A missing or invalid pattern is an error at build time, naming the pattern.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from groupwise.registry import ConfigError, register


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
            raise ConfigError(f"reward 'format' needs `pattern`, a non-empty regular expression string (got {self.pattern!r})")
        try:
            self._regex = re.compile(self.pattern, re.DOTALL)
        except re.error as err:
            raise ConfigError(f"reward 'format': pattern {self.pattern!r} is not a valid regular expression: {err}") from err

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float | None]:
        match = self._regex.search if self.search else self._regex.fullmatch
        return [1.0 if match(text) else 0.0 for text in completions]
