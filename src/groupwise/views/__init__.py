"""Views: edited contexts that rows are re-scored under (``Need(view=NAME)``; protocol in ``components.View``).

A view's ``apply(rollout, encode)`` returns either a ``Rollout`` on the original token axis (the
prompt edited, completions untouched: ``ground_truth``, ``corrupt_context``) or a :class:`Remapped`
(the completion tokens edited too: ``ablate_role``), whose ``positions`` say where each original
token sits in the edited rows; the need resolver scores the edited rows and maps every quantity
back to the original axis (``needs.remap_back``).

A view that edits only the prompt may also define ``prompt(meta, key)`` (the edited prompt of one
dataset row): such a view can score held-out prompts too (``eval.views``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from groupwise.types import Rollout


@dataclass
class Remapped:
    """Rows whose completion tokens a view edited, with the map back to the original token axis.

    ``rows``: the edited rollout ([B,G,T'] actions, mask a prefix; same groups, rows and prompts
    unless the view edits them). ``positions`` [B,G,T] long: for each original token t of row
    (b, g), its index in ``rows``' token axis, or −1 when it has no counterpart (a removed token);
    a mapped token must be the same token id inside the edited row's mask (checked by the resolver)."""

    rows: Rollout
    positions: Tensor  # [B,G,T] long


def edit_user_text(prompt: Any, edit: Callable[[str], str], who: str, group: int = 0) -> Any:
    """``edit`` applied to a prompt string, or to the content of the LAST user message of a copy of chat messages."""
    if isinstance(prompt, str):
        return edit(prompt)
    messages = copy.deepcopy(list(prompt))
    users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise ValueError(f"{who}: group {group}'s prompt is neither a string nor chat messages with a user turn")
    messages[users[-1]]["content"] = edit(messages[users[-1]]["content"])
    return messages
