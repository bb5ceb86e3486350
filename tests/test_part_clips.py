"""LAC's per-part clips (spec 10, design §3 "10 LAC", [INFERRED] values): the objective's ``rows``
filter on a token extra keeps those tokens, so two ``ppo_clip`` entries on the planner kind's ``part``
(0 plan positions, 1 generator steps) clip each part with its own range and average each over its own
tokens. By hand on a tiny rollout, then through the trainer on recipe ``lac`` with the option set."""

from __future__ import annotations

import pytest
import torch
from helpers import info_for, leaf, rollout_from

from groupwise.objective import Objective, RowFilter

PART_CLIPS = [
    {"name": "ppo_clip", "key": "clip_plan", "eps_low": 0.2, "eps_high": 0.2, "rows": {"extra": "part", "equals": 0}},
    {
        "name": "ppo_clip",
        "key": "clip_generator",
        "eps_low": 1e-3,
        "eps_high": 1e-3,
        "rows": {"extra": "part", "equals": 1},
    },
]


def _two_part_rollout():
    # 1 group of 2 rows, T = 4: two plan positions, then two generator steps; A = +1 and -1
    mb = rollout_from(torch.zeros(1, 2, 4), adv=torch.tensor([[1.0, -1.0]]))
    mb.set_extra("part", torch.tensor([[[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]]]), "token")
    ratio = torch.tensor([[[1.1, 1.3, 1.01, 1.0005], [0.9, 0.7, 0.99, 1.0]]])
    return mb, leaf(ratio.log())


def test_two_clips_on_the_part_extra_by_hand():
    obj = Objective.from_config(PART_CLIPS, "token_mean")
    assert obj.row_filters == [RowFilter("part", 0.0), RowFilter("part", 1.0)] and obj.rollout_extras == ("part",)
    mb, logp = _two_part_rollout()
    loss = obj.loss(mb, {"logp": logp}, obj.normalizers(mb, info_for(4)), info_for(4))
    # per token −min(ρA, clip(ρ, 1 ± ε)A); plan (ε = 0.2): −1.1, −1.2 (1.3 clipped to 1.2), 0.9, 0.8 (0.7 clipped to
    # 0.8): mean over the 4 plan tokens −0.6/4 = −0.15; generator (ε = 1e-3): −1.001 (1.01 clipped), −1.0005, 0.999
    # (0.99 clipped), 1.0: mean −0.0025/4 = −0.000625; the loss is their sum, −0.150625
    assert loss.item() == pytest.approx(-0.150625, abs=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    # unclipped tokens get −ρA / 4 (each part's own 4 tokens): −1.1/4, 0.9/4, −1.0005/4, 1.0/4; clipped ones 0
    want = torch.tensor([[[-0.275, 0.0, 0.0, -0.250125], [0.225, 0.0, 0.0, 0.25]]])
    torch.testing.assert_close(grad, want, atol=1e-6, rtol=0)
    # one ppo_clip (ε = 0.2) over all 8 tokens instead: (−0.6 − 1.01 − 1.0005 + 0.99 + 1.0)/8 = −0.0775625
    one = Objective.from_config(["ppo_clip"], "token_mean")
    assert one.loss(mb, {"logp": logp}, one.normalizers(mb, info_for(4)), info_for(4)).item() == pytest.approx(
        -0.0775625, abs=1e-6
    )


def test_a_filter_on_a_missing_extra_names_it():
    mb = rollout_from(torch.zeros(1, 1, 2), torch.zeros(1, 1))
    with pytest.raises(ValueError, match="reads the extra 'part'.*or a policy that writes it"):
        RowFilter("part", 0.0)(mb)


def test_lac_with_part_clips_trains_each_part_under_its_own_normaliser(tmp_path):
    from groupwise.build import build as build_parts
    from groupwise.config import load_config
    from groupwise.trainer import Trainer

    terms = (
        '[{name="ppo_clip", key="clip_plan", eps_low=0.2, eps_high=0.2, rows={extra="part", equals=0}}, '
        '{name="ppo_clip", key="clip_generator", eps_low=1e-3, eps_high=1e-3, rows={extra="part", equals=1}}]'
    )
    # a wide hit radius: a random planner's samples then hit some modes (at 0.75 none do: no RL signal)
    wide = 'rewards=[{name="binding_reward", radius=3.0}]'
    overrides = ["phases=[]", wide, "train.steps=1", "rollout.prompts_per_step=4", "eval.size=0"]
    overrides += ['objective.agg="token_mean"', 'update={name="sgd", lr=0.1}']  # no grad-norm clip
    cfg, _ = load_config("lac", [f'out="{tmp_path}"', f"objective.terms={terms}", *overrides])
    trainer = Trainer(build_parts(cfg))  # the strategy does not collect `part`: the planner writes it
    policy = trainer.policy
    batch = trainer.prepare(trainer.collect())
    assert batch.advantages is not None and batch.advantages.abs().sum() > 0, "a batch with no signal tests nothing"
    # on-policy (ρ = 1, nothing clipped): −Σ A ∇logp over each part's tokens / that part's token count, summed
    params = policy.parameters()
    logp = policy.forward(batch)["logp"]  # [B,G,T]
    mask = batch.mask & batch.group_valid[..., None]  # [B,G,T]
    ref = sum(
        -(batch.advantages[..., None] * logp * m).sum() / m.sum()
        for m in (mask & (batch.extras["part"] == 0), mask & (batch.extras["part"] == 1))
    )
    grads = torch.autograd.grad(ref, params, allow_unused=True)
    want = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
    captured = []
    handle = trainer.updater.optimizer.register_step_pre_hook(
        lambda opt, a, k: (
            captured or captured.extend(torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params)
        )
    )
    trainer.update(batch)
    handle.remove()
    assert len(captured) == len(want)
    for got, w in zip(captured, want):
        torch.testing.assert_close(got.double(), w.double(), atol=1e-6, rtol=1e-5)
