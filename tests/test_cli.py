"""The command line a new user meets first: `train --help`, `eval --help` and `cp` (issue 13)."""

from __future__ import annotations

from groupwise import cli
from groupwise.config import RECIPES, load_config, shipped_recipes
from groupwise.run import Run


def test_train_and_eval_help(capsys):
    """Before: `--help` was taken for a recipe name / a model path and failed."""
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: groupwise train [RECIPE]") and "--resume-allow" in out and "flash_grpo" in out
    assert cli.main(["eval", "-h"]) == 0
    assert capsys.readouterr().out.startswith("usage: groupwise eval [MODEL | RUN]")


def test_cp_copies_a_shipped_recipe_that_then_loads(tmp_path, capsys):
    target = tmp_path / "mine.toml"
    assert cli.main(["cp", "demo", str(target)]) == 0
    assert target.read_text() == (RECIPES / "demo.toml").read_text()
    cfg, _ = load_config(str(target), [])
    assert cfg.name == "demo"
    assert cli.main(["cp", "demo", str(target)]) == 2  # never overwrites without --force
    assert "exists; add --force" in capsys.readouterr().err
    # a folder: keeps the name
    assert cli.main(["cp", "demo", str(tmp_path)]) == 0 and (tmp_path / "demo.toml").exists()
    assert cli.main(["cp", "nope", str(target)]) == 2 and "shipped recipes:" in capsys.readouterr().err


def test_eval_of_a_run_folder_uses_the_runs_settings_and_final_model(tmp_path, capsys):
    """Before: `groupwise eval runs/x` treated the folder as a model path and evaluated on the default task."""
    import json

    from test_trainer import make_trainer

    run = tmp_path / "run"
    summary = Run(
        make_trainer(run, "train.steps=2", "eval.size=12", 'data.task="countdown"', "rollout.max_new_tokens=8")
    ).train()
    capsys.readouterr()
    assert cli.main(["eval", str(run)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["task"] == "countdown" and result["eval_size"] == 12
    assert result["accuracy"] == summary["accuracy_after"]  # the same model on the same held-out rows


def test_a_reader_that_leaves_early_is_not_an_error(monkeypatch):
    import io
    import os

    # `groupwise explain X | head -1` once head has exited: every write to stdout is a broken pipe
    read_end, write_end = os.pipe()
    os.close(read_end)
    closed = io.TextIOWrapper(io.FileIO(write_end, "w"), line_buffering=True)
    monkeypatch.setattr("sys.stdout", closed)
    assert cli.main(["explain", "grpo"]) == 0
    closed.write("x\n")  # the fd now points at /dev/null: the interpreter's last flush cannot fail
    closed.close()


def test_explain_a_recipe_lists_its_components_and_its_file(capsys):
    """Before: `groupwise explain demo` was "no component named 'demo'"."""
    assert cli.main(["explain", "demo"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("== recipe · demo")
    lines = [line.strip() for line in out.splitlines()]
    for stage, name, where in (
        ("sampling", "uniform", "sampling"),
        ("rollout", "sample", "rollout"),
        ("reward", "exact", "the default reward of task 'arithmetic'"),
        ("advantage", "grpo", "advantage.estimator"),
        ("objective", "ppo_clip", "objective.terms[0]"),
        ("aggregation", "seq_mean_token_mean", "objective.agg"),
        ("update", "adamw", "update"),
    ):
        assert any(line.startswith(f"{stage} · {name}  [{where}]") for line in lines), (stage, name)
    assert "lr = 0.0002, max_grad_norm = 1.0" in lines  # the parameters the recipe sets
    assert (RECIPES / "demo.toml").read_text().rstrip() in out  # its config, comments included


def test_explain_a_name_that_is_a_component_and_a_recipe_shows_both(capsys):
    assert cli.main(["explain", "lora_placement"]) == 0
    out = capsys.readouterr().out
    component, recipe = out.index("== update · lora_placement"), out.index("== recipe · lora_placement")
    assert component < recipe
    lines = [line.strip() for line in out[recipe:].splitlines()]
    assert any(line.startswith("update · lora_placement  [update]") for line in lines)
    assert any(line.startswith("update · adamw  [update.inner]") for line in lines)  # the updater nested in it
    assert any(line.startswith("phase · lora_placement_probe  [phases[0]]") for line in lines)


def test_explain_an_unknown_name_suggests_components_and_recipes(capsys):
    assert cli.main(["explain", "lora_placemnt"]) == 2
    err = capsys.readouterr().err
    assert "no component or recipe named 'lora_placemnt'" in err
    assert "lora_placement (component)" in err and "lora_placement (recipe)" in err
    assert cli.main(["explain", "dem"]) == 2 and "demo (recipe)" in capsys.readouterr().err


def test_every_shipped_recipe_explains():
    """Each component a shipped recipe names resolves in the registry (what `explain RECIPE` prints)."""
    from groupwise.config import component_entries
    from groupwise.registry import lookup

    for path in shipped_recipes().values():  # recipes/ and every papers/NN_slug/recipes/
        entries = component_entries(load_config(path.stem)[0])
        assert {stage for stage, _, _ in entries} >= {
            "sampling",
            "rollout",
            "advantage",
            "objective",
            "aggregation",
            "update",
        }, path.stem
        for stage, spec, _where in entries:
            lookup(stage, spec if isinstance(spec, str) else spec["name"])
