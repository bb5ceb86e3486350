"""The tokenizer layer (groupwise.tokens): retokenize, align from the tokenizers' own offsets, residual."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from groupwise import tokens
from groupwise.models.build import default_tokenizer_corpus, train_tokenizer
from groupwise.policy.kinds import build_policy


def _merged_tokenizer() -> PreTrainedTokenizerFast:
    """A BPE whose two merges join '1'+'2' and '+'+'7' (the library applies them and reports offsets)."""
    vocab = {"1": 0, "2": 1, "+": 2, "7": 3, "12": 4, "+7": 5}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("1", "2"), ("+", "7")]))
    return PreTrainedTokenizerFast(tokenizer_object=core)


def _per_digit_tokenizer() -> PreTrainedTokenizerFast:
    return train_tokenizer(default_tokenizer_corpus(n_per_format=50))


def test_spec52_twelve_plus_seven():
    # spec 52: "12+7" as ['1','2','+','7'] (per-digit) and ['12','+7'] (merged):
    # '12' covers characters 0..2 = per-digit tokens 0, 1; '+7' covers 2..4 = tokens 2, 3
    text = "12+7"
    digit, merged = _per_digit_tokenizer(), _merged_tokenizer()
    assert digit.convert_ids_to_tokens(digit(text, add_special_tokens=False)["input_ids"]) == ["1", "2", "+", "7"]
    assert merged.convert_ids_to_tokens(merged(text, add_special_tokens=False)["input_ids"]) == ["12", "+7"]
    alignment = tokens.align(tokens.offsets(merged, text), tokens.offsets(digit, text))
    assert alignment == [[0, 1], [2, 3]]
    # neither merged token has a 1:1 counterpart
    assert tokens.residual(alignment) == 1.0
    # the other direction: each digit token lies inside exactly one merged token, which it shares
    back = tokens.align(tokens.offsets(digit, text), tokens.offsets(merged, text))
    assert back == [[0], [0], [1], [1]]
    assert tokens.residual(back) == 1.0


def test_residual_counts_one_to_one_spans():
    # tokens 0 and 2 map 1:1; token 1 maps to two targets; token 3 shares target 4 with token 4
    alignment = [[0], [1, 2], [3], [4], [4]]
    assert tokens.residual(alignment) == pytest.approx(1 - 2 / 5)
    assert tokens.residual([[0], [1], [2]]) == 0.0  # equal tokenizations
    assert tokens.residual([]) == 0.0
    assert tokens.align([(0, 0), (0, 2)], [(0, 1), (1, 2)]) == [[], [0, 1]]  # an empty span maps to nothing


def test_text_residual_weights_tokens():
    digit, merged = _per_digit_tokenizer(), _merged_tokenizer()
    # "12+7": 2 merged tokens, both unmatched; "7": '7' in both, 1:1 → 2 of 3 source tokens unmatched
    assert tokens.text_residual(merged, digit, ["12+7", "7"]) == pytest.approx(2 / 3)
    assert tokens.text_residual(digit, digit, ["12+7"]) == 0.0


def test_split_digits_false_merges_digit_runs():
    corpus = default_tokenizer_corpus(n_per_format=200)
    merged = train_tokenizer(corpus, split_digits=False)
    ids = merged("37+45=82", add_special_tokens=False)["input_ids"]
    pieces = merged.convert_ids_to_tokens(ids)
    assert any(len(p) > 1 and p.isdigit() for p in pieces), pieces  # some digit run is one token
    assert merged.decode(ids) == "37+45=82"  # lossless
    digit = train_tokenizer(corpus)
    assert all(len(p) == 1 for p in digit.convert_ids_to_tokens(digit("37+45=82")["input_ids"]) if p.isdigit())


def test_retokenize_is_the_destination_policys_completion_encoding():
    from groupwise.config import ModelCfg, PerfCfg

    policy = build_policy(ModelCfg(), PerfCfg())
    ids = tokens.retokenize(["12+7", ""], policy)
    assert ids[0] == policy.encode_completion("12+7")
    assert ids[0][-1] == policy.tokenizer.eos_token_id
    assert ids[1] == [policy.tokenizer.eos_token_id]  # an empty completion is EOS alone
    with pytest.raises(TypeError, match="encode_completion"):
        tokens.retokenize(["x"], object())
