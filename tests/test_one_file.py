"""examples/grpo_in_one_file.py is the library's GRPO written out: on one rollout of the demo recipe
its rewards, advantages, log-probs, loss and gradient equal the library's plain path; it draws the
library's prompts and held-out problems, lays out sampled rows as the library does, and runs end to end."""

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from test_plain_path import PLAIN
from test_trainer import grads_after_one_update

from groupwise.build import build
from groupwise.config import load_config
from groupwise.policy.lm import DEFAULT_MODEL
from groupwise.trainer import Trainer
from groupwise.types import Request

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("grpo_in_one_file", ROOT / "examples" / "grpo_in_one_file.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def demo_trainer(tmp_path):
    """The demo recipe on the plain path (the model's own forward, padded rows), 8 prompts x 8 samples;
    seed 1 draws prompts of two lengths (seed 0's first 8 are all "ab+cd=")."""
    cfg, _ = load_config(
        "demo",
        [
            f'out="{tmp_path}"',
            'model.path="default"',
            "seed=1",
            "rollout.prompts_per_step=8",
            "eval.size=16",
            "threads=1",
            *PLAIN,
        ],
    )
    return Trainer(build(cfg))


def as_example_rows(rollout, pad_id: int):
    """The library's rollout [B,G,T] as the example's tensors [N,L], N = B*G, row b*G+g = completion g of
    prompt b: the prompt left-padded to the longest prompt P, then the completion, then padding (what
    ``sample`` returns for the same tokens)."""
    B, G, T = rollout.shape
    P = max(len(p) for p in rollout.prompt_ids)
    input_ids, attention_mask, completion_mask = [], [], []
    for b in range(B):
        prompt = list(rollout.prompt_ids[b])
        for g in range(G):
            n = int(rollout.mask[b, g].sum())
            left, right = P - len(prompt), T - n
            input_ids.append([pad_id] * left + prompt + rollout.actions[b, g, :n].tolist() + [pad_id] * right)
            attention_mask.append([0] * left + [1] * (len(prompt) + n) + [0] * right)
            completion_mask.append([False] * P + [True] * n + [False] * right)
    tensors = torch.tensor(input_ids), torch.tensor(attention_mask), torch.tensor(completion_mask)  # [N,L] x3
    return *tensors, P  # L = P + T


@pytest.mark.parametrize("policy", ["on", "off"])
def test_one_file_loss_and_gradient_equal_the_library(tmp_path, example, policy):
    # "on": the training case, logp_old = the first forward's detached log-probs (ratio 1; the loss is
    # then -mean(adv) over rows, ~0, so the value alone says little: the gradient carries the check).
    # "off": both get the same logp_old = logp + 0.3·noise, so ratios fall on both sides of the clip
    # [0.8, 1.2] and the loss is ~0.05: the clipped surrogate and its aggregation are compared too.
    trainer = demo_trainer(tmp_path)
    assert trainer.cfg.rollout.group_size == 8 and trainer.cfg.objective.agg == "seq_mean_token_mean"
    assert trainer.updater.max_grad_norm == 1.0
    ours, theirs = (
        example.adamw(copy.deepcopy(trainer.policy.module), 2e-4).defaults,
        trainer.updater.optimizer.defaults,
    )
    keys = ("lr", "betas", "eps", "weight_decay")  # the same AdamW (the demo's lr is 2e-4)
    assert {k: ours[k] for k in keys} == {k: theirs[k] for k in keys}
    model = copy.deepcopy(trainer.policy.module)  # the example's copy of the same weights
    rollout = trainer.collect()  # [B,G,T]
    B, G, T = rollout.shape

    # the same prompts: the example's prompt_batches draws the library's uniform sampler's rows
    drawn = next(example.prompt_batches(example.arithmetic_rows("train"), B, trainer.cfg.seed))
    assert [r["prompt"] for r in drawn] == [m["prompt"] for m in rollout.meta]
    # the same rewards: the example's exact_reward on the library's decoded completions
    texts = trainer.policy.decode(rollout)  # [B][G]
    rewards = [[example.exact_reward(texts[b][g], rollout.meta[b]["answer"]) for g in range(G)] for b in range(B)]
    torch.testing.assert_close(torch.tensor(rewards), rollout.rewards, rtol=0, atol=0)  # [B,G]
    assert 0 < rollout.rewards.mean() < 1

    trainer.prepare(rollout)
    adv = example.group_advantages(rollout.rewards)  # [B,G]
    assert rollout.advantages.abs().sum() > 0, "a rollout with no learning signal tests nothing"
    # float32 statistics here, float64 in the library: 0/1 rewards give the same advantages to 1 ulp
    torch.testing.assert_close(adv, rollout.advantages, rtol=2e-7, atol=1e-7)

    input_ids, attention_mask, completion_mask, P = as_example_rows(rollout, trainer.policy.tokenizer.pad_token_id)
    ragged = len(set(rollout.mask.sum(-1).flatten().tolist())) > 1 and len({len(p) for p in rollout.prompt_ids}) > 1
    assert ragged, "ragged prompts and completions exercise the padding"
    with torch.no_grad():
        logp_now = example.sequence_logprobs(model, input_ids, attention_mask, completion_mask)  # [N,L]
    logp_old = logp_now  # [N,L]
    if policy == "off":
        noise = 0.3 * torch.randn(logp_now.shape, generator=torch.Generator().manual_seed(0))  # [N,L]
        logp_old = torch.where(completion_mask, logp_now + noise, 0.0)  # [N,L]
        rollout.logp_old = logp_old[:, P:].reshape(B, G, T).clone()  # [B,G,T] the library takes a given logp_old as is
        ratio = torch.exp(logp_now - logp_old)[completion_mask]  # [K]
        sign = adv.reshape(-1, 1).expand_as(completion_mask)[completion_mask]  # [K]
        assert ((ratio < 0.8) & (sign < 0)).any() and ((ratio > 1.2) & (sign > 0)).any(), "both clips act"

    # the example: loss, backward, clip to max_grad_norm (what the library's AdamW step does before stepping)
    logp = example.sequence_logprobs(model, input_ids, attention_mask, completion_mask)  # [N,L]
    loss = example.grpo_loss(logp, logp_old, adv.reshape(-1), completion_mask, 0.2, 0.2)  # []
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # [] before clipping
    # the library: update on the plain path; grads_after_one_update captures the gradient AdamW steps with
    grads, stats = grads_after_one_update(trainer, rollout)

    # The two forwards differ only in layout (left- vs right-padded rows at the same positions) and the
    # losses in the order of their float32 sums. Seen on this batch: log-probs bit-equal; loss 0.0532079
    # both (1.1e-8 apart, 3 float32 ulps) off-policy, -3.7e-9 vs +3.7e-9 on-policy; gradients at most
    # 2.2e-8 apart (largest entry 0.079). Tolerances: log-probs 1e-6; loss rel 1e-6 off-policy, abs 1e-7
    # on-policy (a loss of ~0 has no relative scale); gradients atol 2e-7 + rtol 1e-5 (~10x the worst
    # difference seen, 2.5e-6 of the largest entry; a wrong std, aggregation, clip or mask moves them by
    # percents).
    if policy == "on":  # the library stored its first forward's log-probs as logp_old
        torch.testing.assert_close(logp_now[:, P:].reshape(B, G, T), rollout.logp_old, rtol=1e-6, atol=1e-6)
        assert loss.item() == pytest.approx(stats["loss"], abs=1e-7)
    else:
        assert abs(loss.item()) > 0.01, "an off-policy loss far from 0 (on-policy it is ~0 and compares little)"
        assert loss.item() == pytest.approx(stats["loss"], rel=1e-6, abs=0)
    assert norm.item() == pytest.approx(stats["grad_norm"], rel=1e-5)  # pre-clip norms
    assert norm.item() > 1.0, "the clip acts: the compared gradients are the clipped ones"
    named = dict(model.named_parameters())
    assert grads.keys() == named.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(named[name].grad, grad, rtol=1e-5, atol=2e-7, msg=lambda m: f"{name}: {m}")  # noqa: B023 (called at once, inside this iteration)


def test_one_file_sample_lays_out_rows_as_the_library(tmp_path, example):
    # Greedy decoding is deterministic, so the example's sample() and the library's engine must write
    # the same tokens; the example's layout (left-padded prompt, completion, mask up to and including
    # EOS) must then be the library's rollout converted by as_example_rows.
    trainer = demo_trainer(tmp_path)
    rows = example.arithmetic_rows("test")[:64]
    # the library's held-out split
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in trainer.parts.eval_rows[:64]]
    requests = [Request(key=i, n=1, prompt=trainer.policy.encode(r["prompt"])) for i, r in enumerate(rows)]
    greedy = {**trainer.sampling_params, "greedy": True}
    library = trainer.policy.generate(requests, greedy, trainer.info())  # [64,1,T]
    prompts, max_new = [r["prompt"] for r in rows], trainer.cfg.rollout.max_new_tokens
    input_ids, attention_mask, completion_mask, texts = example.sample(
        trainer.policy.module, trainer.policy.tokenizer, prompts, 1, max_new, greedy=True
    )  # [64,L] x3
    want_ids, want_attention, want_completion, _ = as_example_rows(library, trainer.policy.tokenizer.pad_token_id)
    lengths = library.mask.sum(-1).flatten()  # [64]
    assert len({len(p) for p in prompts}) > 1 and (lengths < library.shape[2]).any(), "ragged prompts, an EOS"
    assert torch.equal(input_ids, want_ids) and torch.equal(attention_mask, want_attention)
    assert torch.equal(completion_mask, want_completion)
    assert texts == [t[0] for t in trainer.policy.decode(library)]


def test_one_file_runs_and_evaluates_like_the_library(example, capsys):
    # Greedy accuracy on the first 100 held-out problems of the untrained model: the warm start measured
    # it with the library's own engine and split (models/default/warmstart.json). Equal: the same split,
    # prompt format, greedy decoding and reward.
    expected = json.loads((DEFAULT_MODEL / "warmstart.json").read_text())["test_greedy_accuracy_first_100"]
    out = example.main(
        [
            "--steps",
            "3",
            "--prompts",
            "4",
            "--group",
            "4",
            "--eval-size",
            "100",
            "--eval-every",
            "2",
            "--log-every",
            "1",
            "--threads",
            "1",
        ]
    )
    assert out["accuracy_before"] == pytest.approx(expected, abs=1e-9)
    assert out["steps"] == len(out["history"]) == 3
    for row in out["history"]:
        assert 0.0 <= row["reward"] <= 1.0 and torch.isfinite(torch.tensor([row["loss"], row["grad_norm"]])).all()
    assert any(row["grad_norm"] > 0 for row in out["history"]), "some step had a learning signal"
    printed = capsys.readouterr().out
    assert "step    2  held-out greedy accuracy" in printed
    assert f"{expected:.3f} -> {out['accuracy_after']:.3f}" in printed
