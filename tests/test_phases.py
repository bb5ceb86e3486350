"""Phases before the RL steps (groupwise.phases): the sft phase's loss by hand, a run with an sft
phase (its output saved with a digest, loaded — not rerun — when the run starts again), artifacts
checked at build and injected, and a damaged output refused."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from groupwise.phases import load_output, save_output
from groupwise.phases.sft import _loss, teacher_forced
from groupwise.registry import ConfigError, register
from test_trainer import make_trainer


def test_teacher_forced_rows_and_the_token_mean_loss_by_hand():
    batch = teacher_forced([[1, 2], [3]], [[5, 0], [6, 7, 0]])  # answers + EOS (id 0), lengths 2 and 3
    assert batch.actions.tolist() == [[[5, 0, 0]], [[6, 7, 0]]]
    assert batch.mask.tolist() == [[[True, True, False]], [[True, True, True]]]

    class Fixed:  # log-probs −1, −2 (row 0) and −1, −1, −1 (row 1); the padding value 9 must not count
        def __init__(self):
            self.logp = torch.tensor([[[-1.0, -2.0, 9.0]], [[-1.0, -1.0, -1.0]]], requires_grad=True)

        def forward(self, rollout, quantities):
            return {"logp": self.logp}

    fixed = Fixed()
    loss = _loss(fixed, batch)
    assert loss.item() == pytest.approx(6 / 5)  # −(−1 −2 −1 −1 −1) / 5 tokens
    torch.testing.assert_close(fixed.logp.grad, torch.tensor([[[-0.2, -0.2, 0.0]], [[-0.2, -0.2, -0.2]]]))  # −1/5 per token, 0 on padding


def test_a_run_with_an_sft_phase_trains_first_and_does_not_redo_it(tmp_path, capsys):
    phase = 'phases=[{name="sft", steps=8, batch_size=16}]'
    trainer = make_trainer(tmp_path, phase, "train.steps=1", "eval.size=32")
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    summary = trainer.train()
    assert summary["phases"]["sft"]["steps"] == 8
    saved = load_output(tmp_path / "phases" / "sft.pt")
    moved = [k for k, v in saved["policy"]["model"].items() if not torch.equal(v, before[k])]
    assert moved, "the sft phase changed the weights RL started from"
    # a rerun in the same folder after a kill before any RL checkpoint: the phase output is loaded, not recomputed
    (tmp_path / "summary.json").unlink()
    import shutil
    shutil.rmtree(tmp_path / "checkpoints", ignore_errors=True)
    again = make_trainer(tmp_path, phase, "train.steps=1", "eval.size=32")
    calls = []
    again.phases[0].fit = lambda *a, **k: calls.append(1)
    again.train()
    assert calls == [] and "done already" in capsys.readouterr().err
    assert json.loads((tmp_path / "summary.json").read_text())["phases"]["sft"]["steps"] == 8


def test_a_damaged_phase_output_is_refused_naming_it(tmp_path):
    path = tmp_path / "probe.pt"
    save_output(path, {"artifact": {"w": torch.ones(2)}})
    assert torch.equal(load_output(path)["artifact"]["w"], torch.ones(2))
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(RuntimeError, match="probe.pt: the phase output is incomplete or damaged"):
        load_output(path)


@pytest.fixture
def artifact_components():
    """A test offline phase making the artifact ``table`` and a token weight reading it, registered
    for one test only (other tests iterate over every registered component)."""
    from groupwise import registry

    @register("phase", "_test_table")
    @dataclass
    class Table:
        """Test offline phase: an artifact holding the number of train rows."""

        kind = "offline"
        artifact: str = "table"

        def __call__(self, ctx):
            return {"rows": len(ctx.train_rows)}

    @register("weight", "_test_reads_table")
    @dataclass
    class ReadsTable:
        """Test token weight that needs the artifact ``table``."""

        needs = ()
        artifacts = ("table",)
        seen = None

        def use_artifact(self, name, value):
            type(self).seen = (name, value)

        def __call__(self, rollout, info):
            return torch.ones_like(rollout.mask, dtype=torch.float32)

    yield ReadsTable
    del registry._REGISTRY["phase"]["_test_table"], registry._REGISTRY["weight"]["_test_reads_table"]


def test_an_artifact_no_phase_makes_is_a_build_error_and_a_made_one_is_injected(tmp_path, artifact_components):
    with pytest.raises(ConfigError, match="needs the artifact 'table', which no offline phase produces"):
        make_trainer(tmp_path / "a", 'objective.weights=["_test_reads_table"]')
    trainer = make_trainer(tmp_path / "b", 'objective.weights=["_test_reads_table"]', 'phases=["_test_table"]', "train.steps=1", "eval.size=0")
    trainer.train()
    assert artifact_components.seen == ("table", {"rows": len(trainer.train_rows)})
    assert load_output(tmp_path / "b" / "phases" / "table.pt")["artifact"] == {"rows": len(trainer.train_rows)}
