"""Built-in verifiable tasks. Each task yields rows ``{"prompt": str, "answer": str, ...}`` with
disjoint ``train`` and ``test`` (held-out) splits, and names its default reward."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from groupwise.registry import ConfigError


@dataclass
class Task:
    name: str
    description: str
    rows: Callable[[str, int, int], list[dict]]  # (split, n, seed) -> rows
    reward: str = "exact"  # default reward component name


TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    if task.name in TASKS:
        raise ConfigError(f"task {task.name!r} is registered twice")
    TASKS[task.name] = task
    return task


def get_task(name: str) -> Task:
    for mod in ("arithmetic", "countdown", "sorting"):
        try:
            importlib.import_module(f"groupwise.tasks.{mod}")
        except ModuleNotFoundError as err:
            if err.name != f"groupwise.tasks.{mod}":
                raise
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; built-in tasks: {', '.join(sorted(TASKS))} (or give data.path)")
    return TASKS[name]
