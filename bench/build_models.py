"""Build the benchmark's random-init models into ``bench/models/<preset>/`` (offline, seconds).

Each folder holds groupwise's default tokenizer (``train_tokenizer(default_tokenizer_corpus())``)
and a freshly initialised Qwen3 of the preset (``build_model(..., seed=0)``), saved with
``save_pretrained`` so that both frameworks load the very same files.

**Fixed-length completions.** For timing, every completion should be exactly ``max_completion_length``
tokens in both frameworks. A random-init model emits EOS with probability ≈ 1/V per token (V = 319),
so ~33 % of 128-token rows would end early, differently in each framework. We therefore make EOS
practically impossible *in the weights*, so neither framework needs a special option: column 0 of
the tied embedding / output matrix is set to ``+EOS_MARGIN`` for every token and to ``-EOS_MARGIN`` for
EOS. That column dominates the residual stream, so after the final RMSNorm hidden dimension 0 is
large and positive at every position, and the EOS logit sits ≈ 2·h₀·EOS_MARGIN below all others (it also shifts
every other logit by the same constant, which sampling ignores). ``check_no_eos`` samples from the
model to confirm that no row stops early. The models are for timing only: the time-to-accuracy run
uses a warm-started model, untouched.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from common import MODELS, parameter_counts

EOS_MARGIN = 4.0
MAX_POSITIONS = 256  # prompt (<= 6 tokens) + 128 completion tokens exceed build.MAX_POSITIONS = 128
VERSION = 2  # bump when the recipe below changes, so stale folders are rebuilt


def model_dir(preset: str) -> Path:
    return MODELS / preset


def build(preset: str, force: bool = False) -> Path:
    """Build (or reuse) ``bench/models/<preset>``; returns the folder."""
    from groupwise.models.build import build_model, default_tokenizer_corpus, save_pretrained, train_tokenizer

    folder = model_dir(preset)
    record = folder / "bench_model.json"
    if not force and record.exists():
        try:
            if json.loads(record.read_text()).get("version") == VERSION:
                return folder
        except (OSError, ValueError):
            pass
    tokenizer = train_tokenizer(default_tokenizer_corpus())
    model = build_model(len(tokenizer), preset, eos_token_id=tokenizer.eos_token_id, seed=0)
    with torch.no_grad():
        weight = model.get_input_embeddings().weight  # [V,H], tied with the output head
        weight[:, 0] = EOS_MARGIN
        weight[tokenizer.eos_token_id, 0] = -EOS_MARGIN
    # RoPE has no learnt parameters: raising the declared context only silences transformers' warning.
    model.config.max_position_embeddings = MAX_POSITIONS
    tokenizer.model_max_length = MAX_POSITIONS
    save_pretrained(model, tokenizer, folder)
    record.write_text(
        json.dumps(
            {
                "version": VERSION,
                "preset": preset,
                "seed": 0,
                "vocab_size": len(tokenizer),
                "eos_token_id": tokenizer.eos_token_id,
                "eos_margin": EOS_MARGIN,
                "max_position_embeddings": MAX_POSITIONS,
                **parameter_counts(model),
            },
            indent=2,
        )
        + "\n"
    )
    return folder


def check_no_eos(preset: str, rows: int = 32, length: int = 128) -> dict[str, float]:
    """Sample ``rows`` completions (temperature 1, HF ``generate``): the fraction that stopped before
    ``length`` tokens and the largest EOS log-probability met on the way."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model_dir(preset)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokenizer(["12+34="] * rows, return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(
        **ids,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=length,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        return_dict_in_generate=True,
        output_logits=True,
    )
    completions = out.sequences[:, ids["input_ids"].shape[1] :]  # [rows,T]
    logp = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)  # [rows,T,V]
    short = (completions == tokenizer.eos_token_id).any(dim=1)
    return {
        "early_stop_fraction": float(short.float().mean()),
        "max_eos_logprob": float(logp[..., tokenizer.eos_token_id].max()),
    }


if __name__ == "__main__":
    import sys

    torch.set_num_threads(1)
    for name in sys.argv[1:] or ["tiny", "small", "medium"]:
        print(name, build(name, force=True), check_no_eos(name))
