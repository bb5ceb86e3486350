"""M6: ``Rollout.cat_tokens`` joins rows of the same groups along T (chains of non-text turns)."""

import pytest
import torch

from groupwise.types import Rollout


def _part(lengths, actions_base, *, seg=None, row_value=0.0, prompt=(7,)):
    """A [1,2,T] part whose row g has lengths[g] tokens numbered actions_base + t (padding 0 after)."""
    T = max(lengths)
    mask = torch.tensor([[[t < n for t in range(T)] for n in lengths]])  # [1,2,T]
    actions = (torch.arange(T) + actions_base).expand(1, 2, T) * mask  # [1,2,T]
    r = Rollout(
        prompt_ids=[list(prompt)],
        actions=actions.long(),
        mask=mask,
        group_valid=torch.ones(1, 2, dtype=torch.bool),
        truncated=torch.zeros(1, 2, dtype=torch.bool),
        prompt_index=torch.tensor([3]),
        rewards=torch.full((1, 2), row_value),
        logp_old=actions.float() / 10 * mask,  # [1,2,T]
        segment_id=seg,
    )
    r.set_extra("vec", torch.stack([actions.float(), -actions.float()], -1), "token")  # [1,2,T,2]
    r.set_extra("x_final", torch.full((1, 2, 2), row_value), "row")
    r.set_extra("tag", torch.tensor([row_value]), "group")
    return r


def test_one_part_returns_itself():
    p = _part([2, 1], 10)
    assert Rollout.cat_tokens([p]) is p


def test_two_parts_pack_each_row_and_keep_a_prefix_mask():
    # part A: row 0 has tokens [10,11], row 1 [10]; part B: row 0 [20], row 1 [20,21,22]
    # joined: row 0 = [10,11,20] (+1 pad), row 1 = [10,20,21,22]; T = max(2+1, 1+3) = 4
    a, b = _part([2, 1], 10, row_value=1.0, prompt=(7,)), _part([1, 3], 20, row_value=2.0, prompt=(8,))
    out = Rollout.cat_tokens([a, b])
    assert out.shape == (1, 2, 4)
    assert out.actions.tolist() == [[[10, 11, 20, 0], [10, 20, 21, 22]]]
    assert out.mask.tolist() == [[[True, True, True, False], [True, True, True, True]]]
    # logp_old = action / 10 on real tokens, 0 on padding
    assert torch.allclose(out.logp_old, torch.tensor([[[1.0, 1.1, 2.0, 0.0], [1.0, 2.0, 2.1, 2.2]]]))
    # token extra [1,2,T,2]: (a, -a) per real token, zeros on padding
    assert out.extras["vec"][0, 0].tolist() == [[10, -10], [11, -11], [20, -20], [0, 0]]
    assert out.extras["vec"].shape == (1, 2, 4, 2)
    # each part is one segment: A -> 0, B -> 1, padding -1
    assert out.segment_id.tolist() == [[[0, 0, 1, -1], [0, 1, 1, 1]]]
    # row fields from the last part (B: 2.0), group fields from the first (A: prompt [7], tag 1.0)
    assert out.rewards.tolist() == [[2.0, 2.0]]
    assert out.extras["x_final"].tolist() == [[[2.0, 2.0], [2.0, 2.0]]]
    assert out.prompt_ids == [[7]] and out.extras["tag"].tolist() == [1.0]
    assert out.extra_levels == {"vec": "token", "x_final": "row", "tag": "group"}


def test_segment_ids_offset_past_a_part_with_its_own_segments():
    # part A has two segments per row ([0,1] on row 0, [0,0] on row 1): its S = max id + 1 = 2, so
    # part B (no segment_id: one segment) numbers from 2; three parts: the third from 3
    seg = torch.tensor([[[0, 1], [0, 0]]])
    a = _part([2, 2], 10, seg=seg)
    a.set_extra("turn_score", torch.tensor([[[0.5, 0.25], [1.0, float("nan")]]]), "segment")
    out = Rollout.cat_tokens([a, _part([1, 1], 20), _part([1, 1], 30)])
    assert out.segment_id.tolist() == [[[0, 1, 2, 3], [0, 0, 2, 3]]]
    # segment extra joined along S: A's 2 columns, then NaN for B's and C's single segments
    turn = out.extras["turn_score"]  # [1,2,4]
    assert turn.shape == (1, 2, 4)
    assert turn[0, 0, :2].tolist() == [0.5, 0.25] and torch.isnan(turn[0, 0, 2:]).all()


def test_refuses_other_groups_and_non_prefix_masks():
    a, b = _part([2, 1], 10), _part([1, 1], 20)
    b.prompt_index = torch.tensor([4])
    with pytest.raises(ValueError, match="same groups"):
        Rollout.cat_tokens([a, b])
    c = _part([2, 2], 20)
    c.mask = torch.tensor([[[False, True], [True, True]]])
    with pytest.raises(ValueError, match="not a prefix"):
        Rollout.cat_tokens([a, c])
