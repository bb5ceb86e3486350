"""Per-model scoring (M8, design §4 item 17): the need resolver scores each model with its own policy's
``score`` (``score_of[name]``), so a frozen role of another policy serves needs through that policy, and
a need of a quantity the role's policy does not compute is refused at build naming the role."""

from __future__ import annotations

import contextlib

import pytest
import torch

from groupwise.errors import ConfigError
from groupwise.modalities.flow import FlowPolicy
from groupwise.needs import NeedResolver
from groupwise.types import Need, Request, StepInfo

INFO = StepInfo(step=0, seed=1, max_new_tokens=0)


def _resolver(main, teacher, needs, teacher_quantities=None, calls: list | None = None):
    calls = [] if calls is None else calls

    def teacher_score(handle, rollout, quantities):
        calls.append(("teacher", tuple(quantities)))
        return teacher.score(handle, rollout, quantities)

    return NeedResolver(
        needs,
        {"policy": lambda: contextlib.nullcontext(main), "teacher": lambda: contextlib.nullcontext(teacher)},
        {},
        main.score,
        main.encode,
        quantities=main.quantities,
        score_of={"teacher": teacher_score},
        quantities_of={"teacher": teacher.quantities if teacher_quantities is None else teacher_quantities},
    )


def test_a_frozen_flow_teacher_serves_its_step_means_through_its_own_policy():
    main, teacher = FlowPolicy(init_seed=1, hidden=8), FlowPolicy(init_seed=2, hidden=16)  # another net and width
    rollout = main.generate([Request(key=k, n=3, prompt=k % 4) for k in range(2)], {}, INFO)
    calls: list = []
    need = Need("step_mean", model="teacher")
    resolver = _resolver(main, teacher, [need], calls=calls)
    resolver.fill(rollout, [need])
    assert calls == [("teacher", ("logp", "step_mean"))]  # one forward of the teacher, by the teacher's scorer
    with torch.no_grad():
        expected = teacher.forward(rollout, ["step_mean"])["step_mean"]  # [B,G,T,2]
        own = main.forward(rollout, ["step_mean"])["step_mean"]  # [B,G,T,2]
    got = rollout.extras[need.key]
    assert got.shape == (2, 3, rollout.shape[2], 2) and torch.equal(got, expected) and not torch.equal(got, own)


def test_a_quantity_the_role_does_not_compute_is_refused_at_build_naming_the_role():
    main, teacher = FlowPolicy(hidden=8), FlowPolicy(hidden=8)
    with pytest.raises(ConfigError, match=r"model 'teacher' \(roles.teacher\) computes \['logp'\], not 'step_mean'"):
        _resolver(main, teacher, [Need("step_mean", model="teacher")], teacher_quantities=frozenset({"logp"}))
    # the policy's own quantities keep their message
    with pytest.raises(ConfigError, match="this run's policy computes .*, not 'logprobs'"):
        _resolver(main, teacher, [Need("logprobs")])
