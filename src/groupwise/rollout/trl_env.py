"""TRL's ``environment_factory`` classes as environments: a TRL user's environment class, unchanged.

**Change vs GRPO**: none by itself — an adapter from TRL's environment contract
(``GRPOTrainer(environment_factory=...)``, TRL 1.16, ``trl/trainer/grpo_trainer.py``: the factory
probe in ``__init__``, the per-rollout ``reset`` in ``_generate_and_score_completions``, the tool loop
``_tool_call_loop``) to the env contract (``components.Env``), played by the ``agent`` strategy.

TRL's contract, as its trainer calls it: ``factory()`` makes an instance; ``reset(**row)`` gets the
dataset row's columns as keyword arguments (here all but ``env``, which names the env) and returns
``None`` or a string that is appended to the row's last prompt message; every public method other
than ``reset`` and ``get_reward`` is a tool (a bound method: its calls change this rollout's
instance); the rollout ends when the assistant answers without a tool call; ``get_reward()`` then
scores it from the instance's state.

**Math** (one episode)::

    reset(row, seed):  env = factory();  obs = env.reset(**row)
                       messages = row["prompt"] (a string is one user message; none: one empty user message)
                       obs not None: the last message's content += obs
    tools():           the public methods of type(env) but reset and get_reward, bound to env
    step(answer):      ("", env.get_reward(), done)            the first reply without a tool call ends it

**Defaults**

- ``factory``: required; ``"module:Class"`` (or any callable, in Python), imported like a plug-in.

**Notes**

1. ``get_reward`` is required: the agent strategy scores an episode by its return (``env_return``);
   TRL's other route, reward functions that receive ``environments=``, has no counterpart here.
2. ``reset`` gets no seed (TRL passes none): an episode replays exactly on resume when ``reset`` is a
   function of the row (draw any randomness from a row column, e.g. a seed column).
3. One fresh instance per episode (TRL pools instances and calls ``reset`` again; a class written for
   TRL resets its whole state in ``reset``, so both give the same episodes).
4. Async methods (TRL runs them on an event loop) are not supported and are refused.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from groupwise.errors import ConfigError
from groupwise.registry import register


def _public_methods(cls: type) -> list[str]:
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)  # on the class: properties stay unread
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


@register("env", "trl")
@dataclass
class TRLEnvironment:
    """A TRL ``environment_factory`` class: its methods are the episode's tools, ``get_reward`` its return."""

    factory: Any = None
    _env: Any = field(default=None, init=False, repr=False)
    _reward: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if isinstance(self.factory, str):
            from groupwise.rollout.tools import _load_function

            self.factory = _load_function(self.factory, "rollout.params.env_params.factory")
        if not callable(self.factory):
            raise ConfigError(
                f"env trl: factory={self.factory!r} must be a TRL environment class or factory, 'module:Class' "
                f"(rollout.params.env_params = {{factory = 'my_envs:MyEnv'}})"
            )
        probe = self.factory()  # as TRL does at construction: the class must have reset and get_reward
        cls = type(probe)
        for needed in ("reset", "get_reward"):
            if not callable(getattr(cls, needed, None)):
                raise ConfigError(
                    f"env trl: {cls.__name__} has no {needed}() method; TRL environments define reset(**row), and "
                    f"here the episode's return is get_reward() (TRL's reward_funcs(environments=...) is not "
                    f"supported: score in get_reward)"
                )
        asynchronous = [
            n for n in ("get_reward", *_public_methods(cls)) if inspect.iscoroutinefunction(getattr(cls, n))
        ]
        if asynchronous:
            raise ConfigError(f"env trl: {cls.__name__} has async methods {asynchronous}; only plain methods are run")

    def reset(self, row: dict, seed: int) -> list[dict]:
        self._env, self._reward = self.factory(), 0.0
        # every column but ``env``, the runner's control field (as TRL leaves out its ``environment`` field)
        observation = self._env.reset(**{k: v for k, v in row.items() if k != "env"})
        prompt = row.get("prompt", "")
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            messages = [dict(m) for m in prompt]
        else:
            raise ConfigError(f"env trl: a row's 'prompt' is a string or a list of messages, got {prompt!r:.80}")
        if observation is not None:
            messages[-1]["content"] = str(messages[-1].get("content", "")) + str(observation)
        return messages

    def tools(self) -> list:
        return [getattr(self._env, name) for name in _public_methods(type(self._env))]

    def step(self, action: str) -> tuple[str, float, bool]:
        self._reward = float(self._env.get_reward())
        return "", self._reward, True

    def outcome(self) -> dict:
        return {"reward": self._reward}
