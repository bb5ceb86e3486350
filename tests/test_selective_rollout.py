"""Selective Rollout (spec 60): the edit-distance gate by hand (the spec's numbers), the dilution it
removes, the Env runner's group hook on a scripted policy, and the strategy on the embedded model
(kept groups identical to the ungated ``episodes`` run; ppo_clip / gspo composition)."""

from __future__ import annotations

import pytest
import torch
from helpers import info_for, leaf, objective_for, rollout_from, train_recorded
from test_grow import REACH, Scripted, scripted_ctx
from test_trainer import make_trainer

from groupwise.errors import ConfigError
from groupwise.registry import build
from groupwise.rollout.env import play
from groupwise.rollout.selective import (
    normalized_edit_distance,
    prefix_edit_distance_mean,
    selective_gate,
    termination_fraction,
)
from groupwise.types import Rollout

SPEC = [["go a", "take x", "go b"], ["go a", "take x", "go b"], ["go a", "look"]]


# ---------------------------------------------------------------------------------------------- the gate
def test_normalized_edit_distance_by_hand():
    assert normalized_edit_distance(["a", "b", "c", "d"], ["b", "c", "d", "a"]) == 0.5  # delete a, insert a: 2 / 4
    assert normalized_edit_distance(list("kitten"), list("sitting")) == 3 / 7  # k→s, e→i, +g
    assert normalized_edit_distance(["go a"], ["go a"]) == 0.0 and normalized_edit_distance([], []) == 0.0
    assert normalized_edit_distance([], ["x", "y"]) == 1.0
    # each action string is one symbol
    assert normalized_edit_distance(["go a", "look", "<END>"], ["go a", "take x", "go b"]) == 2 / 3


def test_prefix_distance_termination_and_gate_spec_numbers():
    # K = 3: the third sequence pads to [go a, look, <END>]; pairs 0, 2/3, 2/3 → d_K = 4/9
    assert round(prefix_edit_distance_mean(SPEC, 3), 6) == 0.444444
    assert termination_fraction(SPEC, 3) == 1 / 3  # [go a, look] ended before step 3
    assert not selective_gate(SPEC, 3, d_low=0.12, t_high=0.9)
    same = [SPEC[0]] * 3
    assert prefix_edit_distance_mean(same, 3) == 0.0 and selective_gate(same, 3, d_low=0.12)
    assert prefix_edit_distance_mean([["a", "b", "c", "d"], ["b", "c", "d", "a"]], 4) == 0.5
    assert prefix_edit_distance_mean([SPEC[0], SPEC[0] + ["go c", "open"]], 3) == 0.0  # only the first K actions count
    ended = [["a"], ["b"], ["c", "d", "e"]]  # diverse (d_K = 0.889) but 2 of 3 ended before K = 3
    assert not selective_gate(ended, 3, d_low=0.12, t_high=0.9) and selective_gate(ended, 3, d_low=0.12, t_high=0.6)
    assert not selective_gate(ended, 3, d_low=0.12, t_high=None)
    with pytest.raises(ValueError, match="at least 2"):
        prefix_edit_distance_mean([SPEC[0]], 3)


def test_dilution_dropping_zero_variance_groups_doubles_the_gradient_norm():
    # 4 groups × 4 trajectories, 3 tokens each; groups 1 and 3 are zero-variance (all 0, all 1);
    # token-mean REINFORCE loss
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    ro = rollout_from(torch.zeros(4, 4, 3), rewards=rewards)
    ro.advantages = build("advantage", "grpo")(ro, info_for(3))
    obj = objective_for([build("objective", "reinforce")], "token_mean")

    def grad(batch):
        logp = leaf(torch.full(batch.shape, -1.0))
        loss = obj.loss(batch, {"logp": logp}, obj.normalizers(batch, info_for(3)), info_for(3))
        return torch.autograd.grad(loss, logp)[0]

    full, kept = grad(ro), grad(ro.select([0, 2]))
    # the zero-variance groups give nothing but tokens in the normaliser (48 instead of 24)
    assert (full[[1, 3]] == 0).all()
    torch.testing.assert_close(kept, 2 * full[[0, 2]])  # same items, each gradient twice as large
    torch.testing.assert_close(kept.norm() / full.norm(), torch.tensor(2.0))


# --------------------------------------------------------------------------------------------- the group hook, scripted
class Keyed(Scripted):
    """The scripted policy of test_grow, with a script per dataset row: ``script[key][e][t]``."""

    def generate(self, requests, sampling, info):
        out = []
        for r in requests:
            self.script = self.rows[r.key]
            out.append(super().generate([r], sampling, info))
        return Rollout.concat(out)


def _ctx(rows, scripts, G, max_turns=30):
    ctx = scripted_ctx(rows, None, G)
    ctx.policy = Keyed(None, max_turns)
    ctx.policy.rows = scripts
    return ctx


ROW7 = {"env": "reach", "start": 0, "goal": 7, "turns": 3, "prompt": "left 7="}
ROW9 = {"env": "reach", "start": 0, "goal": 9, "turns": 3, "prompt": "left 9="}
SAME = [["3", "3", "1"], ["3", "3", "2"], ["3", "3", "1"]]  # identical 2-move prefixes: d_2 = 0 → cut after move 2
MIXED = [["4", "4", "1"], ["4", "1", "4"], ["1", "4", "4"]]  # d_2 = (1/2 + 1 + 1/2) / 3 = 2/3 → kept, played to the end


def test_the_group_hook_stops_a_group_after_k_steps():
    calls = []

    def hook(group, k):
        calls.append(k)
        return "cut" if k == 2 and group[0].key == 0 else "continue"

    played = play(_ctx([ROW7, ROW9], [SAME, MIXED], 3), [0, 1], 3, 30, on_step=hook)
    assert played.gated == [True, False] and calls == [1, 1, 2, 2, 3]  # the cut group is not asked again
    assert [ep.texts for ep in played.episodes[0]] == [["3", "3"]] * 3 and {ep.cut for ep in played.episodes[0]} == {
        "gate"
    }
    assert [ep.texts for ep in played.episodes[1]] == MIXED and all(ep.done and not ep.cut for ep in played.episodes[1])
    assert played.actions == 6 + 9
    with pytest.raises(ValueError, match="'continue' or 'cut'"):
        play(_ctx([ROW7], [SAME], 3), [0], 3, 30, on_step=lambda group, k: "stop")


def test_selective_rollout_drops_the_gated_group_by_hand():
    strategy = build("rollout", "selective_rollout", K=2)
    batch = strategy(_ctx([ROW7, ROW9], [SAME, MIXED], 3))
    assert batch.shape[0] == 1 and batch.prompt_index.tolist() == [1]  # the gated task left the batch
    # 9 = 4+4+1 = 4+1+4 = 1+4+4
    assert [i["actions"] for i in batch.info[0]] == MIXED and batch.rewards.tolist() == [[1.0, 1.0, 1.0]]
    stats = strategy.step_stats()
    assert stats["episodes/env_steps"] == 15 and stats["episodes/gated_frac"] == 0.5
    assert stats["selective/d_k"] == pytest.approx((0.0 + 2 / 3) / 2) and stats["selective/evaluated_frac"] == 1.0
    ungated = build("rollout", "episodes", max_turns=30)
    assert (
        ungated(_ctx([ROW7, ROW9], [SAME, MIXED], 3)).shape[0] == 2 and ungated.step_stats()["episodes/env_steps"] == 18
    )
    # an episode that ends before K: ROW3 needs one move of 3;
    # with K = 2 no episode reaches step 2, so the gate never runs
    row3 = {"env": "reach", "start": 0, "goal": 3, "turns": 1, "prompt": "left 3="}
    strategy(_ctx([row3], [[["3"], ["3"], ["3"]]], 3))
    assert (
        strategy.step_stats()["selective/evaluated_frac"] == 0.0 and strategy.step_stats()["episodes/gated_frac"] == 0.0
    )
    with pytest.raises(ConfigError, match="K"):
        build("rollout", "selective_rollout", K=40)
    with pytest.raises(ConfigError, match="d_low"):
        build("rollout", "selective_rollout", d_low=1.5)


# ---------------------------------------------------------------------------------------------- the embedded model
# K = 1: cut groups whose first moves are all equal; temperature 0.5 makes such groups common at the seed
GATE = ['rollout.name="selective_rollout"', "rollout.params={K=1, d_low=0.12, t_high=0.9}", "rollout.temperature=0.5"]


def test_kept_groups_are_the_ungated_runs_groups(tmp_path):
    gated = make_trainer(tmp_path / "a", *REACH, *GATE)
    plain = make_trainer(
        tmp_path / "b", *REACH, 'rollout.name="episodes"', "rollout.params={max_turns=30}", "rollout.temperature=0.5"
    )
    batch, whole = gated.collect(), plain.collect()
    stats, plain_stats = gated.strategy.step_stats(), plain.strategy.step_stats()
    assert 0 < stats["episodes/gated_frac"] < 1, "the seed must gate some groups and keep others"
    kept = [b for b in range(whole.shape[0]) if int(whole.prompt_index[b]) in batch.prompt_index.tolist()]
    assert len(kept) == batch.shape[0] == round(whole.shape[0] * (1 - stats["episodes/gated_frac"]))
    ref = whole.select(kept)
    for name in ("actions", "mask", "loss_mask", "rewards"):
        T = getattr(batch, name).shape[-1] if getattr(batch, name).dim() == 3 else None
        torch.testing.assert_close(getattr(batch, name), getattr(ref, name)[..., :T] if T else getattr(ref, name))
    assert [i["actions"] for g in batch.info for i in g] == [i["actions"] for g in ref.info for i in g]
    # every dropped group had identical first moves, and its episodes stopped after 1 action
    dropped = [b for b in range(whole.shape[0]) if b not in kept]
    for b in dropped:
        assert len({i["actions"][0].strip() for i in whole.info[b]}) == 1
    saved = sum(len(i["actions"]) - 1 for b in dropped for i in whole.info[b])
    assert stats["episodes/env_steps"] == plain_stats["episodes/env_steps"] - saved


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_two_steps_with_ppo_clip_and_gspo(tmp_path, objective):
    rows, seen = train_recorded(tmp_path, objective, *REACH, *GATE)
    assert any(r["episodes/gated_frac"] > 0 for r in rows)
    for row, batch in zip(rows, seen):
        assert batch.shape[0] == round(4 * (1 - row["episodes/gated_frac"]))
        assert batch.loss_mask is not None and all(i["cut"] != "gate" for g in batch.info for i in g)
