"""Token positions of a completion mapped to spans of its text (phase and role maps from tags).

Shared by the components that credit parts of a completion by what its text says: F-GRPO's
generation / ranking phases (``advantages/f_grpo.py``, ``losses/f_grpo.py``) and SRPO's perception
/ reasoning roles (``weights/srpo.py``, ``views/ablate_role.py``). Each reads the policy's token
texts (``use_vocabulary``, components.py).

Conventions:

- A row's text is the concatenation of its tokens' texts (``token_text[id]``; an id outside the
  vocabulary, and a special token, is ""), over the row's ``mask`` prefix.
- A token belongs to the span in which its FIRST character lies (``starts[t]``, the character
  offset where token t begins). An empty token (EOS) starts where the next one would; at the end
  of the text it lies in no segment.
- A tagged segment is the text strictly between an open tag and the next close tag after it; the
  tags themselves are outside it. An open tag with no close tag after it opens a segment that runs
  to the end of the text (a completion cut by the length limit). Segments do not overlap: the
  search for the next open tag starts after the previous segment's close tag.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from groupwise.errors import ConfigError


def check_tags(tags: Sequence[str], who: str, need_open: bool) -> tuple[str, str]:
    """``(open, close)`` of a tag option, or a ConfigError naming ``who`` (``need_open``: both non-empty)."""
    if (
        isinstance(tags, str)
        or len(tags) != 2
        or not all(isinstance(t, str) for t in tags)
        or (need_open and not (tags[0] and tags[1]))
    ):
        want = "two non-empty strings" if need_open else "two strings (empty = none)"
        raise ConfigError(f"{who} must be [open, close], {want}; got {tags!r}")
    return tags[0], tags[1]


def row_texts(actions: Tensor, mask: Tensor, token_text: Sequence[str]) -> list[list[str]]:
    """actions, mask [N,T] -> per row the text of each token of its mask prefix."""
    counts, ids = mask.bool().sum(-1).tolist(), actions.tolist()
    V = len(token_text)
    return [[token_text[t] if 0 <= t < V else "" for t in ids[r][: counts[r]]] for r in range(len(ids))]


def starts_of(texts: Sequence[str]) -> list[int]:
    """The character offset where each token begins in the joined text."""
    out, at = [], 0
    for text in texts:
        out.append(at)
        at += len(text)
    return out


def label_tokens(
    actions: Tensor, mask: Tensor, token_text: Sequence[str], label: Callable[[str, list[int]], Sequence[int]]
) -> Tensor:
    """[N,T] long: ``label(text, starts)`` gives one label per token of a row's mask prefix; −1 outside the mask.

    ``text`` is the row's joined text and ``starts`` the offset of each token's first character."""
    N, T = actions.shape
    out = torch.full((N, T), -1, dtype=torch.long)  # [N,T]
    for r, texts in enumerate(row_texts(actions, mask, token_text)):
        labels = list(label("".join(texts), starts_of(texts)))
        if len(labels) != len(texts):
            raise ValueError(f"label_tokens: the labeller gave {len(labels)} labels for {len(texts)} tokens")
        if labels:
            out[r, : len(labels)] = torch.tensor(labels, dtype=torch.long)
    return torch.where(mask.bool(), out, torch.full_like(out, -1))  # [N,T]


def tag_spans(text: str, tags: Sequence[str]) -> list[tuple[int, int]]:
    """``[(begin, end)]`` character ranges of every segment between ``tags = [open, close]`` (module docstring)."""
    open_tag, close_tag = tags
    spans, at = [], 0
    while True:
        begin = text.find(open_tag, at)
        if begin < 0:
            return spans
        begin += len(open_tag)
        end = text.find(close_tag, begin)
        if end < 0:
            spans.append((begin, len(text)))
            return spans
        spans.append((begin, end))
        at = end + len(close_tag)


def in_spans(starts: Sequence[int], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """Whether each token's first character lies inside one of ``spans``."""
    return [any(b <= s < e for b, e in spans) for s in starts]


def segment_ids(actions: Tensor, mask: Tensor, token_text: Sequence[str], tag_pairs: Sequence[Sequence[str]]) -> Tensor:
    """[N,T] long: k + 1 for a token inside a segment of ``tag_pairs[k]``, 0 for any other token of
    the mask prefix (tags, text between segments, EOS), −1 outside the mask. Where segments of two
    pairs overlap, the first pair listed wins."""

    def label(text: str, starts: list[int]) -> list[int]:
        out = [0] * len(starts)
        for k in reversed(range(len(tag_pairs))):
            for t, inside in enumerate(in_spans(starts, tag_spans(text, tag_pairs[k]))):
                if inside:
                    out[t] = k + 1
        return out

    return label_tokens(actions, mask, token_text, label)
