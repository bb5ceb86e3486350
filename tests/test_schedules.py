"""The general step schedules (schedules/standard.py), by hand: polynomial (plain and centred) and step.

polynomial, start 2 → end −2 (HölderPO's p), S = 8:
    u = s/8;  power 2:  2 − 4·u²          s = 2 → u = .25 → 2 − .25 = 1.75;  s = 4 → 1;  s = 8 → −2
    centred, power 3:   2 − 4·(1 + (2u − 1)³)/2
                        s = 2 → (2u − 1) = −.5 → (1 − .125)/2 = .4375 → 2 − 1.75 = .25
                        s = 4 → .5 → 0 (the midpoint);  s = 6 → (1 + .125)/2 = .5625 → −.25
step, 0 → .05 at S = 3:  s = 0, 1, 2 → 0;  s = 3, 10 → .05
"""

from __future__ import annotations

import pytest

from groupwise.registry import build
from groupwise.types import StepInfo


def _at(schedule, step, total=0):
    return schedule(StepInfo(step=step, seed=0, max_new_tokens=1, total_steps=total))


def test_polynomial_by_hand():
    quad = build("schedule", "polynomial", start_value=2.0, end=-2.0, power=2.0, steps=8)
    assert [_at(quad, s) for s in (0, 2, 4, 8, 20)] == pytest.approx([2.0, 1.75, 1.0, -2.0, -2.0], abs=1e-12)
    cubic = build("schedule", "polynomial", start_value=2.0, end=-2.0, power=3.0, centered=True, steps=8)
    assert [_at(cubic, s) for s in (0, 2, 4, 6, 8)] == pytest.approx([2.0, 0.25, 0.0, -0.25, -2.0], abs=1e-12)
    assert quad.start() == 2.0 and cubic.start() == 2.0


def test_polynomial_power_one_is_linear_and_centred_is_odd_symmetric():
    poly = build("schedule", "polynomial", start_value=0.5, end=3.0, power=1.0)
    lin = build("schedule", "linear", start_value=0.5, end=3.0)
    for s in range(0, 12):
        assert _at(poly, s, total=10) == pytest.approx(_at(lin, s, total=10), abs=1e-12)
    for power in (0.5, 2.0, 3.0, 5.0):
        c = build("schedule", "polynomial", start_value=0.0, end=1.0, power=power, centered=True, steps=10)
        for s in range(11):
            assert _at(c, s) + _at(c, 10 - s) == pytest.approx(1.0, abs=1e-12)  # f(u) + f(1 − u) = 1
        assert _at(c, 5) == pytest.approx(0.5, abs=1e-12)
    # a power that differs makes a different curve (the test above can fail)
    assert _at(build("schedule", "polynomial", power=2.0, steps=10), 5) == pytest.approx(0.25)


def test_step_schedule():
    step = build("schedule", "step", start_value=0.0, end=0.05, steps=3)
    assert [_at(step, s) for s in (0, 1, 2, 3, 10)] == [0.0, 0.0, 0.0, 0.05, 0.05]
    assert step.start() == 0.0
    whole = build("schedule", "step", start_value=1.0, end=2.0)  # steps = 0: the run's length, one past the last step
    assert [_at(whole, s, total=4) for s in range(4)] == [1.0, 1.0, 1.0, 1.0]


def test_a_component_parameter_given_as_these_schedules():
    term = build(
        "objective", "kl", coef={"schedule": "polynomial", "start_value": 0.1, "end": 0.0, "power": 2.0, "steps": 4}
    )
    assert term.coef == 0.1 and _at(term.schedules["coef"], 2) == pytest.approx(0.1 - 0.1 * 0.25)
    term = build("objective", "kl", coef={"schedule": "step", "start_value": 0.0, "end": 0.2, "steps": 2})
    assert term.coef == 0.0 and _at(term.schedules["coef"], 2) == 0.2


@pytest.mark.parametrize(
    "name, params, match",
    [
        ("polynomial", {"power": 0.0}, "power"),
        ("polynomial", {"power": -1.0}, "power"),
        ("polynomial", {"steps": -1}, "steps"),
        ("step", {"steps": -2}, "steps"),
    ],
)
def test_bad_parameters_are_named(name, params, match):
    with pytest.raises(ValueError, match=match):
        build("schedule", name, **params)
