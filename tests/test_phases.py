"""Phases before the RL steps (groupwise.phases): the sft phase's loss by hand, a run with an sft
phase (its output saved with a digest, loaded — not rerun — when the run starts again), artifacts
checked at build and injected, and a damaged output refused."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from test_trainer import make_trainer

from groupwise.errors import ConfigError
from groupwise.phases import load_output, save_output
from groupwise.phases.sft import _loss, teacher_forced
from groupwise.registry import register
from groupwise.run import Run


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
    # −1/5 per token, 0 on padding
    torch.testing.assert_close(fixed.logp.grad, torch.tensor([[[-0.2, -0.2, 0.0]], [[-0.2, -0.2, -0.2]]]))


def test_a_run_with_an_sft_phase_trains_first_and_does_not_redo_it(tmp_path, capsys):
    phase = 'phases=[{name="sft", steps=8, batch_size=16}]'
    trainer = make_trainer(tmp_path, phase, "train.steps=1", "eval.size=32")
    before = {k: v.clone() for k, v in trainer.policy.module.state_dict().items()}
    summary = Run(trainer).train()
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
    again.parts.phases[0].fit = lambda *a, **k: calls.append(1)
    Run(again).train()
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
    trainer = make_trainer(
        tmp_path / "b",
        'objective.weights=["_test_reads_table"]',
        'phases=["_test_table"]',
        "train.steps=1",
        "eval.size=0",
    )
    Run(trainer).train()
    assert artifact_components.seen == ("table", {"rows": len(trainer.train_rows)})
    assert load_output(tmp_path / "b" / "phases" / "table.pt")["artifact"] == {"rows": len(trainer.train_rows)}


def test_an_artifact_without_its_digest_is_computed_again(tmp_path, artifact_components, capsys):
    """A kill between phases/table.pt and its digest (issue 33, item 3). Before: every rerun failed
    with "incomplete or damaged ... delete it"; now the output counts as never written."""
    args = ('objective.weights=["_test_reads_table"]', 'phases=["_test_table"]', "train.steps=1", "eval.size=0")
    Run(make_trainer(tmp_path, *args)).train()
    digest = tmp_path / "phases" / "table.sha256"
    kept = digest.read_text()
    for name in ("summary.json", "FINISHED"):
        (tmp_path / name).unlink(missing_ok=True)
    __import__("shutil").rmtree(tmp_path / "checkpoints")  # the RL steps had not begun when the kill came
    (tmp_path / "phases" / "table.pt").write_bytes(b"half a file")  # and the new table.pt is any bytes at all
    digest.unlink()
    capsys.readouterr()
    trainer = make_trainer(tmp_path, *args)
    Run(trainer).train()
    said = capsys.readouterr().err
    assert "table.pt has no digest (a run killed while saving it): running the phase again" in said
    assert artifact_components.seen == ("table", {"rows": len(trainer.train_rows)})
    assert digest.read_text() == kept  # the same artifact, saved whole with its digest


def test_a_save_removes_the_old_digest_before_writing(tmp_path, monkeypatch):
    """At every moment of a save, a file without a matching digest never passes for finished: the
    digest of an earlier save is gone before the new file replaces the old one."""
    from groupwise import runfolder
    from groupwise.phases import is_saved

    path = tmp_path / "probe.pt"
    save_output(path, {"artifact": 1})
    seen = []
    real = runfolder.write_atomic
    monkeypatch.setattr(
        runfolder, "write_atomic", lambda p, data: (seen.append((p.name, is_saved(path))), real(p, data))
    )
    save_output(path, {"artifact": 2})
    assert seen == [("probe.pt", False), ("probe.sha256", False)] and is_saved(path)
    assert load_output(path)["artifact"] == 2


class _NanSummary:
    """An offline phase whose summary has a NaN (an AUROC without both classes)."""

    kind, artifact, registry_name = "offline", "", "nan_summary"

    def __call__(self, ctx):
        return {"w": torch.ones(2), "summary": {"auroc": float("nan"), "turns": 3, "by": [float("inf"), 1.0]}}


def test_a_phase_summarys_nan_is_written_as_null(tmp_path):
    """Before: pair_probe's held-out AUROC was NaN on a small run and summary.json (allow_nan=False)
    failed at the very end of training."""
    from groupwise.phases import PhaseContext, run_phases

    ctx = PhaseContext(None, [], [], 0, None, None, lambda line: None)
    artifacts = run_phases([_NanSummary()], ctx, tmp_path, rl_started=False, rank=0)
    assert ctx.summary["nan_summary"] == {"auroc": None, "turns": 3, "by": [None, 1.0]}
    json.dumps(ctx.summary, allow_nan=False)
    assert torch.equal(artifacts["nan_summary"]["w"], torch.ones(2))
    assert load_output(tmp_path / "nan_summary.pt")["summary"]["auroc"] is None


RANKS_SCRIPT = """
import json, sys, time
from pathlib import Path
import torch
from groupwise import dist
from groupwise.phases import PhaseContext, run_phases

rank, world = dist.init()

class RankTable:
    kind, artifact, registry_name = "offline", "", "rank_table"
    def __call__(self, ctx):
        return {"rank": rank, "w": torch.full((2,), float(rank)), "summary": {}}

if rank == 1:
    time.sleep(3)  # rank 0 has written phases/rank_table.pt before rank 1 looks for it
said = []
ctx = PhaseContext(None, [], [], 0, None, None, said.append)
artifacts = run_phases([RankTable()], ctx, Path(sys.argv[1]), rl_started=False, rank=rank)
dist.barrier()
out = {"rank": rank, "artifact_rank": artifacts["rank_table"]["rank"], "w": artifacts["rank_table"]["w"].tolist(), "said": said}
Path(sys.argv[2], f"rank{rank}.json").write_text(json.dumps(out))  # one file a rank: two ranks' stdout lines can interleave
dist.shutdown()
"""  # noqa: E501


@pytest.mark.dist
def test_under_two_ranks_the_phase_file_is_decided_together_and_rank_0s_artifact_is_everyones(tmp_path):
    """Two failures of a phase under torchrun. (1) A rank that looked for the phase's file after rank
    0 had written it loaded it and skipped the barrier rank 0 waited in: the ranks' collectives
    no longer matched (a hang). (2) A phase whose result depends on the rank gave each rank its
    own artifact (the file only rank 0's). Now both ranks compute, and both use rank 0's."""
    import os
    import subprocess
    import sys

    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            str(tmp_path / "phases"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["artifact_rank"] for r in rows] == [0, 0] and [r["w"] for r in rows] == [[0.0, 0.0], [0.0, 0.0]]
    for r in rows:  # computed on each rank (not loaded from rank 0's file), and the difference reported on both
        assert not any("done already" in line for line in r["said"])
        assert any("the ranks computed different artifacts" in line for line in r["said"])
    assert load_output(tmp_path / "phases" / "rank_table.pt")["artifact"]["rank"] == 0
