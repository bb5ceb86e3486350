"""policy.functional against the models' own Hugging Face forward: hidden states and gradients, KV-cache
decoding, the CPU engine on both paths, and the cases that must fall back to Hugging Face."""

from __future__ import annotations

import peft
import pytest
import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM

from groupwise.policy.engine import CPUEngine
from groupwise.policy.functional import DecodeState, hidden_states, unsupported_reason
from groupwise.seeds import row_seeds

PAD, EOS = 0, 1
V = 64
ARCHS = ["llama", "llama_bias", "mistral", "qwen2", "qwen3"]
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16], [17], [18, 19, 20, 21, 22]]

# Tolerances. Both paths do the same float32 maths in a different order (fused q|k|v and gate|up GEMMs,
# residual adds folded into addmm, F.rms_norm vs x*rsqrt(mean+eps), roll vs cat in rotate_half).
# Rounding is ~1e-7 relative per op. Measured worst differences: hidden states (O(1) after the final norm)
# 3e-6, logits 7e-6, gradients 1.2e-6 of their largest entry; so 1e-5 (hidden), 1e-4 (logits) and 1e-5
# relative (gradients) leave a 3-15x margin, while a real mistake (a missing bias, a wrong position, a
# leaked padding key) moves values by 1e-2 or more.
HIDDEN_ATOL = 1e-5
GRAD_RTOL = 1e-5  # of the largest gradient entry
LOGIT_ATOL = 1e-4


def tiny_model(arch: str, seed: int = 0, **overrides):
    """A random tiny float32 decoder of one of the supported families; biases (when present) non-zero."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=V,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        initializer_range=0.2,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=None,
    )
    common.update(overrides)
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
    elif arch == "llama_bias":
        config = transformers.LlamaConfig(attention_bias=True, mlp_bias=True, **common)
    elif arch == "mistral":
        config = transformers.MistralConfig(**{"sliding_window": None, **common})
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)  # q, k, v biases by default
    elif arch == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, **common)
    else:
        raise ValueError(arch)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():  # HF initialises biases to zero, which would hide a bias the functional path forgot
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    return model


def bias_names(model) -> list[str]:
    return [name for name, _ in model.named_parameters() if name.endswith(".bias")]


def test_bias_architectures_really_have_biases():
    assert bias_names(tiny_model("llama")) == []
    names = bias_names(tiny_model("llama_bias"))
    assert any("o_proj" in n for n in names) and any("down_proj" in n for n in names)
    names = bias_names(tiny_model("qwen2"))
    assert any("q_proj" in n for n in names) and not any("o_proj" in n for n in names)


# --------------------------------------------------------------------------- hidden_states (training path)
@pytest.mark.parametrize("arch", ARCHS)
def test_hidden_states_of_packed_rows_equal_each_sequence_alone(arch):
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(2, V, (n,), generator=g) for n in (5, 7, 11)]
    W = 14
    # row 0: seq 0 (5) + seq 1 (7) + 2 padding; row 1: seq 2 (11) + 3 padding
    layout = [[0, 1], [2]]
    input_ids = torch.full((2, W), PAD, dtype=torch.long)  # [N,W]
    positions = torch.zeros(2, W, dtype=torch.long)  # [N,W] padding at position 0
    segment = torch.full((2, W), -1, dtype=torch.long)  # [N,W] -1 on padding
    spans = []  # (row, start, seq index)
    for row, members in enumerate(layout):
        start = 0
        for s in members:
            n = len(seqs[s])
            input_ids[row, start : start + n] = seqs[s]
            positions[row, start : start + n] = torch.arange(n)  # restart at 0 for each sequence
            segment[row, start : start + n] = s
            spans.append((row, start, s))
            start += n
    causal = torch.ones(W, W, dtype=torch.bool).tril()  # [W,W]
    same = (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0)  # [N,W,W]
    allowed = (same & causal) | torch.eye(W, dtype=torch.bool)  # [N,W,W] padding sees only itself

    params = [
        model.model.layers[0].self_attn.q_proj.weight,
        model.model.norm.weight,
        model.model.layers[1].mlp.down_proj.weight,
        model.model.embed_tokens.weight,
    ]
    if model.model.layers[0].self_attn.q_proj.bias is not None:
        params.append(model.model.layers[0].self_attn.q_proj.bias)
    probe = torch.randn(2, W, 64, generator=g)  # [N,W,D] fixed weights turning hidden states into a scalar loss

    out = hidden_states(model, input_ids, positions, allowed)  # [N,W,D]
    assert out.shape == (2, W, 64)
    loss = sum(
        (out[row, start : start + len(seqs[s])] * probe[row, start : start + len(seqs[s])]).sum()
        for row, start, s in spans
    )
    grads = torch.autograd.grad(loss, params)

    ref_loss = 0.0
    for row, start, s in spans:
        n = len(seqs[s])
        ref = model.model(input_ids=seqs[s][None]).last_hidden_state[0]  # [n,D]
        assert torch.allclose(out[row, start : start + n], ref, atol=HIDDEN_ATOL), (
            arch,
            s,
            (out[row, start : start + n] - ref).abs().max(),
        )
        ref_loss = ref_loss + (ref * probe[row, start : start + n]).sum()
    ref_grads = torch.autograd.grad(ref_loss, params)
    for p, got, want in zip(params, grads, ref_grads):
        scale = want.abs().max()  # gradients reach 10-100 here (sums over every position and probe dim)
        assert scale > 1e-3  # the parameter really matters to the loss
        # float32 rounding of such sums is ~1e-6 of their size (measured: <= 1.2e-6; in float64 with HF's
        # float32 RMSNorm upcast disabled the paths agree to 1e-13 relative), so compare relative to the scale
        assert (got - want).abs().max() <= GRAD_RTOL * scale, (arch, p.shape, (got - want).abs().max() / scale)


# --------------------------------------------------------------------------- DecodeState (generation path)
@pytest.mark.parametrize("arch, repeat", [(arch, 2) for arch in ARCHS] + [("qwen3", 12), ("llama_bias", 12)])
def test_decode_state_matches_full_forward_at_every_step(arch, repeat):
    # repeat=12: 36 rows x 2 kv heads >= 64 takes the batched-GEMM attention instead of SDPA
    model = tiny_model(arch)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15, 16, 17]]
    B, W, steps = len(prompts), 6, 4
    input_ids = torch.full((B, W), PAD, dtype=torch.long)  # [B,W]
    for b, p in enumerate(prompts):
        input_ids[b, W - len(p) :] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in prompts])  # [B]
    real = torch.arange(W) >= (W - lengths)[:, None]  # [B,W]
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)  # [B,W]
    # [steps,R] rows differ
    fed = torch.tensor([[2 + (7 * t + 5 * r) % 60 for r in range(B * repeat)] for t in range(steps)])

    @torch.no_grad()
    def reference(row: int, t: int) -> torch.Tensor:
        """HF logits [V] at the last position of row's prompt + its first t fed tokens, run unpadded."""
        seq = prompts[row // repeat] + fed[:t, row].tolist()
        return model(torch.tensor([seq])).logits[0, -1]  # [V]

    state = DecodeState(model)
    logits = state.prefill(input_ids, positions, real, repeat, W + 5)  # [B,V]
    assert logits.shape == (B, V)
    for b in range(B):
        assert torch.allclose(logits[b], reference(b * repeat, 0), atol=LOGIT_ATOL), (arch, b)

    live = torch.arange(B * repeat)  # [A] original row of each live row
    for t in range(steps):
        if t == 2:  # rows 1 and 4 finish: one copy of prompt 0 and one of prompt 2 leave
            keep = torch.tensor([r for r in range(B * repeat) if r not in (1, 4)])  # [A']
            state.select(keep)
            live = live[keep]
        tokens = fed[t, live]  # [A]
        logits = state.step(tokens, lengths[live // repeat] + t, W + t)  # [A,V]
        assert logits.shape == (len(live), V)
        for a, row in enumerate(live.tolist()):
            ref = reference(row, t + 1)  # [V]
            assert torch.allclose(logits[a], ref, atol=LOGIT_ATOL), (arch, t, row, (logits[a] - ref).abs().max())
    # the two copies of one prompt were fed different tokens: their logits must differ (the rows are independent)
    assert not torch.allclose(logits[0], logits[1], atol=1e-2)


# --------------------------------------------------------------------------- engine: functional vs HF
def eos_prone_model(arch: str = "llama_bias"):
    """A model whose lm_head has a bias making EOS likely (both paths read lm_head.bias): ragged lengths."""
    model = tiny_model(arch, seed=3)
    old = model.lm_head
    head = nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[EOS] = 3.0
    model.lm_head = head
    return model


@pytest.mark.parametrize("share_prefix", [True, False])
@pytest.mark.parametrize(
    "sampling", [dict(), dict(top_k=5, top_p=0.9), dict(greedy=True)], ids=["plain", "topk_topp", "greedy"]
)
def test_engine_functional_equals_hf_path(sampling, share_prefix):
    model = eos_prone_model()
    n = 3
    seeds = row_seeds(4, 1, list(range(len(PROMPTS))), n)  # [B*n]
    outs = []
    for functional in (True, False):
        engine = CPUEngine(model, [EOS], PAD, share_prefix=share_prefix, functional=functional)
        assert engine.functional == functional  # each engine really takes its path
        outs.append(engine.generate(PROMPTS, n, seeds, 10, **sampling))
    fun, hf = outs
    assert torch.equal(fun.tokens, hf.tokens)
    assert torch.equal(fun.lengths, hf.lengths) and torch.equal(fun.truncated, hf.truncated)
    assert torch.allclose(fun.logp, hf.logp, atol=LOGIT_ATOL)
    assert len(set(fun.lengths.flatten().tolist())) > 1  # ragged: rows ended at different steps (dropping exercised)


# --------------------------------------------------------------------------- fallbacks
@pytest.mark.parametrize("arch", ARCHS)
def test_supported_models_have_no_unsupported_reason(arch):
    assert unsupported_reason(tiny_model(arch)) is None


def _hooked():
    model = tiny_model("qwen3")
    model.model.layers[0].mlp.register_forward_hook(lambda module, inputs, out: out)
    return model


def _lora():
    return peft.get_peft_model(
        tiny_model("llama"), peft.LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=["q_proj"])
    )


@pytest.mark.parametrize(
    "make",
    [
        _hooked,
        lambda: tiny_model("qwen3").to(torch.bfloat16),
        lambda: AutoModelForCausalLM.from_config(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=V)),
        _lora,
        lambda: tiny_model("mistral", sliding_window=16),
    ],
    ids=["forward_hook", "bfloat16", "gpt2", "peft_lora", "mistral_sliding_window"],
)
def test_unsupported_models_say_why(make):
    reason = unsupported_reason(make())
    assert isinstance(reason, str) and reason


def test_engine_falls_back_to_hf_when_a_hook_appears():
    model = tiny_model("qwen3")
    seeds = row_seeds(0, 0, [0, 1, 2, 3], 2)  # [B*n]
    functional = CPUEngine(model, [EOS], PAD, functional=True)
    assert functional.functional  # no hook yet: the functional path is chosen at construction
    plain = functional.generate(PROMPTS, 2, seeds, 6, greedy=True)

    def favour(module, inputs, logits):  # a hook that changes the logits: skipping it would show
        logits = logits.clone()
        logits[..., 40] += 5.0
        return logits

    handle = model.lm_head.register_forward_hook(favour)
    try:
        assert unsupported_reason(model) is not None
        hooked = functional.generate(PROMPTS, 2, seeds, 6, greedy=True)
        reference = CPUEngine(model, [EOS], PAD, functional=False).generate(PROMPTS, 2, seeds, 6, greedy=True)
    finally:
        handle.remove()
    assert torch.equal(hooked.tokens, reference.tokens) and torch.equal(hooked.lengths, reference.lengths)
    assert torch.allclose(hooked.logp, reference.logp, atol=LOGIT_ATOL)
    assert not torch.equal(hooked.tokens, plain.tokens)  # the hook mattered, so the fallback really ran
    assert unsupported_reason(model) is None  # hook gone: the functional path is usable again


def test_swiglu_down_recomputes_exact_gradients():
    """The memory-saving SwiGLU + down projection: float64 gradients equal finite differences, and
    float32 values and gradients equal autograd through the plain expression."""
    from groupwise.policy.functional import _SwiGLUDown

    torch.manual_seed(0)
    gate_up = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)  # [N,W,2I] I = 4
    weight = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)  # [D,I]
    bias = torch.randn(6, dtype=torch.float64, requires_grad=True)  # [D]
    assert torch.autograd.gradcheck(_SwiGLUDown.apply, (gate_up, weight, bias))
    assert torch.autograd.gradcheck(lambda g, w: _SwiGLUDown.apply(g, w, None), (gate_up, weight))

    g32, w32 = gate_up.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    fused = _SwiGLUDown.apply(g32, w32, None)  # [N,W,D]
    gate, up = g32.chunk(2, dim=-1)
    plain = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w32)  # [N,W,D]
    torch.testing.assert_close(fused, plain)
    upstream = torch.randn_like(plain)
    grads_fused = torch.autograd.grad(fused, (g32, w32), upstream)
    grads_plain = torch.autograd.grad(plain, (g32, w32), upstream)
    for a, b in zip(grads_fused, grads_plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_swiglu_mlp_recomputing_gate_up_has_exact_gradients():
    """perf.recompute_mlp's MLP (gate|up recomputed in the backward): float64 gradients equal finite
    differences, with and without biases, and in float32 the values and every gradient equal the
    stored-product path's bit for bit (the recomputed product is the same GEMM on the same input)."""
    from groupwise.policy.functional import _SwiGLUDown, _SwiGLUMLP
    from groupwise.policy.precision import linear

    torch.manual_seed(0)
    h = torch.randn(3, 5, 6, dtype=torch.float64, requires_grad=True)  # [N,W,D] D = 6
    gate_up_w = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)  # [2I,D] I = 4
    gate_up_b = torch.randn(8, dtype=torch.float64, requires_grad=True)  # [2I]
    down_w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)  # [D,I]
    down_b = torch.randn(6, dtype=torch.float64, requires_grad=True)  # [D]
    assert torch.autograd.gradcheck(_SwiGLUMLP.apply, (h, gate_up_w, gate_up_b, down_w, down_b))
    assert torch.autograd.gradcheck(lambda a, w, d: _SwiGLUMLP.apply(a, w, None, d, None), (h, gate_up_w, down_w))

    inputs = [t.detach().float().requires_grad_() for t in (h, gate_up_w, gate_up_b, down_w, down_b)]
    recomputed = _SwiGLUMLP.apply(*inputs)  # [N,W,D]
    stored = _SwiGLUDown.apply(linear(inputs[0], inputs[1], inputs[2]), inputs[3], inputs[4])  # [N,W,D]
    assert torch.equal(recomputed, stored)
    upstream = torch.randn_like(stored)
    for a, b in zip(torch.autograd.grad(recomputed, inputs, upstream), torch.autograd.grad(stored, inputs, upstream)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("arch", ["qwen3", "llama_bias"])
def test_recompute_mlp_saves_the_gate_up_products_and_changes_no_gradient(arch):
    """hidden_states(recompute_mlp=True) on a real decoder: the same hidden states and parameter
    gradients, and the tensors kept for the backward shrink by exactly the [N,W,2I] gate|up
    product of every layer (less its [2I] bias, which the recomputation keeps where there is one)."""
    model = tiny_model(arch)
    N, W = 2, 9
    input_ids = torch.randint(2, V, (N, W), generator=torch.Generator().manual_seed(2))  # [N,W]
    positions = torch.arange(W).expand(N, W)  # [N,W]
    allowed = torch.ones(W, W, dtype=torch.bool).tril().expand(N, W, W)  # [N,W,W]

    def run(recompute: bool):
        saved: dict[int, int] = {}

        def pack(t):
            saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return t

        model.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            hidden = hidden_states(model, input_ids, positions, allowed, recompute_mlp=recompute)  # [N,W,D]
        hidden.pow(2).sum().backward()
        # the head is unused here
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return hidden.detach(), grads, sum(saved.values())

    hidden_stored, grads_stored, bytes_stored = run(False)
    hidden_recomputed, grads_recomputed, bytes_recomputed = run(True)
    assert torch.equal(hidden_recomputed, hidden_stored)
    assert grads_recomputed.keys() == grads_stored.keys() and any("mlp" in name for name in grads_stored)
    for name, grad in grads_stored.items():
        torch.testing.assert_close(grads_recomputed[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    cfg = model.config
    gate_up_bytes = cfg.num_hidden_layers * N * W * 2 * cfg.intermediate_size * 4  # float32 [N,W,2I] per layer
    # [2I] per layer
    bias_bytes = cfg.num_hidden_layers * 2 * cfg.intermediate_size * 4 if getattr(cfg, "mlp_bias", False) else 0
    assert bytes_stored - bytes_recomputed == gate_up_bytes - bias_bytes


# ----------------------------------------------------------------------------- RMSNorm in fewer ops
@pytest.mark.parametrize("shape", [(5, 16), (3, 4, 2, 8)])
def test_rms_norm_matches_torch_and_its_gradient_is_exact(shape):
    from groupwise.policy.functional import rms_norm

    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    weight = (torch.rand(shape[-1], dtype=torch.float64) + 0.5).requires_grad_()
    eps = 1e-6
    ref = torch.nn.functional.rms_norm(x, (shape[-1],), weight, eps)
    out = rms_norm(x, weight, eps)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)  # the same function, other op order
    assert torch.autograd.gradcheck(lambda a, w: rms_norm(a, w, eps), (x, weight))  # the hand-written backward
    g = torch.randn(*shape, dtype=torch.float64)
    grads = torch.autograd.grad(out, (x, weight), g)
    ref_grads = torch.autograd.grad(ref, (x, weight), g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    with torch.no_grad():  # the no-grad path (decoding) computes the same values
        torch.testing.assert_close(rms_norm(x, weight, eps), ref, atol=1e-12, rtol=1e-12)


def test_rms_norm_of_a_zero_row_is_zero_with_finite_gradients():
    from groupwise.policy.functional import rms_norm

    x = torch.zeros(2, 4, requires_grad=True)
    weight = torch.ones(4, requires_grad=True)
    out = rms_norm(x, weight, 1e-6)  # eps keeps the denominator at sqrt(eps), as in the model's module
    assert torch.equal(out, torch.zeros(2, 4))
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(weight.grad).all()
    torch.testing.assert_close(x.grad, torch.full((2, 4), 1e3))  # d/dx (x / sqrt(eps)) = 1 / sqrt(1e-6)
