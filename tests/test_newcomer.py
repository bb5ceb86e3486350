"""What a new user still tripped on (issue 36): an environment of their own from a recipe, held-out
evaluation that plays its episodes closed-loop, their own reward as the held-out metric, TRL's
conversational completions, a demo budgeted in steps, every GRPOConfig field in docs/from-trl.md,
and one clear line for a bad data file or reward, checked before the model loads."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_grow import ROW, SPEC, Scripted
from test_trainer import make_trainer

from groupwise.cli import main
from groupwise.config import Config, EvalCfg, load_config
from groupwise.errors import ConfigError
from groupwise.heldout import HeldOut
from groupwise.registry import build
from groupwise.types import StepInfo

# two reach rows: from 0 to 7 and from 0 to 5, 3 turns each
ROWS = [ROW, {**ROW, "goal": 5, "prompt": "left 5="}]


def scripted_heldout(rows, closed_loop=True, samples=0, strategy="episodes"):
    """A HeldOut over a scripted policy (test_grow.Scripted: episode e plays SPEC[e]) and ``rows``."""
    policy = Scripted(SPEC)
    parts = SimpleNamespace(
        cfg=Config(eval=EvalCfg(size=len(rows), samples=samples)),
        eval_rows=rows,
        eval_stage=None,  # never used by closed-loop evaluation
        prompts=None,
        sampling_params={"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 1},
        closed_loop=closed_loop,
        strategy=build("rollout", strategy),
    )
    trainer = SimpleNamespace(parts=parts, policy=policy, info=lambda: StepInfo(step=5, seed=0, max_new_tokens=1))
    return HeldOut(trainer)


# ---------------------------------------------------------------------------------------------- item 2
@pytest.mark.parametrize("strategy", ["episodes", "grow"])
def test_heldout_plays_each_row_closed_loop(strategy):
    """Greedy: one episode per row, SPEC[0] = moves 3, 3, 1. Row 1 (goal 7): 3+3+1 = 7, won (return 1);
    row 2 (goal 5): 3+3 = 6 > 5, overshot (return 0). Accuracy 1/2, mean return 1/2.
    Sampled, eval.samples = 2: episode 1 plays SPEC[1] = 4, 4: 8 overshoots both goals. Successes per
    row [1, 0] of 2: mean@2 = 1/4, return@2 = 1/4, pass@1 = (1/2 + 0)/2 = 1/4, pass@2 = (1 + 0)/2 = 1/2.
    The text evaluation scored one completion per row: here the first move, 3, of each."""
    heldout = scripted_heldout(ROWS, samples=2, strategy=strategy)
    assert heldout.evaluate_detail() == {"accuracy": 0.5, "return": 0.5}
    assert heldout.evaluate() == 0.5
    assert heldout.evaluate_sampled() == {"mean@2": 0.25, "return@2": 0.25, "pass@1": 0.25, "pass@2": 0.5}
    assert heldout.evaluate(rows=ROWS[1:]) == 0.0  # eval.by's subsets are played too


def test_closed_loop_is_the_default_for_your_env_and_not_for_reach(tmp_path):
    """eval.closed_loop = "auto": on for an env strategy on your own data (its default eval reward, exact
    match, cannot score an episode); off for the built-in env task reach, whose own reward env_return
    scores the first move by Q* (its recipes' claims were measured that way); off for a text strategy."""
    rows = tmp_path / "guess.jsonl"
    rows.write_text("".join(json.dumps({**ROW, "answer": "3"}) + "\n" for _ in range(4)))
    env = ['rollout.name="episodes"', 'rewards=["env_return"]', "rollout.max_new_tokens=1"]
    data = [f'data.path="{rows}"', f'data.eval_path="{rows}"']
    assert make_trainer(tmp_path / "a", *env, *data).parts.closed_loop
    assert not make_trainer(tmp_path / "b", *env, *data, "eval.closed_loop=false").parts.closed_loop
    assert not make_trainer(tmp_path / "c", *env, 'data.task="reach"').parts.closed_loop
    assert make_trainer(tmp_path / "d", *env, 'data.task="reach"', "eval.closed_loop=true").parts.closed_loop
    assert not make_trainer(tmp_path / "e").parts.closed_loop
    with pytest.raises(ConfigError, match=r"eval.closed_loop=true: rollout strategy 'sample' plays no episodes"):
        make_trainer(tmp_path / "f", "eval.closed_loop=true")
    with pytest.raises(ConfigError, match=r"eval.views=.*a view edits a text prompt"):
        make_trainer(tmp_path / "g", *env, *data, 'eval.views=["corrupt_context"]')


# ---------------------------------------------------------------------------------------------- item 1
def test_an_env_that_does_not_exist_fails_at_build(tmp_path):
    """Before: the env name was first looked up by the first rollout, after the model had loaded."""
    env = ['rollout.name="episodes"', 'rewards=["env_return"]', "rollout.max_new_tokens=1", 'data.task="reach"']
    with pytest.raises(ConfigError, match=r"rollout.params.env='guess_game' cannot be built: unknown env component"):
        make_trainer(tmp_path / "a", *env, 'rollout.params={env="guess_game"}')
    with pytest.raises(ConfigError, match=r"rollout.params.env='no_such_module:Env' cannot be built"):
        make_trainer(tmp_path / "b", *env, 'rollout.params={env="no_such_module:Env"}')
    with pytest.raises(ConfigError, match=r"env 'reach' has no parameter 'hight'"):
        make_trainer(tmp_path / "c", *env, "rollout.params={env_params={hight=3}}")


def test_groupwise_eval_names_an_env_that_is_not_registered(tmp_path, capsys):
    """Before: `groupwise eval` with eval.reward=env_return on rows naming an unknown env reported
    accuracy 0.0 (each failed score excluded as wrong); now a config error naming the env."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "guess 1-16=", "answer": "7", "env": "guess_game"}) + "\n")
    code = main(["eval", f'data.path="{rows}"', f'data.eval_path="{rows}"', 'eval.reward="env_return"', "threads=1"])
    assert code == 2
    assert "unknown env component 'guess_game'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- item 4
def test_a_trl_conversational_reward_gets_assistant_messages():
    """TRL's own think_format_reward reads completion[0]["content"]: on chat prompts it scores 1 for a
    "<think>...</think>" answer, 0 otherwise; on text prompts a reward still gets strings."""
    rewards = pytest.importorskip("trl.rewards")
    chat = [{"role": "user", "content": "2+2?"}]
    got = []

    def spy(prompts, completions, **kwargs):
        got.append((prompts, completions))
        return [0.0] * len(completions)

    think = build("reward", "python", fn="trl.rewards:think_format_reward")
    assert think._func is rewards.think_format_reward
    assert think(prompts=[chat, chat], completions=["<think>\nfour\n</think>\n4", "4"]) == [1.0, 0.0]
    build("reward", "python", fn=spy)(prompts=[chat], completions=["4"])
    build("reward", "python", fn=spy)(prompts=["2+2="], completions=["4"])
    assert got == [([chat], [[{"role": "assistant", "content": "4"}]]), (["2+2="], ["4"])]


def test_training_logprobs_are_not_divided_by_the_temperature(tmp_path):
    """docs/from-trl.md: TRL's training log-probs are log_softmax(logits / temperature); groupwise's
    are the model's own (temperature 1), at any rollout.temperature. Checked with TRL's function."""
    import torch

    trl_utils = pytest.importorskip("trl.trainer.utils")
    from groupwise.phases.sft import teacher_forced

    policy = make_trainer(tmp_path, "rollout.temperature=0.7").policy
    prompt, answer = policy.encode("12+34="), policy.encode_completion("46")  # answer: its tokens then EOS
    batch = teacher_forced([prompt], [answer])
    logp = policy.forward(batch, ("logp",))["logp"][0, 0][batch.mask[0, 0]]  # [L]
    with torch.no_grad():
        logits = policy.module(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1].float()  # [L,V]
    index = torch.tensor(answer)  # [L]
    assert torch.allclose(logp, trl_utils.selective_log_softmax(logits, index), atol=1e-5)
    tempered = trl_utils.selective_log_softmax(logits, index, temperature=0.7)  # [L] TRL's at 0.7
    assert (logp - tempered).abs().max() > 1e-2
    page = (Path(__file__).resolve().parents[1] / "docs" / "from-trl.md").read_text()
    assert "TRL divides the logits by `temperature`" in page and "groupwise trains on the model's own log-probs" in page


# ---------------------------------------------------------------------------------------------- item 3
def test_your_own_reward_is_the_heldout_metric(tmp_path):
    """eval.reward as a reward entry: a python reward that calls every completion right makes the
    held-out accuracy exactly 1.0 (16 of 16), whatever the untrained model writes."""
    (tmp_path / "my_rewards.py").write_text(
        "def always(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"
    )
    spec = f'eval.reward={{name="python", fn="{tmp_path}/my_rewards.py:always"}}'
    trainer = make_trainer(tmp_path / "run", spec)
    assert trainer.parts.eval_stage.labels == [f"{tmp_path}/my_rewards.py:always"]
    assert HeldOut(trainer).evaluate() == 1.0


def test_a_missing_answer_says_what_needs_it_and_the_setting_that_does_not(tmp_path):
    from groupwise.tasks.data import DataError

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a}+1="}) + "\n" for a in range(8)))
    (tmp_path / "my_rewards.py").write_text(
        "def zero(prompts, completions, **kw):\n    return [0.0] * len(completions)\n"
    )
    own = f'{{name="python", fn="{tmp_path}/my_rewards.py:zero"}}'
    with pytest.raises(DataError, match=r"no column 'answer'.*training needs it because the default reward 'exact'"):
        make_trainer(tmp_path / "a", f'data.path="{rows}"')
    with pytest.raises(
        DataError, match=r"no column 'answer'.*held-out evaluation \(data.eval_path\) needs it.*eval.reward"
    ):
        make_trainer(tmp_path / "b", f'data.path="{rows}"', f'data.eval_path="{rows}"', f"rewards=[{own}]")
    parts = make_trainer(
        tmp_path / "c", f'data.path="{rows}"', f'data.eval_path="{rows}"', f"rewards=[{own}]", f"eval.reward={own}"
    ).parts
    assert len(parts.eval_rows) == 8 and parts.eval_rows[0]["answer"] is None


# ---------------------------------------------------------------------------------------------- item 5
def test_the_demo_ends_at_its_step_budget_on_a_slow_machine(tmp_path, monkeypatch):
    """Each step takes 150 s of (simulated) wall time. Before: train.max_seconds = 170 stopped the demo
    after step 2 (300 s > 170 s); now it is a far safety net (3600 s) and the run ends at its steps (3)."""
    import time

    from groupwise.run import Run

    cfg, _ = load_config(
        "demo", ["train.steps=3", "eval.size=0", "threads=1", "log.table_every=0", f'out="{tmp_path}"']
    )
    run = Run.from_config(cfg)
    offset, real = [0.0], time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real() + offset[0])
    step = run.trainer.run_step

    def slow_step():
        offset[0] += 150.0
        return step()

    run.trainer.run_step = slow_step
    summary = run.train()
    assert summary["steps"] == 3 and "stopped_early" not in summary
    assert cfg.train.max_seconds == 3600


# ---------------------------------------------------------------------------------------------- item 7
RUN = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4", "eval.size=0", "threads=1"]


def test_a_bad_data_file_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """Before: the model loaded first (30-40 s for a real one), then a 100-line traceback."""
    import groupwise.build

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr(groupwise.build, "build_policy", no_model)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1=", "solution": "2"}) + "\n")
    assert main(["train", f'data.path="{rows}"', f'out="{tmp_path / "run"}"', *RUN]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert (
        err[0].startswith("groupwise: ")
        and "no column 'answer'" in err[0]
        and err[0].endswith("--debug prints the traceback)")
    )
    from groupwise.tasks.data import DataError

    with pytest.raises(DataError, match="no column 'answer'"):  # --debug: the exception itself
        main(["train", f'data.path="{rows}"', f'out="{tmp_path / "run"}"', *RUN, "--debug"])


def test_a_failing_reward_is_one_line_and_its_traceback_is_in_the_run_folder(tmp_path, capsys):
    (tmp_path / "bad.py").write_text("def broken(prompts, completions, **kw):\n    return 1 / 0\n")
    out = tmp_path / "run"
    code = main(["train", f'rewards=[{{name="python", fn="{tmp_path}/bad.py:broken"}}]', f'out="{out}"', *RUN])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("groupwise: ")]
    assert code == 1 and len(err) == 1 and "raised ZeroDivisionError: division by zero" in err[0]
    assert err[0].endswith(f"(traceback: {out / 'error.log'}; --debug prints it)")
    log = (out / "error.log").read_text()
    assert log.startswith("Traceback") and "return 1 / 0" in log


def test_the_resolved_config_is_one_line_naming_what_differs(tmp_path, capsys):
    """Before: ~100 lines of TOML before every run."""
    out = tmp_path / "run"
    assert main(["train", "demo", "train.steps=1", f'out="{out}"', *RUN, "log.table_every=0"]) == 0
    err = capsys.readouterr().err
    assert "[rollout]" not in err and "group_size = " not in err
    line = next(x for x in err.splitlines() if x.startswith("resolved config"))
    assert line == (
        f"resolved config written to {out / 'config.toml'}; differs from the recipe in: threads=1, "
        "rollout.group_size=4, rollout.prompts_per_step=4, rollout.max_new_tokens=4, train.steps=1, eval.size=0, "
        "log.table_every=0"
    )
    assert (out / "config.toml").exists()
