"""Row contexts (``Rollout.ctx``, ``behav_ctx``), row flags, segments (``segment_id``, segment-level
extras) and the second mask (``Rollout.loss_mask``): how they travel through select / concat /
join_rows / regroup, that a hole in the loss mask leaves the loss and every normaliser while the
token stays in the sequence, and that the ``behaviour`` view scores a row under the context it was
sampled under. The forward's side is in tests/test_plain_path.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import info_for, leaf, make_rollout, objective_for, rollout_from, run_two_ranks
from test_trainer import make_trainer

from groupwise.registry import build
from groupwise.types import Need, Rollout


def test_a_hole_in_the_loss_mask_leaves_the_loss_and_the_normaliser():
    # one row of 4 tokens, logp_old = 0, logp = 0 (ratio 1), advantage 1: PPO's per-token loss is −1
    # token_mean over the 3 policy tokens (token 1 is an environment token) = −3/3 = −1, and the
    # gradient at each policy token is −1/3, at the hole exactly 0
    mb = rollout_from(torch.zeros(1, 1, 4), torch.tensor([[1.0]]))
    mb.loss_mask = torch.tensor([[[True, False, True, True]]])
    logp = leaf(torch.zeros(1, 1, 4))
    obj = objective_for([build("objective", "ppo_clip")], "token_mean")
    norms = obj.normalizers(mb, info_for(4))
    loss = obj.loss(mb, {"logp": logp}, norms, info_for(4))
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == -1.0
    torch.testing.assert_close(grad.flatten(), torch.tensor([-1 / 3, 0.0, -1 / 3, -1 / 3]))
    assert mb.row_mask.flatten().tolist() == [True, False, True, True] and mb.mask.all()  # the sequence keeps the token
    # seq_mean_token_mean: the row's mean over its 3 policy tokens; without the hole it would be 4
    obj = objective_for([build("objective", "ppo_clip")], "seq_mean_token_mean")
    loss = obj.loss(mb, {"logp": logp}, obj.normalizers(mb, info_for(4)), info_for(4))
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad.flatten(), torch.tensor([-1 / 3, 0.0, -1 / 3, -1 / 3]))


def test_select_concat_and_join_keep_contexts_and_holes():
    a, b = make_rollout(2, 2, 3, seed=0), make_rollout(1, 2, 5, seed=1)
    a.ctx = [[[7, 7], [8]], [[9], [9]]]
    a.loss_mask = a.mask.clone()
    a.loss_mask[0, 0, 0] = False
    assert a.select([1]).ctx == [[[9], [9]]]
    joined = type(a).concat([a, b])  # b sets neither: its rows get their group's prompt and their whole mask
    assert joined.ctx[:2] == a.ctx and joined.ctx[2] == [list(b.prompt_ids[0])] * 2
    assert (
        joined.loss_mask.shape == (3, 2, 5)
        and not joined.loss_mask[0, 0, 0]
        and torch.equal(joined.loss_mask[2], b.mask[0])
    )
    # padding is no token
    assert torch.equal(joined.loss_mask[:2, :, :3], a.loss_mask) and not joined.loss_mask[:2, :, 3:].any()


def test_join_rows_keeps_the_context_a_row_was_sampled_under():
    base = make_rollout(2, 2, 3, seed=0)
    same = make_rollout(1, 1, 3, seed=1)
    same.prompt_ids = [list(base.prompt_ids[1])]
    assert base.join_rows(same, [1]).ctx == []  # further samples of the same prompt (HORA): no row contexts
    other = dataclasses.replace(same, prompt_ids=[[5, 6]])  # sampled under a feedback prompt
    out = base.join_rows(other, [1])
    assert out.ctx[1] == [list(base.prompt_ids[1])] * 2 + [[5, 6]]
    assert out.ctx[0][:2] == [list(base.prompt_ids[0])] * 2 and out.ctx[0][2] == [] and not out.group_valid[0, 2]
    assert out.row_contexts() is out.ctx


def test_regroup_gathers_rows_into_new_groups_with_their_contexts():
    base = make_rollout(3, 2, 4, seed=2)
    base.ctx = [[[1], [2]], [[3], [4]], [[5], [6]]]
    base.set_extra("tag", torch.tensor([10.0, 20.0, 30.0]), "group")
    base.completions = [["a", "b"], ["c", "d"], ["e", "f"]]
    # group 0: rows (0,1) and (2,0); group 1: row (1,0) and a padding row
    out = base.regroup([[(0, 1), (2, 0)], [(1, 0)]])
    assert out.shape[:2] == (2, 2)
    assert torch.equal(out.actions[0, 0], base.actions[0, 1]) and torch.equal(out.actions[0, 1], base.actions[2, 0])
    assert out.group_valid.tolist() == [
        [bool(base.group_valid[0, 1]), bool(base.group_valid[2, 0])],
        [bool(base.group_valid[1, 0]), False],
    ]
    assert not out.mask[1, 1].any()  # the padding row has no tokens
    assert out.ctx == [[[2], [5]], [[3], []]]
    assert out.prompt_index.tolist() == [int(base.prompt_index[0]), int(base.prompt_index[1])]
    assert out.extras["tag"].tolist() == [10.0, 20.0]  # group-level: from each new group's first row
    assert out.completions == [["b", "e"], ["c", ""]]


def test_concat_pads_the_row_axis_with_invalid_rows():
    a, b = make_rollout(1, 3, 4, seed=3), make_rollout(2, 2, 4, seed=4)
    b.ctx = [[[1], [2]], [[3], [4]]]
    out = type(a).concat([a, b])
    assert out.shape[:2] == (3, 3)
    assert out.group_valid[1:, 2].tolist() == [False, False] and not out.mask[1:, 2].any()
    assert torch.allclose(out.rewards[1:, :2], b.rewards, equal_nan=True)  # make_rollout puts NaN (excluded) rewards in
    assert out.ctx[1] == [[1], [2], []]


# --------------------------------------------------------------------------------------- behav_ctx, row_flags, segments
def _with_row_fields(B: int, G: int, T: int, seed: int, S: int = 2):
    """A hand-built batch carrying every row-context field: row g of group b sampled under [100 + b, g] when g is odd,
    flag injected on those rows, segment g // 2 of every token of the
    mask, a segment extra (b, g, s) -> 100b + 10g + s."""
    ro = make_rollout(B, G, T, seed=seed)
    ro.behav_ctx = [[[100 + b, g] if g % 2 else [] for g in range(G)] for b in range(B)]
    ro.set_flag("injected", torch.tensor([[g % 2 == 1 for g in range(G)] for _ in range(B)]))
    ro.segment_id = torch.where(ro.mask, torch.arange(T)[None, None, :] // 2, torch.full((), -1))  # [B,G,T]
    value = torch.tensor([[[100.0 * b + 10 * g + s for s in range(S)] for g in range(G)] for b in range(B)])  # [B,G,S]
    ro.set_extra("env/x", value, "segment")
    return ro


def test_under_prompts_moves_other_contexts_to_behav_ctx():
    ro = make_rollout(2, 2, 3, seed=5)
    ro.ctx = [[list(ro.prompt_ids[0]), [7, 8]], [list(ro.prompt_ids[1])] * 2]
    out = ro.under_prompts()
    assert out.ctx == [] and out.behav_ctx == [[[], [7, 8]], [[], []]]
    assert out.row_contexts() == [
        [list(ro.prompt_ids[0])] * 2,
        [list(ro.prompt_ids[1])] * 2,
    ]  # trained under the group's prompt
    assert out.behaviour_contexts() == ro.ctx  # sampled under what ctx said
    same = make_rollout(1, 2, 3, seed=6)
    same.ctx = [[list(same.prompt_ids[0])] * 2]
    # nothing differed: no behaviour contexts
    assert same.under_prompts().behav_ctx == [] and same.under_prompts().ctx == []
    assert make_rollout(1, 2, 3).under_prompts().behav_ctx == []


def test_select_concat_pad_and_regroup_keep_flags_and_segments():
    a, b = _with_row_fields(2, 2, 4, seed=0, S=2), _with_row_fields(1, 3, 6, seed=1, S=3)
    sel = a.select([1])
    assert sel.behav_ctx == [[[], [101, 1]]] and sel.row_flags["injected"].tolist() == [[False, True]]
    assert torch.equal(sel.segment_id, a.segment_id[1:]) and sel.extras["env/x"].tolist() == [
        [[100.0, 101.0], [110.0, 111.0]]
    ]
    out = type(a).concat([a, b])  # a is padded to G = 3 rows, T = 6 tokens, S = 3 segments
    assert out.shape == (3, 3, 6)
    assert out.behav_ctx[:2] == [[[], [100, 1], []], [[], [101, 1], []]] and out.behav_ctx[2] == b.behav_ctx[0]
    assert out.row_flags["injected"].tolist() == [[False, True, False], [False, True, False], [False, True, False]]
    # padding rows and tokens are in no segment
    assert (out.segment_id[:2, 2] == -1).all() and (out.segment_id[:2, :2, 4:] == -1).all()
    assert torch.equal(out.segment_id[:2, :2, :4], a.segment_id) and torch.equal(out.segment_id[2], b.segment_id[0])
    x = out.extras["env/x"]  # [3,3,3]
    # padding segments are NaN
    assert x[0, 1, :2].tolist() == [10.0, 11.0] and torch.isnan(x[0, 1, 2]) and torch.isnan(x[0, 2]).all()
    plain = make_rollout(1, 2, 4, seed=2)  # sets none of them: no flag (False), no behaviour context, no segments (−1)
    plain.set_extra("env/x", torch.zeros(1, 2, 1), "segment")
    mixed = type(a).concat([a, plain])
    assert (
        mixed.behav_ctx[2] == [[], []]
        and mixed.row_flags["injected"][2].tolist() == [False, False]
        and (mixed.segment_id[2] == -1).all()
    )
    back = out.regroup([[(2, 2), (0, 1)], [(1, 0)]])  # rows keep their behaviour context, flag and segments
    assert back.behav_ctx == [[[], [100, 1]], [[], []]] and back.row_flags["injected"].tolist() == [
        [False, True],
        [False, False],
    ]
    assert torch.equal(back.segment_id[0, 1], out.segment_id[0, 1]) and (back.segment_id[1, 1] == -1).all()
    assert (
        torch.equal(
            back.extras["env/x"][0, 0],
            out.extras["env/x"][2, 2],
        )
        and torch.isnan(back.extras["env/x"][1, 1]).all()
    )


def test_join_rows_keeps_flags_segments_and_behaviour_contexts():
    base = _with_row_fields(2, 2, 3, seed=3, S=1)
    more = _with_row_fields(1, 2, 5, seed=4, S=2)
    more.prompt_ids = [list(base.prompt_ids[1])]
    out = base.join_rows(more, [1])
    assert out.shape == (2, 4, 5)
    assert out.behav_ctx == [[[], [100, 1], [], []], [[], [101, 1], [], [100, 1]]]
    assert out.row_flags["injected"].tolist() == [[False, True, False, False], [False, True, False, True]]
    assert (out.segment_id[0, 2:] == -1).all() and torch.equal(out.segment_id[1, 2:], more.segment_id[0])
    assert (
        out.extras["env/x"][1, 2:].tolist() == [[0.0, 1.0], [10.0, 11.0]]
        and torch.isnan(out.extras["env/x"][0, 2:]).all()
    )
    assert torch.isnan(out.extras["env/x"][:, :2, 1]).all()  # base's rows had one segment: the second is NaN


def test_segment_extras_and_flags_are_checked():
    ro = make_rollout(1, 2, 3)
    with pytest.raises(ValueError, match=r"\[B,G,S\]"):
        ro.set_extra("bad", torch.zeros(1, 2), "segment")
    with pytest.raises(ValueError, match="bool"):
        ro.set_flag("injected", torch.ones(1, 2))
    assert ro.flag("anything").tolist() == [[False, False]]


def test_the_behaviour_view_scores_rows_under_their_sampling_context(tmp_path):
    trainer = make_trainer(tmp_path, "eval.size=0")
    encode = trainer.policy.encode
    x, fap = encode("3+4="), encode("1+1=2\n3+4=")
    g = torch.Generator().manual_seed(0)
    actions = torch.randint(3, 20, (1, 3, 4), generator=g)  # [1,3,4]
    ro = Rollout(
        prompt_ids=[x],
        actions=actions,
        mask=torch.tensor([[[True] * 4, [True] * 3 + [False], [True] * 4]]),
        group_valid=torch.ones(1, 3, dtype=torch.bool),
        truncated=torch.zeros(1, 3, dtype=torch.bool),
        prompt_index=torch.tensor([0]),
        behav_ctx=[[[], fap, []]],
    )  # row 1 was sampled under the other prompt
    need = Need("logp", view="behaviour")
    trainer.needs.fill(ro, [need])
    got = ro.extras[need.key]  # [1,3,4]
    with torch.no_grad():
        under_x = trainer.policy.forward(ro)["logp"]  # every row under x
        # each row under its sampling context
        direct = trainer.policy.forward(dataclasses.replace(ro, ctx=[[x, fap, x]]))["logp"]
    m = ro.row_mask
    torch.testing.assert_close(got[m], direct[m], atol=1e-6, rtol=0)
    # no behaviour context: its training one
    torch.testing.assert_close(got[0, [0, 2]][m[0, [0, 2]]], under_x[0, [0, 2]][m[0, [0, 2]]], atol=1e-6, rtol=0)
    assert (got[0, 1][m[0, 1]] - under_x[0, 1][m[0, 1]]).abs().max() > 1e-3  # the other context changes the log-probs
    assert (got[~m] == 0).all()
    # a GRPO batch: the view is the default one
    plain = dataclasses.replace(ro, behav_ctx=[], extras={}, extra_levels={})
    trainer.needs.fill(plain, [need])
    torch.testing.assert_close(plain.extras[need.key][m], under_x[m], atol=1e-6, rtol=0)


GATHER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from groupwise import dist
from test_row_contexts import _with_row_fields

rank, world = dist.init()
ro = _with_row_fields(1, 2, 3 + 2 * rank, seed=rank, S=1 + rank)  # rank 1: longer rows and one more segment
batch = dist.gather_rollout(ro)
x = batch.extras["env/x"]
with open(f"{sys.argv[2]}/rank{rank}.json", "w") as fh:
    json.dump({"shape": list(batch.shape), "injected": batch.row_flags["injected"].tolist(), "behav": batch.behav_ctx,
               "seg_pad": batch.segment_id[0, :, 3:].tolist(), "x": torch.nan_to_num(x, nan=-9.0).tolist()}, fh)
dist.shutdown()
"""


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_gather_flags_behaviour_contexts_and_segments(tmp_path):
    got = run_two_ranks(GATHER, tmp_path)
    assert got[0] == got[1]  # the same whole batch on every rank
    want_x = [
        [[0.0, -9.0], [10.0, -9.0]],
        [[0.0, 1.0], [10.0, 11.0]],
    ]  # rank 0's one segment padded with NaN to rank 1's two
    assert got[0]["shape"] == [2, 2, 5] and got[0]["x"] == want_x
    assert got[0]["injected"] == [[False, True], [False, True]] and got[0]["behav"] == [[[], [100, 1]], [[], [100, 1]]]
    assert got[0]["seg_pad"] == [[-1, -1], [-1, -1]]  # rank 0's rows padded from 3 to 5 tokens: no segment
