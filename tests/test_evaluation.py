"""Sampled held-out metrics (issue 13): the unbiased pass@k estimator by hand, and eval.samples."""

from __future__ import annotations

import math

import pytest

from groupwise.evaluation import pass_at_k
from groupwise.run import Run


def test_pass_at_k_by_hand():
    # n = 4 samples, c = 1 correct: pass@1 = 1/4; pass@2 = 1 − C(3,2)/C(4,2) = 1 − 3/6 = 0.5; pass@4 = 1
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == 1.0
    # n = 10, c = 3, k = 5: 1 − C(7,5)/C(10,5) = 1 − 21/252
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 8, 1) == 1.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_sampled_evaluation_through_the_trainer(tmp_path):
    from test_trainer import make_trainer

    trainer = make_trainer(tmp_path / "run", "train.steps=1", "eval.size=8", "eval.samples=4", "eval.pass_at=[1, 2, 4]")
    job = Run(trainer)
    summary = job.train()
    before = summary["accuracy_before_sampled"]
    assert set(before) == {"mean@4", "pass@1", "pass@2", "pass@4"}
    assert before["pass@1"] == pytest.approx(before["mean@4"])  # pass@1 is the mean correctness
    assert before["pass@1"] <= before["pass@2"] <= before["pass@4"] <= 1.0
    assert job.heldout.evaluate_sampled() == summary["accuracy_after_sampled"]  # the same noise (step −1): reproducible
