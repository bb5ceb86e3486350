"""Built-in verifiable tasks. Each task yields rows ``{"prompt": str, "answer": str, ...}`` with
disjoint ``train`` and ``test`` (held-out) splits, and names its default reward. A paper's own toy
task lives in its folder (``papers/NN_slug/``) and registers itself the same way."""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable
from dataclasses import dataclass

from groupwise.errors import ConfigError


@dataclass
class Task:
    name: str
    description: str
    rows: Callable[[str, int, int], list[dict]]  # (split, n, seed) -> rows
    reward: str | dict = "exact"  # default reward: a component name, or a table {name = ..., <params>}


TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    if task.name in TASKS:
        raise ConfigError(f"task {task.name!r} is registered twice")
    TASKS[task.name] = task
    return task


def split_pool(items: list, split: str, n: int, seed: int, test_size: int, task: str) -> list:
    """The items of ``split`` of a generated task: the first ``test_size`` are 'test' (fixed order), the
    rest 'train'; ``n > 0`` train items are a ``seed``-shuffled sample, ``n <= 0`` the whole split."""
    if split == "test":
        pool = list(items[:test_size])
    elif split == "train":
        pool = list(items[test_size:])
        if n > 0:
            random.Random(seed).shuffle(pool)
    else:
        raise ValueError(f"{task} has splits 'train' and 'test', not {split!r}")
    return pool[:n] if n > 0 else pool


def _task_modules() -> list[str]:
    """Every module of this package except the file loader: each registers its tasks on import."""
    import pkgutil

    return [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_") and m.name != "data"]


def get_task(name: str) -> Task:
    """A task by name: this package's tasks, then the paper folders' toys (``groupwise.papers``)."""
    for mod in _task_modules():
        importlib.import_module(f"groupwise.tasks.{mod}")
    if name not in TASKS:
        from groupwise.registry import load_all  # imports every paper folder's modules, which register their tasks

        load_all()
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; built-in tasks: {', '.join(sorted(TASKS))} (or give data.path)")
    return TASKS[name]


def resampled(held: list[dict], seed: int) -> list[dict]:
    """``data.resample_eval``: the held-out rows in a ``seed``-shuffled order, so the first
    ``eval.size`` of them are the seed's own sample of the test split (without replacement). The
    shuffle has its own stream (``heldout:<seed>``), not the training draw's."""
    rows = list(held)
    random.Random(f"heldout:{seed}").shuffle(rows)
    return rows


def load_splits(
    data_cfg, seed: int, own_rewards: bool = False, eval_needs_answer: bool = True
) -> tuple[list[dict], list[dict], str]:
    """(train rows, held-out rows, default reward name) for a run's ``[data]`` section. A run that
    scores training with its own rewards (``own_rewards``) needs no ``answer`` column in its
    training rows; the held-out rows need it when held-out evaluation compares with it
    (``eval_needs_answer``: the default eval reward). A missing answer is refused naming what
    needs it and the setting that makes it unnecessary. With ``data.resample_eval`` the held-out
    rows come in the seed's order (``resampled``)."""
    if data_cfg.path:
        from groupwise.tasks.data import load_rows

        columns = dict(data_cfg.columns) or None
        train = load_rows(
            data_cfg.path,
            columns=columns,
            on_bad_row=data_cfg.on_bad_row,
            require_answer=not own_rewards,
            answer_needed_by="training needs it because the default reward 'exact' compares each completion with "
            'it: set `rewards` to your own reward (e.g. rewards=[{name="python", fn="my_rewards:score"}]) and '
            "the train rows need no answer",
        ).rows
        held = (
            load_rows(
                data_cfg.eval_path,
                columns=columns,
                on_bad_row=data_cfg.on_bad_row,
                require_answer=eval_needs_answer,
                answer_needed_by="held-out evaluation (data.eval_path) needs it because the default eval reward "
                "'exact' compares each completion with it: set eval.reward to a reward that needs no answer (your "
                'own, e.g. eval.reward={name="python", fn="my_rewards:score"}), or eval.size=0',
            ).rows
            if data_cfg.eval_path
            else []
        )
        if data_cfg.train_size > 0:
            train = train[: data_cfg.train_size]
        return train, resampled(held, seed) if data_cfg.resample_eval else held, "exact"
    task = get_task(data_cfg.task)
    held = task.rows("test", 0, seed)
    held = resampled(held, seed) if data_cfg.resample_eval else held
    return task.rows("train", data_cfg.train_size, seed), held, task.reward
