"""``model.matmul``: bfloat16 matrix products over float32 master weights (``policy/precision.py``).

What is checked: the log-prob error of the embedded model under bfloat16 products is bounded (and
not zero: the products really run in bfloat16); weights, gradients, log-probs and the loss stay
float32; the ``auto`` probe's decision from injected measurements (both branches, the threshold);
bad values name the key and the choices; a resumed bfloat16 run equals the uninterrupted one
exactly, and a resumed ``auto`` run keeps the dtype its start measured. The default (float32) path
is the plain path bit for bit: tests/test_equivalences.py, test_plain_path.py, test_functional.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_functional import tiny_model
from test_trainer import make_trainer

from groupwise.config import load_config
from groupwise.errors import ConfigError
from groupwise.policy import precision
from groupwise.policy.forward import completion_logprobs
from groupwise.policy.functional import DecodeState, hidden_states
from groupwise.run import Run

BF16 = torch.bfloat16

# Log-prob error bounds, measured on the embedded model with the demo's prompts (32 arithmetic
# prompts x 8 sampled completions of <= 6 tokens, 3 prompt sets): the functional path's largest
# |logp_bf16 - logp_fp32| was 0.041-0.107 and its mean 0.0037-0.0044 (bfloat16 keeps 8 bits of
# mantissa: ~0.4 % per rounding, and the logits are ~10 in size); through the model's own forward
# under autocast (the residual stream partly bfloat16) 0.12-0.28 and 0.0052-0.0075. Bounds are about
# 2.5x the worst measured; a product left in float32 would give an error of ~1e-5 (the floor checked).
FUNCTIONAL_MAX, FUNCTIONAL_MEAN = 0.25, 0.011
AUTOCAST_MAX, AUTOCAST_MEAN = 0.7, 0.02
# Gradients under bfloat16 products vs float32 on the random tiny models of test_functional (sharp:
# initializer_range 0.2): ||g_bf16 - g|| / ||g|| per weight tensor was at most 0.048 (q/k projections,
# where attention's softmax amplifies rounding; most tensors 0.005-0.02); bound 2.5x that.
GRAD_RELATIVE = 0.12
NOT_FLOAT32 = 5e-4  # mean error below this: the products did not run in bfloat16


@pytest.fixture(scope="module")
def demo():
    """The demo's policy and a rollout of its prompts, sampled with float32 products."""
    cfg, _ = load_config("demo", ["threads=1", "eval.size=0", "out=/tmp/unused-bf16-test"])
    from groupwise.build import build
    from groupwise.trainer import Trainer

    trainer = Trainer(build(cfg))
    prompts = [trainer.prompts("train", trainer.train_rows, i) for i in range(32)]
    gen = trainer.policy.engine.generate(prompts, 8, torch.arange(256), 6)
    return trainer.policy, prompts, gen


def test_logprob_error_of_bf16_products_on_the_embedded_model_is_bounded(demo):
    policy, prompts, gen = demo
    rows = torch.ones(32, 8, dtype=torch.bool)  # [B,G]
    with torch.no_grad():
        exact = completion_logprobs(policy.module, prompts, gen.tokens, gen.mask, rows)["logp"]  # [B,G,T]
        for functional, (bound_max, bound_mean) in (
            (True, (FUNCTIONAL_MAX, FUNCTIONAL_MEAN)),
            (False, (AUTOCAST_MAX, AUTOCAST_MEAN)),
        ):
            low = completion_logprobs(
                policy.module, prompts, gen.tokens, gen.mask, rows, matmul=BF16, functional=functional
            )["logp"]
            assert low.dtype == torch.float32
            error = (low - exact).abs()[gen.mask]  # [K]
            assert error.max() < bound_max and error.mean() < bound_mean, (functional, error.max(), error.mean())
            assert error.mean() > NOT_FLOAT32, "the products did not run in bfloat16"
            assert bool((low[~gen.mask] == 0).all())  # padding stays exactly 0


def test_bf16_generation_keeps_float32_logp_and_nearly_the_same_samples(demo):
    """The engine under bfloat16 products: float32 log-probs of its samples close to the float32
    engine's; measured 98-99.6 % of the 256 rows identical, bound 90 %."""
    policy, prompts, gen = demo
    engine = policy.engine
    engine.matmul = BF16
    try:
        low = engine.generate(prompts, 8, torch.arange(256), 6)
    finally:
        engine.matmul = None
    assert low.logp.dtype == torch.float32
    same = (low.tokens.shape == gen.tokens.shape) and (low.tokens == gen.tokens).all(-1)  # [B,n]
    assert float(same.float().mean()) >= 0.9
    rows = same & (low.lengths == gen.lengths)  # [B,n]
    error = (low.logp - gen.logp).abs()[rows[..., None] & gen.mask]
    assert 0 < error.max() < FUNCTIONAL_MAX


@pytest.mark.parametrize("functional", [True, False])
def test_both_engine_paths_run_bf16_products_with_float32_logp(functional):
    """The functional decoder (bf16 weight snapshots) and the model's own forward (autocast): float32
    log-probs of the same greedy tokens within bf16 rounding of float32's, and not equal to them."""
    from test_functional import EOS, PAD, PROMPTS

    from groupwise.policy.engine import CPUEngine

    model = tiny_model("qwen3")
    seeds = torch.arange(len(PROMPTS) * 2)
    exact = CPUEngine(model, [EOS], PAD, functional=functional).generate(PROMPTS, 2, seeds, 5, greedy=True)
    engine = CPUEngine(model, [EOS], PAD, functional=functional, matmul=BF16)
    assert engine.functional == functional
    low = engine.generate(PROMPTS, 2, seeds, 5, greedy=True)
    assert low.logp.dtype == torch.float32
    first = exact.mask[..., :1] & low.mask[..., :1]  # [B,n,1] the first token: the same context in both
    assert bool((low.tokens[..., 0] == exact.tokens[..., 0]).all())
    error = (low.logp[..., :1] - exact.logp[..., :1]).abs()[first]
    assert 1e-5 < float(error.max()) < FUNCTIONAL_MAX


def test_decode_state_snapshots_gemm_weights_in_bf16_and_keeps_norms_float32():
    model = tiny_model("qwen3")
    state = DecodeState(model, BF16)
    layer = state.layers[0]
    assert {layer.qkv.dtype, layer.o_t.dtype, layer.gate_up.dtype, layer.down_t.dtype, state.head.dtype} == {BF16}
    assert {layer.norm_in.dtype, layer.norm_post.dtype, state.final_norm.dtype, state.embed.dtype} == {torch.float32}
    plain = DecodeState(model)
    assert plain.layers[0].qkv.dtype == torch.float32 and plain.head.dtype == torch.float32


@pytest.mark.parametrize("arch", ["llama_bias", "qwen3"])
def test_training_forward_gradients_land_float32_on_the_master_weights(arch):
    """hidden_states with bfloat16 products: float32 outputs within bfloat16 rounding of the float32
    forward (measured 0.053 max abs on O(1) final-norm states, bound 0.15), float32 gradients on every
    weight within GRAD_RELATIVE of the float32 ones (the casts are differentiable: nothing is detached)."""
    model = tiny_model(arch)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 0, 0]])  # [N,W]
    positions = torch.arange(6).expand(2, 6)  # [N,W]
    allowed = torch.ones(6, 6, dtype=torch.bool).tril_().expand(2, 6, 6)  # [N,W,W]
    # [N,W,D] a fixed readout
    direction = torch.randn(2, 6, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    grads = {}
    outs = {}
    for low in (None, BF16):
        model.zero_grad()
        out = hidden_states(model, ids, positions, allowed, matmul=low)  # [N,W,D]
        (out * direction).sum().backward()
        outs[low] = out.detach()
        grads[low] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert outs[BF16].dtype == torch.float32
    difference = (outs[BF16] - outs[None]).abs().max()
    assert 1e-4 < difference < 0.15, difference
    assert grads[BF16].keys() == grads[None].keys() and all(p.dtype == torch.float32 for p in model.parameters())
    for name, exact in grads[None].items():
        low = grads[BF16][name]
        assert low.dtype == torch.float32, name
        relative = float((low - exact).norm() / exact.norm())  # [] of the whole tensor
        assert relative < GRAD_RELATIVE, (name, relative)


def test_a_bf16_step_keeps_loss_and_gradients_float32(tmp_path):
    trainer = make_trainer(tmp_path, "model.matmul=bfloat16", "train.steps=1", "eval.size=0")
    assert trainer.policy.matmul.low is BF16 and trainer.policy.engine.matmul is BF16
    captured = {}

    def capture(optimizer, args, kwargs):
        captured.update({n: p.grad.dtype for n, p in trainer.policy.module.named_parameters() if p.grad is not None})

    trainer.updater.optimizer.register_step_pre_hook(capture)
    Run(trainer).train()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert captured and set(captured.values()) == {torch.float32}
    assert all(p.dtype == torch.float32 for p in trainer.policy.module.parameters())
    assert isinstance(row["loss"], float) and row["loss"] == row["loss"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["matmul"]["setting"] == "bfloat16" and summary["matmul"]["dtype"] == "bfloat16"


# --------------------------------------------------------------------------- the auto probe
QWEN_TINY = type("Config", (), {"hidden_size": 128, "intermediate_size": 384})()


@pytest.mark.parametrize(
    "fp32, bf16, dtype, words",
    [
        (214.0, 874.0, "bfloat16", ">= 1.3x: bfloat16 products on"),  # an AVX512-BF16 EPYC at 512³
        (100.0, 130.0, "bfloat16", "1.30x"),  # exactly the threshold turns it on
        (100.0, 129.0, "float32", "not enough faster than float32"),
        (150.0, 40.0, "float32", "slower than float32, staying float32"),  # a CPU without bf16 units emulates it
    ],
)
def test_auto_decides_from_the_measurements(fp32, bf16, dtype, words):
    shapes = []
    choice = precision.resolve("auto", QWEN_TINY, measure=lambda m, k, n: (shapes.append((m, k, n)), (fp32, bf16))[1])
    assert shapes == [(256, 128, 384)]  # the model's own MLP shape, once
    assert choice.dtype == dtype and (choice.low is BF16) == (dtype == "bfloat16")
    assert choice.fp32_gflops == fp32 and choice.bf16_gflops == bf16 and words in choice.reason
    assert f"float32 {fp32:.1f} GFLOP/s, bfloat16 {bf16:.1f} GFLOP/s" in choice.line()
    assert choice.as_dict()["shape"] == [256, 128, 384] and choice.as_dict()["threads"] == torch.get_num_threads()


def test_fixed_settings_do_not_probe():
    def fail(*_):
        raise AssertionError("probed")

    assert precision.resolve("float32", QWEN_TINY, measure=fail).low is None
    assert precision.resolve("bfloat16", QWEN_TINY, measure=fail).low is BF16


def test_the_real_probe_is_quick_and_measures_both():
    import time

    start = time.perf_counter()
    fp32, bf16 = precision.probe(64, 128, 384)
    assert time.perf_counter() - start < 2.0  # ~0.2 s; 2 s allows a shared CPU
    assert fp32 > 0 and bf16 > 0


def test_auto_run_says_and_records_its_decision(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(precision, "probe", lambda m, k, n, device="cpu": (100.0, 50.0))
    trainer = make_trainer(tmp_path, "model.matmul=auto", "train.steps=1", "eval.size=0")
    assert trainer.policy.matmul.low is None and trainer.policy.engine.matmul is None
    Run(trainer).train()
    said = capsys.readouterr().err
    assert said.count("model.matmul=auto: products in float32") == 1 and "slower than float32" in said
    recorded = json.loads((tmp_path / "summary.json").read_text())["matmul"]
    assert recorded["dtype"] == "float32" and recorded["fp32_gflops"] == 100.0 and recorded["bf16_gflops"] == 50.0


@pytest.mark.parametrize("value", ["float16", "bf16", "AUTO"])
def test_a_bad_value_names_the_key_and_the_choices(value):
    with pytest.raises(ConfigError, match=r"model\.matmul.*float32, bfloat16, auto"):
        load_config(None, [f'model.matmul="{value}"'])
    with pytest.raises(ConfigError, match=r"model\.matmul.*float32, bfloat16, auto"):
        precision.resolve(value)


# --------------------------------------------------------------------------- resume
def _straight_and_resumed(tmp_path, *overrides):
    common = ["train.steps=4", "eval.size=0", "checkpoint.every=2", *overrides]
    straight = make_trainer(tmp_path / "a", *common)
    Run(straight).train()
    first = make_trainer(tmp_path / "b", *common)
    first.cfg.train.steps = 2  # stop half-way
    Run(first).train()
    resumed = make_trainer(tmp_path / "b", *common)
    Run(resumed).train(resume_allow=["train.steps"])
    return straight, resumed


def test_resume_under_bf16_equals_the_uninterrupted_bf16_run(tmp_path):
    straight, resumed = _straight_and_resumed(tmp_path, "model.matmul=bfloat16")
    assert resumed.step == straight.step == 4
    for (name, p), q in zip(straight.policy.module.named_parameters(), resumed.policy.module.parameters()):
        assert torch.equal(p, q), name
    plain = make_trainer(tmp_path / "c", "train.steps=4", "eval.size=0")
    Run(plain).train()
    assert not all(
        torch.equal(p, q) for p, q in zip(plain.policy.module.parameters(), straight.policy.module.parameters())
    )  # bf16 did change the run


def test_a_resumed_auto_run_keeps_the_dtype_its_start_measured(tmp_path, monkeypatch):
    # straight, first half: bf16; the resume's probe would say fp32
    measured = iter([(100.0, 400.0), (100.0, 400.0), (100.0, 50.0)])
    monkeypatch.setattr(precision, "probe", lambda m, k, n, device="cpu": next(measured))
    straight, resumed = _straight_and_resumed(tmp_path, "model.matmul=auto")
    assert (
        straight.policy.matmul.dtype == resumed.policy.matmul.dtype == "bfloat16"
        and resumed.policy.engine.matmul is BF16
    )
    assert "restored from the checkpoint" in resumed.policy.matmul.reason
    for (name, p), q in zip(straight.policy.module.named_parameters(), resumed.policy.module.parameters()):
        assert torch.equal(p, q), name


_RANKS_SCRIPT = """
import sys
from groupwise import dist
from groupwise.policy import precision
rank, world = dist.init()
fast = [r == 'fast' for r in sys.argv[2:]][rank]  # what this rank's probe measures
config = type('Config', (), {'hidden_size': 128, 'intermediate_size': 384})()
choice = precision.resolve('auto', config, measure=lambda m, k, n: (100.0, 400.0 if fast else 50.0))
open(f'{sys.argv[1]}/rank{rank}.txt', 'w').write(choice.dtype)  # a file per rank: printed lines of two ranks can interleave
import torch.distributed
torch.distributed.barrier()
torch.distributed.destroy_process_group()  # no rank exits while the other still talks to it (gloo aborts then)
"""  # noqa: E501


@pytest.mark.dist
@pytest.mark.parametrize("measured, dtype", [(["fast", "fast"], "bfloat16"), (["fast", "slow"], "float32")])
def test_ranks_agree_on_the_products(tmp_path, measured, dtype):
    """Under torchrun every rank runs the same products: bfloat16 only where every rank measured it faster."""
    import os
    import subprocess
    import sys

    script = tmp_path / "ranks.py"
    script.write_text(_RANKS_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            str(tmp_path),
            *measured,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == [dtype, dtype]
