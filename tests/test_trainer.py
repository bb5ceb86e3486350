"""The loop end to end on the embedded model: invariance to the micro-batch split, resume, bad input."""

import copy
import json

import pytest
import torch

from groupwise.build import build
from groupwise.config import load_config
from groupwise.errors import ConfigError
from groupwise.rewards._common import RewardError
from groupwise.run import Run
from groupwise.trainer import Trainer
from groupwise.types import Need

SMALL = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=6",
    "eval.size=16",
    "update.lr=1e-3",
    "threads=1",
]


MODEL = __import__("os").environ.get("GROUPWISE_TEST_MODEL", "default")


def make_trainer(tmp_path, *overrides):
    cfg, _ = load_config(None, [*SMALL, f'out="{tmp_path}"', f'model.path="{MODEL}"', *overrides])
    return Trainer(build(cfg))


def grads_after_one_update(trainer, rollout):
    """Gradient of the first optimiser step of `update`, captured before the weights move."""
    captured = {}

    def first_gradient(optimizer, args, kwargs):
        if not captured:
            captured.update(
                {n: p.grad.clone() for n, p in trainer.policy.module.named_parameters() if p.grad is not None}
            )

    handle = trainer.updater.optimizer.register_step_pre_hook(first_gradient)
    stats = trainer.update(rollout)
    handle.remove()
    return captured, stats


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["train.epochs=2", "train.minibatches=2"],
        ['objective.agg="token_mean"', 'objective.terms=["ppo_clip", {name="kl", coef=0.1}]'],
    ],
)
def test_loss_and_gradient_do_not_depend_on_micro_batching(tmp_path, extra):
    # SGD: the weight change is the gradient itself (Adam's first step is ~lr·sign(g), which
    # amplifies float noise in near-zero gradient entries)
    sgd = 'update={name="sgd", lr=0.1}'
    whole = make_trainer(tmp_path / "a", *extra, sgd, "train.micro_batch_groups=0")
    split = make_trainer(tmp_path / "b", *extra, sgd, "train.micro_batch_groups=1")
    split.policy.module.load_state_dict(whole.policy.module.state_dict())
    whole.policy.module.eval()
    rollout = whole.collect()
    whole.prepare(rollout)
    assert rollout.advantages.abs().sum() > 0, "a rollout with no learning signal tests nothing"
    whole.policy.module.train()
    grads_a, stats_a = grads_after_one_update(whole, copy.deepcopy(rollout))
    grads_b, stats_b = grads_after_one_update(split, copy.deepcopy(rollout))
    assert stats_a["loss"] == pytest.approx(stats_b["loss"], abs=1e-6)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=1e-6, rtol=1e-5)
    # and after μ·minibatches optimiser steps (one rollout reused) the weights agree too
    for (name, p), q in zip(whole.policy.module.named_parameters(), split.policy.module.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)


def test_run_writes_outputs_and_resumes_exactly(tmp_path):
    straight = make_trainer(tmp_path / "straight", "train.steps=4")
    Run(straight).train()
    out = tmp_path / "straight"
    summary = json.loads((out / "summary.json").read_text())
    assert {"accuracy_before", "accuracy_after", "steps", "wall_seconds"} <= set(summary)
    assert summary["steps"] == 4
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for key in (
        "reward_mean",
        "reward_std",
        "zero_std_frac",
        "clip_low",
        "clip_high",
        "entropy",
        "completion_len",
        "step_seconds",
        "tokens_per_s",
    ):
        assert key in rows[0], key
    assert (out / "reward.png").stat().st_size > 0
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "final")

    # stop after 2 steps (checkpoint every step), then resume in a new process-equivalent trainer
    first = make_trainer(tmp_path / "resumed", "train.steps=2", "checkpoint.every=1")
    Run(first).train()
    again = make_trainer(tmp_path / "resumed", "train.steps=4", "checkpoint.every=1")
    Run(again).train(resume_allow=["train.steps"])  # a changed setting is refused unless allowed
    from groupwise import checkpoint

    kept = checkpoint.complete(tmp_path / "resumed")
    assert [p.name for p in kept] == [
        "step_000003",
        "step_000004_r1",
    ]  # keep_last=2 pruned steps 1 and 2; the final save superseded step 4's
    for (name, p), q in zip(straight.policy.module.named_parameters(), again.policy.module.parameters()):
        assert torch.equal(p, q), f"{name} differs after resume"
    resumed_rows = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_mean"] for r in resumed_rows] == [r["reward_mean"] for r in rows]


@pytest.mark.parametrize(
    "name,body",
    [
        ("broken", "raise RuntimeError('boom')"),  # raises
        ("short", "return [1.0]"),  # wrong length: one value for 16 completions
    ],
    ids=["raises", "wrong-length"],
)
def test_broken_reward_is_named(tmp_path, name, body):
    module = f"reward_{name}"
    (tmp_path / f"{module}.py").write_text(f"def {name}(prompts, completions, **kw):\n    {body}\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        trainer = make_trainer(tmp_path / "run", f'rewards=[{{name="python", fn="{module}:{name}"}}]')
        with pytest.raises(
            RewardError, match=f"reward '{module}.{name}' (raised RuntimeError|returned 1 values for 16)"
        ):
            trainer.collect()
    finally:
        sys.path.remove(str(tmp_path))


def test_none_rewards_are_excluded_and_counted(tmp_path):
    (tmp_path / "partial_reward.py").write_text(
        "def partial(prompts, completions, **kw):\n    return [None "
        "if i % 4 == 0 else 1.0 for i in range(len(completions))]\n"
    )
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        trainer = make_trainer(tmp_path / "run", 'rewards=[{name="python", fn="partial_reward:partial"}]')
        rollout = trainer.collect()
        assert trainer.reward_stage.excluded == 4  # one row in each of the 4 groups
        assert not rollout.group_valid[:, 0].any() and rollout.group_valid[:, 1:].all()
        trainer.prepare(rollout)
        assert torch.isfinite(rollout.advantages).all() and (rollout.advantages[:, 0] == 0).all()
    finally:
        sys.path.remove(str(tmp_path))


def test_dataset_row_missing_answer_names_file_and_row(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "1+1=", "answer": "2"}\n{"question": "2+2="}\n')
    with pytest.raises(ValueError, match=r"data\.jsonl.*line 2"):
        make_trainer(tmp_path / "run", f'data.path="{data}"', 'data.columns={prompt="question"}')


def test_own_rewards_need_no_answer_column(tmp_path):
    """Before: every training row needed an 'answer' even when the run's rewards never read it."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "1+1="}\n{"question": "2+2="}\n')
    (tmp_path / "length_reward.py").write_text(
        "def short(prompts, completions, **kw):\n    return [float(len(c) < 3) for c in completions]\n"
    )
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        trainer = make_trainer(
            tmp_path / "run",
            f'data.path="{data}"',
            'data.columns={prompt="question"}',
            "eval.size=0",
            'rewards=[{name="python", fn="length_reward:short"}]',
        )
        assert [r["answer"] for r in trainer.train_rows] == [None, None]
        assert torch.isfinite(trainer.collect().rewards).all()
    finally:
        sys.path.remove(str(tmp_path))


def test_unknown_config_key_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="group_size"):
        make_trainer(tmp_path, "rollout.groupsize=3")


def test_old_logprobs_from_the_first_pass_equal_a_separate_pass(tmp_path):
    """μ = 2 with one mini-batch: epoch 0's own forward (detached) stands in for the no-grad pass
    over the old policy; the result must be the same as computing that pass separately."""
    sgd = 'update={name="sgd", lr=0.1}'
    reuse = make_trainer(tmp_path / "a", "train.epochs=2", sgd)
    separate = make_trainer(tmp_path / "b", "train.epochs=2", sgd)
    separate.step_needs = [Need("logp")]  # the explicit no-grad pass in prepare()
    rollout = reuse.collect()
    ra, rb = copy.deepcopy(rollout), copy.deepcopy(rollout)
    reuse.prepare(ra)
    separate.prepare(rb)
    assert ra.logp_old is None and rb.logp_old is not None
    assert ra.advantages.abs().sum() > 0, "a rollout with no learning signal tests nothing"
    grads_a, stats_a = grads_after_one_update(reuse, ra)
    grads_b, stats_b = grads_after_one_update(separate, rb)
    torch.testing.assert_close(ra.logp_old, rb.logp_old, atol=1e-6, rtol=0)  # recorded by epoch 0
    assert stats_a["loss"] == pytest.approx(stats_b["loss"], rel=1e-6, abs=1e-7)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=1e-6, rtol=1e-5)
    for (name, p), q in zip(reuse.policy.module.named_parameters(), separate.policy.module.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)


def test_each_reward_function_has_its_own_mean_in_the_log(tmp_path):
    (tmp_path / "const_rewards.py").write_text(
        "def one(prompts, completions, **kw):\n    return [1.0] * len(completions)\ndef quarter(prompts, "
        "completions, **kw):\n    return [0.25 if i % 2 else None for i in range(len(completions))]\n"
    )
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        trainer = make_trainer(
            tmp_path / "run",
            "train.steps=1",
            "eval.size=0",
            'reward.missing="zero"',
            'rewards=[{name="python", fn="const_rewards:one", '
            'weight=2.0}, {name="python", fn="const_rewards:quarter"}]',
        )
        Run(trainer).train()
    finally:
        sys.path.remove(str(tmp_path))
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["reward/const_rewards.one"] == 1.0  # unweighted
    assert row["reward/const_rewards.quarter"] == 0.25  # over the rows with a verdict (None rows left out)
    assert row["reward_mean"] == pytest.approx(2.0 + 0.25 / 2)  # weighted total, None counted as 0 (missing="zero")


def test_reference_sync_mixes_the_policy_into_the_reference(tmp_path):
    """model.ref_sync_every=2: after step 1 (the 2nd), ref = 0.6·policy + 0.4·ref, exactly (TRL's formula)."""
    trainer = make_trainer(
        tmp_path / "run",
        "train.steps=2",
        "eval.size=0",
        "model.ref_sync_every=2",
        'objective.terms=["ppo_clip", {name="kl", coef=0.1}]',
    )
    ref = trainer.policy.reference._model
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    trainer.step = 0
    trainer.run_step()  # step 0: no sync
    assert all(torch.equal(p, initial[n]) for n, p in ref.named_parameters())
    trainer.step = 1
    trainer.run_step()  # step 1: sync
    for (name, p), live in zip(ref.named_parameters(), trainer.policy.module.parameters()):
        # float32 rounding of the in-place mix
        torch.testing.assert_close(p, 0.6 * live.detach() + 0.4 * initial[name], rtol=1e-6, atol=1e-7)
    with pytest.raises(ConfigError, match="no component reads the reference model"):
        make_trainer(tmp_path / "other", "model.ref_sync_every=2")


def test_lora_trains_only_the_adapters_and_saves_a_merged_model(tmp_path):
    """The documented LoRA example (README): PEFT adapters on q/v,
    the KL reference is the base with the adapters off."""
    lora = 'model.lora={r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=false}'
    trainer = make_trainer(
        tmp_path / "run", "train.steps=2", "eval.size=0", lora, 'objective.terms=["ppo_clip", {name="kl", coef=0.05}]'
    )
    trainable = {n for n, p in trainer.policy.module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    base = {n: p.detach().clone() for n, p in trainer.policy.module.named_parameters() if not p.requires_grad}
    Run(trainer).train()
    # the base is frozen
    assert all(torch.equal(p, base[n]) for n, p in trainer.policy.module.named_parameters() if n in base)
    assert trainer.policy.reference.uses_adapter  # no second copy of the model for the reference
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert not any("lora" in n for n, _ in merged.named_parameters())  # adapters merged into plain weights


def test_on_bad_row_skip_drops_prompts_too_long_for_the_context(tmp_path):
    """Before: data.on_bad_row="skip" stopped at the first over-long prompt (the docs said skipped)."""
    data = tmp_path / "data.jsonl"
    long_prompt = "1+" * 80 + "1="  # 162 characters: far past the embedded model's 128 positions
    data.write_text(
        json.dumps({"question": "1+1=", "answer": "2"})
        + "\n"
        + json.dumps({"question": long_prompt, "answer": "81"})
        + "\n"
    )
    with pytest.raises(ValueError, match="exceeds the model's context of 128"):
        make_trainer(tmp_path / "a", f'data.path="{data}"', 'data.columns={prompt="question"}', "eval.size=0").collect()
    trainer = make_trainer(
        tmp_path / "b",
        f'data.path="{data}"',
        'data.columns={prompt="question"}',
        "eval.size=0",
        'data.on_bad_row="skip"',
    )
    assert [r["prompt"] for r in trainer.train_rows] == ["1+1="] and trainer.parts.rows_skipped == {"train": 1}
    assert Run(trainer).summary["rows_skipped"] == {"train": 1}
    assert torch.isfinite(trainer.collect().rewards).all()


def test_chat_prompts_and_system_prompt_use_the_chat_template(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}) + "\n")
    trainer = make_trainer(tmp_path / "run", f'data.path="{data}"', "eval.size=0", 'data.system_prompt="add:"')
    with pytest.raises(ValueError, match="chat template"):  # the embedded tokenizer has none
        trainer.prompts("train", trainer.train_rows, 0)
    # a minimal template
    trainer.policy.tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    ids = trainer.prompts("train", trainer.train_rows, 0)
    assert trainer.policy.tokenizer.decode(ids) == "<system>add:<user>1+1="
