"""PAIR's turn features (spec 03): the turns of a transcript row and what the probe reads of each.

A turn is a segment of ``rollout.segment_id`` within the row's own tokens (``rollout.row_mask``; without
segments a maximal run of them); its features are the
hidden state at its last token and four attention statistics per head of each probed layer
(``rewards/pair.py`` has the maths and the positions). Used by the ``pair`` reward and the
``pair_probe`` phase, which must read the same features.
"""

from __future__ import annotations

import torch
from torch import Tensor


def attention_stats(A: Tensor, s: int, e: int) -> Tensor:
    """[4·heads] (max, std, prefix ratio, self ratio per head) of attention rows ``A`` [heads,Q,K]
    over keys 0..K−1, the turn's keys being ``[s, e)``."""
    A = A.double()  # [heads,Q,K]
    total = A.sum(-1).clamp(min=1e-30)  # [heads,Q]
    max_attn = A.max(-1).values.mean(-1)  # [heads]
    std_attn = A.std(-1, unbiased=False).mean(-1)  # [heads]
    prefix = (A[..., :s].sum(-1) / total).mean(-1) if s > 0 else torch.zeros(A.shape[0], dtype=torch.float64)  # [heads]
    own = (A[..., s:e].sum(-1) / total).mean(-1)  # [heads]
    return torch.cat([max_attn, std_attn, prefix, own])  # [4·heads]


def pair_features(
    hidden_states: list[Tensor], attentions: list[Tensor], span: tuple[int, int]
) -> tuple[Tensor, Tensor]:
    """The spec's interface: (h [D], a [4·H·L]) of the turn ``span = (s, e)`` of a full dialog from
    per-layer states [S,D] and attentions [H,S,S] (queries and keys both dialog positions)."""
    s, e = span
    if not 0 <= s < e:
        raise ValueError(f"pair_features: a turn span needs 0 <= s < e, got {span}")
    h = hidden_states[-1][e - 1].double()  # [D]
    a = (
        torch.cat([attention_stats(A[:, s:e, :], s, e) for A in attentions])
        if attentions
        else torch.zeros(0, dtype=torch.float64)
    )
    return h, a  # [D], [4·H·L]


def turn_spans(row_mask: Tensor, segment_id: Tensor | None = None) -> list[tuple[int, int]]:
    """A row's turns [s, e), in order: the maximal runs of tokens of ``row_mask`` [T] with one
    ``segment_id`` [T] (its turn), or without segments the maximal runs of True in ``row_mask``."""
    flags = row_mask.bool().tolist()
    ids = segment_id.tolist() if segment_id is not None else [0] * len(flags)
    keys = [i if on else None for on, i in zip(flags, ids)] + [None]
    spans, start = [], None
    for t, key in enumerate(keys):
        if start is not None and key != keys[start]:
            spans.append((start, t))
            start = None
        if key is not None and start is None:
            start = t
    return spans


def row_turn_features(
    hidden: Tensor,
    attns: list[Tensor],
    row_mask: Tensor,
    prompt_length: int,
    length: int,
    segment_id: Tensor | None = None,
) -> tuple[list, Tensor, Tensor]:
    """(spans, h [n,D], a [n,4·heads·L]) of one row's turns (``turn_spans``) from its ``hidden_at(l)``
    [T,D] and ``attn_at(l)`` [T,heads,S] quantities (Notes 2-3); ``length`` = its completion tokens."""
    spans = turn_spans(row_mask, segment_id)
    K = prompt_length + length
    h = (
        torch.stack([hidden[e - 1].double() for _, e in spans])
        if spans
        else torch.zeros(0, hidden.shape[-1], dtype=torch.float64)
    )
    rows = [
        torch.cat([attention_stats(A[s:e, :, :K].transpose(0, 1), prompt_length + s, prompt_length + e) for A in attns])
        if attns
        else torch.zeros(0, dtype=torch.float64)
        for s, e in spans
    ]
    a = torch.stack(rows) if rows else torch.zeros(0, 0, dtype=torch.float64)
    return spans, h, a
