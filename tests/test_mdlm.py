"""K2 of the non-text design (issue 41): the masked-diffusion LM kind ``mdlm`` — its likelihood
estimators by hand (stratified masking, mean-field, the Monte-Carlo ELBO), the unmasking sampler's
contract, exact re-scoring with common random numbers, the masked-diffusion fit, loading from
``model.path``, and a run through the trainer that resumes bit-identically."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import assert_resume_is_exact

from groupwise.build import build
from groupwise.config import load_config
from groupwise.errors import ConfigError
from groupwise.modalities.mdlm import MDLMPolicy
from groupwise.modalities.mdlm_likelihood import elbo_logp, stratified_logp, stratified_partition
from groupwise.phases.sft import SFT
from groupwise.policy.kinds import build_policy
from groupwise.trainer import Trainer
from groupwise.types import Request, StepInfo

INFO = StepInfo(step=2, seed=9, max_new_tokens=0)
REQUESTS = [Request(key=0, n=3, prompt="82="), Request(key=4, n=2, prompt="7=")]
MASK = 2  # the stubs' [MASK] id (tokens 0 and 1 are real)


def _neighbour_stub(y, calls):
    """Spec 54's stub: p(y_i | canvas) = 0.9 if a neighbour of i is visible, else 0.5 (two real tokens)."""

    def score(canvas):
        calls.append(canvas.clone())
        visible = (canvas != MASK).double()  # [N,L]
        left = torch.nn.functional.pad(visible, (1, 0))[:, :-1]
        right = torch.nn.functional.pad(visible, (0, 1))[:, 1:]
        p = torch.where((left + right) > 0, 0.9, 0.5)  # [N,L] probability of y_i
        other = torch.log1p(-p)
        return torch.stack([torch.where(y == 0, p.log(), other), torch.where(y == 1, p.log(), other)], -1)

    return score


def test_stratified_and_mean_field_on_spec_54s_stub():
    # L = 4, K = 2, strata {0,2},{1,3}: every masked token has a visible neighbour -> 4·log 0.9 = −0.421442;
    # mean-field (all masked) -> 4·log 0.5 = −2.772589; one forward per stratum
    y = torch.tensor([[0, 1, 1, 0]])
    calls = []
    logp, _ = stratified_logp(_neighbour_stub(y, calls), y, torch.tensor([[0, 1, 0, 1]]), 2, MASK)
    assert float(logp.sum()) == pytest.approx(-0.421442, abs=1e-6) and len(calls) == 2
    calls.clear()
    logp, entropy = stratified_logp(_neighbour_stub(y, calls), y, torch.zeros(1, 4, dtype=torch.long), 1, MASK)
    assert float(logp.sum()) == pytest.approx(-2.772589, abs=1e-6) and len(calls) == 1
    assert torch.allclose(entropy, torch.full((1, 4), math.log(2), dtype=torch.float64))  # p = ½ over two tokens


def test_the_partition_is_balanced_and_seeded():
    strata = stratified_partition(10, 4, torch.Generator().manual_seed(5))
    assert sorted(torch.bincount(strata).tolist()) == [2, 2, 3, 3]
    assert torch.equal(strata, stratified_partition(10, 4, torch.Generator().manual_seed(5)))
    with pytest.raises(ValueError, match="1 <= K <= L"):
        stratified_partition(3, 4, torch.Generator())


def test_the_monte_carlo_elbo_against_hand_worked_values():
    # (1) a product model (p(y_i) = 0.8, 0.6, 0.3 whatever is visible): every estimator is exact,
    #     log 0.8 + log 0.6 + log 0.3 = −0.223144 − 0.510826 − 1.203973 = −1.937942; the ELBO's
    #     expectation is the same (E[1[masked]/t] = 1): M = 3000 draws within 0.05
    p = torch.tensor([[0.8, 0.6, 0.3]], dtype=torch.float64)
    y = torch.zeros(1, 3, dtype=torch.long)

    def product(canvas):
        return torch.stack([p.log(), torch.log1p(-p)], -1).expand(canvas.shape[0], 3, 2)

    for K in (1, 2, 3):
        got, _ = stratified_logp(product, y, torch.arange(3)[None] % K, K, MASK)
        assert float(got.sum()) == pytest.approx(-1.937942, abs=1e-6)
    elbo = elbo_logp(product, y, 3000, [torch.Generator().manual_seed(1)], MASK)
    assert float(elbo.sum()) == pytest.approx(-1.937942, abs=0.05)
    # with one p = 0.6 at every position, each draw is (L/l)·l·log 0.6 = 3·log 0.6 = 3·(−0.510826) = −1.532477 exactly
    p = torch.full((1, 3), 0.6, dtype=torch.float64)
    elbo = elbo_logp(product, y, 5, [torch.Generator().manual_seed(1)], MASK)
    assert float(elbo.sum()) == pytest.approx(-1.532477, abs=1e-6)
    # (2) the neighbour stub, L = 2: l = 1 masks one position (neighbour visible, weight L/l = 2): 2·log 0.9;
    #     l = 2 masks both (weight 1): 2·log 0.5; each l half the draws -> log 0.9 + log 0.5
    #     = −0.105361 − 0.693147 = −0.798508 (mean-field −1.386294, stratified(2) −0.210721)
    y = torch.tensor([[1, 0]])
    calls = []
    elbo = elbo_logp(_neighbour_stub(y, calls), y, 4, [torch.Generator().manual_seed(2)], MASK)
    assert float(elbo.sum()) == pytest.approx(-0.798508, abs=1e-6) and len(calls) == 4
    # the continuous form agrees: position i masked w.p. t, its neighbour visible w.p. 1 − t,
    # ∫ (1/t)·t·[(1−t) log 0.9 + t log 0.5] dt = ½ log 0.9 + ½ log 0.5 per position, the same total


def test_unmasking_samples_the_contract_and_rescore_exactly():
    policy = MDLMPolicy(allowed="0123456789+", estimator="stratified(4)")
    out = policy.generate(REQUESTS, {}, INFO)
    assert out.actions.shape == (2, 3, 8) and out.extras["q_trace"].shape == (2, 3, 8, 8)
    commit = out.extras["commit_step"][0]  # [G,L]: S = L = 8, one commit per step
    assert sorted(commit[0].tolist()) == list(range(1, 9))
    trace = out.extras["q_trace"][0, 0]  # [L,S]: finite up to the commit step, NaN after
    for i, tau in enumerate(commit[0].tolist()):
        assert bool(trace[i, :tau].isfinite().all()) and bool(trace[i, tau:].isnan().all())
    allowed = set(policy.encode("0123456789+")) | {policy.eos}
    assert set(out.actions[out.mask].tolist()) <= allowed
    assert out.completions[1][2] == "" and not out.mask[1, 2].any()  # the padding row
    assert torch.equal(policy.forward(out)["logp"], out.logp_sampler)
    # row j draws from its own seed: the second request alone samples the same canvases
    alone = policy.generate(REQUESTS[1:], {}, INFO)
    assert torch.equal(alone.actions[0, :2], out.actions[1, :2])
    # the rollout context passes encoded prompts (ids): the same rows as the text
    encoded = [Request(key=r.key, n=r.n, prompt=policy.encode(r.prompt)) for r in REQUESTS]
    assert torch.equal(policy.generate(encoded, {}, INFO).actions, out.actions)
    # greedy: no draws, every row of a prompt the same
    greedy = policy.generate(REQUESTS, {"greedy": True}, INFO)
    assert torch.equal(greedy.actions[0, 0], greedy.actions[0, 2])


def test_common_random_numbers_and_the_estimator_needs():
    policy = MDLMPolicy(allowed="0123456789+", estimator="stratified(4)")
    out = policy.generate(REQUESTS, {}, INFO)
    ref = policy.scoring_models(with_reference=True)["ref"]
    with ref() as frozen, torch.no_grad():
        again = policy.score(frozen, out, ("logp", "strat_logp(4)", "strat_logp(1)", "elbo(4)"))
    assert torch.equal(again["logp"], out.logp_sampler)  # same weights, same strata from mdlm_seed
    assert torch.equal(again["strat_logp(4)"], again["logp"])
    assert not torch.equal(again["strat_logp(1)"], again["logp"])
    got = policy.forward(out, ("logp", "entropy"))
    assert got["logp"].requires_grad and got["entropy"].shape == (2, 3, 8)
    with pytest.raises(ValueError, match="not \\['step_mean'\\]"):
        policy.forward(out, ("step_mean",))
    with pytest.raises(ValueError, match="'stratified\\(K\\)' with 1 <= K <= length"):
        MDLMPolicy(estimator="stratified(9)")


def test_the_fit_learns_a_demonstration_and_a_fitted_model_loads(tmp_path):
    rows = [{"prompt": f"{n}=", "answer": f"{n}+0"} for n in range(10)]
    policy, losses = MDLMPolicy(allowed="0123456789+", width=32, heads=2), []
    SFT(steps=150, batch_size=10, update={"name": "adamw", "lr": 3e-3, "warmup_steps": 10}).fit(
        policy, rows, [], 0, lambda s, r, i: policy.encode(r[i]["prompt"]), None, lambda s, loss, a: losses.append(loss)
    )
    # measured (seed 0): loss 2.6 -> 0.02 (means of the first and last 10 steps); greedy "n+0" for every n
    assert sum(losses[:10]) / 10 > 1.5 and sum(losses[-10:]) / 10 < 0.2
    greedy = policy.generate([Request(key=n, n=1, prompt=f"{n}=") for n in range(10)], {"greedy": True}, INFO)
    assert [c[0] for c in greedy.completions] == [f"{n}+0" for n in range(10)]
    policy.save(tmp_path / "fit")
    loaded = build_policy(_Model(tmp_path / "fit", {"estimator": "stratified(2)"}), None)
    a, b = policy.generate(REQUESTS, {}, INFO), loaded.generate(REQUESTS, {}, INFO)
    assert torch.equal(a.actions, b.actions) and loaded.estimator == ("stratified", 2)
    with pytest.raises(ConfigError, match="change the architecture saved in"):
        build_policy(_Model(tmp_path / "fit", {"width": 64}), None)
    with pytest.raises(ConfigError, match="no mdlm_policy.pt there"):
        build_policy(_Model(tmp_path / "none"), None)


class _Model:  # model config of a toy kind (the fields build_policy reads)
    def __init__(self, path, params=None):
        self.policy, self.path, self.params, self.device = "mdlm", str(path), params or {}, "cpu"


def _trainer(out, *overrides):
    cfg, _ = load_config(
        None,
        [
            f'out="{out}"',
            'model.policy="mdlm"',
            'model.params={allowed="0123456789+", width=32, heads=2, estimator="stratified(2)"}',
            'data.task="sum_pairs"',
            "rollout.group_size=4",
            "rollout.prompts_per_step=4",
            'objective.terms=[{name="ppo_clip"}]',
            "eval.size=8",
            *overrides,
        ],
    )
    return Trainer(build(cfg))


def test_an_mdlm_run_trains_and_resumes_bit_identically(tmp_path):
    common = ["train.steps=4", "checkpoint.every=2"]
    assert_resume_is_exact(lambda out: _trainer(out, *common), tmp_path, metric="loss")
    assert (tmp_path / "a" / "final" / "mdlm_policy.pt").exists()


def test_the_shipped_fit_loads_by_name_and_matches_its_record():
    from groupwise.models.mdlm_fit import HERE, greedy_accuracy
    from groupwise.tasks.sum_pairs import rows

    record = json.loads((HERE / "fit.json").read_text())
    policy = build_policy(_Model("mdlm_sum_pairs"), None)  # a bare name: the folder shipped in groupwise/models
    assert policy.config == record["config"]
    # greedy unmasking is deterministic: the held-out accuracy fit.json recorded (0.16 on the 50 test targets)
    assert greedy_accuracy(policy, rows("test", 0)) == record["test_greedy_accuracy"] == 0.16


@pytest.mark.parametrize(
    "component",
    [
        'objective.weights=[{name="sampler_is"}]',
        'objective.terms=[{name="vespo", sampler_is="token_truncate"}]',
        'objective.terms=[{name="dppo_tv", anchor="sampler"}]',
    ],
)
def test_components_reading_the_sampler_logp_are_refused_at_build(tmp_path, component):
    # logp_sampler of this kind is the likelihood estimate at sampling time, not a sampler log-prob (design K2)
    with pytest.raises(ConfigError, match="logp_sampler as the sampler's log-prob.*estimate"):
        _trainer(tmp_path, component)
