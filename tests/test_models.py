"""The embedded default model: tokenizer, architecture presets, the shipped checkpoint, the warm start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from groupwise.models import warmstart
from groupwise.models.build import (
    EOS_TOKEN,
    PRESETS,
    build_model,
    count_parameters,
    default_tokenizer_corpus,
    save_pretrained,
    train_tokenizer,
)
from groupwise.tasks import get_task

SHIPPED = warmstart.DEFAULT_OUT
TASK_STRINGS = [
    "37+45=82",
    "0+0=0",
    "99+99=198",
    "nums 3 5 7 target 22:3*5+7",
    "sort 5 2 9:2 5 9",
    "  two  spaces, (parens) [brackets] {braces} 'quotes' \"double\" back\\slash\ttab\nnewline ~`!@#$%^&|<>?/;",
    "".join(chr(code) for code in range(32, 127)),  # all printable ASCII
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(default_tokenizer_corpus())


@pytest.fixture(scope="module")
def shipped_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SHIPPED, local_files_only=True)


@pytest.fixture(scope="module")
def shipped_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(SHIPPED, local_files_only=True).eval()


# ------------------------------------------------------------------------------------------ tokenizer


@pytest.mark.parametrize("text", TASK_STRINGS)
def test_tokenizer_round_trips_task_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_tokenizer_splits_digits_into_single_tokens(tokenizer):
    text = "1234567890+98765=1111"
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode(text, add_special_tokens=False)]
    assert pieces == list(text)
    # A digit is never merged with a neighbour, wherever it stands.
    for piece in (
        tokenizer.decode([i]) for i in tokenizer.encode("nums 13 25 target 38:13+25", add_special_tokens=False)
    ):
        assert not any(ch.isdigit() for ch in piece) or len(piece) == 1


def test_tokenizer_special_tokens_and_size(tokenizer):
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.bos_token is None
    assert tokenizer.encode("1+2=", add_special_tokens=True) == tokenizer.encode("1+2=", add_special_tokens=False)
    assert 257 <= len(tokenizer) <= 512
    assert tokenizer.decode([tokenizer.eos_token_id]) == EOS_TOKEN


def test_tokenizer_training_is_deterministic(tokenizer):
    assert train_tokenizer(default_tokenizer_corpus()).get_vocab() == tokenizer.get_vocab()


def test_saved_tokenizer_reloads_with_identical_ids(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    save_pretrained(build_model(len(tokenizer), "tiny", eos_token_id=tokenizer.eos_token_id), tokenizer, tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    for text in TASK_STRINGS:
        assert reloaded.encode(text) == tokenizer.encode(text)
        assert reloaded.decode(reloaded.encode(text)) == text
    assert reloaded.eos_token_id == reloaded.pad_token_id == tokenizer.eos_token_id


# ------------------------------------------------------------------------------------------ presets


@pytest.mark.parametrize(
    "preset, low, high",
    [("tiny", 0.5e6, 1.5e6), ("small", 6e6, 10e6), ("medium", 25e6, 35e6)],
)
def test_preset_parameter_counts(preset, low, high):
    model = build_model(319, preset)
    assert low <= count_parameters(model) <= high
    assert model.config.tie_word_embeddings
    assert model.config.model_type == "qwen3"


def test_presets_are_listed():
    assert {"tiny", "small", "medium"} <= set(PRESETS)


def test_build_model_is_seeded():
    first, second = build_model(300, "tiny", seed=3), build_model(300, "tiny", seed=3)
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------ shipped model


def test_shipped_folder_is_complete_and_small():
    names = {path.name for path in SHIPPED.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "warmstart.json",
    } <= names
    assert sum(path.stat().st_size for path in SHIPPED.rglob("*") if path.is_file()) <= 20 * 2**20


def test_shipped_tokenizer_matches_a_fresh_build(shipped_tokenizer, tokenizer):
    for text in TASK_STRINGS:
        assert shipped_tokenizer.encode(text) == tokenizer.encode(text)
        assert shipped_tokenizer.decode(shipped_tokenizer.encode(text)) == text


def test_shipped_model_loads_offline(shipped_model, shipped_tokenizer):
    config = shipped_model.config
    assert config.model_type == "qwen3"
    assert config.vocab_size == len(shipped_tokenizer)
    assert config.eos_token_id == shipped_tokenizer.eos_token_id
    assert shipped_model.generation_config.eos_token_id == shipped_tokenizer.eos_token_id
    ids = torch.tensor([shipped_tokenizer.encode("12+34=")])  # [1, P]
    with torch.no_grad():
        logits = shipped_model(input_ids=ids).logits  # [1, P, V]
    assert logits.shape == (1, ids.shape[1], len(shipped_tokenizer))
    assert torch.isfinite(logits).all()


def test_shipped_model_is_partially_accurate(shipped_model, shipped_tokenizer):
    record = json.loads((SHIPPED / "warmstart.json").read_text())
    rows = get_task("arithmetic").rows("test", 100, 0)
    accuracy = warmstart.greedy_accuracy(shipped_model, shipped_tokenizer, rows)
    assert 0.05 < accuracy < 0.60
    assert abs(accuracy - record["test_greedy_accuracy_first_100"]) <= 0.03
    assert 0.05 < record["test_greedy_accuracy"] < 0.60
    assert record["test_pass_at_8_t1"] >= 0.5


def test_batched_greedy_matches_generate(shipped_model, shipped_tokenizer):
    """The bucketed KV-cache decoder agrees with ``model.generate`` on single prompts."""
    rows = get_task("arithmetic").rows("test", 6, 0)
    ours = warmstart.generate(shipped_model, shipped_tokenizer, [row["prompt"] for row in rows], max_new_tokens=5)
    for row, (completion,) in zip(rows, ours):
        ids = torch.tensor([shipped_tokenizer.encode(row["prompt"])])  # [1, P]
        out = shipped_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
        new = out[0, ids.shape[1] :].tolist()  # [T]
        if shipped_tokenizer.eos_token_id in new:
            new = new[: new.index(shipped_tokenizer.eos_token_id)]
        assert shipped_tokenizer.decode(new) == completion


# ------------------------------------------------------------------------------------------ warm start


def test_short_warmstart_runs_end_to_end(tmp_path: Path):
    out = tmp_path / "model"
    record = warmstart.run(
        [
            "--out",
            str(out),
            "--max-steps",
            "6",
            "--eval-every",
            "3",
            "--batch-size",
            "8",
            "--train-size",
            "64",
            "--val-size",
            "16",
            "--test-size",
            "16",
            "--k",
            "2",
            "--seed",
            "1",
            "--quiet",
        ]
    )
    assert record["steps"] <= 6
    twin = warmstart.run(
        [
            "--out",
            str(tmp_path / "twin"),
            "--max-steps",
            "6",
            "--eval-every",
            "3",
            "--batch-size",
            "8",
            "--train-size",
            "64",
            "--val-size",
            "16",
            "--test-size",
            "16",
            "--k",
            "2",
            "--seed",
            "1",
            "--quiet",
        ]
    )
    assert twin["steps"] == record["steps"]
    # deterministic
    assert (tmp_path / "twin" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert (
        warmstart.main(
            [
                "--out",
                str(tmp_path / "again"),
                "--max-steps",
                "1",
                "--train-size",
                "8",
                "--val-size",
                "4",
                "--test-size",
                "4",
                "--k",
                "1",
                "--quiet",
            ]
        )
        == 0
    )
    saved = json.loads((out / "warmstart.json").read_text())
    assert saved["seed"] == 1
    assert saved["command"].startswith("groupwise warmstart --out")
    for key in (
        "test_greedy_accuracy",
        "test_sample_accuracy_t1",
        "test_pass_at_2_t1",
        "train_seconds",
        "wall_seconds",
    ):
        assert key in saved

    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(out, local_files_only=True)
    AutoModelForCausalLM.from_pretrained(out, local_files_only=True)


def test_shipped_models_resolve_by_name_and_the_hinted_one_reads_a_hint(tmp_path):
    """`model.path="hinted"` is the shipped hint-trained model; a bare name that is no shipped folder
    stays a hub id / path; the hinted model scores the right answer higher with the hint than without."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from groupwise.policy.lm import DEFAULT_MODEL, resolve_model_path

    assert resolve_model_path("hinted") == str(DEFAULT_MODEL.parent / "hinted")
    assert resolve_model_path("not-a-shipped-model") == "not-a-shipped-model"
    path = resolve_model_path("hinted")
    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)

    def answer_logp(prompt: str, answer: str) -> float:
        p, a = tok(prompt)["input_ids"], tok(answer)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([p + a])).logits[0, len(p) - 1 : len(p) + len(a) - 1].log_softmax(-1)
        return float(logits.gather(1, torch.tensor(a)[:, None]).sum())

    plain = answer_logp("37+45=", "82")
    hinted = answer_logp("Reference solution: 82\n37+45=", "82")
    assert hinted > plain + 0.5, (plain, hinted)
