"""Row contexts (``Rollout.ctx``) and the second mask (``Rollout.loss_mask``): how they travel through
select / concat / join_rows, and that a hole in the loss mask leaves the loss and every normaliser
while the token stays in the sequence. The forward's side is in tests/test_plain_path.py."""

from __future__ import annotations

import dataclasses

import torch

from groupwise.registry import build
from helpers import info_for, leaf, make_rollout, objective_for, rollout_from


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
    assert joined.loss_mask.shape == (3, 2, 5) and not joined.loss_mask[0, 0, 0] and torch.equal(joined.loss_mask[2], b.mask[0])
    assert torch.equal(joined.loss_mask[:2, :, :3], a.loss_mask) and not joined.loss_mask[:2, :, 3:].any()  # padding is no token


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
    out = base.regroup([[(0, 1), (2, 0)], [(1, 0)]])  # group 0: rows (0,1) and (2,0); group 1: row (1,0) and a padding row
    assert out.shape[:2] == (2, 2)
    assert torch.equal(out.actions[0, 0], base.actions[0, 1]) and torch.equal(out.actions[0, 1], base.actions[2, 0])
    assert out.group_valid.tolist() == [[bool(base.group_valid[0, 1]), bool(base.group_valid[2, 0])], [bool(base.group_valid[1, 0]), False]]
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
