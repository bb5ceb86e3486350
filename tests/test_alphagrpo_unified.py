"""AlphaGRPO's unified-model analogue (spec 27): a tiny causal LM's think tokens, then the flow toy
conditioned on them, in one row; the joint text + image loss by hand; one update of both nets from
one shared advantage, checked against the hand-written gradient; ppo_clip and gspo composition."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import leaf, rollout_from

from groupwise.advantages.alphagrpo import per_prompt_advantages
from groupwise.build import build as build_parts
from groupwise.config import load_config
from groupwise.losses.alphagrpo_joint import joint_text_image_loss
from groupwise.modalities.unified import THINK_VOCAB, UnifiedPolicy
from groupwise.registry import build
from groupwise.trainer import Trainer
from groupwise.types import Request, StepInfo

INFO = StepInfo(step=3, seed=11, max_new_tokens=0)


def _policy(**kw):
    return UnifiedPolicy(
        n_labels=12, hidden=16, layers=2, steps=4, sde=kw.pop("sde", "all"), n_think=3, think_hidden=8, **kw
    )


def test_think_lm_is_causal():
    policy = _policy()
    label = torch.tensor([3, 3])
    a = torch.tensor([[0, 1, 2], [0, 1, 2]])
    b = torch.tensor([[0, 1, 5], [4, 1, 2]])  # row 0: last token changed; row 1: first token changed
    la, lb = policy.think_lm(label, a), policy.think_lm(label, b)  # [2,3,V]
    torch.testing.assert_close(la[0], lb[0], atol=0, rtol=0)  # position t sees tokens < t only
    torch.testing.assert_close(la[1, 0], lb[1, 0], atol=0, rtol=0)
    assert (la[1, 1:] - lb[1, 1:]).abs().max() > 1e-6


def test_generate_layout_and_log_probs_by_hand():
    policy = _policy()
    batch = policy.generate([Request(key=2, n=3, prompt=[5]), Request(key=7, n=2, prompt=[0])], {}, INFO)
    n, K = 3, 4
    assert batch.shape == (2, 3, n + K) and policy.T == n + K
    assert (
        batch.extras["image_token"][0, 0].tolist() == [0.0] * n + [1.0] * K
        and batch.extras["image_token"][1, 2].sum() == 0
    )  # padding row
    assert torch.equal(batch.extras["think_ids"], batch.actions[:, :, :n]) and int(batch.actions[:, :, :n].max()) < len(
        THINK_VOCAB
    )
    assert batch.mask[1].tolist() == [[True] * 7, [True] * 7, [False] * 7]
    # the think tokens' sampling log-probs, recomputed by hand from the think LM
    label = torch.tensor([5, 5, 5])
    logq = torch.log_softmax(policy.think_lm(label, batch.actions[0, :, :n]), -1)  # [3,n,V]
    want = logq.gather(-1, batch.actions[0, :, :n, None])[..., 0]  # [3,n]
    torch.testing.assert_close(batch.logp_sampler[0, :, :n], want.float(), atol=1e-6, rtol=0)
    # the training forward gives back the sampler's log-probs at every position (think and flow)
    logp = policy.forward(batch)["logp"]  # [B,G,T]
    torch.testing.assert_close(logp * batch.mask, batch.logp_sampler, atol=1e-6, rtol=0)
    assert policy.think_text(batch)[0][0] == " ".join(THINK_VOCAB[int(t)] for t in batch.actions[0, 0, :n])
    again = policy.generate([Request(key=2, n=3, prompt=[5]), Request(key=7, n=2, prompt=[0])], {}, INFO)
    # seeded
    assert torch.equal(again.actions, batch.actions) and torch.equal(again.extras["x_final"], batch.extras["x_final"])
    greedy = policy.generate([Request(key=2, n=2, prompt=[5])], {"greedy": True}, INFO)
    plan = torch.zeros(1, n, dtype=torch.long)
    for t in range(n):  # greedy decoding by hand: the argmax token at each position
        plan[0, t] = policy.think_lm(torch.tensor([5]), plan)[0, t].argmax()
    # the ODE: no trained flow step
    assert greedy.shape[2] == n and greedy.actions[0].tolist() == [plan[0].tolist()] * 2


def test_flow_sees_the_plan_not_the_label():
    policy = _policy()
    x, s = torch.tensor([[0.3, -0.2]], dtype=torch.float64), torch.tensor([0.5], dtype=torch.float64)
    plan, other = torch.tensor([[0, 2, 4]]), torch.tensor([[1, 3, 6]])
    v0 = policy._velocity(x, s, torch.tensor([0]), plan)
    # the label does not enter
    torch.testing.assert_close(v0, policy._velocity(x, s, torch.tensor([9]), plan), atol=0, rtol=0)
    assert (v0 - policy._velocity(x, s, torch.tensor([0]), other)).abs().max() > 1e-6
    seeing = _policy(flow_sees_label=True)
    assert (
        seeing._velocity(x, s, torch.tensor([0]), plan) - seeing._velocity(x, s, torch.tensor([9]), plan)
    ).abs().max() > 1e-6


def test_state_dict_round_trip_keeps_the_think_lm():
    a, b = _policy(init_seed=0), _policy(init_seed=5)
    b.load_state_dict(a.state_dict())
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    twin = a.snapshot()
    assert not any(p.requires_grad for p in twin.think_lm.parameters()) and all(
        p.requires_grad for p in a.think_lm.parameters()
    )


# ---------------------------------------------------------------------------------------------- the joint loss
def test_joint_loss_by_hand():
    term = build("objective", "alphagrpo_joint", text_eps_low=0.2, text_eps_high=0.2, img_eps=1e-3, adv_clip_max=5.0)
    logp_old = torch.zeros(2, 1, 3)
    ro = rollout_from(logp_old, adv=torch.tensor([[7.0], [-2.0]]))
    ro.set_extra("image_token", torch.tensor([[[0.0, 1.0, 1.0]], [[0.0, 0.0, 1.0]]]), "token")
    ratio = torch.tensor([[[1.5, 1.01, 0.99]], [[0.5, 1.0, 1.0005]]])
    loss = term(ro, {"logp": ratio.log()}, INFO)
    # row 0 (A = 7): text −min(1.5·7, 1.2·7) = −8.4; image A' = 5: −min(1.01·5, 1.001·5) = −5.005,
    # −min(0.99·5, 0.999·5)... = −4.95
    # row 1 (A = −2): text −min(−1, 0.8·−2) = 1.6, −min(−2, −2) = 2; image −min(1.0005·−2, 1.0005·−2) = 2.001
    torch.testing.assert_close(loss, torch.tensor([[[-8.4, -5.005, -4.95]], [[1.6, 2.0, 2.001]]]), atol=1e-5, rtol=0)
    stats = term.stats(ro, {"logp": ratio.log()})
    assert stats["clip_high"][0, 0].tolist() == [1.0, 1.0, 0.0] and stats["clip_low"][1, 0].tolist() == [1.0, 0.0, 0.0]
    # no image_token extra: every position is text (= ppo_clip)
    plain = rollout_from(logp_old, adv=torch.tensor([[7.0], [-2.0]]))
    torch.testing.assert_close(
        term(plain, {"logp": ratio.log()}, INFO), build("objective", "ppo_clip")(plain, {"logp": ratio.log()}, INFO)
    )


def test_joint_loss_on_policy_gradient_and_the_interface_function():
    term = build("objective", "alphagrpo_joint")
    ro = rollout_from(torch.zeros(1, 2, 2), adv=torch.tensor([[8.0, -1.0]]))
    ro.set_extra("image_token", torch.tensor([[[0.0, 1.0], [0.0, 1.0]]]), "token")
    logp = leaf(torch.zeros(1, 2, 2))
    term(ro, {"logp": logp}, INFO).sum().backward()
    # −A on text, −clip(A, ±5) on image
    torch.testing.assert_close(logp.grad, torch.tensor([[[-8.0, -5.0], [1.0, 1.0]]]))
    # spec 27's interface: token-mean text part + mean image part
    got = joint_text_image_loss(
        torch.log(torch.tensor([[1.5, 1.0], [1.0, 1.0]])),
        torch.zeros(2, 2),
        torch.tensor([[True, True], [True, False]]),
        torch.log(torch.tensor([[1.01], [1.0]])),
        torch.zeros(2, 1),
        torch.tensor([7.0, -2.0]),
    )
    text = (-8.4 - 7.0 + 2.0) / 3
    image = (-5.005 + 2.0) / 2
    assert float(got) == pytest.approx(text + image, abs=1e-5)


# ---------------------------------------------------------------------------------------------- through the trainer
UNIFIED = [
    'model.policy="unified"',
    'model.params={n_labels=12, steps=3, sde="all", hidden=16, n_think=3, think_hidden=8}',
    'data.task="flow_attrs"',
    'rewards=[{name="dv_reward", domain="point2d"}]',
    'advantage.estimator="alphagrpo"',
    "rollout.group_size=4",
    "rollout.prompts_per_step=4",
    "eval.size=8",
    "threads=1",
    'update={name="sgd", lr=0.1}',
    'objective.agg="token_mean"',
]


def test_one_update_trains_both_nets_from_the_shared_advantage(tmp_path):
    cfg, _ = load_config(None, [*UNIFIED, f'out="{tmp_path}"', 'objective.terms=["alphagrpo_joint"]', "train.steps=1"])
    trainer = Trainer(build_parts(cfg))
    policy = trainer.policy
    trainer.policy.eval()
    batch = trainer.prepare(trainer.collect())
    assert batch.advantages.dim() == 2 and batch.advantages.abs().sum() > 0, "a batch with no signal tests nothing"
    ids = [int(i) for i in batch.prompt_index for _ in range(batch.shape[1])]
    want = per_prompt_advantages(batch.rewards.reshape(-1), ids, valid=batch.group_valid.reshape(-1)).reshape(
        batch.shape[:2]
    )
    torch.testing.assert_close(batch.advantages, want.float())
    assert float(batch.advantages.abs().max()) < 5.0  # no advantage clip on the image part here
    # the hand gradient: on-policy, token_mean: −Σ A_row · ∇logp[b,g,t] / Σ mask over every position,
    # think and flow alike
    params = policy.parameters()
    logp = policy.forward(batch)["logp"]  # [B,G,T]
    mask = batch.mask & batch.group_valid[..., None]  # [B,G,T]
    ref = -(batch.advantages[..., None] * logp * mask).sum() / mask.sum()
    want_grads = [
        torch.zeros_like(p) if g is None else g
        for p, g in zip(params, torch.autograd.grad(ref, params, allow_unused=True))
    ]  # the label embedding is unused
    captured = []
    handle = trainer.updater.optimizer.register_step_pre_hook(
        lambda opt, a, k: (
            captured or captured.extend(torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params)
        )
    )
    policy.train()
    trainer.update(batch)
    handle.remove()
    n_flow = len(list(policy.net.parameters()))
    assert len(captured) == len(want_grads)
    for got, want_g in zip(captured, want_grads):
        torch.testing.assert_close(got.double(), want_g.double(), atol=1e-6, rtol=1e-5)
    assert (
        max(float(g.abs().max()) for g in want_grads[:n_flow]) > 0
        and max(float(g.abs().max()) for g in want_grads[n_flow:]) > 0
    )  # both parts learn


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_two_unified_steps_compose(tmp_path, objective):
    cfg, _ = load_config(
        None,
        [*UNIFIED, f'out="{tmp_path}"', f'objective.terms=["{objective}", {{name="kl", coef=0.04}}]', "train.steps=2"],
    )
    trainer = Trainer(build_parts(cfg))
    seen = []
    prepare = trainer.prepare
    trainer.prepare = lambda batch: (seen.append(prepare(batch)), seen[-1])[1]
    rows = [trainer.run_step() for _ in range(2)]
    for batch, row in zip(seen, rows):
        assert batch.shape[2] == 3 + 3 and math.isfinite(row["loss"])
        # one-step-old forward = the sampler
        torch.testing.assert_close(batch.logp_old * batch.mask, batch.logp_sampler, atol=1e-6, rtol=0)
        assert 0.0 <= row["reward_metric/dv_sat"] <= 1.0
