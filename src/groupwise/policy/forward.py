"""Log-probs (and entropies) of completion tokens from one packed forward pass.

Every scored row's ``prompt + completion`` is laid end to end in bins no longer than the longest
row (first-fit decreasing), an input ``[n_bins, width]`` whose ``position_ids`` restart at 0 for
each row. Supported models run ``policy.functional.hidden_states`` with the block-diagonal causal
mask built here; others get ``attention_mask=None`` and transformers 5.x reads the restarts as
packed sequences (``masking_utils.find_packed_sequence_indices``). Attention kernels compute the
dense (masked) square of a bin, so bins stay as short as the longest row: short rows share a bin,
nothing is widened (256-token bins of 22-token rows cost 1.7x the forward + backward of 22-token
bins on the small bench model). Or each group is laid out as one prompt and its G completions
under a tree mask, when ``_layout_cost`` says the saved prompt tokens outweigh the wider square.

Logits are computed only where they are needed: the decoder's hidden states at position ``p-1``
for every completion token ``p`` go through the output head (plus the logit scaling or
soft-capping some architectures apply). Memory for logits is ``[completion tokens, V]``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from groupwise.policy import functional as functional_forward
from groupwise.policy.functional import unsupported_reason
from groupwise.policy.precision import autocast, linear


def _completion_lengths(mask: Tensor, rows: Tensor) -> Tensor:
    """[B,G] completion length of each row (0 for rows not scored); checks that ``mask`` is a prefix."""
    lengths = mask.sum(dim=-1)  # [B,G]
    T = mask.shape[-1]
    is_prefix = mask == (torch.arange(T, device=mask.device) < lengths[..., None])  # [B,G,T]
    if not bool(is_prefix[rows].all()):
        raise ValueError("mask must be a prefix per row: True for the completion tokens, then False")
    return lengths * rows  # [B,G]


def _token_stats(logits: Tensor, targets: Tensor, want_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """(logp [K], entropy [K] or None) of ``targets`` [K] under ``logits`` [K,V], in float32."""
    logp_all = torch.log_softmax(logits.float(), dim=-1)  # [K,V]
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)  # [K]
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1) if want_entropy else None  # [K]
    return logp, entropy


def _keeps_index_tensor(model) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (a PEFT wrapper forwards it to its base)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def pack_bins(lengths: list[int], capacity: int = 0) -> list[list[int]]:
    """First-fit decreasing: row indices per bin, each bin's total length at most
    ``max(capacity, longest row)``. Attention inside a bin is quadratic in its length, so bins as
    short as the longest row (the default) pack short rows together without widening anything."""
    capacity = max(capacity, max(lengths))
    shortest = min(lengths)
    bins: list[list[int]] = []
    room: list[int] = []
    open_bins: list[int] = []  # bins that can still take the shortest row, in creation order
    for i in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        for slot, b in enumerate(open_bins):
            if lengths[i] <= room[b]:
                bins[b].append(i)
                room[b] -= lengths[i]
                if room[b] < shortest:  # full for good: later rows are no shorter than the shortest
                    del open_bins[slot]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
            if room[-1] >= shortest:
                open_bins.append(len(bins) - 1)
    return bins


# CPU attention kernels do a (query, key) pair's 4·hidden FLOPs several times slower than a GEMM does
# a token's (measured: SDPA's flash kernel at head dim 32 vs MKL GEMMs, forward + backward).
_ATTENTION_SLOWDOWN = 4.0


def _layout_cost(model, sizes: list[int], capacity: int) -> float:
    """Relative cost of one forward over segments of ``sizes`` packed into bins: every bin is padded to
    the widest, GEMMs scale with the tokens, dense masked attention with the width squared."""
    bins = pack_bins(sizes, capacity)
    width = max(sum(sizes[i] for i in items) for items in bins)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    hidden = getattr(config, "hidden_size", 1)
    # attention + gated MLP
    layer_params = 4 * hidden * hidden + 3 * hidden * getattr(config, "intermediate_size", 4 * hidden)
    return len(bins) * (width * 2 * layer_params + _ATTENTION_SLOWDOWN * 4 * hidden * width * width)


def _head(model, hidden: Tensor, matmul: torch.dtype | None = None) -> Tensor:
    """The model's output head on selected hidden states [K,H] -> logits [K,V], with the logit
    transforms some architectures apply after ``lm_head`` (scale, soft-capping). ``matmul``: the
    product in that dtype, the logits cast back to ``hidden``'s (float32 before any log-softmax)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if matmul is None or hidden.dtype == matmul:
        logits = head(hidden)  # [K,V]
    else:
        logits = linear(hidden, head.weight.to(matmul), getattr(head, "bias", None))  # [K,V] in hidden's dtype
    config = base.config
    if getattr(config, "logit_scale", None):  # Cohere
        logits = logits * config.logit_scale
    if getattr(config, "logits_scaling", None):  # Granite
        logits = logits / config.logits_scaling
    if getattr(config, "final_logit_softcapping", None):  # Gemma 2/3
        cap = config.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    return logits


class _LayerTap:
    """Residual-stream states of the model's own decoder (forward hooks): 0 = embeddings, l = after
    decoder layer l, as [n_bins,width,H]. Used when ``hidden(l)`` is requested off the functional path."""

    def __init__(self, model, wanted: set[int]):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        decoder = base.get_decoder()
        self.states: dict[int, Tensor] = {}
        self.handles = []
        for l in sorted(wanted):
            module = decoder.embed_tokens if l == 0 else decoder.layers[l - 1]
            self.handles.append(
                module.register_forward_hook(
                    lambda m, i, o, l=l: self.states.__setitem__(l, o[0] if isinstance(o, tuple) else o)
                )
            )

    def __enter__(self) -> dict[int, Tensor]:
        return self.states

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()


@contextlib.contextmanager
def _checkpointed(layers, on: bool):
    """While open, each of the model's own decoder ``layers`` keeps only its inputs for the backward and
    runs again there (``perf.activation_checkpointing`` off the functional path). The instance's
    ``forward`` is swapped, not its ``__call__``: hooks on the layer (FSDP2's gather) still run once."""
    if not on:
        yield
        return
    own = [layer.__dict__.get("forward") for layer in layers]  # an instance's own forward, if it had one
    for layer in layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    try:
        yield
    finally:
        for layer, forward in zip(layers, own):
            if forward is None:
                del layer.forward  # the class's forward again
            else:
                layer.forward = forward


def _decoder_hidden(
    model,
    input_ids: Tensor,
    position_ids: Tensor,
    allowed: Tensor | None,
    attention_mask,
    layers: set[int],
    functional: bool,
    matmul: torch.dtype | None = None,
    recompute_mlp: bool = False,
    checkpoint_layers: bool = False,
) -> tuple[Tensor, dict[int, Tensor]]:
    """([n,W,H] final-norm hidden states, {l: [n,W,H]}) from the functional decoder or the model's own
    (``matmul``: explicit low-precision GEMMs in the former, autocast around the latter;
    ``recompute_mlp``: the former's MLPs recompute gate|up in the backward instead of storing it)."""
    device = next(model.parameters()).device
    if functional and unsupported_reason(model) is None:
        kept: dict[int, Tensor] = dict.fromkeys(layers)
        hidden = functional_forward.hidden_states(
            model,
            input_ids.to(device),
            position_ids.to(device),
            allowed.to(device),
            kept if layers else None,
            matmul=matmul,
            recompute_mlp=recompute_mlp,
            checkpoint_layers=checkpoint_layers,
        )
        return hidden, kept
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    recompute = checkpoint_layers and torch.is_grad_enabled()
    with (
        _LayerTap(model, layers) as kept,
        autocast(device, matmul),
        _checkpointed(base.get_decoder().layers, recompute),
    ):
        hidden = base.get_decoder()(
            input_ids=input_ids.to(device),
            position_ids=position_ids.to(device),
            attention_mask=attention_mask,
            use_cache=False,
        ).last_hidden_state  # [n,W,H]
    return hidden, dict(kept)


def _gather(hidden: Tensor, layers: dict[int, Tensor], at: Tensor) -> tuple[Tensor, dict[int, Tensor]]:
    """Rows ``at`` [K] of the flattened [n*W,H] states: ([K,H], {l: [K,H]})."""
    at = at.to(hidden.device)
    flat = lambda x: x.reshape(-1, x.shape[-1])[at]  # noqa: E731  [K,H]
    return flat(hidden), {l: flat(x) for l, x in layers.items()}


def _packed_hidden(
    model,
    sequences: list[list[int]],
    prompt_lengths: list[int],
    completion_lengths: list[int],
    pack_tokens: int = 0,
    functional: bool = True,
    layers: set[int] = frozenset(),
    matmul: torch.dtype | None = None,
    recompute_mlp: bool = False,
    checkpoint_layers: bool = False,
) -> tuple[Tensor, dict[int, Tensor]]:
    """([K,H], {l: [K,H]}) hidden states predicting every completion token of the rows, in row order,
    from bins of packed rows: input [n_bins, width] with position ids restarting at 0 for each row (and
    for each bin's padding tail), so every row attends only to itself."""
    bins = pack_bins([len(s) for s in sequences], pack_tokens)
    width = max(sum(len(sequences[i]) for i in rows) for rows in bins)
    ids: list[int] = []  # assembled as Python ints, converted once (per-row tensor ops cost more here)
    positions: list[int] = []
    flat_start = [0] * len(sequences)  # where each row starts in the flattened [n_bins*width]
    for b, rows in enumerate(bins):
        for i in rows:
            flat_start[i] = len(positions)
            ids += sequences[i]
            positions += range(len(sequences[i]))
        tail = (b + 1) * width - len(positions)
        ids += [0] * tail
        positions += range(tail)  # the padding tail is a segment of its own
    input_ids = torch.tensor(ids, dtype=torch.long).view(len(bins), width)  # [n_bins,width]
    position_ids = torch.tensor(positions, dtype=torch.long).view(len(bins), width)  # [n_bins,width]
    # completion token j of a row sits at start + P + j and is predicted from start + P + j - 1
    predict_at = torch.tensor(
        [
            flat_start[i] + p - 1 + j
            for i, (p, c) in enumerate(zip(prompt_lengths, completion_lengths))
            for j in range(c)
        ],
        dtype=torch.long,
    )  # [K]
    allowed = None
    if functional and unsupported_reason(model) is None:
        segment = (position_ids == 0).cumsum(dim=-1)  # [n_bins,width] a new row starts where positions restart
        index = torch.arange(width)
        # [n_bins,q,k] own row, causal
        allowed = (segment[:, :, None] == segment[:, None, :]) & (index[:, None] >= index[None, :])
    # off the functional path transformers reads the position restarts as packed sequences and builds the same mask
    hidden, kept = _decoder_hidden(
        model, input_ids, position_ids, allowed, None, layers, functional, matmul, recompute_mlp, checkpoint_layers
    )  # [n_bins,width,H]
    return _gather(hidden, kept, predict_at)


def _shared_prefix_hidden(
    model,
    prompts: list[list[int]],
    groups: list[int],
    completions: list[list[int]],
    pack_tokens: int = 0,
    functional: bool = True,
    layers: set[int] = frozenset(),
    matmul: torch.dtype | None = None,
    recompute_mlp: bool = False,
    checkpoint_layers: bool = False,
) -> tuple[Tensor, dict[int, Tensor]]:
    """([K,H], {l: [K,H]}) hidden states predicting every completion token, in row order, with each
    group's prompt computed ONCE: a group is laid out as ``prompt, completion_1, ..., completion_G``
    and a custom attention mask lets completion k see the prompt and its own earlier tokens only (a
    tree). Position ids restart at the prompt length for every completion, so each row is computed
    exactly as if it stood alone. Groups are packed into bins as rows are in ``_packed_hidden``."""
    members: dict[int, list[int]] = {}
    for r, b in enumerate(groups):
        members.setdefault(b, []).append(r)
    order = list(members)
    sizes = [len(prompts[b]) + sum(len(completions[r]) for r in members[b]) for b in order]
    bins = pack_bins(sizes, pack_tokens)
    width = max(sum(sizes[i] for i in items) for items in bins)
    # assembled as Python ints and converted once: per-row tensor ops would cost more than the rest
    ids: list[int] = []
    positions: list[int] = []
    tree: list[int] = []  # group slot within its bin, -1 = padding
    branch: list[int] = []  # 0 = prompt, k+1 = completion k
    predict_at: list[list[int]] = [[] for _ in completions]
    for n, items in enumerate(bins):
        for slot, i in enumerate(items):
            b = order[i]
            P = len(prompts[b])
            ids += prompts[b]
            positions += range(P)
            tree += [slot] * P
            branch += [0] * P
            last_prompt = len(ids) - 1
            for k, r in enumerate(members[b]):
                c = len(completions[r])
                # token 0 is predicted from the prompt's last token, token j from the row's token j-1
                predict_at[r] = [last_prompt, *range(len(ids), len(ids) + c - 1)]
                ids += completions[r]
                positions += range(P, P + c)
                tree += [slot] * c
                branch += [k + 1] * c
        tail = (n + 1) * width - len(ids)
        ids += [0] * tail
        positions += [0] * tail
        tree += [-1] * tail
        branch += [0] * tail
    shape = (len(bins), width)
    input_ids = torch.tensor(ids, dtype=torch.long).view(shape)  # [n_bins,width]
    position_ids = torch.tensor(positions, dtype=torch.long).view(shape)  # [n_bins,width]
    tree_t = torch.tensor(tree, dtype=torch.long).view(shape)  # [n_bins,width]
    branch_t = torch.tensor(branch, dtype=torch.long).view(shape)  # [n_bins,width]
    gather_at = torch.tensor([i for row in predict_at for i in row], dtype=torch.long)  # [K]
    index = torch.arange(width)
    same_tree = (tree_t[:, :, None] == tree_t[:, None, :]) & (tree_t[:, :, None] >= 0)  # [n_bins,q,k]
    # [n_bins,q,k] prompt or own branch
    visible = (branch_t[:, None, :] == 0) | (branch_t[:, :, None] == branch_t[:, None, :])
    causal = index[None, :, None] >= index[None, None, :]  # [1,q,k]
    # [n_bins,q,k] padding sees itself
    allowed = (same_tree & visible & causal) | torch.eye(width, dtype=torch.bool)[None]
    additive = None
    if not (functional and unsupported_reason(model) is None):
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        additive = (
            torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[:, None].to(device)
        )  # [n_bins,1,q,k]
    hidden, kept = _decoder_hidden(
        model, input_ids, position_ids, allowed, additive, layers, functional, matmul, recompute_mlp, checkpoint_layers
    )  # [n_bins,width,H]
    return _gather(hidden, kept, gather_at)


def _padded_hidden(
    model,
    sequences: list[list[int]],
    prompt_lengths: list[int],
    completion_lengths: list[int],
    layers: set[int] = frozenset(),
    matmul: torch.dtype | None = None,
) -> tuple[Tensor, dict[int, Tensor]]:
    """As ``_packed_hidden`` but from a right-padded batch with an attention mask through the model's
    own decoder (the reference path)."""
    N, width = len(sequences), max(len(s) for s in sequences)
    # [N,L] pad id is irrelevant: it is masked
    input_ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences], dtype=torch.long)
    attention_mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences], dtype=torch.long)  # [N,L]
    at = torch.tensor(
        [r * width + p - 1 + j for r, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)) for j in range(c)],
        dtype=torch.long,
    )  # [K]
    device = next(model.parameters()).device
    hidden, kept = _decoder_hidden(
        model,
        input_ids,
        torch.arange(width).expand(N, width),
        None,
        attention_mask.to(device),
        layers,
        functional=False,
        matmul=matmul,
    )
    return _gather(hidden, kept, at)


def parse_quantities(quantities) -> tuple[set[int], list[int], bool, bool]:
    """(hidden layers, top-k sizes, entropy wanted, final hidden wanted) from quantity strings
    (``attn_at(l)`` / ``hidden_at(l)`` are read by ``eager_quantities``)."""
    layers, topks, entropy, last = set(), [], False, False
    for q in quantities:
        name, _, arg = q.partition("(")
        arg = arg.rstrip(")")
        # logprobs: read by completion_logprobs itself
        if name in ("logp", "logprobs") or (name in EAGER and arg.isdigit()):
            continue
        if name == "entropy":
            entropy = True
        elif name == "topk" and arg.isdigit() and int(arg) > 0:
            topks.append(int(arg))
        elif name == "hidden" and arg.isdigit():
            layers.add(int(arg))
        elif name == "last_hidden":
            last = True
        else:
            raise ValueError(
                f"the packed forward cannot compute {q!r}; it computes logp, logprobs, "
                "entropy, topk(k), hidden(l), last_hidden, attn_at(l), hidden_at(l)"
            )
    return layers, topks, entropy, last


EAGER = ("attn_at", "hidden_at")  # quantities of the extra eager pass, at each token's own position


def eager_quantities(quantities) -> list[tuple[str, int]]:
    """The (name, layer) of the ``attn_at(l)`` / ``hidden_at(l)`` quantities asked for."""
    out = []
    for q in quantities:
        name, _, arg = q.partition("(")
        if name in EAGER and arg.rstrip(")").isdigit():
            out.append((name, int(arg.rstrip(")"))))
    return sorted(set(out))


def _eager_states(
    model,
    sequences: list[list[int]],
    prompt_lengths: list[int],
    completion_lengths: list[int],
    wanted: list[tuple[str, int]],
) -> dict[str, Tensor]:
    """{"attn_at(l)": [K,heads,S], "hidden_at(l)": [K,H]} at the position OF every completion token
    of the rows (the query at the token itself), in row order. ``attn_at(l)``: decoder layer l's
    (1-based) attention probabilities over the key positions 0..S-1 of the row's own ``prompt +
    completion`` (S = the longest row; 0 past a row's end and at future keys); ``hidden_at(l)``: the
    model's own ``hidden_states[l]`` (0 = embeddings; l = the layer count: after the final norm). The
    model's own forward on a right-padded batch with eager attention (``output_attentions=True``; an
    SDPA or flash model is switched to eager for the call and back)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    n_layers = int(base.config.num_hidden_layers)
    for name, l in wanted:
        if l > n_layers or (name == "attn_at" and l < 1):
            raise ValueError(
                f"{name}({l}) asked of a model with {n_layers} decoder layers; "
                f"use attn_at(1..{n_layers}) or hidden_at(0..{n_layers})"
            )
    _N, width = len(sequences), max(len(s) for s in sequences)
    device = next(model.parameters()).device
    input_ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences], dtype=torch.long, device=device)  # [N,S]
    attention_mask = torch.tensor(
        [[1] * len(s) + [0] * (width - len(s)) for s in sequences], dtype=torch.long, device=device
    )  # [N,S]
    rows = torch.tensor(
        [r for r, c in enumerate(completion_lengths) for _ in range(c)], dtype=torch.long, device=device
    )  # [K]
    at = torch.tensor(
        [p + j for p, c in zip(prompt_lengths, completion_lengths) for j in range(c)], dtype=torch.long, device=device
    )  # [K]
    attend = any(name == "attn_at" for name, _ in wanted)
    before = base.config._attn_implementation
    if attend and before != "eager":
        base.set_attn_implementation("eager")
    try:
        out = base(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_attentions=attend,
            output_hidden_states=True,
            use_cache=False,
        )
    finally:
        if attend and before != "eager":
            base.set_attn_implementation(before)
    result = {}
    for name, l in wanted:
        if name == "attn_at":
            result[f"attn_at({l})"] = out.attentions[l - 1][rows, :, at].float()  # [K,heads,S]
        else:
            result[f"hidden_at({l})"] = out.hidden_states[l][rows, at].float()  # [K,H]
    return result


def completion_logprobs(
    model,
    prompt_ids: list[list[int]],
    actions: Tensor,
    mask: Tensor,
    rows: Tensor,
    want_entropy: bool = False,
    packed: bool = True,
    pack_tokens: int = 0,
    share_prefix: bool | None = None,
    functional: bool = True,
    quantities=(),
    row_prompts: list[list[list[int]]] | None = None,
    matmul: torch.dtype | None = None,
    recompute_mlp: bool = False,
    checkpoint_layers: bool = False,
) -> dict[str, Tensor]:
    """Per-token log-probs of ``actions`` [B,G,T] given each group's prompt, scattered back to [B,G,T].
    With ``row_prompts`` ([B][G] token lists: row contexts) each row is conditioned on its own
    context instead, and ``share_prefix`` computes each distinct context once.

    Returns ``{"logp": [B,G,T] float32}`` (0 where ``mask`` is False or the row is not in ``rows`` [B,G])
    plus every requested quantity under its own name: ``"entropy"`` [B,G,T] (also with
    ``want_entropy``), ``"logprobs"`` [B,G,T,V] (the whole next-token log-distribution, in vocabulary
    order), ``"topk(k)"`` [B,G,T,k] (the k largest log-probs, descending), ``"hidden(l)"``
    [B,G,T,H] (residual stream after layer l, 0 = embeddings), ``"last_hidden"`` [B,G,T,H] (final-norm
    states the head reads), all at the position that predicts token t and 0 elsewhere; and, at the
    position OF token t (an extra eager, unpacked pass of the model's own forward, ``_eager_states``):
    ``"attn_at(l)"`` [B,G,T,heads,S] (layer l's attention probabilities over the key positions
    0..S-1 of the row's prompt + completion, S = longest prompt + T) and ``"hidden_at(l)"`` [B,G,T,H]
    (the model's ``hidden_states[l]``). Autograd flows
    to the model's parameters unless the caller runs it under ``torch.no_grad()``. ``share_prefix``
    computes each group's prompt once (tree attention); ``None`` chooses the layout with the lower
    estimated cost (``_layout_cost``: the tree saves prompt tokens but its mask is quadratic in a whole
    group's length). ``pack_tokens`` caps a bin's length (0: the longest row or group).
    ``packed=False`` is the padded reference path. ``functional`` runs supported (Llama-family,
    float32) models through ``policy.functional.hidden_states`` instead of their own forward (same
    values, fewer ops). ``matmul``: the model's GEMMs (decoder and head) in that dtype when not
    float32 (``model.matmul=bfloat16``, ``policy/precision.py``); logits are float32 before the
    log-softmax, so every returned quantity is float32. (The eager ``attn_at`` / ``hidden_at`` pass stays float32.)
    ``recompute_mlp``: the functional forward's MLPs keep only their input and recompute gate|up in the
    backward (``perf.recompute_mlp``: same values and gradients, less memory, one more GEMM per layer).
    """
    layers, topks, entropy_wanted, last_wanted = parse_quantities(quantities)
    full_wanted = "logprobs" in quantities
    eager = eager_quantities(quantities)
    want_entropy = want_entropy or entropy_wanted
    B, G, T = actions.shape
    rows = rows.bool()  # [B,G]
    lengths = _completion_lengths(mask.bool(), rows)  # [B,G]
    scored = lengths > 0  # [B,G] rows with at least one token to score
    device = next(model.parameters()).device
    # [B,G,T] tokens that get a value
    out_mask = (torch.arange(T, device=lengths.device) < lengths[..., None]).to(device)
    result = {"logp": torch.zeros(B, G, T, dtype=torch.float32, device=device)}  # [B,G,T]
    if want_entropy:
        result["entropy"] = torch.zeros(B, G, T, dtype=torch.float32, device=device)  # [B,G,T]
    width = _hidden_size(model)
    for k in topks:
        result[f"topk({k})"] = torch.zeros(B, G, T, k, dtype=torch.float32, device=device)  # [B,G,T,k]
    for l in layers:
        result[f"hidden({l})"] = torch.zeros(B, G, T, width, dtype=torch.float32, device=device)  # [B,G,T,H]
    if last_wanted:
        result["last_hidden"] = torch.zeros(B, G, T, width, dtype=torch.float32, device=device)  # [B,G,T,H]
    if full_wanted:
        result["logprobs"] = torch.zeros(B, G, T, _vocab_size(model), dtype=torch.float32, device=device)  # [B,G,T,V]
    if eager:
        heads = int((model.get_base_model() if hasattr(model, "get_base_model") else model).config.num_attention_heads)
        contexts = [c for g in row_prompts for c in g] if row_prompts is not None else list(prompt_ids)
        # S: every key position a row's prompt + completion can have
        keys = max((len(c) for c in contexts), default=0) + T
        for name, l in eager:
            shape = (B, G, T, heads, keys) if name == "attn_at" else (B, G, T, width)
            # [B,G,T,heads,S] or [B,G,T,H]
            result[f"{name}({l})"] = torch.zeros(*shape, dtype=torch.float32, device=device)
    if not bool(scored.any()):
        return result

    # Row order here (b, g row-major, tokens in order) is the order of out_mask's True entries.
    groups, members = scored.nonzero(as_tuple=True)  # [N], [N]
    group_ids, member_ids = groups.tolist(), members.tolist()
    row_groups = group_ids  # [N] each scored row's group, where its actions are
    prompts = [p.tolist() if isinstance(p, Tensor) else list(p) for p in prompt_ids]
    if row_prompts is not None:  # a table of the distinct row contexts; a row's "group" is its context id
        table: dict[tuple[int, ...], int] = {}
        group_ids = [table.setdefault(tuple(row_prompts[b][g]), len(table)) for b, g in zip(group_ids, member_ids)]
        prompts = [list(p) for p in table]
    prompt_lengths = [len(prompts[b]) for b in group_ids]
    if min(prompt_lengths) == 0:
        raise ValueError("a scored row has an empty prompt: its first token has nothing to condition on")
    completion_lengths = lengths[groups, members].tolist()
    action_ids = actions.tolist()  # [B][G][T] host ints: inputs are assembled on the host, moved once
    completions = [action_ids[b][g][:c] for b, g, c in zip(row_groups, member_ids, completion_lengths)]
    # [K] the completion tokens
    targets = torch.tensor([t for c in completions for t in c], dtype=torch.long, device=device)

    if share_prefix is None:
        completed: dict[int, int] = {}
        for b, c in zip(group_ids, completion_lengths):
            completed[b] = completed.get(b, 0) + c
        tree_sizes = [len(prompts[b]) + c for b, c in completed.items()]
        row_sizes = [p + c for p, c in zip(prompt_lengths, completion_lengths)]
        share_prefix = _layout_cost(model, tree_sizes, pack_tokens) < _layout_cost(model, row_sizes, pack_tokens)
    if packed and share_prefix:
        hidden, kept = _shared_prefix_hidden(
            model,
            prompts,
            group_ids,
            completions,
            pack_tokens,
            functional,
            layers,
            matmul,
            recompute_mlp,
            checkpoint_layers,
        )  # [K,H]
    else:
        sequences = [prompts[b] + c for b, c in zip(group_ids, completions)]  # prompt + completion per row
        if packed:
            hidden, kept = _packed_hidden(
                model,
                sequences,
                prompt_lengths,
                completion_lengths,
                pack_tokens,
                functional,
                layers,
                matmul,
                recompute_mlp,
                checkpoint_layers,
            )  # [K,H]
        else:
            hidden, kept = _padded_hidden(model, sequences, prompt_lengths, completion_lengths, layers, matmul)  # [K,H]
    logits = _head(model, hidden, matmul)  # [K,V]
    logp, entropy = _token_stats(logits, targets, want_entropy)  # [K], [K]
    result["logp"] = result["logp"].masked_scatter(out_mask, logp)  # [B,G,T]
    if want_entropy:
        result["entropy"] = result["entropy"].masked_scatter(out_mask, entropy)  # [B,G,T]
    for k in topks:
        top = torch.log_softmax(logits.float(), dim=-1).topk(min(k, logits.shape[-1]), dim=-1).values  # [K,k']
        top = torch.nn.functional.pad(top, (0, k - top.shape[-1]), value=float("-inf"))  # [K,k]
        result[f"topk({k})"] = _scatter_rows(result[f"topk({k})"], out_mask, top)  # [B,G,T,k]
    for l, states in kept.items():
        result[f"hidden({l})"] = _scatter_rows(result[f"hidden({l})"], out_mask, states.float())  # [B,G,T,H]
    if last_wanted:
        result["last_hidden"] = _scatter_rows(result["last_hidden"], out_mask, hidden.float())  # [B,G,T,H]
    if full_wanted:
        # [B,G,T,V]
        result["logprobs"] = _scatter_rows(result["logprobs"], out_mask, torch.log_softmax(logits.float(), dim=-1))
    if eager:
        sequences = [prompts[b] + c for b, c in zip(group_ids, completions)]
        # [K,...]
        for key, values in _eager_states(model, sequences, prompt_lengths, completion_lengths, eager).items():
            into = result[key]  # [B,G,T,...]
            if values.dim() == 3:
                values = torch.nn.functional.pad(values, (0, into.shape[-1] - values.shape[-1]))  # [K,heads,S]
            flat = into.reshape(-1, *into.shape[3:])  # [B*G*T,...]
            index = out_mask.reshape(-1).nonzero().squeeze(1)  # [K]
            result[key] = flat.index_copy(0, index, values.to(flat.dtype)).view_as(into)  # [B,G,T,...]
    return result


def _scatter_rows(into: Tensor, mask: Tensor, values: Tensor) -> Tensor:
    """[B,G,T,D] with ``values`` [K,D] written at the True entries of ``mask`` [B,G,T], in order."""
    flat = into.reshape(-1, into.shape[-1])  # [B*G*T,D]
    index = mask.reshape(-1).nonzero().squeeze(1)  # [K]
    return flat.index_copy(0, index, values.to(flat.dtype)).view_as(into)  # [B,G,T,D]


def _vocab_size(model) -> int:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return int(base.get_output_embeddings().weight.shape[0])


def _hidden_size(model) -> int:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return int(base.config.hidden_size)


def token_kl(model, hidden_p: Tensor, hidden_q: Tensor, mask: Tensor, chunk_tokens: int = 1024) -> Tensor:
    """[B,G,T] full-vocabulary KL(p ‖ q) per token, where p and q are the model's next-token
    distributions read from final-norm hidden states ``hidden_p``, ``hidden_q`` [B,G,T,H] (the
    ``last_hidden`` quantity under two contexts). The head runs on ``chunk_tokens`` tokens at a time,
    so no [tokens, V] tensor larger than [chunk_tokens, V] ever exists. 0 outside ``mask``."""
    index = mask.reshape(-1).nonzero().squeeze(1)  # [K]
    weight = next(model.parameters())  # the head runs where the model lives, in its dtype (states are kept float32)
    # [K,H]
    flat_p = hidden_p.reshape(-1, hidden_p.shape[-1])[index.to(hidden_p.device)].to(weight.device, weight.dtype)
    # [K,H]
    flat_q = hidden_q.reshape(-1, hidden_q.shape[-1])[index.to(hidden_q.device)].to(weight.device, weight.dtype)
    parts = []
    for start in range(0, flat_p.shape[0], chunk_tokens):
        logp = torch.log_softmax(_head(model, flat_p[start : start + chunk_tokens]).float(), dim=-1)  # [c,V]
        logq = torch.log_softmax(_head(model, flat_q[start : start + chunk_tokens]).float(), dim=-1)  # [c,V]
        parts.append((logp.exp() * (logp - logq)).sum(-1))  # [c]
    kl = torch.cat(parts).to(mask.device) if parts else torch.zeros(0, device=mask.device)  # [K]
    # [B*G*T] beside the mask (the host's rollout)
    out = torch.zeros(mask.numel(), dtype=torch.float32, device=mask.device)
    return out.index_copy(0, index, kl.float()).view(mask.shape)  # [B,G,T]


def tempered_logp(
    model, last_hidden: Tensor, actions: Tensor, mask: Tensor, temperature: float, chunk_tokens: int = 1024
) -> Tensor:
    """[B,G,T] log-prob of each token of ``actions`` under the model's next-token distribution at
    ``temperature`` (``log_softmax(logits / temperature)``, no top-k / top-p), read from its final-norm
    states ``last_hidden`` [B,G,T,H] (the ``last_hidden`` quantity); the head runs ``chunk_tokens`` at a
    time. 0 outside ``mask``. At temperature 1 it equals the ``logp`` quantity."""
    if not temperature > 0.0:
        raise ValueError(f"tempered_logp: temperature must be > 0, got {temperature}")
    index = mask.reshape(-1).nonzero().squeeze(1)  # [K]
    weight = next(model.parameters())
    # [K,H]
    flat = last_hidden.reshape(-1, last_hidden.shape[-1])[index.to(last_hidden.device)].to(weight.device, weight.dtype)
    targets = actions.reshape(-1)[index].to(weight.device)  # [K]
    parts = []
    for start in range(0, flat.shape[0], chunk_tokens):
        logits = _head(model, flat[start : start + chunk_tokens]).float() / temperature  # [c,V]
        parts.append(
            logits.gather(1, targets[start : start + chunk_tokens, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
        )  # [c]
    logp = torch.cat(parts).to(mask.device) if parts else torch.zeros(0, device=mask.device)  # [K]
    out = torch.zeros(mask.numel(), dtype=torch.float32, device=mask.device)  # [B*G*T]
    return out.index_copy(0, index, logp.float()).view(mask.shape)  # [B,G,T]
