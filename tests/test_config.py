"""Config loading, overrides and the errors a user sees for bad keys or names."""

import tomllib

import pytest

from groupwise.config import Config, _from_dict, load_config, parse_value, to_dict, to_toml
from groupwise.errors import ConfigError
from groupwise.registry import build, build_spec


def test_overrides_are_toml_values():
    cfg, _ = load_config(
        None,
        ["train.steps=7", "rollout.temperature=0.5", 'objective.terms=[{name="ppo_clip", eps_high=0.28}]', "name=abc"],
    )
    assert cfg.train.steps == 7 and cfg.rollout.temperature == 0.5 and cfg.name == "abc"
    assert cfg.objective.terms == [{"name": "ppo_clip", "eps_high": 0.28}]
    assert parse_value("runs/x") == "runs/x"  # not TOML: kept as a string
    assert parse_value("[1, 2]") == [1, 2]


def test_unknown_top_level_key_names_valid_keys():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trian.steps=3"])
    assert "'trian'" in str(err.value) and "did you mean train" in str(err.value) and "rollout" in str(err.value)


def test_unknown_nested_key_suggests_close_name():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.grup_size=3"])
    assert "rollout.group_size" in str(err.value)


def test_malformed_override():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["train.steps"])


def test_unknown_component_and_parameter():
    with pytest.raises(ConfigError) as err:
        build("advantage", "grp")
    assert "did you mean" in str(err.value) and "grpo" in str(err.value)
    with pytest.raises(ConfigError) as err:
        build_spec("objective", {"name": "ppo_clip", "eps_hgh": 0.3})
    assert "eps_hgh" in str(err.value) and "eps_high" in str(err.value)
    with pytest.raises(ConfigError, match="needs a 'name'"):
        build_spec("objective", {"coef": 1.0})


def test_shipped_recipes_load_and_build():
    from groupwise.config import shipped_recipes

    for path in shipped_recipes().values():  # recipes/ and every papers/NN_slug/recipes/
        cfg, _ = load_config(str(path))
        build_spec("advantage", cfg.advantage.estimator)
        for term in cfg.objective.terms:
            build_spec("objective", term)
        for reward in cfg.rewards:
            build_spec("reward", reward)
        build_spec("sampling", cfg.sampling)
        build_spec("update", cfg.update)


def test_unknown_recipe_lists_shipped_ones():
    with pytest.raises(ConfigError) as err:
        load_config("no-such-recipe")
    assert "grpo" in str(err.value)


def test_resolved_config_round_trips_through_toml():
    cfg, _ = load_config("dapo", ["train.steps=3"])
    again = _from_dict(Config, tomllib.loads(to_toml(to_dict(cfg))), "")
    assert again == cfg


@pytest.mark.parametrize(
    "override,words",
    [
        ('rollout.group_size="eight"', ["rollout.group_size", "an integer", "'eight'"]),
        ("rollout.group_size=0", ["rollout.group_size=0", ">= 1"]),
        ("rollout.temperature=0", ["rollout.temperature=0", "> 0"]),
        ("rollout.temperature=-1.5", ["rollout.temperature=-1.5"]),
        ("train.steps=true", ["train.steps", "an integer", "True"]),
        ("checkpoint.keep_last=0", ["checkpoint.keep_last=0"]),
    ],
)
def test_bad_values_name_the_key_the_value_and_what_is_allowed(override, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_component_parameters_are_type_checked():
    with pytest.raises(ConfigError, match=r"update 'adamw' parameter lr must be a number, got '1e-4' \(str\)"):
        build_spec("update", {"name": "adamw", "lr": "1e-4"})
    with pytest.raises(ConfigError, match="eps_high must be a number"):
        build_spec("objective", {"name": "ppo_clip", "eps_high": True})
    assert build_spec("update", {"name": "adamw", "lr": 1}).lr == 1  # an integer is a number
    assert build_spec("objective", {"name": "ppo_clip", "dual_clip": None}).dual_clip is None
    # a schedule table is allowed
    assert build_spec("objective", {"name": "kl", "coef": {"schedule": "linear", "end": 0.1}}).coef == 0.0


def test_group_size_one_with_a_group_relative_advantage_is_refused(tmp_path):
    from test_trainer import make_trainer

    with pytest.raises(ConfigError, match="group_size=1 with the group-relative advantage 'grpo'"):
        make_trainer(tmp_path, "rollout.group_size=1")
    make_trainer(tmp_path, "rollout.group_size=1", 'advantage.estimator="sign"')  # a fixed reference needs no group


def test_a_missing_model_is_one_line_naming_model_path(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "groupwise", "train", "model.path=/no/such/model", "train.steps=1", f"out={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "model.path='/no/such/model' is not a local model folder" in result.stderr and "default" in result.stderr


def test_the_reward_tables_the_docs_show_parse(tmp_path):
    """Before: `explain code` and docs/sandbox.md showed `[[reward]]`, which the config refuses; the
    shown block, as written, must load."""
    import re
    from pathlib import Path

    import groupwise.rewards.code as code_module

    block = re.search(r"(\[\[rewards\]\]\n(?:    .*\n)+)", code_module.__doc__).group(1)
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "t"\n' + "\n".join(line.removeprefix("    ") for line in block.splitlines()) + "\n")
    cfg, _ = load_config(str(recipe), [])
    assert cfg.rewards[0]["name"] == "code" and cfg.rewards[0]["column"] == "tests"
    docs = (Path(__file__).resolve().parents[1] / "docs" / "sandbox.md").read_text()
    assert "[[reward]]" not in docs and "[[rewards]]" in docs


def test_the_config_reference_is_current():
    """docs/config.md is generated from the dataclasses (`groupwise config > docs/config.md`): every
    key is there with its default and a meaning, and the page matches the code."""
    from pathlib import Path

    from groupwise.config import reference_markdown

    text = reference_markdown()
    assert (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text().strip() == text.strip(), (
        "regenerate: groupwise config > docs/config.md"
    )
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) > 60 and all(not line.endswith("|  |") for line in rows), [
        line for line in rows if line.endswith("|  |")
    ]
    assert "| `group_size` | `int` | `8` |" in text and "## `[roles.NAME]`" in text


def test_strings_with_newlines_and_control_characters_survive_the_stored_config():
    # a run folder's config.toml must read back as the config it was written from (FBOS's template has "\n")
    import tomllib

    from groupwise.config import toml_value

    for text in ["{completion}: {feedback}\n{prompt}", "tab\there", 'say "hi"', "back\\slash", "bell\x07", "crlf\r\n"]:
        assert tomllib.loads("k = " + toml_value(text))["k"] == text
