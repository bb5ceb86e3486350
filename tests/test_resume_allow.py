"""Every key ``--resume-allow`` accepts takes effect on the resumed steps, or is refused as not
changeable on resume, naming it (issue 33, item 2). The allowed set is open (any key or section),
so the test is per class of key (docs/reliability.md lists them):

A. optimiser hyper-parameters (``update.lr``, ``betas``, ``weight_decay``, ``eps``; a role's
   ``roles.NAME.update.*``; gxpo's inner optimiser): into the restored optimiser's param groups;
B. the learning-rate schedule (``update.lr`` with ``schedule`` / ``warmup_steps``, ``train.steps``
   as its length): into the scheduler's base lrs, the lr in force = new base × factor(step);
C. run-loop settings read from the configuration at each use (``train.*``, ``eval.*``,
   ``checkpoint.*``, ``log.*``, ``reward.*``, ``perf.*``);
D. component parameters (``objective.terms``, ``rollout.*``, ...): components are rebuilt from the
   configuration and a checkpointed state does not override them (the rubric bank's capacity did);
E. schedules of coefficients: their parameters take effect; a stateful controller's ``init`` (its
   value before the first step) cannot, and is refused; controller states are matched by name;
F. keys fixed when the run started (``seed``, ``model.path/dtype/lora/policy/params``, a role's
   model, ``update.optimizer``, the training data, ``phases``): refused even when allowed.

Before: ``--resume-allow update.lr`` wrote the new lr to config.toml and trained with the old one
(the optimiser state restored from the checkpoint kept it); classes E and F went ahead silently."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_trainer import make_trainer

from groupwise import checkpoint
from groupwise.errors import ConfigError
from groupwise.rubric_bank import RubricBank
from groupwise.run import Run

BASE = ["train.steps=2", "checkpoint.every=1", "eval.size=0"]


def stopped(run, *extra):
    """A run SIGTERMed during its first step: checkpointed at step 1, one step left."""
    trainer = make_trainer(run, *BASE, *extra)
    job = Run(trainer)
    step = trainer.run_step

    def preempted():
        job._stop_requested = "SIGTERM"
        return step()

    trainer.run_step = preempted
    job.train()
    assert trainer.step == 1
    return trainer


def resumed(run, allow, *extra, steps=2):
    trainer = make_trainer(run, *[a for a in BASE if not a.startswith("train.steps")], f"train.steps={steps}", *extra)
    Run(trainer).train(resume_allow=allow)
    return trainer


def logged(run, key):
    return [json.loads(line).get(key) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------- A. optimiser hyper-parameters
def test_a_new_lr_moves_the_weights_by_the_new_lr(tmp_path):
    """SGD without momentum: a step moves the weights by −lr·g. From the same checkpoint (same
    weights, same samples, so the same g), lr 0.1 → 0.2 must move them exactly twice as far."""
    sgd = 'update={name="sgd", lr=0.1}'
    stopped(tmp_path / "a", sgd, "seed=1")  # seed 1: step 1 has groups with reward spread (seed 0's: g = 0)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    start = checkpoint.load(checkpoint.latest_intact(tmp_path / "a"))["policy"]["model"]
    same = resumed(tmp_path / "a", [], sgd, "seed=1")
    doubled = resumed(tmp_path / "b", ["update.lr"], 'update={name="sgd", lr=0.2}', "seed=1")
    assert logged(tmp_path / "a", "lr") == [0.1, 0.1] and logged(tmp_path / "b", "lr") == [0.1, 0.2]
    moved = 0
    for name, w0 in start.items():
        d1 = same.policy.module.state_dict()[name] - w0  # −0.1·g
        d2 = doubled.policy.module.state_dict()[name] - w0  # −0.2·g
        torch.testing.assert_close(d2, 2 * d1, atol=1e-6, rtol=1e-4, msg=name)
        moved += int(d1.abs().max() > 1e-5)
    assert moved > 0, "a step that moves nothing tests nothing"


def test_adamw_hyper_parameters_reach_the_param_groups(tmp_path):
    stopped(tmp_path, "update.lr=1e-3")
    trainer = resumed(
        tmp_path, ["update"], "update.lr=5e-4", "update.betas=[0.8, 0.9]", "update.weight_decay=0.25", "update.eps=1e-6"
    )
    for group in trainer.updater.optimizer.param_groups:
        hyper = (group["lr"], group["initial_lr"], group["betas"], group["weight_decay"], group["eps"])
        assert hyper == (5e-4, 5e-4, (0.8, 0.9), 0.25, 1e-6)
    assert trainer.updater.scheduler.base_lrs == [5e-4] * len(trainer.updater.optimizer.param_groups)
    assert logged(tmp_path, "lr") == [1e-3, 5e-4]
    assert trainer.updater.optimizer.state, "the Adam moments were restored, not restarted"


def test_gxpo_inner_optimiser_takes_the_new_lr(tmp_path):
    stopped(tmp_path, 'update={name="gxpo", lr=1e-3}')
    trainer = resumed(tmp_path, ["update.lr"], 'update={name="gxpo", lr=3e-3}')
    assert [g["lr"] for g in trainer.updater.torch_optimizer.param_groups] == [3e-3]
    assert logged(tmp_path, "lr") == [1e-3, 3e-3]


def test_a_roles_lr_reaches_its_optimiser(tmp_path):
    from test_trainer import MODEL, SMALL

    from groupwise.build import build
    from groupwise.config import load_config
    from groupwise.trainer import Trainer

    def codistill(lr, steps):
        cfg, _ = load_config(
            "codistill",
            [
                *SMALL,
                f'out="{tmp_path}"',
                f'model.path="{MODEL}"',
                *BASE[1:],
                f"train.steps={steps}",
                f"roles.teacher.update.lr={lr}",
            ],
        )
        return Trainer(build(cfg))

    first = codistill(1e-3, 2)
    job, step = Run(first), first.run_step
    first.run_step = lambda: (setattr(job, "_stop_requested", "SIGTERM"), step())[1]
    job.train()
    again = codistill(4e-3, 2)
    Run(again).train(resume_allow=["roles.teacher.update.lr"])
    teacher = again.roles[0].updater
    assert [g["lr"] for g in teacher.optimizer.param_groups] == [4e-3] and teacher.scheduler.base_lrs == [4e-3]
    assert [g["lr"] for g in again.updater.optimizer.param_groups] == [1e-3]  # the student's (SMALL's), unchanged


# ---------------------------------------------------------------------------------------------- B. the lr schedule
def test_a_new_schedule_and_base_lr_give_the_lr_by_hand(tmp_path):
    """Stopped after step 0 at constant lr 0.01, resumed with lr 0.02, linear decay over 4 steps:
    lr(s) = 0.02·(1 − s/4) → steps 1, 2, 3: 0.015, 0.01, 0.005."""
    stopped(tmp_path, 'update={name="sgd", lr=0.01}')
    resumed(tmp_path, ["update", "train.steps"], 'update={name="sgd", lr=0.02, schedule="linear"}', steps=4)
    assert logged(tmp_path, "lr") == pytest.approx([0.01, 0.015, 0.01, 0.005], rel=1e-12)


def test_a_new_warmup_gives_the_lr_by_hand(tmp_path):
    """Resumed at step 1 with lr 0.02 and 4 warm-up steps: lr(s) = 0.02·(s + 1)/4 → 0.01, 0.015, 0.02."""
    stopped(tmp_path, 'update={name="sgd", lr=0.01}')
    resumed(tmp_path, ["update", "train.steps"], 'update={name="sgd", lr=0.02, warmup_steps=4}', steps=4)
    assert logged(tmp_path, "lr") == pytest.approx([0.01, 0.01, 0.015, 0.02], rel=1e-12)


# ---------------------------------------------------------------------------------------------- C. run-loop settings
def test_run_loop_settings_take_effect(tmp_path):
    stopped(tmp_path)
    resumed(
        tmp_path,
        ["checkpoint.keep_last", "eval", "train.steps"],
        "checkpoint.keep_last=1",
        "eval.every=1",
        "eval.size=4",
        steps=3,
    )
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step_000003_r1"]  # keep_last 1 (2 before): one folder
    assert [v is not None for v in logged(tmp_path, "eval_accuracy")] == [False, True, True]  # eval.every=1 from step 1


# ---------------------------------------------------------------------------------------------- D. component parameters
def test_component_parameters_take_effect(tmp_path):
    stopped(tmp_path)
    trainer = resumed(
        tmp_path,
        ["objective.terms", "rollout.temperature"],
        'objective.terms=[{name="ppo_clip", eps_low=0.1, eps_high=0.3}]',
        "rollout.temperature=0.7",
    )
    term = trainer.objective.terms[0]
    assert (term.eps_low, term.eps_high, trainer.sampling_params["temperature"]) == (0.1, 0.3, 0.7)


def test_a_rubric_bank_keeps_its_configured_capacity():
    """Before: load_state_dict restored the saved capacity over the configured one."""
    saved = RubricBank(capacity=4)
    for reflection in ("r1", "r2", "r3"):
        saved.add("task", reflection)
    bank = RubricBank(capacity=2)
    bank.load_state_dict(saved.state_dict())
    assert bank.capacity == 2 and bank.retrieve("task", 9) == ["r3", "r2"]  # newest first, the 2 that fit


# ---------------------------------------------------------------------------------------------- E. schedules
def test_a_schedules_parameters_take_effect(tmp_path):
    """kl coef linear from 0 to `end` over 4 steps (value at step s = end·s/4): end 0.4 → 0.8 on
    resume at step 1: steps 1, 2 log 0.2, 0.4 (the old end would give 0.1, 0.2)."""

    def kl(end):
        schedule = f'{{schedule="linear", start_value=0.0, end={end}, steps=4}}'
        return f'objective.terms=["ppo_clip", {{name="kl", coef={schedule}}}]'

    stopped(tmp_path, kl(0.4))
    resumed(tmp_path, ["objective.terms", "train.steps"], kl(0.8), steps=3)
    assert logged(tmp_path, "coef/kl.coef") == pytest.approx([0.0, 0.2, 0.4])


def test_a_controllers_init_is_refused_naming_it(tmp_path):
    def kl(init):
        return f'objective.terms=["ppo_clip", {{name="kl", coef={{schedule="adaptive_kl", init={init}}}}}]'

    stopped(tmp_path, kl(0.1))
    refused = r"objective.kl.coef: adaptive_kl: init: 0.1 -> 0.3 is not changeable on resume"
    with pytest.raises(ConfigError, match=refused):
        resumed(tmp_path, ["objective.terms"], kl(0.3))
    named = r"scheduled coefficients \['objective.kl.coef'\].*this configuration schedules \[\]"
    with pytest.raises(ConfigError, match=named):
        resumed(tmp_path, ["objective.terms"], 'objective.terms=["ppo_clip", {name="kl", coef=0.1}]')
    resumed(tmp_path, ["objective.terms"], kl(0.1))  # the stored init: goes ahead


# ---------------------------------------------------------------------------------------------- F. fixed on resume
@pytest.mark.parametrize(
    ("key", "override"),
    [
        ("seed", "seed=3"),
        ("model.dtype", 'model.dtype="bfloat16"'),
        ("model.lora.r", "model.lora={r=2}"),
        ("data.train_size", "data.train_size=50"),
        ("phases", 'phases=[{name="sft", steps=1}]'),
        ("update.optimizer", 'update={name="gxpo", optimizer="sgd"}'),
    ],
)
def test_keys_fixed_at_start_are_refused_even_when_allowed(tmp_path, key, override):
    extra = ['update={name="gxpo"}'] if key == "update.optimizer" else []
    stopped(tmp_path, *extra)
    stored = (tmp_path / "config.toml").read_text()
    with pytest.raises(ConfigError, match=rf"not changeable on resume: {key.replace('.', '[.]')}: .* -> "):
        resumed(tmp_path, [key.split(".")[0]], *extra, override)
    assert (tmp_path / "config.toml").read_text() == stored  # nothing recorded for a refused resume


def test_a_key_added_to_groupwise_after_the_run_started_is_not_a_change(tmp_path):
    # A run folder written before a config key existed (``plugins``, added later) resumes when the key
    # is left at its default: the stored config is read with today's defaults for what it lacks. Set
    # to something else, it is a change like any other, named in the refusal.
    import tomllib

    from groupwise.config import to_toml

    run = tmp_path / "run"
    stopped(run)
    stored = tomllib.loads((run / "config.toml").read_text())
    del stored["plugins"], stored["train"]["max_skipped_in_row"]  # as an older groupwise wrote it
    (run / "config.toml").write_text(to_toml(stored))
    trainer = resumed(run, [])
    assert trainer.step == 2
    stopped(tmp_path / "other")
    stored = tomllib.loads((tmp_path / "other" / "config.toml").read_text())
    del stored["train"]["max_skipped_in_row"]
    (tmp_path / "other" / "config.toml").write_text(to_toml(stored))
    with pytest.raises(ConfigError, match="train.max_skipped_in_row"):
        resumed(tmp_path / "other", [], "train.max_skipped_in_row=7")
