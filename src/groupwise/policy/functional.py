"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) as plain torch functions, for the hot loops.

Why: on a CPU a small model's step is dominated by overhead, not arithmetic. Each Hugging Face
decode step walks dozens of modules (hooks, keyword plumbing, mask building) and its dynamic KV
cache grows by ``torch.cat`` every token, copying the whole cache (quadratic in the length: 0.8 s of
a 2.4 s step at 32 rows x 128 tokens). Here the same function is a few torch ops per layer:

* ``DecodeState`` (generation, no autograd): weights snapshotted once per rollout into fused
  matrices (q|k|v in one GEMM, gate|up in one, residual adds folded into ``addmm``) and a
  KV cache preallocated for the whole completion, written in place.
* ``hidden_states`` (training, autograd): the same layer maths on the model's own parameters, with
  a caller-given attention mask (packed rows or a prompt-sharing tree).

Both reproduce the model's own forward to float rounding (``tests/test_functional.py``). With
``matmul=torch.bfloat16`` (``model.matmul``, ``policy/precision.py``) only the GEMMs run in
bfloat16 (weights cast once, inputs cast in, outputs cast back); norms, rotary, attention and the
residual stream stay float32. Models
outside the family, adapters (PEFT), sliding windows or non-float32 weights take the Hugging Face
path (``unsupported_reason`` says why).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from groupwise.policy.precision import addmm as _addmm
from groupwise.policy.precision import linear as _lin

FAMILY = ("llama", "mistral", "qwen2", "qwen3")


def unsupported_reason(model) -> str | None:
    """Why ``model`` cannot use the functional path, or None when it can. Hooks are checked on every
    call (they come and go); the rest once per model and dtype."""
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return "forward hooks on its modules (the functional path would skip them)"
    weight = next(model.parameters())
    if weight.device.type != "cpu":  # written and measured for CPU kernels; a GPU runs the model's own forward (SDPA)
        return f"weights on {weight.device.type} (the functional path is CPU-only)"
    dtype = weight.dtype  # a model moved to another dtype is checked again
    cached = _STATIC_REASONS.get(model)
    if cached is None or cached[0] != dtype:
        cached = _STATIC_REASONS[model] = (dtype, _static_reason(model))
    return cached[1]


_STATIC_REASONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (dtype, reason)


def _static_reason(model) -> str | None:
    if hasattr(model, "get_base_model") or hasattr(model, "peft_config"):
        return "a PEFT-wrapped model (adapters change the layer maths)"
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILY:
        return f"model_type {model_type!r} is not one of {', '.join(FAMILY)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (the family uses silu)"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return "sliding-window layers"
    if getattr(config, "sliding_window", None) and (
        model_type == "mistral" or getattr(config, "use_sliding_window", False)
    ):
        return "a sliding attention window"
    if getattr(config, "attention_dropout", 0.0):
        return "attention dropout (not applied by the functional maths)"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) in ("dynamic", "longrope"):
        return "a rope type whose frequencies change with the sequence length"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    if any(p.dtype != torch.float32 for p in model.parameters()):
        return "weights that are not float32"
    inner = getattr(model, "model", None)
    if (
        inner is None
        or not hasattr(inner, "layers")
        or not hasattr(inner, "rotary_emb")
        or not hasattr(model, "lm_head")
    ):
        return "an unexpected module layout"
    return None


def _rotate(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """Rotary embedding: ``x*cos + rotate_half(x)*sin``, with ``rotate_half(x) = roll(x)`` times the
    sign pattern folded into ``sin_signed`` = ``[-sin_1, sin_2]`` (one op fewer than slicing and cat)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


def _signed(sin: Tensor) -> Tensor:
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotary(model, positions: Tensor) -> tuple[Tensor, Tensor]:
    """(cos, sin_signed) [..., head_dim] for integer ``positions`` [...] from the model's own rotary module
    (so every rope type and scaling the model supports applies)."""
    flat = positions.reshape(1, -1)  # [1,N]
    cos, sin = model.model.rotary_emb(model.model.embed_tokens.weight[:1], flat)  # [1,N,hd] each
    shape = (*positions.shape, cos.shape[-1])
    return cos.reshape(shape), _signed(sin).reshape(shape)


# --------------------------------------------------------------------------- RMSNorm in fewer ops
# ``F.rms_norm`` on the CPU runs ~7 ops (pow, mean, add, rsqrt, two muls, a cast) and autograd records
# each of them. Here ``rms = hypot(‖x‖, sqrt(D·eps)) / sqrt(D)``, which is sqrt(mean(x²) + eps)
# exactly, so the forward is a norm, a hypot, a scale and two products, and the backward is written
# out. Forward + backward measured 1.6-2.4x faster on [1536,128] to [8576,256]; same values to rounding.
_HYPOT_FLOORS: dict[tuple[int, float], Tensor] = {}


def _rms(x: Tensor, eps: float) -> Tensor:
    """[...,1] sqrt(mean(x²) + eps) over the last dim of ``x``."""
    D = x.shape[-1]
    floor = _HYPOT_FLOORS.get((D, eps))
    if floor is None:
        floor = _HYPOT_FLOORS[(D, eps)] = torch.tensor(math.sqrt(D * eps))  # hypot(‖x‖, floor)² = Σx² + D·eps
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True).hypot_(floor).mul_(1.0 / math.sqrt(D))  # [...,1]


class _RMSNorm(torch.autograd.Function):
    """``x / rms(x) * weight``, keeping only ``x̂ = x / rms`` and ``rms`` for the backward:
    ``dx = (g·w − x̂·mean(g·w·x̂)) / rms`` and ``dw = Σ g·x̂``."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        rms = _rms(x, eps)  # [...,1]
        normed = x / rms  # [...,D]
        ctx.save_for_backward(normed, rms, weight)
        return normed * weight  # [...,D]

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        normed, rms, weight = ctx.saved_tensors
        grad_weight = None
        if ctx.needs_input_grad[1]:
            # weight's shape ([D], or per head [H,D])
            grad_weight = (grad_out * normed).reshape(-1, *weight.shape).sum(0)
        grad_normed = grad_out * weight  # [...,D]
        along = (grad_normed * normed).mean(dim=-1, keepdim=True)  # [...,1] the part of the gradient along x̂
        grad_x = grad_normed.sub_(normed * along).div_(rms)  # [...,D]
        return grad_x, grad_weight, None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim of ``x`` [...,D] with ``weight`` [D] (or per head, broadcastable),
    as the Llama-family module computes it in float32; differentiable in both inputs."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return torch.div(x, _rms(x, eps)).mul_(weight)  # [...,D]


# --------------------------------------------------------------------------- training (autograd)
class _SwiGLUDown(torch.autograd.Function):
    """``down(silu(gate) * up)`` from ``gate_up`` = [gate | up], keeping only ``gate_up`` for the
    backward: ``silu(gate)`` and the product are recomputed there (three elementwise ops) instead of
    being stored, which saves 2·I floats per token per layer (about a third of the activations of a
    Llama-family layer, so the peak memory of a training step drops by as much)."""

    @staticmethod
    def forward(ctx, gate_up: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        # ``weight`` in a lower dtype than ``gate_up`` (model.matmul=bfloat16): the two products run in it
        gate, up = gate_up.chunk(2, dim=-1)  # [...,I] each
        ctx.save_for_backward(gate_up, weight)
        ctx.has_bias = bias is not None
        return _lin(F.silu(gate).mul_(up), weight, bias)  # [...,D]

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        gate_up, weight = ctx.saved_tensors
        return _swiglu_down_backward(gate_up, weight, ctx.has_bias, grad_out)


def _swiglu_down_backward(gate_up: Tensor, weight: Tensor, has_bias: bool, grad_out: Tensor):
    """Gradients of ``down(silu(gate) * up)`` for ``gate_up`` [...,2I], the down weight and its bias."""
    # Elementwise passes over [...,I] are memory-bound here, so they are kept few: 8 instead of 12 + a cat.
    gate, up = gate_up.chunk(2, dim=-1)  # [...,I] each
    sig = torch.sigmoid(gate)  # [...,I]
    silu = gate * sig  # [...,I]
    flat_grad_out = grad_out.reshape(-1, grad_out.shape[-1])  # [N,D]
    grad_bias = flat_grad_out.sum(0) if has_bias else None  # [D]
    if weight.dtype == gate_up.dtype:
        # [D,I] product recomputed, freed at once
        grad_weight = flat_grad_out.t() @ (silu * up).reshape(-1, up.shape[-1])
        grad_product = grad_out @ weight  # [...,I]
    else:  # both backward GEMMs in the weight's dtype (its gradient is cast to the float32 master by autograd)
        low = weight.dtype
        grad_weight = flat_grad_out.t().to(low) @ (silu * up).reshape(-1, up.shape[-1]).to(low)  # [D,I]
        grad_product = (grad_out.to(low) @ weight).to(gate_up.dtype)  # [...,I]
    grad_gate_up = torch.empty_like(gate_up)  # [...,2I] written in place of a cat
    grad_gate, grad_up = grad_gate_up.chunk(2, dim=-1)  # [...,I] views
    torch.mul(grad_product, silu, out=grad_up)
    silu_grad = silu.addcmul_(silu, sig, value=-1).add_(sig)  # silu'(g) = σ + silu·(1 − σ), in silu's storage
    torch.mul(grad_product.mul_(up), silu_grad, out=grad_gate)
    return grad_gate_up, grad_weight, grad_bias


class _SwiGLUMLP(torch.autograd.Function):
    """The whole MLP, ``down(silu(gate) * up)`` with ``[gate | up] = h @ gate_up_weight.T + bias``, keeping
    only its input ``h`` [...,D] for the backward (``perf.recompute_mlp``): ``gate_up`` [...,2I] is
    recomputed there by one more GEMM instead of being stored — with I = 4D, 2I of the ~4.5 I + 6 D
    floats a Llama-family layer saves per token. Same values and gradients as ``_SwiGLUDown`` after
    the gate|up product (the recomputed product is the forward's, bit for bit)."""

    @staticmethod
    def forward(
        ctx, h: Tensor, gate_up_weight: Tensor, gate_up_bias: Tensor | None, weight: Tensor, bias: Tensor | None
    ) -> Tensor:
        gate_up = _lin(h, gate_up_weight, gate_up_bias)  # [...,2I] freed after this call
        gate, up = gate_up.chunk(2, dim=-1)  # [...,I] each
        ctx.save_for_backward(h, gate_up_weight, gate_up_bias, weight)
        ctx.has_bias = bias is not None
        return _lin(F.silu(gate).mul_(up), weight, bias)  # [...,D]

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        h, gate_up_weight, gate_up_bias, weight = ctx.saved_tensors
        gate_up = _lin(h, gate_up_weight, gate_up_bias)  # [...,2I] the forward's product again
        grad_gate_up, grad_weight, grad_bias = _swiglu_down_backward(gate_up, weight, ctx.has_bias, grad_out)
        flat_grad = grad_gate_up.reshape(-1, grad_gate_up.shape[-1])  # [N,2I]
        flat_h = h.reshape(-1, h.shape[-1])  # [N,D]
        grad_gate_up_bias = flat_grad.sum(0) if gate_up_bias is not None else None  # [2I]
        low = gate_up_weight.dtype
        if low == h.dtype:
            grad_h = grad_gate_up @ gate_up_weight  # [...,D]
            grad_gate_up_weight = flat_grad.t() @ flat_h  # [2I,D]
        else:  # as precision.linear's backward: both products in the weight's dtype
            grad_h = (grad_gate_up.to(low) @ gate_up_weight).to(h.dtype)  # [...,D]
            grad_gate_up_weight = flat_grad.t().to(low) @ flat_h.to(low)  # [2I,D]
        return grad_h, grad_gate_up_weight, grad_gate_up_bias, grad_weight, grad_bias


def _low(weight: Tensor, low: torch.dtype | None) -> Tensor:
    """``weight`` cast to the products' dtype (differentiable: the gradient returns in float32), or as it is."""
    return weight if low is None else weight.to(low)


def hidden_states(
    model,
    input_ids: Tensor,
    positions: Tensor,
    allowed: Tensor,
    layers: dict[int, Tensor] | None = None,
    matmul: torch.dtype | None = None,
    recompute_mlp: bool = False,
    checkpoint_layers: bool = False,
) -> Tensor:
    """[N,W,D] final-norm hidden states for ``input_ids`` [N,W] at ``positions`` [N,W]; ``allowed``
    [N,W,W] bool says which key each query sees (every query must see at least itself).
    ``layers``: a dict whose keys name residual-stream states to keep (0 = the embeddings, l = after
    decoder layer l); they are written into it as [N,W,D]. ``matmul``: the GEMMs' dtype when not
    float32 (``model.matmul``); the rest stays float32. ``recompute_mlp``: each MLP keeps only its
    input for the backward and recomputes its gate|up product there (``perf.recompute_mlp``).
    ``checkpoint_layers``: each decoder layer keeps only its input for the backward and runs again there
    (``perf.activation_checkpointing``: same values and gradients, activations of one layer at a time).

    Gradients flow to the model's parameters; the maths is the model's own layer by layer."""
    inner = model.model
    x = inner.embed_tokens(input_ids)  # [N,W,D]
    if layers is not None and 0 in layers:
        layers[0] = x
    cos, sin_signed = rotary(model, positions)  # [N,W,hd] each
    cos, sin_signed = cos[:, None], sin_signed[:, None]  # [N,1,W,hd] broadcast over heads
    mask = allowed[:, None]  # [N,1,W,W]
    for index, layer in enumerate(inner.layers):
        if checkpoint_layers and torch.is_grad_enabled():  # keep the layer's input only; recompute it in the backward
            x = checkpoint(_layer, layer, x, cos, sin_signed, mask, matmul, recompute_mlp, use_reentrant=False)
        else:
            x = _layer(layer, x, cos, sin_signed, mask, matmul, recompute_mlp)  # [N,W,D]
        if layers is not None and index + 1 in layers:
            layers[index + 1] = x
    return rms_norm(x, inner.norm.weight, inner.norm.variance_epsilon)  # [N,W,D]


def _layer(
    layer, x: Tensor, cos: Tensor, sin_signed: Tensor, mask: Tensor, matmul: torch.dtype | None, recompute_mlp: bool
) -> Tensor:
    """One decoder layer of :func:`hidden_states`: ``x`` [N,W,D] -> [N,W,D]."""
    N, W, D = x.shape
    attn, mlp = layer.self_attn, layer.mlp
    hd = attn.head_dim
    H, K = attn.q_proj.weight.shape[0] // hd, attn.k_proj.weight.shape[0] // hd
    h = rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)  # [N,W,D]
    # one GEMM for q|k|v and one for gate|up: fewer, larger products (their backward splits the gradient)
    qkv = _lin(
        h,
        _low(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), matmul),
        _cat_bias(attn.q_proj, attn.k_proj, attn.v_proj),
    ).view(N, W, H + 2 * K, hd)  # [N,W,H+2K,hd]
    q, k, v = qkv.split([H, K, K], dim=2)  # [N,W,H|K|K,hd]
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before the rotation
        q = rms_norm(q, attn.q_norm.weight, attn.q_norm.variance_epsilon)
        k = rms_norm(k, attn.k_norm.weight, attn.k_norm.variance_epsilon)
    q = _rotate(q.transpose(1, 2), cos, sin_signed)  # [N,H,W,hd]
    k = _rotate(k.transpose(1, 2), cos, sin_signed)  # [N,K,W,hd]
    out = F.scaled_dot_product_attention(
        q, k, v.transpose(1, 2), attn_mask=mask, scale=attn.scaling, enable_gqa=H != K
    )  # [N,H,W,hd]
    # [N,W,D]
    x = x + _lin(out.transpose(1, 2).reshape(N, W, H * hd), _low(attn.o_proj.weight, matmul), attn.o_proj.bias)
    h = rms_norm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
    gate_up_weight = _low(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), matmul)  # [2I,D]
    gate_up_bias = _cat_bias(mlp.gate_proj, mlp.up_proj)
    if recompute_mlp and torch.is_grad_enabled():
        x = x + _SwiGLUMLP.apply(
            h, gate_up_weight, gate_up_bias, _low(mlp.down_proj.weight, matmul), mlp.down_proj.bias
        )  # [N,W,D]
    else:
        gate_up = _lin(h, gate_up_weight, gate_up_bias)  # [N,W,2I]
        x = x + _SwiGLUDown.apply(gate_up, _low(mlp.down_proj.weight, matmul), mlp.down_proj.bias)  # [N,W,D]
    return x


# --------------------------------------------------------------------------- generation (no autograd)
@dataclass
class _LayerWeights:
    """One layer's weights for decoding, fused and contiguous, [out, in] like ``nn.Linear`` (MKL reads
    that layout as fast as [in, out] for small batches, and up to 20% faster for wide matrices)."""

    norm_in: Tensor  # [D]
    eps_in: float
    qkv: Tensor  # [(H+2K)*hd,D] q | k | v projections stacked
    qkv_bias: Tensor | None  # [(H+2K)*hd]
    qk_norm: Tensor | None  # [H+K,hd] Qwen3's per-head norms, q's weight repeated H times then k's K times
    eps_qk: float
    o: Tensor  # [D,H*hd]
    o_t: Tensor  # [H*hd,D] a transposed view of `o` (for addmm; no copy)
    o_bias: Tensor | None
    norm_post: Tensor  # [D]
    eps_post: float
    gate_up: Tensor  # [2I,D]
    gate_up_bias: Tensor | None
    down: Tensor  # [D,I]
    down_t: Tensor  # [I,D] view
    down_bias: Tensor | None


def _clone(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().clone()


def _cat_bias(*modules) -> Tensor | None:
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else m.weight.new_zeros(m.weight.shape[0]) for b, m in zip(biases, modules)])


class DecodeState:
    """A batch being decoded: weight snapshot + a KV cache preallocated for ``capacity`` columns.

    Rows are left-padded prompts followed by their completions; every row writes its next token in
    the same column, so a step is one column. ``key_bias`` [R,capacity] is 0 where a column holds a
    real token and -inf on prompt padding.

    Generation hooks (``groupwise.hooks``, the kinds in ``hooks``): ``prefill(..., embed_add)`` adds
    [R,W,D] to the prompt's input embeddings; ``steer(layer, add)`` adds ``add`` [R,D] (one vector
    per row) to the residual stream after decoder layer ``layer`` (0: the embeddings) at every
    position, in the prefill and every step.

    ``matmul``: the GEMMs' dtype when not float32 (``model.matmul``): the projection and head
    matrices are snapshotted in it; activations, norms, the cache and attention stay float32.
    """

    hooks = frozenset({"embed_delta", "residual_add"})

    @torch.no_grad()
    def __init__(self, model, matmul: torch.dtype | None = None):
        self.model = model
        low = (lambda t: t) if matmul is None else (lambda t: t.to(matmul))  # noqa: E731 the GEMM weights' snapshot dtype
        inner = model.model
        first = inner.layers[0].self_attn
        self.head_dim = first.head_dim
        self.heads = first.q_proj.weight.shape[0] // self.head_dim
        self.kv_heads = first.k_proj.weight.shape[0] // self.head_dim
        self.scaling = first.scaling
        self.gqa = self.heads != self.kv_heads
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qk_norm = None
            if hasattr(attn, "q_norm"):
                qk_norm = torch.cat(
                    [attn.q_norm.weight.expand(self.heads, -1), attn.k_norm.weight.expand(self.kv_heads, -1)]
                ).contiguous()
            o, down = low(attn.o_proj.weight.detach().clone()), low(mlp.down_proj.weight.detach().clone())
            self.layers.append(
                _LayerWeights(
                    norm_in=layer.input_layernorm.weight.detach().clone(),
                    eps_in=layer.input_layernorm.variance_epsilon,
                    qkv=low(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])),
                    qkv_bias=_cat_bias(attn.q_proj, attn.k_proj, attn.v_proj),
                    qk_norm=qk_norm,
                    eps_qk=attn.q_norm.variance_epsilon if qk_norm is not None else 0.0,
                    o=o,
                    o_t=o.t(),
                    o_bias=_clone(attn.o_proj.bias),
                    norm_post=layer.post_attention_layernorm.weight.detach().clone(),
                    eps_post=layer.post_attention_layernorm.variance_epsilon,
                    gate_up=low(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                    gate_up_bias=_cat_bias(mlp.gate_proj, mlp.up_proj),
                    down=down,
                    down_t=down.t(),
                    down_bias=_clone(mlp.down_proj.bias),
                )
            )
        self.embed = inner.embed_tokens.weight.detach()  # [V,D] read-only lookups: no copy
        self.final_norm, self.eps_final = inner.norm.weight.detach().clone(), inner.norm.variance_epsilon
        self.head = low(model.lm_head.weight.detach().clone())  # [V,D]
        self.head_bias = _clone(getattr(model.lm_head, "bias", None))
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.key_bias = torch.empty(0)
        self.steer_layer, self.steer_add = -1, None  # residual_add: the layer, [A,D] per live row

    def steer(self, layer: int, add: Tensor) -> None:
        """Add ``add`` [R,D] to the residual stream after decoder layer
        ``layer`` (0: the embeddings), every position."""
        if not 0 <= layer <= len(self.layers):
            raise ValueError(
                f"residual_add hook: layer={layer} but the model has "
                f"decoder layers 1..{len(self.layers)} (0: the embeddings)"
            )
        self.steer_layer, self.steer_add = layer, add

    def close(self) -> None:
        """Nothing to release (the interface of the engine's other decoding state)."""

    # ------------------------------------------------------------------ one layer
    def _layer(self, w: _LayerWeights, x: Tensor, cos: Tensor, sin_signed: Tensor, attend) -> Tensor:
        """x [R,S,D] -> [R,S,D]; ``attend(q [R,H,S,hd], k, v [R,K,S,hd]) -> [R,H,S,hd]`` owns the cache."""
        R, S, D = x.shape
        H, K, hd = self.heads, self.kv_heads, self.head_dim
        h = rms_norm(x, w.norm_in, w.eps_in).view(R * S, D)  # [R*S,D]
        qkv = _lin(h, w.qkv, w.qkv_bias)  # [R*S,(H+2K)*hd]
        qkv = qkv.view(R, S, H + 2 * K, hd)
        qk = qkv[:, :, : H + K]  # [R,S,H+K,hd]
        if w.qk_norm is not None:
            qk = rms_norm(qk, w.qk_norm, w.eps_qk)  # [R,S,H+K,hd]
        qk = _rotate(qk.transpose(1, 2), cos, sin_signed)  # [R,H+K,S,hd]
        out = attend(qk[:, :H], qk[:, H:], qkv[:, :, H + K :].transpose(1, 2))  # [R,H,S,hd]
        x = x.view(R * S, D)
        x = _addmm(x, out.transpose(1, 2).reshape(R * S, H * hd), w.o_t)  # [R*S,D] residual folded in
        if w.o_bias is not None:
            x = x + w.o_bias
        h = rms_norm(x, w.norm_post, w.eps_post)  # [R*S,D]
        gate_up = _lin(h, w.gate_up, w.gate_up_bias)  # [R*S,2I]
        gate, up = gate_up.chunk(2, dim=-1)  # [R*S,I] each
        x = _addmm(x, F.silu(gate).mul_(up), w.down_t)  # [R*S,D]
        if w.down_bias is not None:
            x = x + w.down_bias
        return x.view(R, S, D)

    def _logits(self, x: Tensor) -> Tensor:
        h = rms_norm(x, self.final_norm, self.eps_final)  # [R,D]
        return _lin(h, self.head, self.head_bias)  # [R,V] float32

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(
        self,
        input_ids: Tensor,
        positions: Tensor,
        real: Tensor,
        repeat: int,
        capacity: int,
        embed_add: Tensor | None = None,
    ) -> Tensor:
        """Run left-padded prompts ``input_ids`` [B,W] (``real`` [B,W] bool marks tokens, ``positions``
        [B,W] their positions), keep their KV ``repeat`` times per prompt (rows ``b*repeat+i``) in a
        cache of ``capacity`` >= W columns, and return the last column's logits [B,V] float32.
        ``embed_add`` [B,W,D] is added to the input embeddings (a generation hook); a steering
        addition (``steer``) needs ``repeat = 1`` (one per row)."""
        B, W = input_ids.shape
        causal = torch.ones(W, W, dtype=torch.bool).tril_()  # [W,W]
        # a padding query sees itself too, so no softmax row is empty (its output is never used)
        allowed = ((causal & real[:, None, :]) | torch.eye(W, dtype=torch.bool))[:, None]  # [B,1,W,W]
        # one rotary table for every position this batch can reach; decode steps index it
        # [P,hd] each
        self.cos, self.sin_signed = rotary(self.model, torch.arange(int(positions.max()) + capacity - W + 1))
        cos, sin_signed = self.cos[positions][:, None], self.sin_signed[positions][:, None]  # [B,1,W,hd] each
        R = B * repeat
        self.keys = [torch.empty(R, self.kv_heads, capacity, self.head_dim) for _ in self.layers]  # [R,K,C,hd] each
        self.values = [torch.empty(R, self.kv_heads, capacity, self.head_dim) for _ in self.layers]
        self.key_bias = torch.zeros(R, capacity)  # [R,C]
        self.key_bias[:, :W] = torch.zeros(B, W).masked_fill_(~real, float("-inf")).repeat_interleave(repeat, dim=0)
        x = self.embed[input_ids]  # [B,W,D]
        if embed_add is not None:
            x = x + embed_add  # [B,W,D]
        steer = None if self.steer_add is None else self.steer_add[:, None, :]  # [B,1,D]
        if steer is not None and (repeat != 1 or steer.shape[0] != B):
            raise ValueError("a steered prefill needs one prompt per row (repeat = 1)")
        if self.steer_layer == 0:
            x = x + steer
        for i, w in enumerate(self.layers):

            def attend(q: Tensor, k: Tensor, v: Tensor, i: int = i) -> Tensor:
                self.keys[i][:, :, :W] = k.repeat_interleave(repeat, dim=0)
                self.values[i][:, :, :W] = v.repeat_interleave(repeat, dim=0)
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=allowed, scale=self.scaling, enable_gqa=self.gqa
                )  # [B,H,W,hd]

            x = self._layer(w, x, cos, sin_signed, attend)
            if self.steer_layer == i + 1:
                x = x + steer  # [B,W,D]
        return self._logits(x[:, -1]).float()  # [B,V]

    # ------------------------------------------------------------------ one decode step
    @torch.no_grad()
    def step(self, tokens: Tensor, positions: Tensor, column: int) -> Tensor:
        """Append ``tokens`` [A] (at ``positions`` [A]) in cache column ``column``; logits [A,V] float32.

        The prefill's layer maths specialised to one token per row: 2-D activations, views by
        ``narrow``/``select`` (the per-op cost, not arithmetic, bounds a small decode step)."""
        seen = column + 1
        A, H, K, hd = tokens.shape[0], self.heads, self.kv_heads, self.head_dim
        few_rows = A * K < 64  # few rows: SDPA's one call wins; more rows: two batched GEMMs win (measured)
        bias = self.key_bias[:, None, None, :seen]  # [A,1,1,seen]
        cos, sin_signed = self.cos[positions][:, None], self.sin_signed[positions][:, None]  # [A,1,hd] each
        x = self.embed[tokens]  # [A,D]
        if self.steer_layer == 0:
            x = x + self.steer_add  # [A,D]
        for index, (w, keys, values) in enumerate(zip(self.layers, self.keys, self.values)):
            h = rms_norm(x, w.norm_in, w.eps_in)  # [A,D]
            qkv = _lin(h, w.qkv, w.qkv_bias).view(A, H + 2 * K, hd)  # [A,H+2K,hd]
            qk = qkv.narrow(1, 0, H + K)  # [A,H+K,hd]
            if w.qk_norm is not None:
                qk = rms_norm(qk, w.qk_norm, w.eps_qk)  # [A,H+K,hd]
            qk = _rotate(qk, cos, sin_signed)  # [A,H+K,hd]
            keys.select(2, column).copy_(qk.narrow(1, H, K))  # cache [A,K,C,hd] <- [A,K,hd]
            values.select(2, column).copy_(qkv.narrow(1, H + K, K))
            past_keys, past_values = keys.narrow(2, 0, seen), values.narrow(2, 0, seen)  # [A,K,seen,hd] each
            q = qk.narrow(1, 0, H)  # [A,H,hd]
            if few_rows:
                out = F.scaled_dot_product_attention(
                    q.unsqueeze(2), past_keys, past_values, attn_mask=bias, scale=self.scaling, enable_gqa=self.gqa
                )  # [A,H,1,hd]
            else:  # GQA without repeating the cache: the H/K query heads of each kv head share one matmul
                scores = (
                    torch.matmul(q.reshape(A, K, H // K, hd), past_keys.transpose(-1, -2)).mul_(self.scaling).add_(bias)
                )  # [A,K,H/K,seen]
                out = torch.matmul(scores.softmax(dim=-1), past_values)  # [A,K,H/K,hd]
            x = _addmm(x, out.reshape(A, H * hd), w.o_t)  # [A,D] residual folded in
            if w.o_bias is not None:
                x = x + w.o_bias
            # [A,I] each
            gate, up = _lin(rms_norm(x, w.norm_post, w.eps_post), w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
            x = _addmm(x, F.silu(gate).mul_(up), w.down_t)  # [A,D]
            if w.down_bias is not None:
                x = x + w.down_bias
            if self.steer_layer == index + 1:
                x = x + self.steer_add  # [A,D]
        return self._logits(x).float()  # [A,V]

    def select(self, keep: Tensor) -> None:
        """Keep only rows ``keep`` [A'] (finished rows leave the batch)."""
        self.keys = [k[keep] for k in self.keys]
        self.values = [v[keep] for v in self.values]
        self.key_bias = self.key_bias[keep]
        if self.steer_add is not None:
            self.steer_add = self.steer_add[keep]
