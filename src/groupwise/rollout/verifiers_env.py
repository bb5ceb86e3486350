"""``verifiers`` environments as environments (optional extra ``agents``: ``pip install 'groupwise[agents]'``).

**Change vs GRPO**: none by itself — an adapter from a ``verifiers`` environment (Prime Intellect,
https://github.com/PrimeIntellect-ai/verifiers, ``verifiers`` 0.1.10 on PyPI: the newest release
whose requirements admit the pinned ``openai`` 3.x) to the env contract (``components.Env``), played
by the ``agent`` strategy: its dataset gives the questions, its multi-turn protocol the turns, its
rubric the return. Read for the API: ``verifiers/envs/multiturn_env.py`` (``rollout``: the loop this
adapter unrolls), ``verifiers/envs/environment.py`` (``init_state``, ``is_completed``),
``verifiers/rubrics/rubric.py`` (``score_rollout``).

A verifiers environment drives a model through an OpenAI client (``rollout(input, client, model)``);
here the policy samples instead, so the adapter plays ``MultiTurnEnv.rollout``'s loop one turn at a
time, with no client:

**Math** (one episode of the row whose ``example_id`` is k)::

    reset(row, seed):  x = env.get_dataset()[k];  state = setup_state(init_state(x))
                       → state["prompt"] (the env's messages: its system prompt and the question)
    step(text):        add the assistant turn to state["trajectory"]
                       is_completed(state)  → done
                       else reply = env_response(messages, state)
                            state["final_env_response"] set → done (the reply closes the completion)
                            else → (reply, 0, False)
    done:              render_completion(state); rubric.score_rollout(state) → ("", state["reward"], True)

**Defaults**

- ``environment``: required; ``"module:function"`` returning a ``verifiers.Environment`` (or the
  environment or function itself, in Python), called with ``args``; an installed verifiers
  environment package is ``"verifiers:load_environment"`` with ``args = {env_id = "name", ...}``.
- ``args = {}``.

**Notes**

1. Rows: ``{"prompt": <any text, for logs>, "example_id": k}`` pick the environment's own dataset
   row k (``rows(environment, n)`` writes them): the env formats its prompts (system prompt, few-shot).
2. One verifiers environment serves every episode (episodes copy only their ``state``); its async
   methods run on one private event loop. ``reset`` gets no seed: a verifiers env that draws at
   random in ``setup_state`` does not replay exactly on resume.
3. Tool environments (``ToolEnv``: OpenAI ``tool_calls`` parsed by the inference server) are not
   supported: offer tools through ``rollout.params.tools`` instead. ``outcome()`` gives ``reward``
   and each rubric metric as ``metric/<name>``.
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from typing import Any

from groupwise.errors import ConfigError
from groupwise.registry import register


def _verifiers():
    try:
        import verifiers
    except ImportError:
        raise ConfigError(
            "env verifiers: the verifiers package is not installed; pip install 'groupwise[agents]' "
            "(or 'verifiers==0.1.10')"
        ) from None
    return verifiers


def rows(environment: Any, n: int = -1) -> list[dict]:
    """Data rows for ``environment`` (a verifiers Environment): ``{"prompt", "example_id", "env"}`` per
    dataset row (the first ``n``), the prompt its last message's text (for logs only)."""
    dataset = environment.get_dataset(n)
    return [
        {"prompt": str(x["prompt"][-1]["content"]), "example_id": i, "env": "verifiers"} for i, x in enumerate(dataset)
    ]


@register("env", "verifiers")
@dataclass
class Verifiers:
    """A verifiers environment: its dataset row, its multi-turn turns, its rubric's reward."""

    environment: Any = None
    args: dict = field(default_factory=dict)
    _env: Any = field(default=None, init=False, repr=False)
    _loop: Any = field(default=None, init=False, repr=False)
    _state: Any = field(default=None, init=False, repr=False)
    _messages: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        vf = _verifiers()
        made = self.environment
        if isinstance(made, str):
            from groupwise.rollout.tools import _load_function

            made = _load_function(made, "rollout.params.env_params.environment")
        if callable(made) and not isinstance(made, vf.Environment):
            made = made(**self.args)
        if not isinstance(made, vf.MultiTurnEnv):
            raise ConfigError(
                f"env verifiers: environment={self.environment!r} must be (or make) a verifiers MultiTurnEnv "
                f"(SingleTurnEnv included), got {type(made).__name__}; e.g. env_params = {{environment = "
                f"'my_envs:load_environment'}}"
            )
        if isinstance(made, vf.ToolEnv):
            raise ConfigError(
                f"env verifiers: {type(made).__name__} is a ToolEnv, whose tool calls an OpenAI server parses; offer "
                f"its functions as rollout.params.tools (the agent strategy parses and runs them) with a MultiTurnEnv"
            )
        self._env, self._loop = made, asyncio.new_event_loop()

    def __deepcopy__(self, memo: dict) -> Verifiers:
        twin = copy.copy(self)  # the environment and its loop are shared; an episode owns only its state
        twin._state, twin._messages = None, []
        return twin

    def _run(self, coroutine: Any) -> Any:
        return self._loop.run_until_complete(coroutine)

    def reset(self, row: dict, seed: int) -> list[dict]:
        if "example_id" not in row:
            raise ConfigError(
                f"env verifiers: a row names its dataset row in an 'example_id' column (got columns {sorted(row)}); "
                f"groupwise.rollout.verifiers_env.rows(environment) writes such rows"
            )
        x = dict(self._env.get_dataset()[int(row["example_id"])])
        state = self._run(self._env.init_state(x, client=None, model="groupwise", sampling_args=None))
        self._state = self._run(self._env.setup_state(state))
        self._messages = [dict(m) for m in self._state["prompt"]]
        return [dict(m) for m in self._messages]

    def step(self, action: str) -> tuple[Any, float, bool]:
        env, state = self._env, self._state
        completion = [{"role": "assistant", "content": action}]
        turn = {
            "prompt": self._messages,
            "completion": completion,
            "response": None,
            "tokens": None,
            "reward": None,
            "advantage": None,
            "is_truncated": False,
            "trajectory_id": state["trajectory_id"],
            "extras": {},
        }
        self._run(env.add_trajectory_step(state, turn))
        if not self._run(env.is_completed(state)):
            messages = self._messages + completion
            reply = [dict(m) for m in self._run(env.env_response(messages, state))]
            if state.get("final_env_response") is None:
                self._messages = messages + reply
                return reply, 0.0, False
            self._run(env.is_completed(state))  # the final reply: its stop condition and clean-up, as the loop does
        self._run(env.render_completion(state))
        self._run(env.rubric.score_rollout(state))
        return "", float(state["reward"]), True

    def outcome(self) -> dict:
        state = self._state or {}
        metrics = state.get("metrics") or {}
        out = {"reward": float(state.get("reward") or 0.0)}
        out.update({f"metric/{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
        return out
