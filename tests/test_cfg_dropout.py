"""Classifier-free guidance's condition dropout in the demonstration fit (issue 37, DIAL spec 26):
a demonstration carries its discrete conditions (``FlowPolicy.encode_target``), and the ``sft``
phase's ``p_uncond`` replaces a row's conditions by the null one with that probability
(``modalities/flow.py`` Note 10). Off by default: a fit without it draws and computes as before."""

from __future__ import annotations

import pytest
import torch

from groupwise.errors import ConfigError
from groupwise.modalities.flow import FlowPolicy, cfg_dropout
from groupwise.phases.sft import SFT


def test_cfg_dropout_by_hand():
    # p = 0.1, one uniform draw per row: rows 0 and 2 (u = 0.05, 0.09 < 0.1) lose every condition,
    # row 1 (u = 0.5) and row 3 (u = 0.1, not below p) keep theirs
    codes = torch.tensor([[3, 1], [5, 0], [1, 2], [7, 7]])
    u = torch.tensor([0.05, 0.5, 0.09, 0.1], dtype=torch.float64)
    assert cfg_dropout(codes, u, 0.1).tolist() == [[-1, -1], [5, 0], [-1, -1], [7, 7]]
    assert cfg_dropout(codes, u, 0.0).tolist() == codes.tolist()  # p = 0 drops nothing
    assert cfg_dropout(codes, u, 1.0).tolist() == [[-1, -1]] * 4  # p = 1 drops all (u < 1 always)


def test_encode_target_carries_the_demonstrations_conditions():
    policy = FlowPolicy(condition_extras={"intent": 8})
    # the point, then the intent as a number; a row without the column is the null condition -1
    assert policy.encode_target({"target": [1, 2], "intent": 5}).tolist() == [1.0, 2.0, 5.0]
    assert policy.encode_target({"target": [1, 2]}).tolist() == [1.0, 2.0, -1.0]
    with pytest.raises(ValueError, match=r"condition 'intent' must be an integer in -1\.\.7 .*got 8"):
        policy.encode_target({"target": [1, 2], "intent": 8})
    assert FlowPolicy().encode_target({"target": [1, 2], "intent": 5}).tolist() == [1.0, 2.0]  # no extras: as before


def _recorded(policy, monkeypatch):
    seen = {}

    def zero_velocity(x, sigma, label, cond, codes=None):
        seen["codes"] = None if codes is None else codes.clone()
        return torch.zeros_like(x)

    monkeypatch.setattr(policy, "_velocity", zero_velocity)
    return seen


def test_the_fit_reads_each_rows_conditions_and_drops_them_with_the_generators_draw(monkeypatch):
    policy = FlowPolicy(condition_extras={"intent": 8})
    seen = _recorded(policy, monkeypatch)
    rows = [{"target": [2.0, 0.0], "intent": k} for k in (0, 3, 6, 7, 1, 2)]
    targets = [policy.encode_target(r) for r in rows]
    prompts = [[0]] * len(rows)
    loss = policy.supervised_loss(prompts, targets, torch.Generator().manual_seed(11))
    assert seen["codes"][:, 0].tolist() == [0, 3, 6, 7, 1, 2]  # p_uncond = 0: every row conditioned
    loss_p = policy.supervised_loss(prompts, targets, torch.Generator().manual_seed(11), p_uncond=0.5)
    # the draws in their documented order: σ [N], ε [N,2], then u [N] for the dropout (only when on)
    g = torch.Generator().manual_seed(11)
    torch.rand(6, generator=g, dtype=torch.float64)
    torch.randn(6, 2, generator=g, dtype=torch.float64)
    u = torch.rand(6, generator=g, dtype=torch.float64)
    expected = [-1 if float(u[i]) < 0.5 else k for i, k in enumerate((0, 3, 6, 7, 1, 2))]
    assert seen["codes"][:, 0].tolist() == expected and -1 in expected and expected != [-1] * 6
    # v = 0: the loss is the mean of (ε − x_0)² whatever the conditions, from the same σ and ε
    assert float(loss_p) == float(loss)
    policy.supervised_loss(prompts, targets, torch.Generator().manual_seed(11), p_uncond=1.0)
    assert seen["codes"][:, 0].tolist() == [-1] * 6  # p_uncond = 1: the unconditional fit


def test_dropout_trains_the_null_condition_and_is_off_by_default():
    rows = [{"prompt": 0, "target": [2.0 * (k % 2) - 1.0, 0.0], "intent": k % 2} for k in range(64)]
    fits = {}
    for p in (0.0, 0.5):
        policy = FlowPolicy(condition_extras={"intent": 2}, hidden=16)
        null_before = policy.net.codes[0].weight[-1].clone()  # the null condition's embedding row
        SFT(steps=3, batch_size=16, p_uncond=p, update={"name": "adamw", "lr": 1e-2}).fit(
            policy, rows, [], 0, lambda split, r, i: [0], None
        )
        fits[p] = bool((policy.net.codes[0].weight[-1] != null_before).any())
    # without dropout no row is fitted under the null condition, so its embedding gets no gradient
    assert fits == {0.0: False, 0.5: True}


def test_p_uncond_is_refused_where_it_cannot_apply():
    with pytest.raises(ConfigError, match=r"p_uncond=1\.5 must be in \[0, 1\]"):
        SFT(p_uncond=1.5)
    with pytest.raises(ConfigError, match="needs a policy whose supervised_loss takes p_uncond"):
        SFT(p_uncond=0.1)._fit_options(type("LM", (), {"modality": "text"})(), False)
    with pytest.raises(ValueError, match="drops the condition_extras conditions"):
        FlowPolicy().supervised_loss([[0]], [torch.zeros(2, dtype=torch.float64)], torch.Generator(), p_uncond=0.1)
