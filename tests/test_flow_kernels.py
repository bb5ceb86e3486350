"""The flow toy's sampler kinds and step quantities (issue 37 M3): the consistency kernel and
Flow-GRPO's noise schedule re-score exactly, classifier-free guidance mixes two velocity calls,
greedy calls may deploy another kernel, and ``step_mean`` / ``x0_pred`` come from the same forward
(with grad for the policy, without for a frozen snapshot); a need the policy cannot compute is
refused at build."""

from __future__ import annotations

import pytest
import torch

from groupwise.build import build
from groupwise.config import load_config
from groupwise.errors import ConfigError
from groupwise.modalities.flow import FlowPolicy
from groupwise.modalities.flow_sde import consistency_step, sde_step_with_logprob
from groupwise.seeds import sample_seed
from groupwise.types import Need, Request, StepInfo

INFO = StepInfo(step=1, seed=4, max_new_tokens=0)
REQUESTS = [Request(key=0, n=3, prompt=1), Request(key=7, n=2, prompt=2)]


@pytest.mark.parametrize(
    "params, T",
    [
        ({"sampler": "consistency", "steps": 4, "sde": "one_shared", "sde_window": 3}, 1),
        ({"sampler": "consistency", "steps": 4, "sde": "all"}, 3),  # the last (deterministic) step never trained
        ({"noise": "flow_grpo", "sde": "all"}, 10),
        ({"condition_extras": {"intent": 3}, "cfg_w": 2.0, "sde": "one_per_row"}, 1),
    ],
)
def test_each_kernel_rescores_its_own_samples_exactly(params, T):
    policy = FlowPolicy(**params)
    requests = [Request(key=0, n=3, prompt=1, extras={"intent": [0, 1, 2]}), Request(key=7, n=2, prompt=2)]
    out = policy.generate(requests if "condition_extras" in params else REQUESTS, {}, INFO)
    assert out.mask.shape[2] == T == policy.T
    assert torch.equal(policy.forward(out)["logp"], out.logp_sampler)
    if params.get("sampler") == "consistency":
        steps = out.extras["flow_step"][out.mask]
        assert int(steps.max()) <= 2  # never step 3 (to σ = 0)
        # the kernel's std is the target level s, and each step is scored by its own Gaussian
        assert torch.equal(out.extras["flow_std"][out.mask], out.extras["flow_sigma_next"][out.mask])


def test_cfg_mixes_the_conditional_and_null_velocities(monkeypatch):
    policy = FlowPolicy(condition_extras={"intent": 3}, cfg_w=2.0, sde="all")
    calls = []
    original = policy._velocity

    def spy(x, sigma, label, cond, codes=None):
        calls.append(codes.clone())
        return original(x, sigma, label, cond, codes)

    monkeypatch.setattr(policy, "_velocity", spy)
    policy.generate([Request(key=0, n=2, prompt=0, extras={"intent": [1, 2]})], {}, INFO)
    # two calls per step: the row's intent, then the null code -1
    assert len(calls) == 2 * policy.steps
    assert calls[0][:, 0].tolist() == [1, 2] and calls[1][:, 0].tolist() == [-1, -1]
    with pytest.raises(ValueError, match="cfg_w = 2.0 guides toward a condition_extras condition"):
        FlowPolicy(cfg_w=2.0)


def test_a_greedy_call_may_deploy_another_kernel_a_sampled_one_may_not():
    policy = FlowPolicy()  # trained with 10 Euler steps
    deploy = policy.generate(REQUESTS, {"greedy": True, "sampler": "consistency", "steps": 4}, INFO)
    # greedy consistency, by hand on the first row: x ← (1 − s)·(x − t·v) over σ = 1, .75, .5, .25, 0
    x = torch.randn(2, generator=torch.Generator().manual_seed(sample_seed(4, 1, 0, 0)))[None].double()  # [1,2]
    for t, s in ((1.0, 0.75), (0.75, 0.5), (0.5, 0.25), (0.25, 0.0)):
        v = policy.net(x, torch.tensor([t], dtype=torch.float64), torch.tensor([1]))
        x = consistency_step(v, x.float(), t, s, noise=torch.zeros(1, 2))[0].double()
    assert torch.equal(deploy.extras["x_final"][0, 0], x[0].float())
    assert deploy.mask.shape[2] == 0
    with pytest.raises(
        ValueError, match="a sampled \\(trainable\\) call runs the policy's own kernel 'euler', 10 steps"
    ):
        policy.generate(REQUESTS, {"sampler": "consistency", "steps": 4}, INFO)


@pytest.mark.parametrize("params", [{"sde": "all"}, {"sampler": "consistency", "steps": 4, "sde": "all"}])
def test_step_mean_and_x0_pred_with_and_without_grad(params):
    policy = FlowPolicy(**params)
    out = policy.generate(REQUESTS, {}, INFO)
    got = policy.forward(out, ("logp", "step_mean", "x0_pred"))
    assert got["step_mean"].shape == (2, 3, policy.T, 2) and got["step_mean"].requires_grad
    sel = out.mask  # [B,G,T]
    x, s, sp = out.extras["flow_x"][sel], out.extras["flow_sigma"][sel], out.extras["flow_sigma_next"][sel]
    labels = torch.tensor([1, 2])[:, None, None].expand(sel.shape)[sel]  # [M]
    with torch.no_grad():
        v = policy.net(x, s, labels)  # [M,2]
        if "sampler" in params:
            mean = consistency_step(v, x, s, sp, prev_sample=out.extras["flow_x_next"][sel])[2]
        else:
            mean = sde_step_with_logprob(
                v, x, s, sp, policy.sigma_min, policy.sigma_max, out.extras["flow_x_next"][sel]
            )[2]
        x0 = (x.double() - s.double()[:, None] * v).float()
    assert torch.equal(got["step_mean"][sel].detach(), mean) and torch.equal(got["x0_pred"][sel].detach(), x0)
    assert got["step_mean"][~sel].abs().sum() == 0
    # x̂₀ carries the net's gradient: d Σ x̂₀ / dθ is nonzero
    got["x0_pred"].sum().backward()
    assert policy.net.out.weight.grad.abs().sum() > 0
    # a frozen snapshot (the reference) computes the same quantities on the policy's rows, without grad
    ref = policy.scoring_models(with_reference=True)["ref"]
    with ref() as frozen, torch.no_grad():
        again = policy.score(frozen, out, ("step_mean", "x0_pred"))
    assert torch.equal(again["step_mean"], got["step_mean"].detach()) and not again["step_mean"].requires_grad


def test_a_need_the_policy_does_not_compute_is_refused_at_build(tmp_path):
    flow = build(load_config("flash_grpo", [f'out="{tmp_path / "flow"}"', "eval.size=0"])[0])
    flow.needs.check(Need("step_mean", grad=True))  # the flow toy computes it, with grad
    with pytest.raises(ConfigError, match=r"computes \['entropy', 'logp', 'step_mean', 'x0_pred'\], not 'topk'"):
        flow.needs.check(Need("topk(2)"))
    text = build(load_config(None, [f'out="{tmp_path / "lm"}"', "eval.size=0"])[0])
    with pytest.raises(ConfigError, match=r"not 'step_mean' \(a quantity of another policy kind, model.policy\)"):
        text.needs.check(Need("step_mean"))
