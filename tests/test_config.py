"""Config loading, overrides and the errors a user sees for bad keys or names."""

import tomllib

import pytest

from groupwise.config import Config, _from_dict, load_config, parse_value, to_dict, to_toml
from groupwise.registry import ConfigError, build, build_spec


def test_overrides_are_toml_values():
    cfg, _ = load_config(None, ["train.steps=7", "rollout.temperature=0.5", 'objective.terms=[{name="ppo_clip", eps_high=0.28}]', "name=abc"])
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
    from groupwise.config import RECIPES

    for path in sorted(RECIPES.glob("*.toml")):
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
