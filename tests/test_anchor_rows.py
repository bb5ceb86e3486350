"""M10 (issue 42): the row flag ``anchor`` (generated and scored, never trained) and the generation hook kind
``kv_route`` (an autoregressive frame generator's cache routing), hand-worked."""

from __future__ import annotations

import pytest
import torch
from helpers import info_for, objective_for, rollout_from

from groupwise.errors import ConfigError
from groupwise.hooks import KINDS, KvRoute, check_hooks, row_hooks
from groupwise.modalities.flow import FlowPolicy
from groupwise.registry import build
from groupwise.types import ANCHOR, Rollout


def _batch(anchor: bool) -> Rollout:
    ro = rollout_from(
        torch.zeros(1, 3, 2), adv=torch.tensor([[5.0, 1.0, -2.0]]), rewards=torch.tensor([[1.0, 0.0, 2.0]])
    )
    if anchor:
        ro.set_flag(ANCHOR, torch.tensor([[True, False, False]]))
    return ro


def test_objective_drops_anchor_rows_from_loss_and_normalisers():
    # ppo_clip on-policy (ratio 1), token_mean over 2 tokens a row: −Σ A·2 / #tokens
    # no anchor: −(5·2 + 1·2 − 2·2)/6 = −1.333333; row 0 anchored: −(1·2 − 2·2)/4 = 0.5
    for anchor, expected in ((False, -8 / 6), (True, 0.5)):
        ro = _batch(anchor)
        obj = objective_for([build("objective", "ppo_clip")], "token_mean")
        logp = torch.zeros(1, 3, 2, requires_grad=True)
        info = info_for(2)
        loss = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info), info)
        torch.testing.assert_close(loss, torch.tensor(expected), atol=1e-6, rtol=0)
        (grad,) = torch.autograd.grad(loss, logp)
        assert bool((grad[0, 0] == 0).all()) == anchor  # the anchor row is never trained
        assert bool(obj.loss_mask(ro)[0, 0].any()) != anchor


def test_anchor_row_reward_enters_the_statistics():
    # kvpo's baseline is the anchor's reward 1.0: A = (r − 1)/std_unbiased([1, 0, 2]) = (r − 1)/1 = [0, −1, 1]
    adv = build("advantage", "kvpo", weights=[1.0], fusion="sum")(_batch(True), info_for(2))
    torch.testing.assert_close(adv, torch.tensor([[0.0, -1.0, 1.0]]))


class _Routing:
    registry_name = "routing"
    hooks = ("kv_route",)


def test_kv_route_is_a_known_kind_refused_by_a_policy_that_cannot_apply_it():
    assert "kv_route" in KINDS
    with pytest.raises(ConfigError, match=r"generation hooks \['kv_route'\] that the flow policy"):
        check_hooks(_Routing(), FlowPolicy())
    check_hooks(_Routing(), type("P", (), {"modality": "ar_flow", "hooks": frozenset({"kv_route"})})())


def test_kv_route_validates_its_plan_and_the_text_engine_refuses_it():
    with pytest.raises(ValueError, match="do not agree"):
        KvRoute(frames=torch.tensor([2, 3]), sources=torch.zeros(4, 1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="all >= 0"):
        KvRoute(frames=torch.tensor([2]), sources=torch.tensor([[[0, -1]]]))
    hook = KvRoute(frames=torch.tensor([2]), sources=torch.tensor([[[-1, -1]], [[0, 1]]]))
    with pytest.raises(ValueError, match="text engine cannot apply it"):
        row_hooks([hook], 2, [3], 3, 4)
