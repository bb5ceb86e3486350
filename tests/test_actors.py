"""Actors (M9, ``roles.NAME.samples = true``): roles that sample, are scored and train on their own batch
with their own tokenizer, through their first consumer, Mutual RL (spec 52, rollout ``mutual``)."""

from __future__ import annotations

import json

import pytest
import torch
from test_trainer import MODEL

from groupwise import roles
from groupwise.build import build as build_parts
from groupwise.config import load_config
from groupwise.errors import ConfigError
from groupwise.run import Run
from groupwise.trainer import Trainer
from groupwise.types import INJECTED

SMALL = ["rollout.prompts_per_step=4", "rollout.group_size=4", "eval.size=8", "threads=1"]


def mutual(out, *overrides):
    cfg, _ = load_config("mutual", [*SMALL, f'out="{out}"', *overrides])
    return Trainer(build_parts(cfg))


def test_two_actors_sample_score_and_train_with_their_own_tokenizers(tmp_path):
    trainer = mutual(tmp_path / "run", "train.steps=2", 'rollout.params.share="sgt"')
    peer = trainer.actors["peer"]
    assert trainer.roles == [] and peer.policy.tokenizer.get_vocab() != trainer.policy.tokenizer.get_vocab()
    receiver0 = {n: p.detach().clone() for n, p in trainer.policy.module.named_parameters()}
    peer0 = {n: p.detach().clone() for n, p in peer.policy.module.named_parameters()}
    seen = {}
    step_actor = trainer.step_actor

    def spy(actor, batch):
        seen["peer"] = batch
        return step_actor(actor, batch)

    trainer.step_actor = spy
    summary = Run(trainer).train()
    assert any(not torch.equal(p, receiver0[n]) for n, p in trainer.policy.module.named_parameters())
    assert any(not torch.equal(p, peer0[n]) for n, p in peer.policy.module.named_parameters())
    batch = seen["peer"]
    # the peer's rows are its own tokens: its prompts in its encoding, its completions in its decoding
    key = int(batch.prompt_index[0])
    assert batch.prompt_ids[0] == peer.policy.encode(trainer.train_rows[key]["prompt"])
    assert batch.completions == peer.policy.decode(batch)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["peer/ratio"] == pytest.approx(1.0) and rows[0]["peer/grad_norm"] > 0
    assert {"peer/reward_mean", "peer/reward/exact", "mutual/thl_residual", "mutual/rescued_groups"} <= set(rows[0])
    assert {"peer/accuracy_before", "peer/accuracy_after"} <= set(summary)
    assert (tmp_path / "run" / "final" / "peer" / "model.safetensors").exists()


def test_an_actor_identical_to_the_policy_takes_identical_steps(tmp_path):
    """The actor's path is the policy's: the same model, objective and estimator, sampling the same
    prompts with the same sample seeds, draws the same rows and must end every step with the same weights."""
    trainer = mutual(
        tmp_path / "run",
        f'model.path="{MODEL}"',
        f'roles.peer.model.path="{MODEL}"',
        'rollout.params.share="none"',
    )
    for step in range(3):
        trainer.step = step
        row = trainer.run_step()
        assert row["peer/loss"] == row["loss"] and row["peer/grad_norm"] == row["grad_norm"]
        assert row["peer/reward_mean"] == row["reward_mean"]
        for p, q in zip(trainer.policy.module.parameters(), trainer.actors["peer"].policy.module.parameters()):
            assert torch.equal(p, q)


def test_sgt_injects_retokenised_peer_successes(tmp_path):
    trainer = mutual(tmp_path / "run", 'rollout.params.share="sgt"', "rollout.prompts_per_step=16")
    collected = trainer.collect()
    own, peer = collected["policy"], collected["peer"]
    injected = own.flag(INJECTED)  # [B,G+1]
    G = trainer.cfg.rollout.group_size
    assert own.shape[1] == G + 1 and not injected[:, :G].any()
    rescued = injected[:, G].nonzero().flatten().tolist()
    assert rescued, "no group rescued: the peer solved nothing the receiver failed (pick another seed)"
    for b in rescued:
        assert not (own.rewards[b, :G] >= 1).any()  # the receiver failed the whole group
        assert own.rewards[b, G] == 1.0  # the rescued row, re-scored by the receiver's reward
        text = own.completions[b][G]
        assert text in peer.completions[b]  # a peer success, retokenised:
        n = int(own.mask[b, G].sum())
        assert own.actions[b, G, :n].tolist() == trainer.policy.encode_completion(text)
    std = own.extras["pooled_std"]  # [B] the augmented group's own statistics
    assert all(std[b] > 0 for b in rescued)


def test_actor_errors(tmp_path):
    with pytest.raises(ConfigError, match="an actor .samples = true. trains on its rows; it cannot be frozen"):
        load_config("mutual", ["roles.peer.frozen=true"])
    with pytest.raises(ConfigError, match="an actor .samples = true. is scored on its own rows"):
        load_config("mutual", ['roles.peer.rewards=["exact"]'])
    with pytest.raises(ConfigError, match='share="prp" .* add the weight'):
        mutual(tmp_path / "a", 'rollout.params.share="prp"')
    with pytest.raises(ConfigError, match="advantage component 'xgrpo' reads 'pooled_mean'"):
        mutual(tmp_path / "b", 'rollout.name="sample"', "rollout.params={}", "roles={}")
    with pytest.raises(ConfigError, match=r"'sample' samples with the actors \[\]; the run's actors .* \['peer'\]"):
        mutual(
            tmp_path / "b",
            'rollout.name="sample"',
            "rollout.params={}",
            'advantage.estimator="grpo"',
            'roles.peer.advantage.estimator="grpo"',
        )
    with pytest.raises(ConfigError, match=r"'mutual' samples with the actors \['nobody'\]"):
        mutual(tmp_path / "c", 'rollout.params.peer="nobody"')
    # what the build checks, the step checks again (a strategy whose batches do not match its actors)
    trainer = mutual(tmp_path / "d")
    trainer.strategy.peer = "nobody"
    with pytest.raises(ConfigError, match=r"actor 'nobody'; this run's actors are \['peer', 'policy'\]"):
        trainer.run_step()
    trainer.strategy.peer = "peer"
    with pytest.raises(ConfigError, match=r"returned batches for \['policy'\]; this run's actors are"):
        roles.actor_batches({"policy": trainer.collect()["policy"]}, trainer.actors, trainer.strategy)
    with pytest.raises(ConfigError, match=r"the run has actors \['peer'\] .* returned one batch"):
        roles.actor_batches(trainer.collect()["policy"], trainer.actors, trainer.strategy)


def test_resume_with_two_actors_is_exact(tmp_path):
    args = ["train.steps=4", "eval.size=0", "checkpoint.every=2", 'rollout.params.share="sgt"']
    straight = mutual(tmp_path / "a", *args)
    Run(straight).train()
    first = mutual(tmp_path / "b", *args)
    first.cfg.train.steps = 2
    Run(first).train()
    resumed = mutual(tmp_path / "b", *args)
    Run(resumed).train(resume_allow=["train.steps"])
    for module_a, module_b in (
        (straight.policy.module, resumed.policy.module),
        (straight.actors["peer"].policy.module, resumed.actors["peer"].policy.module),
    ):
        for (name, p), q in zip(module_a.named_parameters(), module_b.parameters()):
            assert torch.equal(p, q), name
    rows = [[json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()] for run in "ab"]
    assert [r["peer/loss"] for r in rows[0]] == [r["peer/loss"] for r in rows[1]] and len(rows[0]) == 4
    assert [r["reward_mean"] for r in rows[0]] == [r["reward_mean"] for r in rows[1]]


def test_dpa_grpo_two_model_form_gives_the_verifier_pairs_to_the_verifier_actor(tmp_path):
    """47 DPA-GRPO's ``models = "separate"``: the verifier's forced pairs are sampled by, scored for and
    trained on the actor ``verifier``; the policy's batch is the first moves and the challenged pairs."""
    from groupwise.heldout import HeldOut

    cfg, _ = load_config(
        "dpa_grpo_separate_inferred",
        ["phases=[]", "rollout.prompts_per_step=2", "rollout.group_size=2", "eval.size=4", f'out="{tmp_path}"'],
    )
    trainer = Trainer(build_parts(cfg))
    collected = trainer.collect()
    own, ver = collected["policy"], collected["verifier"]
    B = 2
    N = int(own.group_valid[:B].sum())  # every first move has one verifier pair and one generator pair
    assert own.shape[:2] == (B + N, 2) and ver.shape[:2] == (N, 2) and N == 4
    assert own.extras["game_role"].eq(0).all() and ver.extras["game_role"].eq(1).all()
    assert all(t[0][:1] == "." and t[1][:1] == "!" for t in ver.completions)
    assert all(t[0][:1] == "k" and t[1][:1] == "r" for t in own.completions[B:])
    verifier = trainer.actors["verifier"].policy
    y0 = own.completions[0][0].strip()
    assert ver.prompt_ids[0] == verifier.encode(f"{own.meta[0]['prompt']}{y0}?")  # in the verifier's encoding
    # R_V(silent) = c(y0), the first move's reward, in (b, g) order
    torch.testing.assert_close(ver.rewards[:, 0], own.rewards[:B].flatten())
    before = [p.detach().clone() for p in verifier.module.parameters()]
    row = trainer.run_step()
    assert {"verifier/loss", "verifier/kl", "kl", "dpa/correct_silence"} <= set(row)  # each its own KL to its own ref
    assert any(not torch.equal(p, q) for p, q in zip(verifier.module.parameters(), before))
    measures = HeldOut(trainer).evaluate_strategy()  # the greedy game, the verifier actor deciding
    assert 0.0 <= measures["game_accuracy"] <= 1.0 and "sac_rate" in measures
    with pytest.raises(ConfigError, match=r"'dpa_game' samples with the actors \['verifier'\]; the run's actors"):
        load_and_build("dpa_grpo_inferred", tmp_path / "x", 'rollout.params.models="separate"', "phases=[]")


def load_and_build(recipe, out, *overrides):
    cfg, _ = load_config(recipe, [*SMALL, f'out="{out}"', *overrides])
    return build_parts(cfg)


def test_an_actors_needs_are_read_from_its_own_model(tmp_path):
    # the peer's token weight sampler_is needs Need("logp"): in the peer's NeedResolver "policy" is the peer,
    # so logp_old is the peer model's own log-prob of its own tokens (== its sampling log-prob at temperature 1)
    trainer = mutual(
        tmp_path / "run",
        'rollout.params.share="none"',
        'roles.peer.objective.weights=[{name="sampler_is", mode="token_truncate", hi=2.0}]',
    )
    peer = trainer.actors["peer"]
    assert [n.key for n in peer.step_needs] == ["logp"]
    batch, _ = trainer.prepare_actor(peer, trainer.collect()["peer"])
    with torch.no_grad():
        own = peer.policy.forward(batch, ("logp",))["logp"]  # [B,G,T]
    mask = batch.row_mask
    torch.testing.assert_close(batch.logp_old[mask], own[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch.logp_sampler[mask], own[mask], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(batch.weight[mask], torch.ones_like(own[mask]), atol=1e-3, rtol=0)  # ρ = 1
