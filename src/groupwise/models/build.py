"""Build the pieces of groupwise's embedded default model: a tiny BPE tokenizer and a tiny Qwen3.

The tokenizer is a byte-level BPE trained by :func:`train_tokenizer` with the ``tokenizers``
library. Digits are always split into single tokens (so that ``"123"`` is ``1 2 3`` and column
arithmetic is learnable), and the 256-symbol byte alphabet guarantees that any text, in particular
any printable ASCII, encodes and decodes losslessly. There is one special token, ``<|endoftext|>``,
used both as end-of-sequence and as padding. There is no BOS token and no chat template: prompts
are raw text.

The model is a :class:`~transformers.Qwen3ForCausalLM`; :data:`PRESETS` holds the sizes
(``tiny`` ≈ 0.85 M parameters is the shipped default; ``nano`` ≈ 0.12 M is paper 28's shipped
``student``; ``small`` ≈ 8 M and ``medium`` ≈ 30 M are for benchmarks). Checkpoints are saved with
``model_type = "qwen3"``: in transformers 5.x ``AutoTokenizer`` re-creates the pre-tokenizer for
``qwen2`` folders, which would silently change the ids, whereas a ``qwen3`` folder whose
``tokenizer_config.json`` names the generic fast tokenizer loads ``tokenizer.json`` untouched.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

EOS_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 384
MAX_POSITIONS = 128

# Architecture presets. ``head_dim * num_attention_heads`` need not equal ``hidden_size`` in Qwen3,
# but it does here. Parameter counts below assume the default 384-token vocabulary.
PRESETS: dict[str, dict[str, int]] = {
    # ≈ 0.85 M parameters: the shipped default, trains and samples fast on 2 CPU cores.
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
    ),
    # ≈ 0.12 M parameters: paper 28's student (``models/student``), a smaller model than ``tiny`` with
    # the same tokenizer, so that a ``tiny`` teacher can distil into it token by token.
    "nano": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=192,
    ),
    # ≈ 8.0 M parameters.
    "small": dict(
        hidden_size=256,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=1024,
    ),
    # ≈ 29.7 M parameters.
    "medium": dict(
        hidden_size=512,
        num_hidden_layers=10,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1408,
    ),
}

# A little English and code so that common words get merges and every printable ASCII character
# appears at least once in the tokenizer's training text.
_GENERIC_TEXT = """\
The quick brown fox jumps over the lazy dog. Answer the question and show your work.
Question: what is the sum of the numbers? Answer: the result is correct if it matches exactly.
def reward(completion, answer):\n    return 1.0 if completion.strip() == answer else 0.0
Use the numbers given to reach the target; each number may be used once. Sort the list in order.
"""


def _printable_ascii() -> str:
    """Every printable ASCII character plus tab and newline, as one string."""
    return "".join(chr(code) for code in range(32, 127)) + "\t\n"


def default_tokenizer_corpus(n_per_format: int = 2000, seed: int = 0) -> list[str]:
    """A fixed, seeded corpus in the formats of the built-in tasks, for :func:`train_tokenizer`.

    The corpus is generated here rather than read from the task modules so that the tokenizer a
    given version of this file builds does not depend on which other tasks happen to be installed.
    It covers: addition (``"37+45=82"``), countdown (``"nums 3 5 7 target 22:3*5+7"``), sorting
    (``"sort 5 2 9:2 5 9"``), a little English and code, and every printable ASCII character.
    """
    rng = random.Random(seed)
    texts: list[str] = []
    for _ in range(n_per_format):
        a, b = rng.randrange(100), rng.randrange(100)
        texts.append(f"{a}+{b}={a + b}")
    for _ in range(n_per_format):
        nums = [rng.randint(1, 25) for _ in range(rng.randint(3, 4))]
        ops = [rng.choice("+-*") for _ in range(len(nums) - 1)]
        expression = str(nums[0]) + "".join(f"{op}{num}" for op, num in zip(ops, nums[1:]))
        target = eval(expression)  # noqa: S307 - a literal arithmetic expression built just above
        texts.append(f"nums {' '.join(map(str, nums))} target {target}:{expression}")
    for _ in range(n_per_format):
        items = [rng.randrange(100) for _ in range(rng.randint(3, 6))]
        texts.append(f"sort {' '.join(map(str, items))}:{' '.join(map(str, sorted(items)))}")
    texts.extend(_GENERIC_TEXT.splitlines())
    texts.append(_printable_ascii())
    return texts


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, split_digits: bool = True
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` with single-digit tokens.

    The vocabulary holds ``<|endoftext|>`` (id 0), the 256 byte symbols, then merges learnt from
    ``texts`` up to ``vocab_size`` entries. Pre-tokenisation first isolates every digit, then applies
    the GPT-2 byte-level split, so merges never span a digit. ``split_digits=False`` leaves out the
    digit split: runs of digits merge (``"12"`` one token), a second vocabulary for the same text
    (``models/peer``, Mutual RL's receiver). Returns a
    :class:`~transformers.PreTrainedTokenizerFast` with ``eos_token = pad_token = <|endoftext|>``,
    no BOS and no automatic special tokens.
    """
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(byte_alphabet) + 1:
        raise ValueError(f"vocab_size must be at least {len(byte_alphabet) + 1} (bytes + EOS), got {vocab_size}")
    core = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if split_digits
        else byte_level
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=byte_alphabet,
        show_progress=False,
    )
    core.train_from_iterator(list(texts), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
        padding_side="left",  # prompts are left-padded for batched generation
    )
    return tokenizer


def build_model(
    vocab_size: int, preset: str = "tiny", eos_token_id: int = 0, seed: int | None = None
) -> Qwen3ForCausalLM:
    """A freshly initialised :class:`~transformers.Qwen3ForCausalLM` of the given ``preset`` size.

    Embeddings are tied, positions use RoPE up to :data:`MAX_POSITIONS`, and ``eos_token_id`` is
    also the pad id. ``seed`` (if given) seeds ``torch`` just before initialisation, so that the
    same seed gives the same weights.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    config = Qwen3Config(
        vocab_size=vocab_size,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        use_sliding_window=False,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        **PRESETS[preset],
    )
    if seed is not None:
        torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config = default_generation_config(eos_token_id)
    return model


def default_generation_config(eos_token_id: int) -> GenerationConfig:
    """Greedy decoding that stops at (and pads with) ``<|endoftext|>``; 32 new tokens at most."""
    return GenerationConfig(
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        bos_token_id=None,
        do_sample=False,
        max_new_tokens=32,
    )


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    return sum(param.numel() for param in model.parameters())


def save_pretrained(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, folder: str | Path) -> Path:
    """Save ``model`` (fp32 safetensors, config, generation config) and ``tokenizer`` to ``folder``.

    The folder then loads offline with ``AutoTokenizer.from_pretrained(folder)`` and
    ``AutoModelForCausalLM.from_pretrained(folder)``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    # Name the generic fast tokenizer class (transformers 5.x writes its internal "TokenizersBackend",
    # which 4.x cannot resolve); both versions then load tokenizer.json unchanged.
    config_path = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    for path in folder.iterdir():  # safetensors writes 0600; package data must be readable by all
        if path.is_file():
            path.chmod(0o644)
    return folder
