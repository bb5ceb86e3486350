"""ProFIL: zero the advantage of rollouts that a frozen probe flags as post-commitment "theater".

"Drop the Act: Probe-Filtered RL for Faithful Chain-of-Thought Reasoning", Swapnil Parekh, 2026.
https://arxiv.org/abs/2605.11467 — spec 34. Only the abstract was available; no code.

**Change vs GRPO**: the advantage is computed as usual, then set to 0 for rollouts whose score
from a probe exceeds a threshold. The probe reads hidden states of a frozen copy of the base model
on the rollout text, one prediction per reasoning step ("is this step after the answer was
already decided?"), and is trained once, offline, on labels from forced answers. Pure functions
and the probe module only: not a registered component (it needs base-model hidden states and an
offline labelling pass).

**Math** (step k of a rollout = its tokens' hidden states ``H_k`` [L,d]; heads h = 1..n_heads)::

    committed_k = 1[forced answer after step k == final answer]
    label_k     = 1[committed_k' for some k' < k]                 (post-commitment step)
    α^h         = softmax_tokens(H_k q_h)                         (q_h ∈ R^d, no positions)
    p_k         = sigmoid(Σ_h w_hᵀ (α^hᵀ H_k V_h) + c)            (V_h: d → d_head)
    S_i         = mean_k 1[p_k > 0.5]  ("mean_flag") | max_k p_k | mean_k p_k
    A_i         = 0 if S_i > tau (and A_i > 0 when only_positive) else A_i

**Defaults**

- probe trained once on the frozen base model; verifier-derived labels; filtering of the
  advantage [ABSTRACT].
- label rule from forced answers, attention-pooling probe form, newline step segmentation
  (``sep`` option) [INFERRED].
- ``mode = "mean_flag"``, ``tau = 0.5``, ``only_positive = False`` [INFERRED].
- ``n_heads = 4``, ``d_head = d_model // n_heads`` [INFERRED].

**Notes**

1. ``probe_scores`` returns NaN for steps a row does not have (ragged step counts); the
   computation stays finite there, so a loss on the present steps has finite gradients.
   ``rollout_score`` skips NaN and gives 0 to a row without steps (nothing to filter).
2. The probe has no positional input: a step's score does not depend on the order of its tokens,
   nor on tokens outside the step (``step_ids == -1`` belongs to no step).
3. ``segment_steps``: a step is a line with visible text (its trailing newline included); blank
   lines belong to no step. A token takes the step of its first visible character, or of its
   first character when it has none. ``sep`` replaces the newline (``";"`` for the ``theater``
   toy): a step is then a ``sep``-terminated segment (or the tail) with visible text besides it.
4. A NaN rollout score never filters (NaN > tau is false).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

SCORE_MODES = ("mean_flag", "max", "mean_prob")


def profil_filter(adv: Tensor, rollout_scores: Tensor, tau: float = 0.5, only_positive: bool = False) -> Tensor:
    """adv float32 with 0 where the rollout's score exceeds ``tau`` (only where adv > 0 if ``only_positive``)."""
    if tuple(adv.shape[: rollout_scores.dim()]) != tuple(rollout_scores.shape):
        raise ValueError(
            f"profil_filter: rollout_scores {tuple(rollout_scores.shape)} "
            f"must be the leading shape of adv {tuple(adv.shape)}"
        )
    flag = rollout_scores > tau  # [N]
    flag = flag.reshape(*flag.shape, *([1] * (adv.dim() - flag.dim())))  # [N] or [N,1] for token advantages
    if only_positive:
        flag = flag & (adv > 0)  # [N] / [N,T]
    return torch.where(flag, torch.zeros((), dtype=torch.float32), adv.float())  # [N] / [N,T]


def committed_steps(forced_answers: list, final: Any, equal: Callable[[Any, Any], bool] | None = None) -> Tensor:
    """[K] bool: the answer forced after step k already equals the final answer."""
    same = equal or (lambda x, y: x == y)
    return torch.tensor([bool(same(f, final)) for f in forced_answers], dtype=torch.bool)  # [K]


def commitment_labels(forced_answers: list, final: Any, equal: Callable[[Any, Any], bool] | None = None) -> Tensor:
    """[K] float32 post-commitment labels: 1 where some earlier step was already committed."""
    committed = committed_steps(forced_answers, final, equal)  # [K]
    # [K] step k−1
    before = torch.cat([torch.zeros(1, dtype=torch.bool), committed[:-1]]) if len(committed) else committed
    return (torch.cumsum(before.long(), 0) > 0).float()  # [K]


class AttnProbe(nn.Module):
    """Multi-head attention pooling over a step's token hidden states, then a sigmoid readout."""

    def __init__(self, d_model: int, n_heads: int = 4, d_head: int | None = None):
        super().__init__()
        if d_model < 1 or n_heads < 1:
            raise ValueError(f"AttnProbe: d_model and n_heads must be >= 1, got {d_model}, {n_heads}")
        self.n_heads, self.d_head = n_heads, d_head or max(1, d_model // n_heads)
        self.query = nn.Linear(d_model, n_heads, bias=False)  # token score per head
        self.value = nn.Linear(d_model, n_heads * self.d_head)
        self.readout = nn.Linear(n_heads * self.d_head, 1)  # = Σ_h w_hᵀ pooled_h + c

    def probe_scores(self, hidden: Tensor, step_ids: Tensor) -> Tensor:
        """p [N,K] float32 in (0,1) per step (K = max step id + 1); NaN where a row lacks step k."""
        if hidden.dim() != 3 or step_ids.shape != hidden.shape[:2]:
            raise ValueError(
                "probe_scores: need hidden [N,T,d] and step_ids [N,T], "
                f"got {tuple(hidden.shape)} and {tuple(step_ids.shape)}"
            )
        hidden = hidden.float()  # [N,T,d]
        K = int(step_ids.max().item()) + 1 if step_ids.numel() else 0
        member = step_ids[:, None, :] == torch.arange(K)[None, :, None]  # [N,K,T]
        # tokens outside every step must not reach a value or a gradient (even if NaN)
        hidden = torch.where((step_ids >= 0)[..., None], hidden, torch.zeros((), dtype=hidden.dtype))  # [N,T,d]
        scores = self.query(hidden)  # [N,T,H]
        scores = scores[:, None].expand(-1, K, -1, -1)  # [N,K,T,H]
        low = torch.finfo(scores.dtype).min
        scores = torch.where(member[..., None], scores, torch.full((), low, dtype=scores.dtype))  # [N,K,T,H]
        attn = torch.softmax(scores, dim=2)  # [N,K,T,H] over the step's tokens; uniform (finite) for an absent step
        values = self.value(hidden).unflatten(-1, (self.n_heads, self.d_head))  # [N,T,H,dh]
        pooled = torch.einsum("nkth,nthd->nkhd", attn, values)  # [N,K,H,dh]
        p = torch.sigmoid(self.readout(pooled.flatten(-2)).squeeze(-1))  # [N,K]
        return torch.where(member.any(-1), p, torch.full((), float("nan"), dtype=p.dtype))  # [N,K]

    def forward(self, step_hidden: Tensor) -> Tensor:
        """p [...] for one step's token states ``step_hidden`` [..., L, d]."""
        flat = step_hidden.reshape(-1, *step_hidden.shape[-2:])  # [M,L,d]
        ids = torch.zeros(flat.shape[:2], dtype=torch.long)  # [M,L] every token in step 0
        return self.probe_scores(flat, ids)[:, 0].reshape(step_hidden.shape[:-2])  # [...]


def rollout_score(p: Tensor, mode: str = "mean_flag", threshold: float = 0.5) -> Tensor:
    """S [N] float32 from per-step probabilities p [N,K] (NaN = no such step; rows without steps → 0)."""
    if mode not in SCORE_MODES:
        raise ValueError(f"rollout_score: mode must be one of {SCORE_MODES}, got {mode!r}")
    present = ~torch.isnan(p)  # [N,K]
    n = present.sum(-1)  # [N]
    if mode == "max":
        s = (
            torch.where(present, p, torch.zeros((), dtype=p.dtype)).amax(-1) if p.shape[-1] else torch.zeros(p.shape[0])
        )  # [N]
    else:
        x = (
            (p > threshold).float() if mode == "mean_flag" else torch.where(present, p, torch.zeros((), dtype=p.dtype))
        )  # [N,K]
        s = x.sum(-1) / n.clamp(min=1)  # [N]; NaN > threshold is False, so absent steps add 0
    return torch.where(n > 0, s, torch.zeros((), dtype=s.dtype)).float()  # [N]


def segment_steps(
    tokens: list[str] | str, offsets: list[tuple[int, int]] | None = None, pad_to: int | None = None, sep: str = "\n"
) -> Tensor:
    """step_ids [T] int64 by ``sep`` boundaries (module note 3; default newlines); -1 = no step (and padding).

    ``tokens``: the decoded text of each token, or the completion text with ``offsets`` (a
    tokenizer's character spans per token); a bare string without offsets is one token per character.
    """
    if isinstance(tokens, str):
        text = tokens
        spans = offsets if offsets is not None else [(i, i + 1) for i in range(len(text))]
    else:
        if offsets is not None:
            raise ValueError("segment_steps: pass offsets only with the completion text (a str), not with token texts")
        text, spans, at = "".join(tokens), [], 0
        for t in tokens:
            spans.append((at, at + len(t)))
            at += len(t)
    if not sep:
        raise ValueError("segment_steps: sep must be a non-empty string")
    ends, at = [], text.find(sep)
    while at >= 0:
        ends.append(at + len(sep))
        at = text.find(sep, at + len(sep))
    char_step, step, line_start = [-1] * len(text), -1, 0
    for end in ends + [len(text)]:
        body = text[line_start:end]
        # visible text besides sep: a step, its sep included
        if (body[: -len(sep)] if body.endswith(sep) else body).strip():
            step += 1
            char_step[line_start:end] = [step] * (end - line_start)
        line_start = end
    ids = []
    for a, b in spans:
        if not 0 <= a <= b <= len(text):
            raise ValueError(f"segment_steps: token span ({a}, {b}) lies outside the text of length {len(text)}")
        visible = [i for i in range(a, b) if not text[i].isspace()]
        ids.append(char_step[visible[0]] if visible else (char_step[a] if b > a else -1))
    if pad_to is not None:
        if pad_to < len(ids):
            raise ValueError(f"segment_steps: pad_to={pad_to} is shorter than the {len(ids)} tokens")
        ids += [-1] * (pad_to - len(ids))
    return torch.tensor(ids, dtype=torch.int64)  # [T]
