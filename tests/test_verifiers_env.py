"""The verifiers adapter (issue 40): verifiers' own environment classes (SingleTurnEnv, a MultiTurnEnv written
as verifiers' docs write one, their Rubric) played by the ``agent`` strategy, and two training steps
on the shipped chat model. Skipped where verifiers is not installed (extra ``agents``)."""

from __future__ import annotations

import json

import pytest
from test_agents import chat_ctx

from groupwise.errors import ConfigError
from groupwise.registry import build


@pytest.fixture(scope="module")
def vf():
    return pytest.importorskip("verifiers")  # imported here, not at collection: the import takes ~4-13 s


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from groupwise.models.chatstart import DEFAULT_OUT

    return AutoTokenizer.from_pretrained(DEFAULT_OUT)


def exact(completion, answer, **kwargs) -> float:
    """A verifiers reward function: the last assistant message is the answer."""
    return 1.0 if completion[-1]["content"].strip() == answer else 0.0


def make_products():
    import verifiers as vf
    from datasets import Dataset

    data = Dataset.from_list([{"question": "12*34=", "answer": "408"}, {"question": "5*6=", "answer": "30"}])
    return vf.SingleTurnEnv(dataset=data, system_prompt="Answer with the number.", rubric=vf.Rubric(funcs=[exact]))


def won(state, **kwargs) -> float:
    return 1.0 if state.get("final_env_response") else 0.0


def make_guess():
    import verifiers as vf
    from datasets import Dataset

    class GuessEnv(vf.MultiTurnEnv):
        """Guess the row's number in at most 3 guesses; the env says higher / lower, ends on a right guess."""

        async def env_response(self, messages, state, **kwargs):
            guess, answer = messages[-1]["content"].strip(), int(state["answer"])
            if guess.isdigit() and int(guess) == answer:
                state["final_env_response"] = [{"role": "user", "content": "right"}]
                return state["final_env_response"]
            hint = "higher" if guess.isdigit() and int(guess) < answer else "lower"
            return [{"role": "user", "content": hint}]

    data = Dataset.from_list([{"question": "Guess my number (1-9).", "answer": "7"}])
    return GuessEnv(dataset=data, rubric=vf.Rubric(funcs=[won]), max_turns=3)


def rows(environment):
    from groupwise.rollout.verifiers_env import rows as vf_rows

    return vf_rows(environment)


def test_a_single_turn_verifiers_env_gives_its_prompts_and_its_rubrics_reward(vf, tok):
    env = make_products()
    data = rows(env)
    assert data == [
        {"prompt": "12*34=", "example_id": 0, "env": "verifiers"},
        {"prompt": "5*6=", "example_id": 1, "env": "verifiers"},
    ]
    strategy = build("rollout", "agent", env_params={"environment": make_products})
    # episode e of every row replies script[e]: "408" is right for row 0 only, "30" for row 1 only
    batch = strategy(chat_ctx(tok, data, [["408"], ["30"]], 2))
    assert batch.rewards.tolist() == [[1.0, 0.0], [0.0, 1.0]]  # the rubric's exact match of each reply
    transcript = batch.info[0][0]["log"]["transcript"]
    assert transcript[:2] == [
        {"role": "system", "content": "Answer with the number."},  # the env's own system prompt
        {"role": "user", "content": "12*34="},
    ]
    assert batch.info[0][1]["env"] == {"reward": 0.0, "metric/exact": 0.0, "metric/num_turns": 1.0}


def test_a_multi_turn_verifiers_env_plays_its_turns(vf, tok):
    data = rows(make_guess())
    # episode 0: 3 (higher), 7 (right: the env's final reply ends it); episode 1: 1, 2, 7: verifiers' loop stops
    # at max_turns=3 right after the third turn, before env_response judges it, so even a right third guess loses
    script = [["3", "7"], ["1", "2", "7"]]
    batch = build("rollout", "agent", env_params={"environment": make_guess})(chat_ctx(tok, data, script, 2))
    assert batch.rewards.tolist() == [[1.0, 0.0]]
    won_t = batch.info[0][0]["log"]["transcript"]
    assert [m["content"] for m in won_t[1:]] == ["3", "higher", "7"]  # the final reply ends it, no turn follows
    assert batch.info[0][0]["env"]["metric/num_turns"] == 2.0
    lost = batch.info[0][1]
    assert [m["content"] for m in lost["log"]["transcript"][1:]] == ["1", "higher", "2", "higher", "7"]
    assert lost["cut"] == "" and lost["env"]["metric/num_turns"] == 3.0  # the env's max_turns ended it


def test_the_adapter_refuses_what_is_not_a_verifiers_env(vf):
    with pytest.raises(ConfigError, match="MultiTurnEnv"):
        build("env", "verifiers", environment=lambda: object())
    with pytest.raises(ConfigError, match="ToolEnv"):
        build("env", "verifiers", environment=lambda: vf.ToolEnv(dataset=make_products().dataset, tools=[]))
    env = build("env", "verifiers", environment=make_guess)
    with pytest.raises(ConfigError, match="example_id"):
        env.reset({"prompt": "x"}, 0)


@pytest.mark.slow  # ~5 s, and the verifiers import; the adapter's turns and rewards are covered above in make test
def test_a_verifiers_env_trains_on_the_chat_model(vf, tmp_path):
    from groupwise.build import build as build_parts
    from groupwise.config import load_config
    from groupwise.run import Run
    from groupwise.trainer import Trainer

    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(make_products())))
    cfg, _ = load_config(
        "agent",
        [
            f'data.path="{tmp_path / "rows.jsonl"}"',
            'rollout.params={env = "verifiers", env_params = {environment = "test_verifiers_env:make_products"}, '
            "tools = [], max_turns = 1}",
            "rollout.max_new_tokens=8",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "train.steps=2",
            "eval.size=0",
            "threads=1",
            "log.table_every=0",
            f'out="{tmp_path / "run"}"',
        ],
    )
    trainer = Trainer(build_parts(cfg))
    Run(trainer).train()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1] and all("env/metric/exact" in m for m in metrics)
