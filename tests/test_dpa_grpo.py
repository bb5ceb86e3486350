"""Paper 47 DPA-GRPO: the game's rewards and pair advantages (spec 47's hand-worked cases), the exact
decision rates, the warm start's rows, and one step of the game on the embedded model."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest
import torch
from helpers import info_for, rollout_from

from groupwise.config import load_config
from groupwise.errors import ConfigError
from groupwise.registry import build
from groupwise.rollout.dpa_game import DPAGame, decision_probability, decision_rates, game_rewards
from groupwise.types import FORCED

RECIPE = Path(__file__).resolve().parents[1] / "src/groupwise/papers/47_dpa_grpo/recipes/dpa_grpo_inferred.toml"
game = importlib.import_module("groupwise.papers.47_dpa_grpo.verify_game")


def pair_advantages(rewards: torch.Tensor, scale: str = "group") -> torch.Tensor:
    """[M,2] rewards -> [M,2] advantages: the recipe's estimator (grpo, population std), eps 0."""
    est = build("advantage", "grpo", std="population", scale=scale, eps=0.0)
    return est(rollout_from(torch.zeros(*rewards.shape, 1), rewards=rewards.float()), info_for(1))


def test_spec_47_verifier_and_generator_pairs():
    # case 1, y0 wrong (c0 = 0), the challenged generator revises to the right total (c_rev = 1):
    #   R_V(silent) = 0, R_V(SAC) = 1 − 0.1 = 0.9; pair mean 0.45, std 0.45 -> A_V(SAC) = +1, A_V(silent) = −1
    #   R_G2(KEEP) = 0, R_G2(REVISE) = 1 − 0.05 = 0.95 -> A_G(REVISE) = +1
    # case 2, y0 right (c0 = 1), the generator keeps: R_V(silent) = 1, R_V(SAC) = 1 − 0.1 = 0.9 -> A_V(SAC) = −1
    c0, c_rev, revise = torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]), torch.tensor([True, False])
    r_silent, r_sac, r_keep, r_rev, c_sac = game_rewards(c0, c_rev, None, 0.1, 0.05, "sampled", revise)
    torch.testing.assert_close(r_silent, torch.tensor([0.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(r_sac, torch.tensor([0.9, 0.9], dtype=torch.float64))
    torch.testing.assert_close(r_rev, torch.tensor([0.95, 0.95], dtype=torch.float64))
    verifier = torch.stack([r_silent, r_sac], 1)  # [2,2] (silent, SAC)
    torch.testing.assert_close(pair_advantages(verifier), torch.tensor([[-1.0, 1.0], [1.0, -1.0]]))
    # scale = "none": R − mean_pair = ∓0.45 in case 1, ±0.05 in case 2
    torch.testing.assert_close(pair_advantages(verifier, "none"), torch.tensor([[-0.45, 0.45], [0.05, -0.05]]))
    generator = torch.stack([r_keep, r_rev], 1)[:1]  # case 1: (KEEP 0, REVISE 0.95)
    torch.testing.assert_close(pair_advantages(generator), torch.tensor([[-1.0, 1.0]]))


def test_expected_sac_outcome_weights_both_branches():
    # p_r = 0.8, c_rev = 1, c_keep = 0: c_sac = 0.8·1 + 0.2·0 = 0.8, R_V(SAC) = 0.8 − 0.1 = 0.7
    _, r_sac, _, _, c_sac = game_rewards(
        torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([0.8]), 0.1, 0.05, "expected"
    )
    assert c_sac.item() == pytest.approx(0.8) and r_sac.item() == pytest.approx(0.7)


def test_decision_probability_and_rates_are_exact():
    # π(yes) = 0.2, π(no) = 0.6: P(yes | one of the two) = 0.2 / 0.8 = 0.25
    p = decision_probability(torch.tensor([math.log(0.2)]), torch.tensor([math.log(0.6)]))
    assert p.item() == pytest.approx(0.25)
    # right y0 rows 0, 1 (silent 0.9, 0.7; revise 0.1, 0.3), wrong row 2 (silent 0.2; revise 0.6):
    # correct silence (0.9 + 0.7)/2 = 0.8, missed error 0.2, calibrated revision 0.6 − (0.1 + 0.3)/2 = 0.4
    rates = decision_rates(torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0.9, 0.7, 0.2]), torch.tensor([0.1, 0.3, 0.6]))
    assert rates["dpa/correct_silence"] == pytest.approx(0.8) and rates["dpa/missed_error"] == pytest.approx(0.2)
    assert rates["dpa/calibrated_revision"] == pytest.approx(0.4)
    assert math.isnan(decision_rates(torch.ones(1), torch.ones(1), torch.ones(1))["dpa/missed_error"])


def test_warm_start_rows_have_the_three_formats_and_only_train_pairs():
    rows = game.sft_rows("train", 300, 0)
    assert [r["format"] for r in rows[:3]] == ["generator", "verifier", "challenged"]
    held = {r["prompt"] for r in game.rows("test", 0)}
    assert all(r["prompt"].split("=")[0] + "=" not in held for r in rows)
    for r in rows:
        total = str(eval(r["prompt"].split("=")[0]))  # the row's a+b
        if r["format"] == "verifier":  # "a+b=y0?" -> "." iff y0 is right, else "!" + the total
            y0 = r["prompt"].split("=")[1][:-1]
            assert r["answer"] == ("." if y0 == total else "!" + total)
        elif r["format"] == "challenged":  # "a+b=y0!e>" -> "k" iff y0 is right, else "r" + the total
            y0 = r["prompt"].split("=")[1].split("!")[0]
            assert r["answer"] == ("k" if y0 == total else "r" + total)
    assert game.sft_rows("test", 0) == []


def test_options_are_checked():
    with pytest.raises(ConfigError, match="models='three'; use one of shared, separate"):
        DPAGame(models="three")
    with pytest.raises(ConfigError, match="sac_outcome"):
        DPAGame(sac_outcome="best")


def test_one_step_of_the_game_on_the_embedded_model(tmp_path):
    from groupwise.build import build as build_parts
    from groupwise.trainer import Trainer

    cfg, _ = load_config(
        str(RECIPE),
        ["phases=[]", "rollout.prompts_per_step=2", "rollout.group_size=2", "eval.size=0", f'out="{tmp_path}"'],
    )
    trainer = Trainer(build_parts(cfg))
    batch = trainer.collect()
    B, G = 2, 2
    N = int(batch.group_valid[:B].sum())  # first moves: one verifier pair and one generator pair each
    assert batch.shape[:2] == (B + 2 * N, 2) and N == B * G
    role, reward = batch.extras["game_role"], batch.extras["game_reward"]  # [B',2]
    assert role[:B].eq(0).all() and role[B : B + N].eq(1).all() and role[B + N :].eq(0).all()
    assert torch.equal(batch.rewards, reward)  # row_extra: each row's reward is its game reward
    forced = batch.flag(FORCED)
    assert not forced[:B].any() and forced[B:].all()
    texts = [batch.completions[k] for k in range(B, B + 2 * N)]
    assert all(t[0][:1] == "." and t[1][:1] == "!" for t in texts[:N])
    assert all(t[0][:1] == "k" and t[1][:1] == "r" for t in texts[N:])
    # the decision token is trained (train = "decision_and_content"): position 0 is in the loss of every forced row
    assert batch.loss_mask[B:, :, 0].all()
    # R_V(SAC) = c_sac − 0.1 and R_V(silent) = c(y0), with c(y0) the first move's reward
    c0 = batch.rewards[:B].flatten()  # [N] in (b, g) order, as the pairs are
    torch.testing.assert_close(batch.rewards[B : B + N, 0], c0)
    assert set(torch.round((batch.rewards[B : B + N, 1] + 0.1) * 100).tolist()) <= {0.0, 100.0}
    stats = trainer.strategy.step_stats()
    assert stats["dpa/first_accuracy"] == pytest.approx(float(c0.mean()))
    row = trainer.run_step()
    assert math.isfinite(row["loss"]) and {"dpa/correct_silence", "kl"} <= set(row)


def test_the_generator_only_baseline_trains_first_moves_alone(tmp_path):
    from groupwise.build import build as build_parts
    from groupwise.trainer import Trainer

    cfg, _ = load_config(
        str(RECIPE),
        ["phases=[]", "rollout.prompts_per_step=2", "rollout.group_size=2", "eval.size=0", f'out="{tmp_path}"',
         'rollout.params={play="first_move"}'],
    )  # fmt: skip
    trainer = Trainer(build_parts(cfg))
    batch = trainer.collect()
    assert batch.shape[:2] == (2, 2) and not batch.flag(FORCED).any()
    right = [[float(c.strip() == m["answer"]) for c in row] for row, m in zip(batch.completions, batch.meta)]
    assert batch.rewards.tolist() == right
    row = trainer.run_step()  # the verifier's KL term has no rows: it adds 0, not NaN
    assert math.isfinite(row["loss"])
