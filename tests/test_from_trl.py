"""docs/from-trl.md stays true: its Python example runs as written, its TOML recipe loads with the
values its comments name, and every GRPOConfig field and component its table names exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import groupwise
from groupwise.registry import entries

DOC = Path(__file__).resolve().parents[1] / "docs" / "from-trl.md"


def _block(lang: str) -> str:
    return re.search(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S).group(1)


def test_the_python_example_runs(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", _block("python")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps, labels = result.stdout.strip().splitlines()[-1].split(" ", 1)
    assert steps == "2" and "my_rewards.py:correct" in labels  # the user's function logged under its own label


def test_the_recipe_loads_with_the_values_its_comments_name(tmp_path):
    text = _block("toml")
    tomllib.loads(text)  # valid TOML
    (tmp_path / "my.toml").write_text(text)
    cfg = groupwise.load_config(str(tmp_path / "my.toml"))
    assert (cfg.seed, cfg.rollout.group_size, cfg.rollout.prompts_per_step, cfg.objective.agg) == (
        42,
        8,
        16,
        "token_mean",
    )
    assert cfg.update["betas"] == [0.9, 0.999] and cfg.update["schedule"] == "linear"
    kl = next(t for t in cfg.objective.terms if isinstance(t, dict) and t["name"] == "kl")
    assert kl["bias_correction"] is True and cfg.checkpoint.every == 50


def test_every_field_and_component_in_the_table_exists():
    table = [line for line in DOC.read_text().splitlines() if line.startswith("| `")]
    fields = {f for line in table for f in re.findall(r"`([a-z_0-9*]+)`", line.split("|")[1])}
    components = {name for _, name, _ in entries()}
    mapped = " ".join(line.split("|")[2] + line.split("|")[3] for line in table)
    named = {
        "grpo",
        "gdpo",
        "gspo",
        "kl",
        "ppo_clip",
        "cispo",
        "sapo",
        "luspo",
        "vespo",
        "mask_truncated",
        "top_entropy",
        "entropy_bonus",
        "target_entropy",
        "sampler_is",
        "token_mean",
        "constant",
        "seq_mean_token_mean",
        "uniform",
    }
    # the table names each of them ...
    assert named - {w for span in re.findall(r"`([^`]+)`", mapped) for w in re.findall(r"[a-z_]+", span)} == set()
    assert named - components == set()  # ... and each is a registered component
    trl = pytest.importorskip("trl")
    known = set(trl.GRPOConfig.__dataclass_fields__) | {"peft_config"}
    stated = {f for f in fields if "*" not in f and f not in ("_mode", "_clip_max", "_clip_min")}
    assert stated - known == set(), f"fields not in TRL's GRPOConfig: {sorted(stated - known)}"


def test_the_table_has_a_row_for_every_grpo_config_field():
    """Issue 36: every field GRPOConfig defines itself (TRL 1.16: 77), and every TrainingArguments field
    whose default it changes, is named in the table's first column, mapped or "not supported, because"."""
    trl = pytest.importorskip("trl")
    import dataclasses

    from transformers import TrainingArguments

    table = [line for line in DOC.read_text().splitlines() if line.startswith("| `")]
    named = {f for line in table for f in re.findall(r"`([a-z_0-9]+)`", line.split("|")[1])}
    base = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    own = {f.name for f in dataclasses.fields(trl.GRPOConfig) if f.name not in base}
    changed = {
        f.name
        for f in dataclasses.fields(trl.GRPOConfig)
        if f.name in base and f.default is not dataclasses.MISSING and f.default != base[f.name].default
    }
    assert own - named == set(), f"GRPOConfig fields without a row: {sorted(own - named)}"
    assert changed - named == set(), (
        f"TrainingArguments defaults GRPOConfig changes, without a row: {sorted(changed - named)}"
    )
