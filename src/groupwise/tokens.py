"""The tokenizer layer (THL): text moved between two policies' vocabularies, and token traces aligned.

Two actors with different tokenizers (``roles.NAME.samples = true``, M9) exchange *text*: a row one
actor wrote is re-encoded by the other's tokenizer (``retokenize``) before the other scores or trains
on it. A token-level quantity of one tokenization (a per-token log-prob) is carried to the other by
character spans: ``align`` maps each source token to the target tokens that cover its characters,
from the offset mappings the tokenizers themselves return (``offsets``: ``tokenizer(text,
return_offsets_mapping=True)``; nothing here re-implements a tokenizer). ``residual`` is the share
of source tokens without a 1:1 counterpart: the cost of the alignment (0 for equal tokenizations).

Mutual RL (Liu et al., arXiv 2605.07244; the author blog, https://xz-liu.github.io/blog/mutual-rl.html)
names this layer THL ("retokenises text and aligns token traces across vocabularies with an explicit
residual cost"); how it does so is not published: the forms here are ours ([INFERRED], spec 52).
"""

from __future__ import annotations

from typing import Any

Span = tuple[int, int]


def retokenize(texts: list[str], dst_policy: Any) -> list[list[int]]:
    """Each text as ``dst_policy`` would write it as a completion (its tokens, then its EOS)."""
    if not hasattr(dst_policy, "encode_completion"):
        raise TypeError(
            f"retokenize: the destination policy ({type(dst_policy).__name__}) has no encode_completion; "
            "text moves only between text policies"
        )
    return [dst_policy.encode_completion(text) for text in texts]


def offsets(tokenizer: Any, text: str) -> list[Span]:
    """The character span of each token of ``text`` under ``tokenizer`` (a fast Hugging Face tokenizer)."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [(int(s), int(e)) for s, e in encoded["offset_mapping"]]


def align(offsets_src: list[Span], offsets_dst: list[Span]) -> list[list[int]]:
    """For each source token, the indices of the target tokens whose characters overlap its own.

    A source token with an empty span (a special token) maps to ``[]``. Both offset lists must be of
    the same text (the tokenizers' own ``offset_mapping``)."""
    out = []
    for s, e in offsets_src:
        out.append([j for j, (ds, de) in enumerate(offsets_dst) if s < e and ds < de and ds < e and s < de])
    return out


def residual(alignment: list[list[int]]) -> float:
    """The share of source tokens without a 1:1 span: mapped to no target, to several, or to a target
    that another source token maps to as well. 0.0 for an empty alignment."""
    if not alignment:
        return 0.0
    users: dict[int, int] = {}
    for targets in alignment:
        for j in targets:
            users[j] = users.get(j, 0) + 1
    one_to_one = sum(1 for targets in alignment if len(targets) == 1 and users[targets[0]] == 1)
    return 1.0 - one_to_one / len(alignment)


def text_residual(src_tokenizer: Any, dst_tokenizer: Any, texts: list[str]) -> float:
    """``residual`` over all tokens of ``texts`` tokenized by both (source tokens weighted equally)."""
    unmatched = total = 0
    for text in texts:
        alignment = align(offsets(src_tokenizer, text), offsets(dst_tokenizer, text))
        unmatched += round(residual(alignment) * len(alignment))
        total += len(alignment)
    return unmatched / total if total else 0.0
