"""Helpers shared by the reward modules (no torch import: the math worker process loads this)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class RewardError(ValueError):
    """A reward function failed or broke its contract; the message names the function."""


def get_column(columns: Mapping[str, Any], name: str, n: int, reward: str) -> Sequence[Any]:
    """Column ``name`` with one value per completion, or an error naming the column and reward."""
    if name not in columns:
        have = ", ".join(sorted(columns)) or "none"
        raise RewardError(
            f"reward {reward!r} needs the dataset column {name!r}, which the batch does not have (columns: {have})"
        )
    values = columns[name]
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
        raise RewardError(f"reward {reward!r}: column {name!r} must hold one value per completion ({n}), got {got}")
    return values


def get_scalar(columns: Mapping[str, Any], name: str, reward: str) -> Any:
    """A per-batch value such as ``max_new_tokens``, or an error naming it and the reward."""
    if name not in columns:
        have = ", ".join(sorted(columns)) or "none"
        raise RewardError(
            f"reward {reward!r} needs {name!r} in the columns, which the batch does not have (columns: {have})"
        )
    return columns[name]
