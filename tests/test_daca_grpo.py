"""Paper 54 DACA-GRPO (spec 54): denoising progress scores as token weights (hand-worked values, the
spec's unit test), the stratified masking likelihood through the policy's estimator, the weight on a
real mdlm batch, and the recipes' build."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_nets_close, permute_rows, permute_tensor, train_one_and_two_ranks

from groupwise.build import build
from groupwise.config import load_config
from groupwise.modalities.mdlm import MDLMPolicy
from groupwise.trainer import Trainer
from groupwise.types import Request, Rollout, StepInfo
from groupwise.weights.dps import DenoisingProgress, dps_scores, dps_weights

NAN = math.nan


def _row(trace, commit):
    """A one-row rollout (B = G = 1) with the mdlm sampler's token extras."""
    L = len(commit)
    out = Rollout(
        prompt_ids=[[1]],
        actions=torch.zeros(1, 1, L, dtype=torch.long),
        mask=torch.ones(1, 1, L, dtype=torch.bool),
        group_valid=torch.ones(1, 1, dtype=torch.bool),
        truncated=torch.zeros(1, 1, dtype=torch.bool),
        prompt_index=torch.zeros(1, dtype=torch.long),
    )
    out.set_extra("q_trace", torch.tensor([[trace]], dtype=torch.float32), "token")  # [1,1,L,S]
    out.set_extra("commit_step", torch.tensor([[commit]]), "token")  # [1,1,L]
    return out


# S = 4 steps, L = 3 tokens: token 0 committed at step 4 after [0.2, 0.5, 0.9] (then 0.95 at its commit),
# token 1 at step 1 (no history), token 2 at step 2 after [0.3]
TRACE = [[0.2, 0.5, 0.9, 0.95], [0.8, NAN, NAN, NAN], [0.3, 0.6, NAN, NAN]]
COMMIT = [4, 1, 2]


def test_spec_54s_progress_score_and_the_weights_by_hand():
    scores = dps_scores(torch.tensor(TRACE), torch.tensor(COMMIT))
    # 1 − (0.2 + 0.5 + 0.9)/3 = 1 − 0.533333 = 0.466667 (spec 54); no history -> 0; 1 − 0.3 = 0.7
    assert scores.tolist() == pytest.approx([0.466667, 0.0, 0.7], abs=1e-6)
    # floored [0.466667, 0.1, 0.7], mean 1.266667/3 = 0.422222 -> [1.105263, 0.236842, 1.657895]
    w = DenoisingProgress()(_row(TRACE, COMMIT), StepInfo(step=0, seed=0, max_new_tokens=0))
    assert w[0, 0].tolist() == pytest.approx([1.105263, 0.236842, 1.657895], abs=1e-6)
    # commit_step: τ/S = [1, 0.25, 0.5], mean 0.583333 -> [1.714286, 0.428571, 0.857143]
    w = DenoisingProgress(mode="commit_step")(_row(TRACE, COMMIT), StepInfo(step=0, seed=0, max_new_tokens=0))
    assert w[0, 0].tolist() == pytest.approx([1.714286, 0.428571, 0.857143], abs=1e-6)


def test_masked_tokens_get_zero_and_stay_out_of_the_mean():
    # the middle token off the mask: mean of [0.466667, 0.7] = 0.583333 -> [0.8, 0, 1.2]
    w = dps_weights(torch.tensor([[[0.466667, 0.0, 0.7]]]), torch.tensor([[[True, False, True]]]), 0.1)
    assert w[0, 0].tolist() == pytest.approx([0.8, 0.0, 1.2], abs=1e-5)
    with pytest.raises(ValueError, match="mode='rank' is not one of"):
        DenoisingProgress(mode="rank")
    bare = _row(TRACE, COMMIT)
    del bare.extras["q_trace"]
    with pytest.raises(ValueError, match=r"dps needs the token extras \['q_trace'\]"):
        DenoisingProgress()(bare, StepInfo(step=0, seed=0, max_new_tokens=0))


def test_the_weight_on_a_sampled_mdlm_batch_has_mean_one_per_row():
    policy = MDLMPolicy(allowed="0123456789+", width=32, heads=2)
    out = policy.generate(
        [Request(key=0, n=3, prompt="82="), Request(key=1, n=2, prompt="5=")],
        {},
        StepInfo(step=1, seed=4, max_new_tokens=0),
    )
    w = DenoisingProgress()(out, StepInfo(step=1, seed=4, max_new_tokens=0))  # [2,3,8]
    rows = out.mask.any(-1)  # [2,3]
    assert torch.allclose(w.sum(-1)[rows], torch.full((5,), 8.0), atol=1e-4)
    assert w[1, 2].abs().sum() == 0 and bool((w[out.mask] >= 0).all())


def test_contract_row_permutation_permutes_the_weights():
    policy = MDLMPolicy(allowed="0123456789+", width=32, heads=2)
    info = StepInfo(step=1, seed=4, max_new_tokens=0)
    batch = policy.generate([Request(key=0, n=4, prompt="82="), Request(key=1, n=2, prompt="5=")], {}, info)
    w = DenoisingProgress()(batch, info)  # [B,G,L]
    perm = torch.tensor([[2, 0, 3, 1], [1, 0, 2, 3]])  # [B,G] (group 1 keeps its padding rows last)
    again = DenoisingProgress()(permute_rows(batch, perm), info)
    torch.testing.assert_close(again, permute_tensor(w, perm), rtol=0, atol=0)


# the recipe on fresh small weights (the shipped fit is not needed to check the wiring)
SMALL = ['model.path="default"', 'model.params={estimator="stratified(4)", allowed="0123456789+", width=32, heads=2}']


def test_the_recipe_trains_on_sml_log_probs_with_dps_weights(tmp_path):
    cfg, _ = load_config("daca_grpo", [f'out="{tmp_path}"', *SMALL, "rollout.prompts_per_step=2", "eval.size=0"])
    trainer = Trainer(build(cfg))
    trainer.run_step()
    batch = trainer.last_batch
    # the weight stage ran dps: mean 1 over each row's tokens
    assert torch.allclose(batch.weight.sum(-1), torch.full((2, 8), 8.0), atol=1e-4)
    # the old log-probs are the K = 4 stratified estimate of the rows' own strata (before the update)
    fresh = MDLMPolicy(estimator="stratified(4)", allowed="0123456789+", width=32, heads=2)
    with torch.no_grad():
        sml = fresh.forward(batch, ("strat_logp(4)",))["strat_logp(4)"]
    assert torch.equal(batch.logp_old, sml)


@pytest.mark.slow  # a torchrun pair: make test-slow / test-dist; make test stays under 10 minutes
@pytest.mark.dist
def test_two_ranks_equal_one_process(tmp_path):
    """One DACA-GRPO step (SGD) over 2 ranks equals one process: the same weights after it."""
    args = ["train", "daca_grpo", *SMALL, "rollout.prompts_per_step=4", "rollout.group_size=4", "train.steps=1"]
    # fresh weights solve no sum: seeded noise rewards give the groups non-zero advantages
    args += ['rewards=[{name="gaussian_noise", sigma=1.0}]', "eval.size=0", 'update={name="sgd", lr=1.0}', "threads=1"]
    one, two = (state["net"] for state in train_one_and_two_ranks(args, tmp_path, "mdlm_policy.pt", 600))
    start = MDLMPolicy(allowed="0123456789+", width=32, heads=2).state_dict()["net"]
    assert any(not torch.equal(one[k], start[k]) for k in start)  # it trained
    assert_nets_close(one, two)
