"""Gymnasium environments for the continuous policy kind (optional extra ``gym``: ``pip install 'groupwise[gym]'``).

**Change vs GRPO**: none by itself — an adapter from Gymnasium's ``Env`` (https://gymnasium.farama.org,
``gymnasium`` 1.x on PyPI; read for the API: ``gymnasium/core.py`` ``Env.reset / step``,
``gymnasium/spaces/box.py``) to the env contract (``components.Env``), for the ``gaussian`` policy
kind (``modalities/gaussian.py``: observation → N(μ_θ(s), σ²I), one continuous action per row).
The multi-turn strategies play it: ``grow`` (every step a row under its own observation; with
``step_return = "rtg"`` each row's value is its reward-to-go) is the natural one.

**Where the spaces fit**: a ``Box`` observation space (flattened: the policy's ``obs_dim`` is its
size) and a ``Box`` action space (``dim`` is its size). Other spaces (``Discrete``, ``Dict``, images
with a ``Box`` of integers are fine as numbers but large) are refused at ``reset`` with the spaces named.

**Math** (one episode; ``env_id`` a registered Gymnasium id, e.g. ``"Pendulum-v1"``)::

    reset(row, seed):  env = gymnasium.make(env_id, max_episode_steps?, **kwargs)
                       obs, _ = env.reset(seed = seed mod 2^32)          → obs.flatten() as floats
    step(a):           a = clip(a, low, high) (``clip``) reshaped to the action space
                       obs, r, terminated, truncated, _ = env.step(a)   → (obs floats, r, terminated or truncated)

The action is the policy's continuous action itself, not text: the env declares
``action_extra = "x_final"`` and the runner (``rollout/env.py``) hands ``step`` that row extra of
the sampled row, a list of ``dim`` floats (the Gaussian policy's action, stored in float32).

**Defaults**

- ``env_id = "Pendulum-v1"`` [INFERRED] a classic-control task with Box spaces (obs 3, action 1).
- ``max_episode_steps = None``: the env's own time limit (Pendulum: 200); a number overrides it.
- ``clip = True``: a Gaussian sample is unbounded, the action space is not; the log-prob stays the
  sample's (the clipping is part of the environment, as in the usual continuous-control PPO).
- the row may name its own ``env_id`` column (a dataset of environments).

**Notes**

1. The seed passed to ``reset`` is the runner's episode seed: episodes replay exactly on resume.
2. ``outcome()`` reports ``return`` (the sum of rewards), ``steps`` and ``terminated`` (the env's
   own end, not its time limit or the runner's ``max_turns``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from groupwise.errors import ConfigError
from groupwise.registry import register


def _gymnasium():
    try:
        import gymnasium
    except ImportError:
        raise ConfigError(
            "env gymnasium: the gymnasium package is not installed; pip install 'groupwise[gym]' (or 'gymnasium>=1,<2')"
        ) from None
    return gymnasium


@register("env", "gymnasium")
@dataclass
class Gymnasium:
    """A Gymnasium environment with Box observations and actions, played by the gaussian policy kind."""

    action_extra: ClassVar[str] = "x_final"  # step() gets the sampled row's continuous action, not its text
    env_id: str = "Pendulum-v1"
    max_episode_steps: int | None = None
    clip: bool = True
    kwargs: dict = field(default_factory=dict)
    _env: Any = field(default=None, init=False, repr=False)
    _return: float = field(default=0.0, init=False)
    _steps: int = field(default=0, init=False)
    _terminated: bool = field(default=False, init=False)

    def reset(self, row: dict, seed: int) -> list[float]:
        gym = _gymnasium()
        env_id = str(row.get("env_id") or self.env_id)
        extra = {"max_episode_steps": self.max_episode_steps} if self.max_episode_steps else {}
        try:
            self._env = gym.make(env_id, **extra, **self.kwargs)
        except Exception as err:
            raise ConfigError(f"env gymnasium: cannot make {env_id!r} ({type(err).__name__}: {err})") from None
        spaces = (self._env.observation_space, self._env.action_space)
        if not all(isinstance(s, gym.spaces.Box) for s in spaces):
            raise ConfigError(
                f"env gymnasium: {env_id!r} has observation space {spaces[0]} and action space {spaces[1]}; the "
                f"gaussian policy kind needs Box spaces for both (continuous observations and actions)"
            )
        obs, _ = self._env.reset(seed=int(seed) % (1 << 32))
        self._return, self._steps, self._terminated = 0.0, 0, False
        return [float(v) for v in obs.reshape(-1)]

    def step(self, action: Any) -> tuple[list[float], float, bool]:
        import numpy as np

        space = self._env.action_space
        a = np.asarray(action, dtype=space.dtype)
        if a.size != int(np.prod(space.shape)):
            raise ConfigError(
                f"env gymnasium: an action of {a.size} numbers for the action space {space}; set the gaussian "
                f"policy's dim (model.params.dim) to {int(np.prod(space.shape))}"
            )
        a = a.reshape(space.shape)
        if self.clip:
            a = np.clip(a, space.low, space.high)
        obs, reward, terminated, truncated, _ = self._env.step(a)
        self._return += float(reward)
        self._steps += 1
        self._terminated = bool(terminated)
        done = bool(terminated or truncated)
        if done:
            self._env.close()
        return [float(v) for v in obs.reshape(-1)], float(reward), done

    def outcome(self) -> dict:
        return {"return": self._return, "steps": self._steps, "terminated": float(self._terminated)}
