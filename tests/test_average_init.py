"""Phase ``average_init`` (M8): the policy becomes the weighted parameter average of earlier runs' final
weights (a toy kind's saved net, a full LM's safetensors); another kind or shape is refused naming the path."""

from __future__ import annotations

import pytest
import torch

from groupwise.errors import ConfigError
from groupwise.modalities.flow import FlowPolicy
from groupwise.phases import PhaseContext
from groupwise.phases.average_init import AverageInit


def _ctx(policy) -> PhaseContext:
    return PhaseContext(policy, [], [], 0, lambda s, r, i: [0], lambda *a, **k: 0.0, lambda line: None)


def _filled(value: float, **kwargs) -> FlowPolicy:
    policy = FlowPolicy(hidden=8, **kwargs)
    with torch.no_grad():
        for t in policy.net.state_dict().values():
            t.fill_(value)
    return policy


def test_two_flow_teachers_average_with_their_weights(tmp_path):
    _filled(1.0).save(tmp_path / "a")
    _filled(3.0).save(tmp_path / "b")
    student = _filled(-7.0)
    # weights [1, 3] -> 1/4 and 3/4: 0.25 * 1 + 0.75 * 3 = 2.5 in every tensor (the student's -7 is gone)
    out = AverageInit(paths=[str(tmp_path / "a"), str(tmp_path / "b")], weights=[1, 3])(_ctx(student))
    for name, t in student.net.state_dict().items():
        assert torch.equal(t, torch.full_like(t, 2.5)), name
    assert out["summary"]["weights"] == [0.25, 0.75]
    # uniform by default: (1 + 3) / 2 = 2
    AverageInit(paths=[str(tmp_path / "a"), str(tmp_path / "b")])(_ctx(student))
    assert all(torch.equal(t, torch.full_like(t, 2.0)) for t in student.net.state_dict().values())
    assert AverageInit.reads_labels is False and AverageInit.kind == "sft"


def test_another_shape_kind_or_a_missing_folder_is_refused(tmp_path):
    _filled(1.0).save(tmp_path / "a")
    FlowPolicy(hidden=16).save(tmp_path / "wide")
    paths = [str(tmp_path / "a"), str(tmp_path / "wide")]
    with pytest.raises(ConfigError, match=r"average_init: .*wide holds a policy saved from .*'hidden': 16.*same kind"):
        AverageInit(paths=paths)(_ctx(_filled(0.0)))
    with pytest.raises(ConfigError, match=r"nothing/flow_policy.pt does not exist"):
        AverageInit(paths=[str(tmp_path / "a"), str(tmp_path / "nothing")])(_ctx(_filled(0.0)))
    with pytest.raises(ConfigError, match="average_init.paths must name at least two folders"):
        AverageInit(paths=[str(tmp_path / "a")])
    with pytest.raises(ConfigError, match=r"one weight per path \(2\)"):
        AverageInit(paths=paths, weights=[1.0])


def test_two_lm_runs_average_their_safetensors(tmp_path):
    from groupwise.config import ModelCfg, PerfCfg
    from groupwise.policy.kinds import build_policy

    base = build_policy(ModelCfg(), PerfCfg())
    original = {k: v.clone() for k, v in base.module.state_dict().items()}
    base.save(tmp_path / "a")
    with torch.no_grad():
        for t in base.module.state_dict().values():
            t.zero_()
    base.save(tmp_path / "zero")
    student = build_policy(ModelCfg(), PerfCfg())
    AverageInit(paths=[str(tmp_path / "a"), str(tmp_path / "zero")])(_ctx(student))
    for name, t in student.module.state_dict().items():  # (w + 0) / 2, in float64 then float32: exactly w / 2
        assert torch.equal(t, original[name] / 2), name
    with pytest.raises(ConfigError, match="an LM run's final/ holds it"):
        AverageInit(paths=[str(tmp_path / "a"), str(tmp_path)])(_ctx(student))
