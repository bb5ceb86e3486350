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

import inspect

import torch
from torch import Tensor

from groupwise.policy import functional as functional_forward
from groupwise.policy.functional import unsupported_reason


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
    layer_params = 4 * hidden * hidden + 3 * hidden * getattr(config, "intermediate_size", 4 * hidden)  # attention + gated MLP
    return len(bins) * (width * 2 * layer_params + _ATTENTION_SLOWDOWN * 4 * hidden * width * width)


def _head(model, hidden: Tensor) -> Tensor:
    """The model's output head on selected hidden states [K,H] -> logits [K,V], with the logit
    transforms some architectures apply after ``lm_head`` (scale, soft-capping)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    logits = base.get_output_embeddings()(hidden)  # [K,V]
    config = base.config
    if getattr(config, "logit_scale", None):  # Cohere
        logits = logits * config.logit_scale
    if getattr(config, "logits_scaling", None):  # Granite
        logits = logits / config.logits_scaling
    if getattr(config, "final_logit_softcapping", None):  # Gemma 2/3
        cap = config.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    return logits


def _packed_logits(model, sequences: list[list[int]], prompt_lengths: list[int], completion_lengths: list[int], pack_tokens: int = 0,
                   functional: bool = True) -> Tensor:
    """[K,V] logits predicting every completion token of the rows, in row order, from bins of
    packed rows: input [n_bins, width] with position ids restarting at 0 for each row (and for
    each bin's padding tail), so every row attends only to itself."""
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
    predict_at = torch.tensor([flat_start[i] + p - 1 + j for i, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)) for j in range(c)],
                              dtype=torch.long)  # [K]
    device = next(model.parameters()).device
    if functional and unsupported_reason(model) is None:
        segment = (position_ids == 0).cumsum(dim=-1)  # [n_bins,width] a new row starts where positions restart
        index = torch.arange(width)
        allowed = (segment[:, :, None] == segment[:, None, :]) & (index[:, None] >= index[None, :])  # [n_bins,q,k] own row, causal
        hidden = functional_forward.hidden_states(model, input_ids.to(device), position_ids.to(device), allowed.to(device))  # [n_bins,width,H]
    else:  # transformers reads the position restarts as packed sequences and builds the same mask
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        hidden = base.get_decoder()(input_ids=input_ids.to(device), position_ids=position_ids.to(device), attention_mask=None, use_cache=False).last_hidden_state  # [n_bins,width,H]
    return _head(model, hidden.reshape(-1, hidden.shape[-1])[predict_at.to(device)])  # [K,V]


def _shared_prefix_logits(model, prompts: list[list[int]], groups: list[int], completions: list[list[int]], pack_tokens: int = 0,
                          functional: bool = True) -> Tensor:
    """[K,V] logits predicting every completion token, in row order, with each group's prompt
    computed ONCE: a group is laid out as ``prompt, completion_1, ..., completion_G`` and a custom
    attention mask lets completion k see the prompt and its own earlier tokens only (a tree).
    Position ids restart at the prompt length for every completion, so each row is computed exactly
    as if it stood alone. Groups are packed into bins as rows are in ``_packed_logits``."""
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
    visible = (branch_t[:, None, :] == 0) | (branch_t[:, :, None] == branch_t[:, None, :])  # [n_bins,q,k] prompt or own branch
    causal = index[None, :, None] >= index[None, None, :]  # [1,q,k]
    allowed = (same_tree & visible & causal) | torch.eye(width, dtype=torch.bool)[None]  # [n_bins,q,k] padding sees itself
    device = next(model.parameters()).device
    if functional and unsupported_reason(model) is None:
        hidden = functional_forward.hidden_states(model, input_ids.to(device), position_ids.to(device), allowed.to(device))  # [n_bins,width,H]
        return _head(model, hidden.reshape(-1, hidden.shape[-1])[gather_at.to(device)])  # [K,V]
    dtype = next(model.parameters()).dtype
    additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[:, None]  # [n_bins,1,q,k]
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.get_decoder()(input_ids=input_ids.to(device), position_ids=position_ids.to(device), attention_mask=additive.to(device), use_cache=False).last_hidden_state  # [n_bins,width,H]
    return _head(model, hidden.reshape(-1, hidden.shape[-1])[gather_at.to(device)])  # [K,V]


def _padded_logits(model, sequences: list[list[int]], prompt_lengths: list[int], completion_lengths: list[int]) -> Tensor:
    """[K,V] logits as ``_packed_logits`` but from a right-padded batch with an attention mask (reference)."""
    N, width = len(sequences), max(len(s) for s in sequences)
    input_ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences], dtype=torch.long)  # [N,L] pad id is irrelevant: it is masked
    attention_mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences], dtype=torch.long)  # [N,L]
    keep = width - min(prompt_lengths) + 1  # the last `keep` positions hold every completion-predicting one
    row_index = torch.cat([torch.full((c,), r) for r, c in enumerate(completion_lengths)])  # [K]
    col_index = torch.cat([torch.arange(c) + p - 1 for p, c in zip(prompt_lengths, completion_lengths)]) - (width - keep)  # [K]
    device = next(model.parameters()).device
    kwargs = {"logits_to_keep": keep} if _keeps_index_tensor(model) else {}
    out = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                position_ids=torch.arange(width, device=device).expand(N, width), use_cache=False, **kwargs)
    logits = out.logits[:, -keep:]  # [N,keep,V]
    return logits[row_index.to(device), col_index.to(device)]  # [K,V]


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
) -> dict[str, Tensor]:
    """Per-token log-probs of ``actions`` [B,G,T] given each group's prompt, scattered back to [B,G,T].

    Returns ``{"logp": [B,G,T] float32}`` (0 where ``mask`` is False or the row is not in ``rows`` [B,G])
    and ``"entropy"`` [B,G,T] float32 when asked. Autograd flows to the model's parameters unless the
    caller runs it under ``torch.no_grad()``. ``share_prefix`` computes each group's prompt once
    (tree attention); ``None`` chooses the layout with the lower estimated cost (``_layout_cost``:
    the tree saves prompt tokens but its mask is quadratic in a whole group's length).
    ``pack_tokens`` caps a bin's length (0: the longest row or group). ``packed=False`` is the
    padded reference path. ``functional`` runs supported (Llama-family, float32) models through
    ``policy.functional.hidden_states`` instead of their own forward (same values, fewer ops).
    """
    B, G, T = actions.shape
    rows = rows.bool()  # [B,G]
    lengths = _completion_lengths(mask.bool(), rows)  # [B,G]
    scored = lengths > 0  # [B,G] rows with at least one token to score
    device = next(model.parameters()).device
    out_mask = (torch.arange(T, device=lengths.device) < lengths[..., None]).to(device)  # [B,G,T] tokens that get a value
    result = {"logp": torch.zeros(B, G, T, dtype=torch.float32, device=device)}  # [B,G,T]
    if want_entropy:
        result["entropy"] = torch.zeros(B, G, T, dtype=torch.float32, device=device)  # [B,G,T]
    if not bool(scored.any()):
        return result

    # Row order here (b, g row-major, tokens in order) is the order of out_mask's True entries.
    groups, members = scored.nonzero(as_tuple=True)  # [N], [N]
    group_ids, member_ids = groups.tolist(), members.tolist()
    prompts = [p.tolist() if isinstance(p, Tensor) else list(p) for p in prompt_ids]
    prompt_lengths = [len(prompts[b]) for b in group_ids]
    if min(prompt_lengths) == 0:
        raise ValueError("a scored row has an empty prompt: its first token has nothing to condition on")
    completion_lengths = lengths[groups, members].tolist()
    action_ids = actions.tolist()  # [B][G][T] host ints: inputs are assembled on the host, moved once
    completions = [action_ids[b][g][:c] for b, g, c in zip(group_ids, member_ids, completion_lengths)]
    targets = torch.tensor([t for c in completions for t in c], dtype=torch.long, device=device)  # [K] the completion tokens

    if share_prefix is None:
        completed: dict[int, int] = {}
        for b, c in zip(group_ids, completion_lengths):
            completed[b] = completed.get(b, 0) + c
        tree_sizes = [len(prompts[b]) + c for b, c in completed.items()]
        row_sizes = [p + c for p, c in zip(prompt_lengths, completion_lengths)]
        share_prefix = _layout_cost(model, tree_sizes, pack_tokens) < _layout_cost(model, row_sizes, pack_tokens)
    if packed and share_prefix:
        logits = _shared_prefix_logits(model, prompts, group_ids, completions, pack_tokens, functional)  # [K,V]
    else:
        sequences = [prompts[b] + c for b, c in zip(group_ids, completions)]  # prompt + completion per row
        if packed:
            logits = _packed_logits(model, sequences, prompt_lengths, completion_lengths, pack_tokens, functional)  # [K,V]
        else:
            logits = _padded_logits(model, sequences, prompt_lengths, completion_lengths)  # [K,V]
    logp, entropy = _token_stats(logits, targets, want_entropy)  # [K], [K]
    result["logp"] = result["logp"].masked_scatter(out_mask, logp)  # [B,G,T]
    if want_entropy:
        result["entropy"] = result["entropy"].masked_scatter(out_mask, entropy)  # [B,G,T]
    return result
