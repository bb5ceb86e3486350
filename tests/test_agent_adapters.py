"""Issue 40, the rest: code tools in the sandbox, TRL's ``environment_factory`` classes as envs, and the
gymnasium adapter, each on real calls (the sandbox, a real registered gymnasium env), not mocks."""

from __future__ import annotations

import json
import time

import pytest

from groupwise.errors import ConfigError
from groupwise.rollout.code_tools import code_tool, function_source, python
from groupwise.rollout.tools import Call, Toolbox, calculator
from groupwise.sandbox.bwrap import Sandbox, SandboxUnavailable


def _sandbox_problem() -> str | None:
    try:
        Sandbox().check()
    except SandboxUnavailable as err:
        return str(err)
    return None


_PROBLEM = _sandbox_problem()
needs_bwrap = pytest.mark.skipif(_PROBLEM is not None, reason=f"no usable bubblewrap sandbox: {_PROBLEM}")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from groupwise.models.chatstart import DEFAULT_OUT

    return AutoTokenizer.from_pretrained(DEFAULT_OUT)  # the shipped chat model's tokenizer and template


def _square(x: int) -> int:
    return x * x


@code_tool
def hypotenuse(a: int, b: int) -> str:
    """The integer hypotenuse of a right triangle (through a module-level helper: not self-contained).

    Args:
        a: one side.
        b: the other side.
    """
    import math

    return str(math.isqrt(_square(a) + _square(b)))


def _error(message: dict) -> str:
    return json.loads(message["content"])["error"]


# ---------------------------------------------------------------------------------------------- code tools
def test_a_code_tools_source_travels_without_its_decorator():
    src = function_source(hypotenuse)
    assert src.startswith("def hypotenuse(a: int, b: int) -> str:") and "@code_tool" not in src
    with pytest.raises(ConfigError, match="not a plain function"):
        code_tool(print)


@needs_bwrap
def test_code_tools_run_in_the_sandbox_with_a_timeout():
    box = Toolbox([calculator, python, hypotenuse], timeout=1.0)
    assert hypotenuse(3, 4) == "5"  # in-process it works; in the sandbox only the function travels, not _square
    assert "NameError: name '_square' is not defined" in _error(box.run(Call("hypotenuse", {"a": 3, "b": 4})))
    out = box.run(Call("python", {"code": "import os\nprint(6 * 7, os.getcwd(), os.path.exists('/work'))"}))
    # 6*7 = 42; the sandbox's working directory is its scratch /tmp and the host's /work is not mounted
    assert out == {"role": "tool", "name": "python", "content": "42 /tmp False\n"}
    raised = box.run(Call("python", {"code": "print(1)\n1 / 0"}))["content"]
    assert raised.startswith("1\nTraceback") and "ZeroDivisionError" in raised  # a program's error is its output
    t0 = time.monotonic()
    looped = box.run(Call("python", {"code": "while True:\n    pass"}))
    took = time.monotonic() - t0
    assert "within 1 s of CPU time" in _error(looped) and took < 10  # killed: 1 s of CPU, 2 s wall backstop
    assert "TypeError" in _error(box.run(Call("python", {"source": "print(1)"})))  # a wrong argument name
    assert box.run(Call("python", {"code": "print('after')"}))["content"] == "after\n"  # the next call is fine
    assert box.run(Call("calculator", {"expression": "2*3"}))["content"] == "6"  # plain tools still in-process
    stats = box.stats()
    # python: 5 calls, 2 errors (the timeout, the wrong argument; a traceback is a result); hypotenuse: 1 of 1
    assert stats["tools/python/calls"] == 5 and stats["tools/python/error_rate"] == pytest.approx(2 / 5)
    assert stats["tools/hypotenuse/error_rate"] == 1.0 and stats["tools/calculator/error_rate"] == 0.0


@code_tool
def isqrt_sum(a: int, b: int) -> int:
    """The integer square root of a*a + b*b.

    Args:
        a: one side.
        b: the other side.
    """
    import math

    return math.isqrt(a * a + b * b)


@needs_bwrap
def test_a_self_contained_code_tool_returns_its_value_as_text():
    box = Toolbox([isqrt_sum], timeout=2.0)
    assert box.run(Call("isqrt_sum", {"a": 5, "b": 12}))["content"] == "13"  # isqrt(25 + 144) = 13
    with pytest.raises(ConfigError, match="unknown keys"):
        Toolbox([isqrt_sum], sandbox={"memory": 1})


@needs_bwrap
def test_an_agent_episode_calls_the_python_tool_in_the_sandbox(tok):
    from test_agents import chat_ctx

    from groupwise.registry import build

    row = {"prompt": "12*34=", "answer": "408", "env": "answer"}
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(12*34)"}}</tool_call>'
    strategy = build("rollout", "agent", tools=["groupwise.rollout.code_tools:python"], tool_timeout=2.0)
    batch = strategy(chat_ctx(tok, [row], [[call, "408"]], 1))
    transcript = batch.info[0][0]["log"]["transcript"]
    assert transcript[2] == {"role": "tool", "name": "python", "content": "408\n"}  # what the program printed
    assert batch.rewards.tolist() == [[1.0]] and strategy.step_stats()["tools/python/calls"] == 1


# ---------------------------------------------------------------------------------------------- TRL environments
class Counter:
    """A TRL ``environment_factory`` class as TRL's docs write one: reset(**kwargs), public methods are tools,
    get_reward() scores the rollout from the instance's state. Nothing here knows groupwise."""

    def __init__(self):
        self.total, self.target = 0, 0

    resets: list = []  # the keyword arguments of every reset (class-wide, for the test)

    def reset(self, **kwargs) -> str | None:
        Counter.resets.append(sorted(kwargs))
        self.total, self.target = 0, int(kwargs["target"])
        return f"The total is 0; reach {self.target}."

    def add(self, n: int) -> str:
        """Add a number to the total.

        Args:
            n: The number to add.
        """
        self.total += n
        return str(self.total)

    def get_reward(self) -> float:
        return 1.0 if self.total == self.target else 0.0


def _add(n: int) -> str:
    return f'<tool_call>{{"name": "add", "arguments": {{"n": {n}}}}}</tool_call>'


def test_a_trl_environment_class_trains_unchanged(tok):
    from test_agents import chat_ctx

    from groupwise.registry import build

    row = {"prompt": [{"role": "user", "content": "Use the tool. "}], "target": 5, "env": "trl"}
    # episode 0: 2 + 3 = 5, then answers: reward 1; episode 1: 4, then answers: reward 0 (its own instance:
    # the first episode's total does not leak into it); episode 2 calls a method that is not a tool
    script = [[_add(2), _add(3), "done"], [_add(4), "done"], ['<tool_call>{"name": "get_reward"}</tool_call>', "x"]]
    strategy = build("rollout", "agent", env_params={"factory": Counter})
    batch = strategy(chat_ctx(tok, [row], script, 3))
    assert batch.rewards.tolist() == [[1.0, 0.0, 0.0]]
    assert Counter.resets[-3:] == [["prompt", "target"]] * 3  # the row's columns, not the runner's 'env'
    log = batch.info[0][0]["log"]["transcript"]
    assert log[0] == {"role": "user", "content": "Use the tool. The total is 0; reach 5."}  # reset's text appended
    assert [m["content"] for m in log if m["role"] == "tool"] == ["2", "5"]
    assert [m["content"] for m in batch.info[0][1]["log"]["transcript"] if m["role"] == "tool"] == ["4"]
    unknown = batch.info[0][2]["log"]["transcript"][2]
    assert "no tool 'get_reward'" in _error(unknown)
    assert "tools: add(n)" in tok.decode(batch.prompt_ids[0])  # the env's method is offered through the template
    stats = strategy.step_stats()
    assert stats["tools/add/calls"] == 3 and stats["tools/unknown"] == 1 and stats["env/reward"] == pytest.approx(1 / 3)


class NoReward:
    def reset(self, **kwargs):
        return None


def test_a_trl_environment_needs_get_reward():
    from groupwise.registry import build

    with pytest.raises(ConfigError, match="no get_reward"):
        build("env", "trl", factory=NoReward)
    with pytest.raises(ConfigError, match="factory"):
        build("env", "trl")


# ---------------------------------------------------------------------------------------------- gymnasium


def test_the_gymnasium_adapter_steps_a_real_env_as_gymnasium_does():
    gymnasium = pytest.importorskip("gymnasium")  # the extra 'gym' (in dev)
    import numpy as np

    from groupwise.registry import build

    env = build("env", "gymnasium", max_episode_steps=3)  # Pendulum-v1: Box(3) observations, Box(1) torque in [-2, 2]
    ref = gymnasium.make("Pendulum-v1", max_episode_steps=3)
    obs, _ = ref.reset(seed=123)
    assert env.reset({}, 123) == obs.tolist()
    # a torque of 5 is clipped to the bound 2: the same transition as gymnasium's own step with 2
    for mine, theirs in (([0.5], [0.5]), ([5.0], [2.0]), ([-0.25], [-0.25])):
        o, r, terminated, truncated, _ = ref.step(np.array(theirs, dtype=np.float32))
        assert env.step(mine) == (o.tolist(), float(r), bool(terminated or truncated))
    assert truncated and env.outcome()["steps"] == 3 and env.outcome()["terminated"] == 0.0  # the time limit ended it
    with pytest.raises(ConfigError, match="Discrete"):
        build("env", "gymnasium", env_id="CartPole-v1").reset({}, 0)  # a discrete action space does not fit
    env.reset({}, 0)
    with pytest.raises(ConfigError, match="model.params.dim"):
        env.step([0.1, 0.2])


def _pendulum_rows(split, n, seed):
    return [{"prompt": [0.0, 0.0, 0.0], "env": "gymnasium"} for _ in range(n or 4)]


@pytest.fixture
def pendulum_task(monkeypatch):
    from groupwise import registry
    from groupwise.tasks import TASKS, Task

    registry.load_all()
    monkeypatch.setitem(TASKS, "test_pendulum", Task("test_pendulum", "a test's task", _pendulum_rows, "env_return"))


def test_a_gaussian_policy_trains_on_a_gymnasium_env_through_grow(tmp_path, pendulum_task):
    gymnasium = pytest.importorskip("gymnasium")
    import numpy as np

    from groupwise.build import build
    from groupwise.config import load_config
    from groupwise.rollout.env import ENV_STREAM
    from groupwise.run import Run
    from groupwise.seeds import sample_seed
    from groupwise.trainer import Trainer

    cfg, _ = load_config(
        None,
        [
            f'out="{tmp_path}"',
            'model.policy="gaussian"',
            "model.params={obs_dim=3, dim=1, sigma=0.5}",
            'data.task="test_pendulum"',
            'rewards=["env_return"]',
            'rollout.name="grow"',
            'rollout.params={step_return="rtg", max_turns=6, env_params={max_episode_steps=6}}',
            "rollout.group_size=2",
            "rollout.prompts_per_step=2",
            'objective.terms=[{name="ppo_clip"}]',
            "eval.size=2",
            "update.lr=1e-3",
            "train.steps=2",
        ],
    )
    trainer = Trainer(build(cfg))
    batch = trainer.collect()  # step 0's batch: 2 tasks x 2 episodes x 6 steps = 12 rows a group
    assert batch.shape[:2] == (2, 12) and bool(batch.group_valid.all())
    # replay episode 0 of task 0 in gymnasium itself, with the runner's reset seed and the sampled actions
    rows = [g for g in range(12) if batch.info[0][g]["episode"] == 0]
    ref = gymnasium.make("Pendulum-v1", max_episode_steps=6)
    obs, _ = ref.reset(seed=sample_seed(cfg.seed, 0, int(batch.prompt_index[0]), ENV_STREAM) % (1 << 32))
    rewards = []
    for g in rows:
        assert batch.row_contexts()[0][g] == obs.tolist()  # the row is sampled under the env's observation
        action = batch.extras["x_final"][0, g].numpy()  # [1] the Gaussian's action, float32
        obs, r, *_ = ref.step(np.clip(action, -2.0, 2.0))
        rewards.append(float(r))
    rtg = [sum(rewards[t:]) for t in range(6)]  # step_return="rtg", gamma 1: the reward-to-go of each step
    assert batch.rewards[0, rows].tolist() == pytest.approx(rtg)
    summary = Run(trainer).train()
    assert summary["finished"] and summary["steps"] == 2
