"""Stage 3: rewards. Each scorer is a registered dataclass with TRL's reward-function signature::

    __call__(prompts: list[str], completions: list[str], **columns) -> list[float | None]

one value per completion, ``None`` meaning "no verdict" (the sample is excluded and counted, never
scored 0). ``columns`` holds the dataset columns repeated per completion plus
``completion_lengths``, ``truncated`` and ``max_new_tokens``. Every scorer has ``weight``.

Built in: ``exact``, ``math``, ``format``, ``overlong``, ``python``, ``code`` (sandboxed execution), and the
rollout scorer ``kl_penalty`` (one module each).
:func:`score` (``score.py``) runs a list of scorers over a batch, validates what each returns and
combines them.

``score`` is imported here eagerly on purpose: it rebinds the package attribute ``score`` from the
submodule to the function, so ``from groupwise.rewards import score`` is always the function and
``from groupwise.rewards.score import score`` works too.
"""

from __future__ import annotations

from groupwise.rewards._common import RewardError
from groupwise.rewards.score import ScoreResult, reward_label, score

__all__ = ["score", "ScoreResult", "RewardError", "reward_label"]
