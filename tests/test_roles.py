"""Trainable roles (issue 11, core-2 §2 D) through their first consumer, CoDistill-GRPO (spec 44):
the KD reward from a role's log-probs, the teacher's composed objective equal to the paper's
teacher loss, both models training on one batch, resume with two trained models, and the errors."""

from __future__ import annotations

import json

import pytest
import torch
from test_trainer import MODEL

from groupwise.build import build as build_parts
from groupwise.config import load_config
from groupwise.errors import ConfigError
from groupwise.losses.codistill import CoDistillKD, codistill_teacher_loss
from groupwise.objective import Objective, token_weights
from groupwise.registry import build
from groupwise.run import Run
from groupwise.trainer import Trainer
from groupwise.types import Rollout, StepInfo

INFO = StepInfo(step=0, seed=0, max_new_tokens=4)
SMALL = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "eval.size=8",
    "threads=1",
    'roles.teacher.model.path="hinted"',
]


def codistill(out, *overrides):
    cfg, _ = load_config("codistill", [*SMALL, f'out="{out}"', f'model.path="{MODEL}"', *overrides])
    return Trainer(build_parts(cfg))


def test_kd_reward_component_spec_numbers():
    # student log-probs [-1, -2], teacher [-0.5, -1] -> r_kd = mean(0.5, 1.0) = 0.75; padding ignored
    ro = Rollout(
        prompt_ids=[[1]],
        actions=torch.ones(1, 1, 3, dtype=torch.long),
        mask=torch.tensor([[[True, True, False]]]),
        group_valid=torch.ones(1, 1, dtype=torch.bool),
        truncated=torch.zeros(1, 1, dtype=torch.bool),
        prompt_index=torch.zeros(1, dtype=torch.long),
    )
    ro.logp_old = torch.tensor([[[-1.0, -2.0, 0.0]]])
    ro.set_extra("teacher.logp", torch.tensor([[[-0.5, -1.0, 9.0]]]), "token")
    kd = CoDistillKD()
    assert [n.key for n in kd.needs] == ["logp", "teacher.logp"]
    assert kd.score_rollout(ro, INFO).tolist() == [[pytest.approx(0.75)]]


def test_the_composed_teacher_objective_is_the_papers_teacher_loss():
    """ppo_clip × sampler_is(token_truncate, hi=2) with token_mean = codistill_teacher_loss."""
    g = torch.Generator().manual_seed(0)
    B, G, T = 2, 4, 5
    mask = torch.rand(B, G, T, generator=g) > 0.2  # [B,G,T]
    student = -torch.rand(B, G, T, generator=g) * 3  # [B,G,T] behaviour log-probs
    teacher_old = -torch.rand(B, G, T, generator=g) * 3  # [B,G,T]
    # [B,G,T] after a step: ratio != 1
    teacher_now = (teacher_old + 0.3 * torch.randn(B, G, T, generator=g)).requires_grad_()
    adv = torch.randn(B, G, generator=g)  # [B,G]
    ro = Rollout(
        prompt_ids=[[1]] * B,
        actions=torch.ones(B, G, T, dtype=torch.long),
        mask=mask,
        group_valid=torch.ones(B, G, dtype=torch.bool),
        truncated=torch.zeros(B, G, dtype=torch.bool),
        prompt_index=torch.arange(B),
    )
    ro.logp_old, ro.logp_sampler, ro.advantages = teacher_old, student, adv
    weight = build("weight", "sampler_is", mode="token_truncate", hi=2.0)
    ro.weight, counted = token_weights([weight], ro, INFO)  # [B,G,T], [B,G,T]
    ro.set_extra("counted", counted, "token")
    objective = Objective.from_config([{"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2}], "token_mean")
    ours = objective.loss(ro, {"logp": teacher_now}, objective.normalizers(ro, INFO, None), INFO)
    theirs = codistill_teacher_loss(teacher_now, teacher_old, student, adv, mask, eps=0.2, C=2.0)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-7)
    (g1,) = torch.autograd.grad(ours, teacher_now)
    (g2,) = torch.autograd.grad(theirs, teacher_now)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-7)


def test_both_models_train_on_the_students_rollouts(tmp_path):
    trainer = codistill(tmp_path / "run", "train.steps=2")
    student0 = {n: p.detach().clone() for n, p in trainer.policy.module.named_parameters()}
    teacher = trainer.roles[0]
    teacher0 = {n: p.detach().clone() for n, p in teacher.policy.module.named_parameters()}
    summary = Run(trainer).train()
    assert any(not torch.equal(p, student0[n]) for n, p in trainer.policy.module.named_parameters())
    assert any(not torch.equal(p, teacher0[n]) for n, p in teacher.policy.module.named_parameters())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # its own old log-probs: on its first pass ratio 1
    assert rows[0]["teacher/ratio"] == pytest.approx(1.0) and rows[0]["teacher/grad_norm"] > 0
    assert rows[0]["reward/codistill_kd"] < 0 < rows[0]["reward_std"]  # the student's samples are likelier under itself
    assert {"teacher/accuracy_before", "teacher/accuracy_after"} <= set(summary)
    assert (tmp_path / "run" / "final" / "teacher" / "model.safetensors").exists()


def test_the_teachers_view_of_the_batch(tmp_path):
    from groupwise import roles

    trainer = codistill(tmp_path / "run", "train.steps=1")
    batch = trainer.prepare(trainer.collect())
    teacher = trainer.roles[0]
    view = roles.view(teacher, batch, batch.logp_old, INFO)
    assert torch.equal(view.logp_old, batch.extras["teacher.logp"]) and torch.equal(view.logp_sampler, batch.logp_old)
    assert torch.equal(view.rewards, batch.reward_parts[..., 0])  # the task reward only ("exact", weight 1)
    assert not torch.equal(batch.rewards, view.rewards)  # the student's total has the KD term
    rho = (batch.extras["teacher.logp"] - batch.logp_old).exp().clamp(max=2.0)  # [B,G,T]
    torch.testing.assert_close(view.weight[view.mask], rho[view.mask])  # the truncated IS weight, C = 2


def test_resume_with_two_trained_models_is_exact(tmp_path):
    straight = codistill(tmp_path / "a", "train.steps=4", "eval.size=0", "checkpoint.every=2")
    Run(straight).train()
    first = codistill(tmp_path / "b", "train.steps=4", "eval.size=0", "checkpoint.every=2")
    first.cfg.train.steps = 2
    Run(first).train()
    resumed = codistill(tmp_path / "b", "train.steps=4", "eval.size=0", "checkpoint.every=2")
    Run(resumed).train(resume_allow=["train.steps"])
    for module_a, module_b in (
        (straight.policy.module, resumed.policy.module),
        (straight.roles[0].policy.module, resumed.roles[0].policy.module),
    ):
        for (name, p), q in zip(module_a.named_parameters(), module_b.parameters()):
            assert torch.equal(p, q), name


def test_role_configuration_errors(tmp_path):
    with pytest.raises(ConfigError, match="roles.ref: 'policy' and 'ref' are the trained policy and its reference"):
        load_config("codistill", ['roles.ref={model={path="hinted"}}'])
    with pytest.raises(
        ConfigError,
        match=r"roles.teacher.rewards names \['nope'\]; the run's reward functions are \['exact', 'codistill_kd'\]",
    ):
        codistill(tmp_path / "x", 'roles.teacher.rewards=["nope"]')


def test_a_role_identical_to_the_policy_takes_identical_steps(tmp_path):
    """The role's update path is the policy's: a teacher that starts as the same model, with the same
    objective and no IS weight, sees the same batch, rewards and advantages (the models stay equal,
    so the IS ratio would be 1 anyway) and must end every step with bit-identical weights."""
    trainer = codistill(
        tmp_path / "run",
        'rewards=["exact"]',
        f'roles.teacher.model.path="{MODEL}"',
        'roles.teacher.objective={agg="seq_mean_token_mean", '
        'terms=[{name="ppo_clip", eps_low=0.2, eps_high=0.2}], weights=[]}',
    )
    for step in range(3):
        trainer.step = step
        row = trainer.run_step()
        assert row["teacher/loss"] == row["loss"] and row["teacher/grad_norm"] == row["grad_norm"]
        for p, q in zip(trainer.policy.module.parameters(), trainer.roles[0].policy.module.parameters()):
            assert torch.equal(p, q)


def test_a_frozen_role_serves_needs_and_is_never_trained(tmp_path):
    # a fixed teacher (roles.teacher.frozen = true): its log-probs feed the KD reward, its weights never move,
    # nothing of it is trained, logged or checkpointed
    import json

    from test_trainer import make_trainer
    from transformers import AutoModelForCausalLM

    from groupwise.losses.codistill import kd_reward
    from groupwise.policy.lm import resolve_model_path

    trainer = make_trainer(
        tmp_path,
        'rewards=["exact", {name="codistill_kd", teacher="teacher"}]',
        'roles.teacher={model={path="hinted"}, frozen=true}',
        "train.steps=2",
        "eval.size=0",
        "checkpoint.every=1",
    )
    assert trainer.roles == [] and list(trainer.parts.frozen) == ["teacher"]
    seen = {}
    prepare = trainer.prepare
    trainer.prepare = lambda batch: seen.setdefault("batch", prepare(batch))
    Run(trainer).train()
    batch = seen["batch"]
    shipped = AutoModelForCausalLM.from_pretrained(resolve_model_path("hinted")).eval()
    with torch.no_grad():
        teacher_logp = trainer.policy.forward(batch, ("logp",), module=shipped)["logp"]  # [B,G,T]
    torch.testing.assert_close(batch.extras["teacher.logp"], teacher_logp, atol=1e-5, rtol=1e-5)
    B, G, T = batch.shape
    want = kd_reward(
        batch.logp_old.reshape(B * G, T), teacher_logp.reshape(B * G, T), batch.row_mask.reshape(B * G, T)
    ).view(B, G)
    got = batch.reward_parts[..., 1]  # [B,G] the KD column
    torch.testing.assert_close(got[batch.group_valid], want[batch.group_valid], atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(trainer.parts.frozen["teacher"].module.named_parameters(), shipped.parameters()):
        assert torch.equal(p, q), name  # the frozen teacher never moved
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert not any(k.startswith("teacher/") for k in rows[-1])
    from groupwise import checkpoint

    assert checkpoint.load(checkpoint.latest_intact(tmp_path))["roles"] == {}
