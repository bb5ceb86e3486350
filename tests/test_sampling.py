"""Samplers: seeded epochs, exact resume from state, DAPO dynamic-sampling filter."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import info_for, rollout_from

from groupwise.registry import build


def _bound(name="uniform", n=10, seed=3, **kw):
    s = build("sampling", name, **kw)
    s.bind(n, seed)
    return s


def test_uniform_epochs_are_seeded_permutations():
    s = _bound()
    ids = s.draw(4, info_for(1)) + s.draw(4, info_for(1)) + s.draw(4, info_for(1))
    perm0 = torch.randperm(10, generator=torch.Generator().manual_seed(3)).tolist()  # seed + epoch 0
    perm1 = torch.randperm(10, generator=torch.Generator().manual_seed(4)).tolist()  # seed + epoch 1
    assert ids[:10] == perm0 and sorted(ids[:10]) == list(range(10))  # no repeat within an epoch
    assert ids[10:] == perm1[:2] and perm0 != perm1
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["position"] == 2


def test_uniform_seed_and_shuffle():
    assert _bound(seed=1).draw(10) == _bound(seed=1).draw(10)
    assert _bound(seed=1).draw(10) != _bound(seed=2).draw(10)
    assert _bound(shuffle=False).draw(13) == list(range(10)) + [0, 1, 2]
    assert _bound(n=3).draw(7) == _bound(n=3).draw(3) + _bound(n=3, seed=4).draw(3) + _bound(n=3, seed=5).draw(1)


def test_uniform_keep_all_and_one_round():
    s = _bound()
    assert s.max_rounds == 1
    ro = rollout_from(torch.zeros(3, 2, 1), None, rewards=torch.ones(3, 2))
    assert s.keep(ro).tolist() == [True, True, True]


@pytest.mark.parametrize("name", ["uniform", "dynamic"])
def test_state_round_trip_resumes_identically(name):
    a = _bound(name, n=7, seed=11)
    for _ in range(3):
        a.draw(3)
    state = json.loads(json.dumps(a.state_dict()))  # plain data, checkpointable as JSON
    expected = [a.draw(3) for _ in range(4)]
    b = build("sampling", name)
    b.load_state_dict(state)  # load before bind ...
    b.bind(7, 11)
    c = _bound(name, n=7, seed=11)
    c.load_state_dict(state)  # ... or after
    assert [b.draw(3) for _ in range(4)] == expected == [c.draw(3) for _ in range(4)]


def test_state_mismatch_and_unbound_errors():
    s = build("sampling", "uniform")
    with pytest.raises(RuntimeError, match="bind"):
        s.draw(1)
    a = _bound(n=7)
    a.draw(2)
    b = _bound(n=8)
    with pytest.raises(ValueError, match="rows"):
        b.load_state_dict(a.state_dict())


def test_dynamic_keeps_groups_with_spread():
    s = _bound("dynamic")
    assert s.max_rounds == 4
    nan = float("nan")
    rewards = torch.tensor([[1.0, 1, 1], [1, 0, 1], [nan, 1, 1], [nan, 0, 1], [0.5, 0.5, 0.7], [2.0, nan, nan]])
    valid = torch.ones(6, 3, dtype=torch.bool)
    valid[4, 2] = False  # the only differing reward is an invalid row → constant
    ro = rollout_from(torch.zeros(6, 3, 1), None, rewards=rewards, group_valid=valid)
    # all equal; spread; NaN ignored → equal; NaN ignored → spread; invalid ignored → equal; single → dropped
    assert s.keep(ro).tolist() == [False, True, False, True, False, False]


def test_dynamic_draws_like_uniform():
    assert _bound("dynamic", seed=5).draw(23) == _bound("uniform", seed=5).draw(23)
    with pytest.raises(ValueError):
        build("sampling", "dynamic", max_rounds=0)
    with pytest.raises(ValueError, match="rewards"):
        _bound("dynamic").keep(rollout_from(torch.zeros(1, 2, 1), None))
