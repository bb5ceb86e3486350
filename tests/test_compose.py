"""Composition by configuration alone: each paper of Core part 1 (GEAR shaper, GXPO updater, CGPO
and FG-ExPO's Gaussian curriculum samplers, FG-ExPO's accuracy-controlled KL coefficient) trains
through the same trainer with the PPO-clip and the GSPO objective, and with the others. Two steps
each on the embedded model; the checks are that the component really acted (its mark in the
metrics or its state), and the loss is finite."""

from __future__ import annotations

import json

import pytest
from test_trainer import make_trainer

from groupwise.run import Run

PAPERS = {
    "gear": ['advantage.shapers=[{name="gear"}]'],
    "gxpo": ['update={name="gxpo", lr=1e-3}'],
    "cgpo": ['sampling={name="cgpo"}'],
    "fg_expo": ['sampling={name="gcs"}', 'objective.terms.kl.coef={schedule="akl", beta_max=0.08}'],
}
OBJECTIVES = {
    "ppo_clip": 'objective.terms=["ppo_clip", {name="kl", coef=0.04}]',
    "gspo": 'objective.terms=["gspo", {name="kl", coef=0.04}]',
}


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("paper", PAPERS)
def test_each_paper_composes_with_each_objective(tmp_path, paper, objective):
    trainer = make_trainer(tmp_path, OBJECTIVES[objective], *PAPERS[paper], "train.steps=2", "eval.size=0")
    assert trainer.objective.terms[0].registry_name == objective
    seen = {}
    observe = trainer.observe
    trainer.observe = lambda batch: (seen.update(batch=batch), observe(batch))
    Run(trainer).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["loss"] is not None for r in rows)
    if paper == "gxpo":
        assert rows[0]["backward_passes"] == 3  # probe, probe, corrective: the closure ran three times
    if paper == "fg_expo":
        assert "coef/kl.coef" in rows[0] and 0 <= rows[0]["coef/kl.coef"] <= 0.08
    if paper == "gear":  # the view's KL was computed and the shaper made token-level advantages
        assert seen["batch"].advantages.dim() == 3 and float(seen["batch"].extras["kl_to(ground_truth)"].max()) > 0
    if paper in ("cgpo", "fg_expo"):  # the curriculum observed the batches: compare with a freshly bound sampler
        fresh = type(trainer.sampler)()
        fresh.bind(len(trainer.train_rows), trainer.cfg.seed)
        key = "table" if paper == "cgpo" else "seen"
        assert fresh.state_dict()[key] != trainer.sampler.state_dict()[key]


def test_all_four_together(tmp_path):
    trainer = make_trainer(
        tmp_path,
        'objective.terms=["gspo", {name="kl", coef={schedule="akl", beta_max=0.08}}]',
        'advantage.shapers=[{name="gear"}]',
        'update={name="gxpo", lr=1e-3}',
        'sampling={name="cgpo"}',
        "train.steps=2",
        "eval.size=0",
    )
    Run(trainer).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["backward_passes"] for r in rows] == [3, 3]
