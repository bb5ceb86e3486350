"""Log-probs (and entropies) of completion tokens from ONE packed forward pass.

Every scored row's ``prompt + completion`` is laid end to end in a single ``[1, total]`` sequence
whose ``position_ids`` restart at 0 for each row and ``attention_mask=None``. transformers 5.x reads
the restarts as packed sequences (``masking_utils.find_packed_sequence_indices``) and builds the
block-diagonal causal mask itself, for sdpa, eager and flex attention alike (flash-attention uses
the same position ids for its varlen kernel). No padding token is ever computed.

Logits are computed only where they are needed: at position ``p-1`` for every completion token
``p`` (``logits_to_keep`` takes the index tensor, so the model's own head, soft-capping and scaling
included, runs on those rows only). Memory for logits is ``[completion tokens, V]``.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor


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


def _packed_logits(model, sequences: list[Tensor], prompt_lengths: list[int], completion_lengths: list[int]) -> Tensor:
    """[K,V] logits predicting every completion token of the packed rows, in row order."""
    input_ids = torch.cat(sequences)[None, :]  # [1,S]
    position_ids = torch.cat([torch.arange(len(s)) for s in sequences])[None, :]  # [1,S] restart at 0 per row
    starts = torch.tensor([0] + [len(s) for s in sequences[:-1]]).cumsum(0)  # [N] offset of each row
    # completion token j of a row sits at start + P + j and is predicted from start + P + j - 1
    predict_at = torch.cat([torch.arange(c) + s + p - 1 for s, p, c in zip(starts.tolist(), prompt_lengths, completion_lengths)])  # [K]
    device = next(model.parameters()).device
    input_ids, position_ids, predict_at = input_ids.to(device), position_ids.to(device), predict_at.to(device)
    if _keeps_index_tensor(model):
        out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False,
                    logits_to_keep=predict_at)
        return out.logits[0]  # [K,V]
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False)
    return out.logits[0, predict_at]  # [K,V] (older models: full logits, then select)


def _padded_logits(model, sequences: list[Tensor], prompt_lengths: list[int], completion_lengths: list[int]) -> Tensor:
    """[K,V] logits as ``_packed_logits`` but from a right-padded batch with an attention mask (reference)."""
    N, width = len(sequences), max(len(s) for s in sequences)
    input_ids = torch.zeros(N, width, dtype=torch.long)  # [N,L] pad id is irrelevant: it is masked
    attention_mask = torch.zeros(N, width, dtype=torch.long)  # [N,L]
    for r, s in enumerate(sequences):  # once per row, building the input
        input_ids[r, : len(s)] = s
        attention_mask[r, : len(s)] = 1
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
) -> dict[str, Tensor]:
    """Per-token log-probs of ``actions`` [B,G,T] given each group's prompt, scattered back to [B,G,T].

    Returns ``{"logp": [B,G,T] float32}`` (0 where ``mask`` is False or the row is not in ``rows`` [B,G])
    and ``"entropy"`` [B,G,T] float32 when asked. Autograd flows to the model's parameters unless the
    caller runs it under ``torch.no_grad()``. ``packed=False`` is the padded reference path.
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
    prompts = [torch.as_tensor(p, dtype=torch.long) for p in prompt_ids]
    actions = actions.to("cpu", torch.long)  # [B,G,T] inputs are assembled on the host, moved once
    prompt_lengths = [len(prompt_ids[b]) for b in groups.tolist()]
    if min(prompt_lengths) == 0:
        raise ValueError("a scored row has an empty prompt: its first token has nothing to condition on")
    completion_lengths = lengths[groups, members].tolist()
    sequences = [torch.cat([prompts[b], actions[b, g, :c]])
                 for b, g, c in zip(groups.tolist(), members.tolist(), completion_lengths)]
    targets = torch.cat([s[p:] for s, p in zip(sequences, prompt_lengths)]).to(device)  # [K] the completion tokens

    logits_fn = _packed_logits if packed else _padded_logits
    logits = logits_fn(model, sequences, prompt_lengths, completion_lengths)  # [K,V]
    logp, entropy = _token_stats(logits, targets, want_entropy)  # [K], [K]
    result["logp"] = result["logp"].masked_scatter(out_mask, logp)  # [B,G,T]
    if want_entropy:
        result["entropy"] = result["entropy"].masked_scatter(out_mask, entropy)  # [B,G,T]
    return result
