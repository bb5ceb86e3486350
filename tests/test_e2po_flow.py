"""E²PO flow form (spec 15, the paper's own form) on the 2-D flow toy: the noise-aware schedule on
the sampler's steps, the embedding condition and its frozen encoder, the embed_delta hook applied
only to its rows, the update on the original condition, the build refusal of a flow policy that
cannot apply the hook, the phase on the flow toy (the flow model frozen) and its artifact's resume,
composition with two objectives, and the trap reward by hand."""

from __future__ import annotations

import math

import pytest
import torch

from groupwise.build import build
from groupwise.config import load_config
from groupwise.errors import ConfigError
from groupwise.hooks import EmbedDelta, noise_aware_gamma, row_hooks
from groupwise.modalities.flow import FlowPolicy
from groupwise.modalities.flow_sde import flow_sigmas, sde_step_with_logprob
from groupwise.modalities.flow_toy import FlowTrapReward, trap_reward
from groupwise.rollout.context import check_strategy
from groupwise.rollout.e2po import CONDITION, E2PO, anchor_loss, diversity_loss
from groupwise.run import Run
from groupwise.trainer import Trainer
from groupwise.types import Request, StepInfo

INFO = StepInfo(step=1, seed=3, max_new_tokens=0)


def flow_trainer(out, *overrides, recipe="e2po_flow"):
    cfg, _ = load_config(recipe, [f'out="{out}"', *overrides])
    return Trainer(build(cfg))


def _delta(n, scale=0.7, seed=0):
    return scale * torch.randn(n, 1, 8, generator=torch.Generator().manual_seed(seed))  # [n,P=1,d=8]


# --------------------------------------------------------------------------- the spec's numbers
def test_the_spec_schedule_on_the_flow_samplers_noise_levels():
    sigmas = flow_sigmas(5)  # 1.0, 0.8, 0.6, 0.4, 0.2, 0.0: the toy's linear schedule
    # spec: 1.0→1, 0.8→0.5, 0.6→0
    torch.testing.assert_close(noise_aware_gamma(sigmas[:3], 0.4), torch.tensor([1.0, 0.5, 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(noise_aware_gamma(torch.tensor(0.5), 0.4), torch.tensor(0.0))  # spec: 0.5→0
    assert noise_aware_gamma(sigmas[3:], 0.4).tolist() == [0.0, 0.0, 0.0]


def test_the_spec_loss_numbers():
    anc = torch.tensor([1.0, 0.0])
    on_band, off_band = torch.tensor([[0.85, math.sqrt(1 - 0.85**2)]]), torch.tensor([[0.6, 0.8]])
    # |0.85−0.8| < ε
    torch.testing.assert_close(anchor_loss(on_band, anc, mu=0.8, eps=0.1), torch.tensor(0.0), atol=1e-6, rtol=0)
    # |0.6−0.8|−0.1
    torch.testing.assert_close(anchor_loss(off_band, anc, mu=0.8, eps=0.1), torch.tensor(0.1), atol=1e-6, rtol=0)
    # orthogonal: L_div = 0
    torch.testing.assert_close(diversity_loss(torch.tensor([[2.0, 0.0], [0.0, 0.5]])), torch.tensor(0.0))


class _Recorder:
    """Wraps the velocity net's condition read to record the condition of every call."""

    def __init__(self, policy):
        self.seen, self.net = [], policy.net
        self.forward = policy.net.forward
        policy.net.forward = self

    def __call__(self, x, sigma, cond):
        self.seen.append((float(sigma[0]), cond.clone()))
        return self.forward(x, sigma, cond)


def test_each_denoising_step_reads_the_mixed_condition():
    policy = FlowPolicy(condition="embedding", steps=5, hidden=16)
    delta = _delta(2)
    # row 0 clean, row 1 perturbed
    hook = EmbedDelta(positions=torch.tensor([0]), delta=torch.cat([torch.zeros(1, 1, 8), delta[:1]]), rho=0.4)
    rec = _Recorder(policy)
    policy.generate([Request(key=0, n=2, prompt=1, hook=hook)], {}, INFO)
    enc = policy.encoder
    c_orig = enc(enc.tokens[1])  # [c]
    c_opt = enc(enc.tokens[1] + delta[0, 0].double())  # [c]
    assert [s for s, _ in rec.seen] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    for (sigma, cond), gamma in zip(rec.seen, [1.0, 0.5, 0.0, 0.0, 0.0]):
        assert torch.equal(cond[0], c_orig), sigma  # the clean row: C^orig exactly, at every step
        # C(t) = γ C^opt + (1 − γ) C^orig; 1e-7: the sampler's σ = 0.8 is float32 (0.80000001), so its γ is 0.5 + 3e-8
        torch.testing.assert_close(cond[1], gamma * c_opt + (1 - gamma) * c_orig, atol=1e-7, rtol=0)
    assert not torch.allclose(c_opt, c_orig)  # so the check above can fail
    # without a schedule (rho None) the perturbed condition is on at every step
    rec2 = _Recorder(policy2 := FlowPolicy(condition="embedding", steps=5, hidden=16))
    policy2.generate([Request(key=0, n=2, prompt=1, hook=EmbedDelta(hook.positions, hook.delta))], {}, INFO)
    assert all(torch.allclose(cond[1], c_opt, atol=1e-12, rtol=0) for _, cond in rec2.seen)


# --------------------------------------------------------------------------- the embedding condition
def test_the_embedding_condition_and_its_frozen_encoder_by_hand():
    policy = FlowPolicy(condition="embedding", hidden=16)
    enc = policy.encoder
    assert enc.tokens.shape == (4, 8) and not list(enc.parameters())  # buffers only: nothing of it is trained
    e = torch.tensor([0.5, -1.0, 0.0, 2.0, 0.0, 0.0, 1.0, -0.5], dtype=torch.float64)
    torch.testing.assert_close(enc(e), torch.tanh(e @ enc.w1 + enc.b1) @ enc.w2 + enc.b2)
    assert enc(e).shape == (16,)
    table, f = policy.prompt_encoder()  # the phase's view: the sum of the real tokens, through f
    torch.testing.assert_close(
        f(table[[2]][:, None].float(), torch.ones(1, 1, dtype=torch.bool)), enc(enc.tokens[2].float().double())[None]
    )
    assert policy.hooks == frozenset({"embed_delta"}) and FlowPolicy().hooks == frozenset()
    # the label form's config (and so Flash-GRPO's checkpoints) is as it was; the embedding form records its own
    assert set(FlowPolicy().config) == {"n_labels", "hidden", "layers", "steps", "shift"}
    assert policy.config["condition"] == "embedding" and policy.config["embed_dim"] == 8
    with pytest.raises(ValueError, match="condition must be one of label, embedding"):
        FlowPolicy(condition="text")
    with pytest.raises(ValueError, match="label form has no prompt embedding"):
        FlowPolicy().prompt_encoder()


def test_the_hook_touches_only_its_rows():
    policy = FlowPolicy(condition="embedding", hidden=16, sde="one_per_row")
    delta = torch.cat([torch.zeros(2, 1, 8), _delta(2)])  # rows 0-1 clean, rows 2-3 perturbed
    plain = [Request(key=5, n=4, prompt=1), Request(key=6, n=3, prompt=2)]
    hooked = [Request(key=5, n=4, prompt=1, hook=EmbedDelta(torch.tensor([0]), delta, rho=0.4)), plain[1]]
    a, b = policy.generate(plain, {}, INFO), policy.generate(hooked, {}, INFO)
    for name in ("x_final", "flow_x", "flow_x_next", "flow_step"):
        assert torch.equal(a.extras[name][1], b.extras[name][1]), name  # the unhooked request: bit-identical
        assert torch.equal(a.extras[name][0, :2], b.extras[name][0, :2]), name  # its zero-delta rows: bit-identical
    assert torch.equal(a.logp_sampler[1], b.logp_sampler[1]) and torch.equal(
        a.logp_sampler[0, :2], b.logp_sampler[0, :2]
    )
    assert bool((a.extras["x_final"][0, 2:] != b.extras["x_final"][0, 2:]).any(-1).all())  # the perturbed rows moved
    assert a.prompt_ids == b.prompt_ids == [[1], [2]]  # stored under the original prompt
    with pytest.raises(ValueError, match=r"positions \[1\] outside the flow prompt's one token"):
        policy.generate([Request(key=5, n=1, prompt=1, hook=EmbedDelta(torch.tensor([1]), _delta(1)))], {}, INFO)
    with pytest.raises(ValueError, match=r"must be \[n=2, P, embed_dim=8\]"):
        policy.generate([Request(key=5, n=2, prompt=1, hook=EmbedDelta(torch.tensor([0]), _delta(3)))], {}, INFO)


def test_the_update_recomputes_logp_on_the_original_condition():
    policy = FlowPolicy(condition="embedding", hidden=16, sde="all", steps=5)
    delta = torch.cat([torch.zeros(2, 1, 8), _delta(2)])
    ro = policy.generate([Request(key=1, n=4, prompt=3, hook=EmbedDelta(torch.tensor([0]), delta, rho=0.4))], {}, INFO)
    with torch.no_grad():
        logp = policy.forward(ro)["logp"]  # [1,4,5]
    # by hand: the net on the stored x under C^orig (never the hook's condition),
    # the SDE step's log-prob of the stored x'
    c = policy.encoder(policy.encoder.tokens[3]).expand(4, -1)  # [4,c]
    for t in range(5):
        x, x_next = ro.extras["flow_x"][0, :, t], ro.extras["flow_x_next"][0, :, t]  # [4,2]
        s, sp = ro.extras["flow_sigma"][0, :, t], ro.extras["flow_sigma_next"][0, :, t]  # [4]
        with torch.no_grad():
            want = sde_step_with_logprob(
                policy.net(x, s, c), x, s, sp, policy.sigma_min, policy.sigma_max, prev_sample=x_next
            )[1]  # [4]
        torch.testing.assert_close(logp[0, :, t], want, atol=1e-6, rtol=0)
    # clean rows: the sampler's log-probs are the update's;
    # perturbed rows differ where γ > 0 (σ = 1.0, 0.8) and agree after
    torch.testing.assert_close(logp[0, :2], ro.logp_sampler[0, :2], atol=1e-6, rtol=0)
    gap = (logp[0, 2:] - ro.logp_sampler[0, 2:]).abs()  # [2,5]
    assert bool((gap[:, :2] > 1e-3).all()) and float(gap[:, 2:].max()) < 1e-6


# --------------------------------------------------------------------------- build-time capability
def test_a_flow_policy_that_cannot_apply_the_hook_is_refused_at_build(tmp_path):
    strategy = E2PO(rho=0.4)
    check_strategy(strategy, FlowPolicy(condition="embedding"), [])  # the embedding form applies embed_delta
    with pytest.raises(
        ConfigError,
        match=r"generation hooks \['embed_delta'\] that the flow policy's engine cannot apply \(it applies none\)",
    ):
        check_strategy(strategy, FlowPolicy(), [])
    with pytest.raises(ConfigError, match="cannot apply"):
        flow_trainer(tmp_path, 'model.params.condition="label"', "eval.size=0")
    with pytest.raises(ValueError, match="a generation hook needs the embedding condition"):  # and at run time
        FlowPolicy().generate([Request(key=0, n=1, prompt=0, hook=EmbedDelta(torch.tensor([0]), _delta(1)))], {}, INFO)
    with pytest.raises(ConfigError, match=r"rho=0.0 must be in \(0, 1\]"):
        E2PO(rho=0.0)


def test_the_text_engine_refuses_a_noise_schedule():
    hook = EmbedDelta(positions=torch.tensor([0]), delta=torch.zeros(2, 1, 4), rho=0.4)
    with pytest.raises(ValueError, match="the text engine has no noise levels"):
        row_hooks([hook], 2, [3], 3, 4)
    with pytest.raises(ValueError, match=r"rho=1.5 must be in \(0, 1\]"):
        EmbedDelta(positions=torch.tensor([0]), delta=torch.zeros(2, 1, 4), rho=1.5)


# --------------------------------------------------------------------------- the reward
def test_the_trap_reward_by_hand():
    # label 0's direction is +x: near optimum centred (1, 0), far optimum (−2.5, 0), radius 0.5
    x = torch.tensor([[[1.0, 0.0], [1.4, 0.3], [-2.5, 0.49], [-2.0, 0.0], [0.0, 0.0], [1.0, 0.51]]])  # [1,6,2]
    assert trap_reward(x, torch.tensor([0])).tolist() == [[0.5, 0.5, 1.0, 1.0, 0.0, 0.0]]
    # label 1's direction is +y: near (0, 1), far (0, −2.5)
    x1 = torch.tensor([[[0.0, 1.2], [0.0, -2.9], [1.0, 0.0]]])
    assert trap_reward(x1, torch.tensor([1])).tolist() == [[0.5, 1.0, 0.0]]
    with pytest.raises(ValueError, match="disjoint regions"):
        FlowTrapReward(near=0.2, far=0.2, radius=0.5)


# --------------------------------------------------------------------------- the phase and the trainer
SMALL = [
    "eval.size=0",
    "data.train_size=8",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    'phases=[{name="e2po_perturbations", conditions=4, steps=20}]',
]


def test_the_phase_learns_on_the_flow_toy_with_the_flow_model_frozen(tmp_path, monkeypatch):
    trainer = flow_trainer(tmp_path, *SMALL, "train.steps=1")
    before = {k: v.clone() for k, v in trainer.policy.net.state_dict().items()}
    run = Run(trainer)
    run._run_phases()
    for key, value in trainer.policy.net.state_dict().items():  # the phase never touches the flow model
        assert torch.equal(before[key], value), key
    art = torch.load(tmp_path / "phases" / "e2po_perturbations.pt", weights_only=False)["artifact"]
    assert art["keys"].tolist() == list(range(8)) and art["conditions"] == 4
    assert art["positions"].tolist() == [[0]] * 8  # the one prompt token of each row
    assert art["delta"].shape == (8, 3, 1, 8) and bool((art["delta"].abs().sum(-1) > 0).all())
    # the summary's L_emb is the final loss: recompute it from the artifact's δ with the frozen encoder
    # (λ_div = 1, μ = 0.8, ε = 0.1)
    table, f = trainer.policy.prompt_encoder()
    one = torch.ones(3, 1, dtype=torch.bool)
    l_emb = []
    for r, row in enumerate(trainer.train_rows):
        e = f((table[row["prompt"]].float() + art["delta"][r, :, 0])[:, None], one)  # [3,c] e_k = f(E + δ_k)
        e_anc = f(table[[row["prompt"]]].float()[:, None], one[:1])[0]  # [c] f(E)
        l_emb.append(float(diversity_loss(e) + anchor_loss(e, e_anc, 0.8, 0.1)))
    summary = run.summary["phases"]["e2po_perturbations"]
    assert summary["rows"] == 8 and summary["loss"] == pytest.approx(sum(l_emb) / 8, abs=1e-5)
    # 20 Adam steps lowered it: the same initial δ (the phase's generator, seeded by the run seed and chunk start 0)
    # after 0 steps
    from groupwise.rollout.e2po import learn_prompt_perturbations

    emb = table[[row["prompt"] for row in trainer.train_rows]].float()[:, None]  # [8,1,d]
    _, init = learn_prompt_perturbations(
        emb,
        torch.ones(8, 1, dtype=torch.bool),
        torch.zeros(8, 1, dtype=torch.long),
        f,
        3,
        0,
        1.0,
        0.8,
        0.1,
        0.5 * float(table.float().pow(2).mean().sqrt()),
        0.1,
        torch.Generator().manual_seed(0),
    )
    assert summary["loss"] < float(init["loss"].mean()) - 0.05, (summary["loss"], float(init["loss"].mean()))
    # resume: a second trainer in the same folder loads the artifact and never learns again
    import groupwise.phases.e2po_perturb as phase_module

    monkeypatch.setattr(phase_module, "learn_prompt_perturbations", lambda *a, **k: pytest.fail("the phase ran again"))
    again = flow_trainer(tmp_path, *SMALL, "train.steps=1")
    Run(again)._run_phases()
    loaded = again.strategy.artifact_value()
    for key in ("keys", "positions", "delta"):
        assert torch.equal(loaded[key], art[key]), key


def test_the_phase_refuses_the_label_form(tmp_path):
    from groupwise.phases import PhaseContext
    from groupwise.phases.e2po_perturb import E2POPerturbations

    ctx = PhaseContext(
        policy=FlowPolicy(),
        train_rows=[{"prompt": 0}],
        eval_rows=[],
        seed=0,
        prompt=lambda s, r, i: [0],
        accuracy=lambda *a, **k: 0.0,
        say=lambda line: None,
    )
    with pytest.raises(
        ConfigError, match=r"phase e2po_perturbations: the flow policy's label form has no prompt embedding"
    ):
        E2POPerturbations(steps=1)(ctx)


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_composition_rows_trained_on_the_original_condition(tmp_path, objective):
    import json

    trainer = flow_trainer(tmp_path, *SMALL, f'objective.terms=["{objective}"]', "train.steps=2")
    assert trainer.objective.terms[0].registry_name == objective
    seen = []
    observe = trainer.observe
    trainer.observe = lambda batch: (seen.append(batch), observe(batch))
    policy = trainer.policy
    old = []
    generate = policy.generate
    # unhooked forward, the sampling weights
    policy.generate = lambda *a, **k: (out := generate(*a, **k), old.append(policy.forward(out)["logp"].detach()))[0]
    Run(trainer).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows) and all("e2po/group_std" in r for r in rows)
    hot_rows = 0
    for batch, want in zip(seen, old):
        cond = batch.extras[CONDITION]  # [B,G]
        assert cond[0].tolist() == [0, 1, 2, 3]
        mask = batch.mask  # [B,G,1]
        # logp_old = the unhooked forward on the stored trajectory
        torch.testing.assert_close(batch.logp_old * mask, want * mask, atol=1e-6, rtol=0)
        clean = ((batch.logp_old - batch.logp_sampler).abs() * mask)[cond == 0]
        assert float(clean.max()) < 1e-6  # the clean rows: the sampler's log-probs are the update's
        steps = batch.extras["flow_sigma"][..., 0]  # [B,G] σ of the trained step (shared by the group)
        pert = ((batch.logp_old - batch.logp_sampler).abs() * mask)[..., 0]  # [B,G]
        hot = (cond > 0) & (steps > 0.6 + 1e-6)  # perturbed rows whose trained step has γ(σ) > 0
        assert (
            bool((pert[hot] > 1e-5).all()) and float(torch.cat([pert[(cond > 0) & ~hot], torch.zeros(1)]).max()) < 1e-7
        )
        hot_rows += int(hot.sum())
    assert hot_rows > 0  # so the check above can fail (seeded: the trained step has γ > 0 in some groups)
