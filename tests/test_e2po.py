"""E²PO text form (spec 15): the schedule and embedding losses by hand, perturbations only on content
tokens, the condition assignment, the offline phase on the embedded model, rows trained on the
original prompt, the build refusal on an engine without hooks, composition with ppo_clip and gspo."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import train_recorded

from groupwise.errors import ConfigError
from groupwise.hooks import mix_condition, noise_aware_gamma
from groupwise.rollout.e2po import (
    CONDITION,
    E2PO,
    anchor_loss,
    diversity_loss,
    embedding_loss,
    eps_insensitive,
    learn_prompt_perturbations,
)
from groupwise.run import Run


def unit(cos: float) -> torch.Tensor:
    return torch.tensor([cos, math.sqrt(1.0 - cos * cos)])


# --------------------------------------------------------------------------- the spec's numbers
def test_noise_aware_gamma_and_the_mixed_condition():
    sigma = torch.tensor([1.0, 0.8, 0.6, 0.5])
    # spec's unit test
    torch.testing.assert_close(noise_aware_gamma(sigma, 0.4), torch.tensor([1.0, 0.5, 0.0, 0.0]), atol=1e-6, rtol=0)
    c_orig, c_opt = torch.tensor([1.0, 0.0]), torch.tensor([3.0, 2.0])
    # 0.5·[3,2] + 0.5·[1,0]
    torch.testing.assert_close(mix_condition(c_orig, c_opt, torch.tensor(0.5)), torch.tensor([2.0, 1.0]))
    with pytest.raises(ValueError, match="rho=0"):
        noise_aware_gamma(sigma, 0.0)


def test_eps_insensitive_anchor_loss_from_the_spec():
    anc = torch.tensor([1.0, 0.0])
    torch.testing.assert_close(
        anchor_loss(unit(0.85)[None], anc, mu=0.8, eps=0.1), torch.tensor(0.0), atol=1e-6, rtol=0
    )  # |0.05| < ε
    # |0.6−0.8|−0.1
    torch.testing.assert_close(anchor_loss(unit(0.6)[None], anc, mu=0.8, eps=0.1), torch.tensor(0.1), atol=1e-6, rtol=0)
    # Σ_k over perturbations: cos 0.6 (0.1) + cos 0.95 (0.15 − 0.1 = 0.05) + cos 0.8 (0)
    torch.testing.assert_close(
        anchor_loss(torch.stack([unit(0.6), unit(0.95), unit(0.8)]), anc, 0.8, 0.1),
        torch.tensor(0.15),
        atol=1e-6,
        rtol=0,
    )
    torch.testing.assert_close(eps_insensitive(torch.tensor([-0.3, 0.05, 0.2]), 0.1), torch.tensor([0.2, 0.0, 0.1]))


def test_diversity_loss_by_hand():
    # orthogonal: 0 (spec)
    torch.testing.assert_close(diversity_loss(torch.tensor([[1.0, 0.0], [0.0, 2.0]])), torch.tensor(0.0))
    three = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # cos pairs 0, 1/√2, 1/√2; mean over the 6 ordered pairs
    torch.testing.assert_close(diversity_loss(three), torch.tensor(2 * (2 / math.sqrt(2)) / 6), atol=1e-6, rtol=0)
    assert diversity_loss(torch.ones(4, 1, 3)).tolist() == [0.0] * 4  # one perturbation: no diversity term
    # L_emb = λ_div · L_div + L_anc: the three above against the anchor [1, 0] (cos 1, 0, 1/√2), μ = 0.8, ε = 0.1
    anc = torch.tensor([1.0, 0.0])
    l_anc = (0.2 - 0.1) + (0.8 - 0.1) + max(0.0, abs(1 / math.sqrt(2) - 0.8) - 0.1)  # 0.1 + 0.7 + 0
    torch.testing.assert_close(
        embedding_loss(three, anc, 2.0, 0.8, 0.1), torch.tensor(2.0 * 0.4714045 + l_anc), atol=1e-5, rtol=0
    )


# --------------------------------------------------------------------------- phase I
def _linear_encoder(emb: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    return (emb * real[..., None]).sum(1)  # [M,d] sum of the real tokens' embeddings


def test_perturbations_touch_only_the_content_tokens():
    torch.manual_seed(0)
    emb = torch.randn(2, 4, 3)  # [N,S,d]
    real = torch.tensor([[False, True, True, True], [True, True, True, True]])  # row 0 left-padded by one
    content = torch.tensor([[1, 3, -1], [0, 1, 2]])  # row 0: columns 1 and 3 (column 2 a special token), padding
    delta, stats = learn_prompt_perturbations(
        emb,
        real,
        content,
        _linear_encoder,
        K=3,
        steps=5,
        lam_div=1.0,
        mu=0.8,
        eps=0.1,
        sigma_init=0.5,
        lr=0.1,
        generator=torch.Generator().manual_seed(1),
    )
    assert delta.shape == (2, 3, 3, 3)
    assert delta[0, :, 2].abs().sum() == 0  # the padding slot of row 0's content list stays exactly 0
    assert bool((delta[0, :, :2].abs() > 0).all()) and bool((delta[1].abs() > 0).all())
    assert stats["loss"].shape == (2,) and stats["cos_anchor"].shape == (2, 3)


def test_a_zero_loss_leaves_the_initial_perturbations_unmoved():
    # λ_div = 0 and an ε wider than any |cos − μ|: L_emb = 0 everywhere, no gradient, Adam never moves δ
    emb, real, content = torch.randn(1, 3, 4), torch.ones(1, 3, dtype=torch.bool), torch.tensor([[0, 2]])
    delta, stats = learn_prompt_perturbations(
        emb,
        real,
        content,
        _linear_encoder,
        K=2,
        steps=10,
        lam_div=0.0,
        mu=0.0,
        eps=2.0,
        sigma_init=0.3,
        lr=0.5,
        generator=torch.Generator().manual_seed(4),
    )
    init = torch.randn(1, 2, 2, 4, generator=torch.Generator().manual_seed(4)) * 0.3
    torch.testing.assert_close(delta, init)
    assert stats["loss"].tolist() == [0.0]


def test_adam_moves_the_perturbations_toward_the_anchor_band():
    # start far from the band (cos ≈ 0 for a big noise); 200 steps bring the anchor term to 0 with K = 1
    torch.manual_seed(3)
    emb, real, content = torch.randn(1, 2, 8), torch.ones(1, 2, dtype=torch.bool), torch.tensor([[0, 1]])
    delta, stats = learn_prompt_perturbations(
        emb,
        real,
        content,
        _linear_encoder,
        K=1,
        steps=200,
        lam_div=1.0,
        mu=0.8,
        eps=0.1,
        sigma_init=5.0,
        lr=0.1,
        generator=torch.Generator().manual_seed(0),
    )
    assert 0.7 - 1e-3 <= float(stats["cos_anchor"][0, 0]) <= 0.9 + 1e-3
    assert float(stats["loss"][0]) < 1e-3


# --------------------------------------------------------------------------- phase II: conditions and hooks
def _artifact(K=4, d=3):
    delta = torch.arange(2 * (K - 1) * 3 * d, dtype=torch.float32).view(2, K - 1, 3, d) + 1  # [N,K−1,L,d], no zeros
    return {
        "keys": torch.tensor([7, 9]),
        "positions": torch.tensor([[0, 2, -1], [1, 2, 3]]),
        "delta": delta,
        "conditions": K,
    }


def test_condition_assignment_per_row():
    strategy = E2PO()
    strategy.use_artifact("e2po_perturbations", _artifact())
    assert strategy._conditions_of(8).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    rr = E2PO(assign="round_robin")
    rr.use_artifact("e2po_perturbations", _artifact())
    assert rr._conditions_of(8).tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    with pytest.raises(ConfigError, match="group_size=6 is not a multiple of the artifact's conditions=4"):
        strategy._conditions_of(6)
    with pytest.raises(ConfigError, match="assign='mixed'"):
        E2PO(assign="mixed")


def test_the_hook_gives_each_row_its_conditions_delta():
    strategy = E2PO()
    art = _artifact()
    strategy.use_artifact("e2po_perturbations", art)
    hook = strategy._hook(7, 8)
    assert hook.positions.tolist() == [0, 2]  # row 7's content positions (padding dropped)
    assert hook.delta.shape == (8, 2, 3)
    assert hook.delta[:2].abs().sum() == 0  # condition 0: the original prompt
    for g in range(2, 8):
        torch.testing.assert_close(hook.delta[g], art["delta"][0, g // 2 - 1, :2])
    with pytest.raises(ConfigError, match="train row 3 has no learned perturbations"):
        strategy._hook(3, 8)


# --------------------------------------------------------------------------- end to end
PHASE = 'phases=[{name="e2po_perturbations", conditions=2, steps=3, chunk=8}]'
RUN = [
    'rollout.name="e2po"',
    PHASE,
    "data.train_size=12",
    "rollout.group_size=4",
    "rollout.prompts_per_step=4",
    "threads=1",
]


def test_the_phase_freezes_the_policy_and_perturbs_content_tokens_only(tmp_path):
    from test_trainer import make_trainer

    trainer = make_trainer(tmp_path, *RUN, "train.steps=1", "eval.size=0")
    before = {k: v.clone() for k, v in trainer.policy.module.state_dict().items()}
    Run(trainer)._run_phases()
    for key, value in trainer.policy.module.state_dict().items():  # the phase never changes the weights
        assert torch.equal(before[key], value), key
    assert all(p.requires_grad for p in trainer.policy.module.parameters())  # and gives them back trainable
    art = torch.load(tmp_path / "phases" / "e2po_perturbations.pt", weights_only=False)["artifact"]
    delta, positions = art["delta"], art["positions"]
    assert delta.shape[:2] == (12, 1) and positions.shape[0] == 12 and art["conditions"] == 2
    assert delta[positions[:, None, :] < 0].abs().sum() == 0  # off the content positions: exactly 0
    assert bool((delta[positions[:, None, :] >= 0].abs().sum(-1) > 0).all())  # every content token perturbed
    prompt = trainer.prompts("train", trainer.train_rows, 0)
    # the arithmetic prompts have no special tokens
    assert positions[0][positions[0] >= 0].tolist() == list(range(len(prompt)))


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_rows_are_trained_on_the_original_prompt(tmp_path, objective):
    rows, seen = train_recorded(tmp_path, objective, *RUN)
    for batch in seen:
        cond = batch.extras[CONDITION]  # [B,G]
        assert cond[0].tolist() == [0, 0, 1, 1]
        mask = batch.mask  # [B,G,T]
        # logp_old is the clean forward with the weights that sampled: equal to the sampler's on clean rows,
        # different on perturbed rows (their sampler log-probs are under the perturbed prompt)
        clean_gap = ((batch.logp_old - batch.logp_sampler).abs() * mask)[cond == 0].max()
        pert_gap = ((batch.logp_old - batch.logp_sampler).abs() * mask)[cond == 1].max()
        assert float(clean_gap) < 1e-4
        assert float(pert_gap) > 1e-2
    assert all(math.isfinite(r["e2po/reward_orig"]) and "e2po/group_std" in r for r in rows)
