"""RubricEM's reflection memory: a bank of accepted reflections keyed by task type, and the judge-gated meta reward.

"RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards", arXiv
2605.10899 (spec 39). In the paper a reflection meta-policy (the policy's own weights under another
prompt) turns a judged trajectory into a rubric-grounded reflection; accepted reflections are stored
in a "rubric bank" and retrieved into later prompts. The spec's CPU analogue: short hint strings,
the bank a dict keyed by task type. The data structure and the reward's form are here; the rollout
strategy ``rubricem_reflect`` (``rollout/rubricem_reflect.py``) generates the reflections, trains them
with GRPO over G reflections, fills the bank and retrieves from it into later prompts.

**Math** [INFERRED] (the spec's form)::

    r_meta = 1[judge approves R] · (score(attempt | R) − score(attempt | no R))

**Defaults**

- ``capacity = 8`` [INFERRED] reflections kept per task key, oldest dropped first.
- Retrieval [INFERRED]: exact task key (the spec's "dict keyed by task type"), newest first; an
  identical reflection added again moves to the front instead of being stored twice.

**Notes**

1. ``retrieve(key, k)`` of an unknown key is ``[]``; ``k <= 0`` is ``[]``.
2. ``state_dict()`` / ``load_state_dict()`` round-trip the bank (a resumed run sees the same bank).
"""

from __future__ import annotations

from typing import Any


def meta_reward(approved: bool, score_with: float, score_without: float) -> float:
    """The judge-gated improvement ``1[approved] · (score_with − score_without)`` (module docstring)."""
    return float(score_with - score_without) if approved else 0.0


class RubricBank:
    """Accepted reflections per task key, newest first, at most ``capacity`` per key."""

    def __init__(self, capacity: int = 8):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"RubricBank: capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self._bank: dict[str, list[str]] = {}

    def add(self, task_key: str, reflection: str) -> None:
        items = [r for r in self._bank.get(task_key, []) if r != reflection]
        self._bank[task_key] = [reflection, *items][: self.capacity]

    def retrieve(self, task_key: str, k: int = 1) -> list[str]:
        return list(self._bank.get(task_key, [])[: max(k, 0)])

    def __len__(self) -> int:
        return sum(len(v) for v in self._bank.values())

    def state_dict(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "bank": {k: list(v) for k, v in self._bank.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved reflections, at most this bank's own ``capacity`` per key (the configured one: a
        run resumed with another capacity keeps the newest that fit)."""
        self._bank = {k: list(v)[: self.capacity] for k, v in state["bank"].items()}
