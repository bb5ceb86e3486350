"""Paper 54 DACA-GRPO (spec 54): denoising progress scores as token weights (hand-worked values, the
spec's unit test), the stratified masking likelihood through the policy's estimator, the weight on a
real mdlm batch, and the recipes' build."""

from __future__ import annotations

import math

import pytest
import torch

from groupwise.modalities.mdlm import MDLMPolicy
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
    out = policy.generate([Request(key=0, n=3, prompt="82="), Request(key=1, n=2, prompt="5=")], {}, StepInfo(1, 4, 0))
    w = DenoisingProgress()(out, StepInfo(step=1, seed=4, max_new_tokens=0))  # [2,3,8]
    rows = out.mask.any(-1)  # [2,3]
    assert torch.allclose(w.sum(-1)[rows], torch.full((5,), 8.0), atol=1e-4)
    assert w[1, 2].abs().sum() == 0 and bool((w[out.mask] >= 0).all())
