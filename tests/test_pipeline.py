"""Pipelines of runs (M8, issue 42): `groupwise pipeline FILE --out DIR --seed S` runs stages as normal run
folders; a later stage loads an earlier one's final weights through `${stage}`; a finished stage is skipped,
an interrupted one resumes to the same final sha256; pipeline.json records the sha256 of every stage's final
weights and loaded models and the label ledger, whose keys never meet the held-out split."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from groupwise import cli
from groupwise.errors import ConfigError
from groupwise.pinning import row_key
from groupwise.pipeline import (
    PipelineError,
    PipelineStopped,
    load_pipeline,
    run_pipeline,
    shipped_pipelines,
    split_overrides,
    tree_sha,
)
from groupwise.policy.lm import resolve_model_path

# two tiny stages of the shipped demo_chain: 2 steps of 4 prompts x 8 samples each, 10 held-out rows
TINY = ["train.steps=2", "rollout.prompts_per_step=4", "eval.size=10", "threads=1", "log.samples=0"]


def _stages(result: dict) -> dict:
    return {s["name"]: s for s in result["stages"]}


def test_stage_two_loads_stage_one_and_a_rerun_skips_both(tmp_path, monkeypatch):
    result = run_pipeline("demo_chain", tmp_path / "p", seed=3, common=TINY)
    grpo, higher = _stages(result)["grpo"], _stages(result)["clip_higher"]
    final = tmp_path / "p" / "grpo" / "final"
    # stage 2's config names stage 1's final folder, and the weights it loaded are stage 1's final weights
    assert higher["config"]["model"]["path"] == str(final.resolve())
    assert higher["loaded"]["model.path"] == grpo["final_sha256"] == tree_sha(final)
    assert higher["config"]["objective"]["terms"][0]["eps_high"] == 0.28 and higher["config"]["seed"] == 3
    on_disk = json.loads((tmp_path / "p" / "pipeline.json").read_text())
    assert on_disk["final_sha256"] == higher["final_sha256"] == tree_sha(tmp_path / "p" / "clip_higher" / "final")
    assert [s["status"] for s in on_disk["stages"]] == ["finished", "finished"]
    # the summary's held-out accuracy before stage 2 is stage 1's after (the same model on the same rows)
    summaries = [json.loads((tmp_path / "p" / n / "summary.json").read_text()) for n in ("grpo", "clip_higher")]
    assert summaries[1]["accuracy_before"] == summaries[0]["accuracy_after"]
    # each run's own summary pins the model it loaded (design §6 rule 2): stage 2's is stage 1's final folder
    assert summaries[1]["models"] == {"model.path": tree_sha(final)}
    assert summaries[0]["models"]["model.path"] == tree_sha(resolve_model_path("default"))

    from groupwise import run as run_module

    def refuse(*args, **kwargs):
        raise AssertionError("a finished stage with its recorded sha256 must not be built again")

    monkeypatch.setattr(run_module.Run, "from_config", refuse)
    again = run_pipeline("demo_chain", tmp_path / "p", seed=3, common=TINY)
    assert again["final_sha256"] == result["final_sha256"]
    # final weights that no longer have their recorded sha256: the stage goes back to its run, which rewrites
    # final/ from its final checkpoint (the same bytes); stage 2 loaded those bytes, so it is skipped again
    monkeypatch.undo()
    with open(final / "model.safetensors", "ab") as fh:
        fh.write(b"damage")
    assert tree_sha(final) != grpo["final_sha256"]
    repaired = run_pipeline("demo_chain", tmp_path / "p", seed=3, common=TINY)
    assert tree_sha(final) == grpo["final_sha256"] and repaired["final_sha256"] == result["final_sha256"]


@pytest.mark.parametrize("stage", ["grpo", "clip_higher"])
def test_killed_in_any_stage_resumes_to_the_same_final_sha256(tmp_path, monkeypatch, stage):
    straight = run_pipeline("demo_chain", tmp_path / "a", seed=5, common=TINY)

    from groupwise.trainer import Trainer

    original = Trainer.run_step

    def signalled(self):  # SIGTERM arrives during the stage's first step: the run checkpoints after it and stops
        row = original(self)
        if self.cfg.out_dir.name == stage and self.step == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return row

    monkeypatch.setattr(Trainer, "run_step", signalled)
    with pytest.raises(PipelineStopped, match=rf"stage {stage} stopped at step 1 .*rerun the same command"):
        run_pipeline("demo_chain", tmp_path / "b", seed=5, common=TINY)
    stopped = json.loads((tmp_path / "b" / "pipeline.json").read_text())
    assert [s["status"] for s in stopped["stages"]] == (["stopped"] if stage == "grpo" else ["finished", "stopped"])
    monkeypatch.setattr(Trainer, "run_step", original)
    resumed = run_pipeline("demo_chain", tmp_path / "b", seed=5, common=TINY)
    assert resumed["final_sha256"] == straight["final_sha256"]
    assert [s["final_sha256"] for s in resumed["stages"]] == [s["final_sha256"] for s in straight["stages"]]


def test_the_ledger_reads_no_held_out_row_and_names_what_each_stage_read(tmp_path):
    from groupwise.config import load_config
    from groupwise.tasks import load_splits

    # stage 2's reward weighs 0 (a stage that draws prompts without reading their labels)
    own = {"clip_higher": ['rewards=[{name = "exact", weight = 0.0}]']}
    result = run_pipeline("demo_chain", tmp_path / "p", seed=1, common=TINY, own=own)
    cfg, _ = load_config("demo", ["seed=1"])
    train, held, _ = load_splits(cfg.data, cfg.seed)
    held_keys = {row_key(r) for r in held}
    assert len(held_keys) == len(held) == 500  # the arithmetic task's held-out split: distinct rows
    for stage in result["stages"]:
        book = stage["ledger"]
        read = book["labelled"]["keys"] + book["unlabelled"]["keys"]
        assert read and not set(read) & held_keys, stage["name"]
        assert book["held_out_overlap"] == 0 and book["train_rows"] == len(train)
        # each key is the content of the train row at the recorded index
        for kind in ("labelled", "unlabelled"):
            assert book[kind]["keys"] == [row_key(train[i]) for i in book[kind]["indices"]]
    grpo, higher = _stages(result)["grpo"]["ledger"], _stages(result)["clip_higher"]["ledger"]
    # 2 steps x 4 prompts: at most 8 distinct prompts, read with a label in stage 1 and without in stage 2
    assert 0 < grpo["labelled"]["rows"] <= 8 and grpo["unlabelled"]["rows"] == 0 and grpo["reward_weights"] == [1.0]
    assert higher["labelled"]["rows"] == 0 and 0 < higher["unlabelled"]["rows"] <= 8
    assert higher["reward_weights"] == [0.0]


def test_a_reference_to_an_unknown_or_later_stage_fails_naming_it(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        '[[stages]]\nname = "a"\nrecipe = "demo"\n\n'
        '[[stages]]\nname = "b"\nrecipe = "demo"\noverrides = [\'model.path="${teacher}/final"\']\n'
    )
    with pytest.raises(
        PipelineError, match=r"refers to \$\{teacher\}, which is not an earlier stage .*earlier stages: a"
    ):
        load_pipeline(bad)
    later = tmp_path / "later.toml"
    later.write_text(
        '[[stages]]\nname = "a"\nrecipe = "demo"\noverrides = [\'model.path="${b}/final"\']\n\n'
        '[[stages]]\nname = "b"\nrecipe = "demo"\n'
    )
    with pytest.raises(PipelineError, match=r"\$\{b\}, which is not an earlier stage \(earlier stages: none\)"):
        load_pipeline(later)
    with pytest.raises(PipelineError, match="no pipeline file or shipped pipeline named 'nope'; shipped pipelines: "):
        load_pipeline("nope")
    with pytest.raises(PipelineError, match=r"stage 'x'; stages: grpo, clip_higher"):
        split_overrides(["x:train.steps=1"], ["grpo", "clip_higher"], "pipeline demo_chain")
    assert issubclass(PipelineError, ConfigError)  # the CLI prints it as one line
    assert "demo_chain" in shipped_pipelines()


def test_the_command_line_runs_and_reports_one_line_errors(tmp_path, capsys):
    assert cli.main(["pipeline", "demo_chain", "--seed", "2"]) == 2
    assert "--out DIR is required" in capsys.readouterr().err
    assert cli.main(["pipeline", str(tmp_path / "missing.toml"), "--out", str(tmp_path / "o")]) == 2
    assert "no pipeline file or shipped pipeline named" in capsys.readouterr().err
    argv = ["pipeline", "demo_chain", "--out", str(tmp_path / "o"), "--seed", "2", *TINY, "clip_higher:train.steps=1"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    record = json.loads((tmp_path / "o" / "pipeline.json").read_text())
    assert out["final_sha256"] == record["final_sha256"] and record["stages"][1]["steps"] == 1


def test_a_claim_config_may_be_a_pipeline_and_shared_stages_run_once_per_seed(tmp_path):
    """Two pipeline configs that differ only in their last stage share stage 1's run folder (same resolved
    config sha256); a recipe config beside them runs as before; the metrics come from the last stage."""
    from rich.console import Console

    from groupwise.claims.claimfile import fixed_fields, load_claim
    from groupwise.claims.report import run_claim

    claim_file = tmp_path / "99-pipeline-toy.toml"
    claim_file.write_text(
        'paper = "toy"\nclaim = "clip-higher after GRPO beats GRPO alone"\nmetric = "final_accuracy"\n'
        'direction = "greater"\nbaseline = "plain"\nexploratory_seeds = 1\n'
        f"common = {json.dumps(TINY)}\n\n"
        '[[configs]]\nlabel = "plain"\nrecipe = "demo"\n\n'
        '[[configs]]\nlabel = "chain"\npipeline = "demo_chain"\n\n'
        '[[configs]]\nlabel = "chain_lr"\npipeline = "demo_chain"\noverrides = ["update.lr=1e-4"]\n'
        'stage_overrides = {grpo = ["train.steps=1"]}\n\n'
        '[[configs]]\nlabel = "chain_b"\npipeline = "demo_chain"\noverrides = ["update.lr=1e-4"]\n'
        'stage_overrides = {grpo = ["train.steps=1"]}\n'
    )
    claim = load_claim(claim_file)
    assert [c.pipeline for c in claim.configs] == ["", "demo_chain", "demo_chain", "demo_chain"]
    assert fixed_fields(claim)["configs"][0] == {"label": "plain", "recipe": "demo", "overrides": []}  # as before
    commands = []

    def launch(argv, log):  # the child's command, run in this process
        commands.append(argv[3:])
        return cli.main(argv[3:])

    record = run_claim(claim, tmp_path / "runs", console=Console(quiet=True), launch=launch)
    assert [c[0] for c in commands] == ["train", "pipeline", "pipeline", "pipeline"] and record["failed"] == 0
    stages = sorted(p.name for p in (tmp_path / "runs" / claim.slug / "_stages").iterdir())
    # 3 pipelines x 2 stages, 4 run folders: grpo with 2 steps (chain) and with 1 step (chain_lr and chain_b),
    # clip_higher from the first at lr 2e-4 (chain) and from the second at lr 1e-4 (chain_lr and chain_b)
    assert [s.split("-")[0] for s in stages] == ["clip_higher", "clip_higher", "grpo", "grpo"]
    (chain_b,) = [
        json.loads(p.read_text()) for p in (tmp_path / "runs" / claim.slug).glob("chain_b/seed0/pipeline.json")
    ]
    (chain_lr,) = [
        json.loads(p.read_text()) for p in (tmp_path / "runs" / claim.slug).glob("chain_lr/seed0/pipeline.json")
    ]
    assert [s["folder"] for s in chain_b["stages"]] == [s["folder"] for s in chain_lr["stages"]]
    last = json.loads((Path(chain_b["stages"][-1]["folder"]) / "summary.json").read_text())
    assert last["steps"] == 2 and chain_b["stages"][0]["steps"] == 1
    assert record["summaries"]["chain_b"]["final_accuracy"].startswith(f"{last['accuracy_after']:.3f}")


def test_a_pipeline_config_of_a_claim_file_is_checked_naming_the_key(tmp_path):
    from groupwise.claims.claimfile import ClaimError, load_claim

    head = 'paper = "toy"\nclaim = "x beats y"\nmetric = "final_accuracy"\ndirection = "greater"\nbaseline = "a"\n'
    cases = {
        'recipe = "demo"\npipeline = "demo_chain"': "give exactly one of 'recipe' .* and 'pipeline'",
        'pipeline = "demo_chain"\nstage_overrides = {teacher = ["train.steps=1"]}': r"no stage 'teacher'; stages: grpo",
        'recipe = "demo"\nstage_overrides = {grpo = ["train.steps=1"]}': "stage_overrides belongs to a pipeline config",
        'pipeline = "nope"': "no pipeline file or shipped pipeline named 'nope'",
    }
    for i, (entry, error) in enumerate(cases.items()):
        path = tmp_path / f"9{i}-bad.toml"
        path.write_text(head + f'\n[[configs]]\nlabel = "a"\nrecipe = "demo"\n\n[[configs]]\nlabel = "b"\n{entry}\n')
        with pytest.raises(ClaimError, match=error):
            load_claim(path)
