"""LoRA rank allocation (spec 49): the allocation arithmetic by hand (budget kept exactly, the
largest-remainder rule, r_min / r_max), the importance-map diagnostics, the per-layer gradient-norm
profiler against gradients read off the optimiser, PEFT ``rank_pattern`` with exact module names and
the adapter parameter count; and LoRA through PEFT on the embedded Qwen3 and on a tiny Llama, the
saved model merged and loadable by AutoModelForCausalLM with the adapted model's outputs."""

from __future__ import annotations

import json

import pytest
import torch

from groupwise.errors import ConfigError
from groupwise.run import Run
from groupwise.updates._lora import (
    assert_lora_param_count,
    largest_remainder,
    layer_of,
    lora_param_count,
    lora_side,
    module_kind,
)
from groupwise.updates.lora_rank import (
    GradNormProfiler,
    allocate_ranks,
    corr,
    layer_rank_pattern,
    max_min_ratio,
    shares_from_metrics,
    top_frac_share,
)

TARGETS = ["q_proj", "v_proj"]


def test_spec_allocation_examples():
    assert allocate_ranks([0.1, 0.2, 0.3, 0.4], 40, "proportional") == [4, 8, 12, 16]
    assert max_min_ratio([0.1, 0.2, 0.3, 0.4]) == pytest.approx(4.0)
    # raw [3.3, 3.3, 3.4] -> floors [3, 3, 3], the one left to the largest remainder (0.4): [3, 3, 4]
    assert allocate_ranks([0.33, 0.33, 0.34], 10, "proportional") == [3, 3, 4]
    assert largest_remainder(torch.tensor([3.3, 3.3, 3.4]), 10).tolist() == [3, 3, 4]
    assert largest_remainder(torch.tensor([2.5, 2.5, 5.0]), 10).tolist() == [3, 2, 5]  # a tie: the lower index


def test_uniform_reduced_and_bounds_keep_the_budget_exactly():
    assert allocate_ranks([0.9, 0.05, 0.05], 96, "uniform") == [32, 32, 32]  # the shares do not matter
    assert allocate_ranks([0.25] * 4, 10, "uniform") == [3, 3, 2, 2]  # 2.5 each: the remainders to the first layers
    # reduced: budget round(0.7 * 40) = 28; raw [2.8, 5.6, 8.4, 11.2] ->
    # [2, 5, 8, 11] + the 2 largest fractions (.8, .6)
    assert allocate_ranks([0.1, 0.2, 0.3, 0.4], 40, "reduced") == [3, 6, 8, 11]
    # r_max = 8: raw [14, 2, 2, 2] -> layer 0 fixed at 8, the other 12 shared equally
    assert allocate_ranks([0.7, 0.1, 0.1, 0.1], 20, "proportional", r_max=8) == [8, 4, 4, 4]
    # r_min = 2: raw [0.2, 4.9, 4.9] -> layer 0 fixed at 2, the other 8 split [4, 4]
    assert allocate_ranks([0.02, 0.49, 0.49], 10, "proportional", r_min=2) == [2, 4, 4]
    # both bounds in one pass, then again: raw [16, 2, 1, 1] (r_min 2, r_max 10) -> [10, ., 2, 2];
    # the 6 left go to layer 1 alone
    assert allocate_ranks([0.8, 0.1, 0.05, 0.05], 20, "proportional", r_min=2, r_max=10) == [10, 6, 2, 2]
    with pytest.raises(ConfigError, match="cannot keep every rank"):
        allocate_ranks([0.5, 0.5], 3, "proportional", r_min=2)
    with pytest.raises(ConfigError, match="allowed: uniform"):
        allocate_ranks([0.5, 0.5], 4, "greedy")


def test_random_ranks_are_seeded_and_rescaled_to_the_budget():
    a = allocate_ranks([0.25] * 28, 896, "random", seed=1)
    assert a == allocate_ranks([0.25] * 28, 896, "random", seed=1) != allocate_ranks([0.25] * 28, 896, "random", seed=2)
    assert sum(a) == 896 and min(a) >= 16 - 1 and max(a) <= 48 + 1  # U[16, 48] rescaled to mean 32


def test_importance_map_diagnostics():
    assert top_frac_share([0.1, 0.2, 0.3, 0.4], 0.3) == pytest.approx(0.4)  # round(1.2) = 1 layer
    assert top_frac_share([0.1, 0.2, 0.3, 0.4], 0.5) == pytest.approx(0.7)
    assert max_min_ratio([0.0468, 0.0215, 0.03]) == pytest.approx(0.0468 / 0.0215)  # the blog's 2.17x
    assert corr([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0) and corr([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # centred: [-1.5,-.5,.5,1.5]·[-1.5,.5,-.5,1.5] = 4 over 5
    assert corr([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert corr([1, 1], [1, 2]) != corr([1, 1], [1, 2])  # NaN for a constant vector


def test_names_of_peft_weights():
    name = "base_model.model.model.layers.12.mlp.down_proj.lora_A.default.weight"
    assert (layer_of(name), lora_side(name), module_kind(name)) == (12, "A", "down_proj")
    assert layer_of("transformer.h.3.attn.c_attn.lora_B.default.weight") == 3
    assert lora_side("model.layers.0.self_attn.q_proj.weight") is None and layer_of("lm_head.weight") is None


def test_profiler_sums_a_and_b_norms_per_layer(tmp_path):
    def param(grad):
        p = torch.nn.Parameter(torch.zeros(len(grad)))
        p.grad = torch.tensor(grad)
        return p

    named = [
        ("m.layers.0.self_attn.q_proj.lora_A.default.weight", param([3.0, 4.0])),  # 5
        ("m.layers.0.self_attn.q_proj.lora_B.default.weight", param([1.0, 0.0])),  # 1
        ("m.layers.1.self_attn.v_proj.lora_A.default.weight", param([0.0, 2.0])),  # 2
        ("m.layers.1.self_attn.v_proj.base_layer.weight", param([100.0, 0.0])),
    ]  # not LoRA: ignored
    prof = GradNormProfiler(named)
    assert prof.step().tolist() == [6.0, 2.0]
    named[2][1].grad = torch.tensor([0.0, 6.0])
    assert prof.step().tolist() == [6.0, 6.0]
    assert prof.importance().tolist() == [6.0, 4.0] and prof.share().tolist() == [0.6, 0.4]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        "\n".join(
            json.dumps({"step": s, "lora_grad/L0": v0, "lora_grad/L1": v1})
            for s, v0, v1 in [(0, 6, 2), (1, 6, 6), (2, 0, 100)]
        )
    )
    assert shares_from_metrics(metrics, last=2) == pytest.approx([0.6, 0.4])


def _peft(model, r=4, pattern=None):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        model, LoraConfig(task_type="CAUSAL_LM", r=r, target_modules=TARGETS, rank_pattern=pattern or {})
    )


def test_rank_pattern_with_exact_names_and_the_parameter_count():
    """Embedded model: q_proj 128 -> 128, v_proj 128 -> 64. Ranks [1, 2, 3, 4] by layer hold
    Σ_l r_l (128 + 128 + 128 + 64) = 10 * 448 = 4480 entries; a key matching nothing (the blog's
    pitfall) leaves the default rank 4 everywhere: 4 * 4 * 448 = 7168."""
    from groupwise.policy.lm import load_policy

    base, _ = load_policy("default")
    modules = [n for n, _ in base.named_modules() if n.rsplit(".", 1)[-1] in TARGETS]
    pattern = layer_rank_pattern(modules, [1, 2, 3, 4])
    assert pattern[r"model\.layers\.2\.self_attn\.v_proj"] == 3 and len(pattern) == 8
    model = _peft(base, pattern=pattern)
    assert_lora_param_count(model, 4480)
    ranks = {n: p.shape[0] for n, p in model.named_parameters() if lora_side(n) == "A"}
    assert ranks["base_model.model.model.layers.3.self_attn.q_proj.lora_A.default.weight"] == 4
    assert ranks["base_model.model.model.layers.0.self_attn.v_proj.lora_A.default.weight"] == 1
    wrong = _peft(load_policy("default")[0], pattern={"model.layers.15.*.q_proj": 12})
    assert lora_param_count(wrong) == 7168
    with pytest.raises(ValueError, match="holds 7168|hold 7168"):
        assert_lora_param_count(wrong, 4480)


def _tiny_llama(folder):
    """A tiny random Llama (another architecture family) with the embedded model's tokenizer."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from groupwise.policy.lm import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_lora_with_a_rank_pattern_trains_and_saves_a_merged_loadable_model(tmp_path, arch):
    """Through the trainer: PEFT LoRA with per-layer ranks, the gradient-norm profiler logging every
    layer, and the final folder loaded by AutoModelForCausalLM equal (logits) to the adapted model."""
    from test_trainer import make_trainer
    from transformers import AutoModelForCausalLM

    from groupwise.policy.lm import resolve_model_path

    path = "default" if arch == "qwen3" else _tiny_llama(tmp_path / "llama")
    d_q, d_v, layers = (128 + 128, 128 + 64, 4) if arch == "qwen3" else (64 + 64, 64 + 32, 2)
    ranks = [2, 1, 3, 2][:layers]
    pattern = (
        "{"
        + ", ".join(
            f'"model\\\\.layers\\\\.{l}\\\\.self_attn\\\\.{m}" = {r}' for l, r in enumerate(ranks) for m in TARGETS
        )
        + "}"
    )
    # the random Llama earns no reward: random adapters make the merge matter
    init = "" if arch == "qwen3" else "init_lora_weights=false, "
    lora = f'model.lora={{r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], {init}rank_pattern={pattern}}}'
    trainer = make_trainer(
        tmp_path / "run",
        f'model.path="{path}"',
        lora,
        "eval.size=0",
        "train.steps=2",
        'update={name="lora_rank_allocation", inner={name="adamw", lr=1e-2}}',
    )
    assert_lora_param_count(trainer.policy.module, sum(ranks) * (d_q + d_v))
    ids = torch.tensor([trainer.policy.encode("12+34=")])
    Run(trainer).train()
    # saving merged a copy: the live model keeps its adapters
    assert any("lora" in n for n, _ in trainer.policy.module.named_parameters())
    with torch.no_grad():
        adapted = trainer.policy.module(ids).logits
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(
        sorted(k for k in r if k.startswith("lora_grad/")) == [f"lora_grad/L{l}" for l in range(layers)] for r in rows
    )
    if arch == "qwen3":  # the warm-started model earns rewards: every layer's adapters get a gradient
        assert all(r[f"lora_grad/L{l}"] > 0 for r in rows for l in range(layers))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert type(merged).__name__ == ("Qwen3ForCausalLM" if arch == "qwen3" else "LlamaForCausalLM")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(path))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted, rtol=1e-4, atol=1e-5)
        assert (merged(ids).logits - base(ids).logits).abs().max() > 1e-3  # the adapters are in the saved weights


def test_profiler_metric_is_the_gradient_the_optimiser_steps_with(tmp_path):
    """At the first step B = 0, so ∇A = 0 exactly and lora_grad/L<l> = Σ_m ‖∇B_m‖ of the gradients the
    inner AdamW receives (no clipping), read off its step pre-hook."""
    from test_trainer import make_trainer

    trainer = make_trainer(
        tmp_path / "run",
        'model.lora={r=2, target_modules=["q_proj", "v_proj"]}',
        "eval.size=0",
        "train.steps=1",
        'update={name="lora_rank_allocation", inner={name="adamw", lr=1e-3, max_grad_norm=0.0}}',
    )
    names = dict(zip([id(p) for p in trainer.policy.parameters()], trainer.policy.parameter_names()))
    captured = {}
    trainer.updater.inner_updater.optimizer.register_step_pre_hook(
        lambda opt, a, k: (
            captured.update({names[id(p)]: p.grad.clone() for g in opt.param_groups for p in g["params"]})
            if not captured
            else None
        )
    )
    trainer.policy.save = lambda folder: __import__("os").makedirs(folder)
    Run(trainer).train()
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert all(float(g.abs().max()) == 0.0 for n, g in captured.items() if lora_side(n) == "A")
    for layer in range(4):
        expected = sum(float(g.double().norm()) for n, g in captured.items() if layer_of(n) == layer)
        assert row[f"lora_grad/L{layer}"] == pytest.approx(expected, rel=1e-9) and expected > 0


def test_a_rank_pattern_survives_the_stored_config():
    """config.toml of a run (what resume compares) writes keys that are not bare TOML keys quoted."""
    import tomllib

    from groupwise.config import to_toml

    data = {"model": {"lora": {"r": 4, "rank_pattern": {r"model\.layers\.0\.self_attn\.q_proj": 2, "plain_key": 3}}}}
    text = to_toml(data)
    assert '"model\\\\.layers\\\\.0\\\\.self_attn\\\\.q_proj" = 2' in text and "plain_key = 3" in text
    assert tomllib.loads(text) == data


def test_the_claim_files_proportional_pattern_builds_the_ranks_it_says():
    """claims/49: the proportional config's rank_pattern gives layers [14, 7, 7, 4] on all seven
    projections; per layer Σ_m (d_in + d_out) = 256 + 192 + 192 + 256 + 512 + 512 + 512 = 2432, so
    the adapters hold 32 * 2432 = 77 824 entries, as uniform r = 8 does."""
    from groupwise.claims.claimfile import load_claim
    from groupwise.config import load_config
    from groupwise.papers import PAPERS
    from groupwise.policy.lm import load_policy

    path = PAPERS / "49_lora_rank_allocation" / "claims" / "49-lora-rank-allocation.toml"
    claim = load_claim(path, check_configs=False)
    counts = {}
    for label in ("uniform", "proportional"):
        cfg, _ = load_config(claim.spec(label).recipe, claim.spec(label).overrides)
        model, _ = load_policy("default", lora=cfg.model.lora)
        assert_lora_param_count(model, 32 * 2432)
        counts[label] = {
            layer_of(n): p.shape[0] for n, p in model.named_parameters() if lora_side(n) == "A" and "down_proj" in n
        }
    assert counts == {"uniform": {0: 8, 1: 8, 2: 8, 3: 8}, "proportional": {0: 14, 1: 7, 2: 7, 3: 4}}


def test_lora_initialisation_is_the_same_in_every_process():
    """Before: PEFT drew LoRA's A from torch's unseeded global generator, so two runs of one config
    differed (the placement claim's first seed-0 runs did). Now A comes from seed 0, the global
    generator untouched."""
    from groupwise.policy.lm import load_policy

    lora = {"r": 2, "target_modules": TARGETS}
    torch.manual_seed(123)
    a = dict(load_policy("default", lora=lora)[0].named_parameters())
    after = torch.rand(1)
    torch.manual_seed(7)
    b = dict(load_policy("default", lora=lora)[0].named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a if lora_side(n) == "A")
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), after)  # the global generator is where it would be without the adapters
