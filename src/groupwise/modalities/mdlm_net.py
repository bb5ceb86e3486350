"""The network and the sampler of the masked-diffusion LM kind (``modalities/mdlm.py``, K2 of
``../shared/design/nontext.md``).

The denoiser is a small bidirectional transformer over ``prompt + canvas`` (pre-norm blocks, learned
positions, no causal mask), as in MDLM (Sahoo et al. 2024, https://arxiv.org/abs/2406.07524) and
LLaDA (Nie et al. 2025, https://arxiv.org/abs/2502.09992). The sampler is MaskGIT / LLaDA
low-confidence remasking (Chang et al. 2022, https://arxiv.org/abs/2202.04200; LLaDA §2.4): at each
of S steps every masked position draws a token from its prediction, and the ``k`` most confident
draws are committed.

**Math** (canvas of L positions, S steps, ``logq_s = log p_θ(· | x, canvas_s)`` [L,V])::

    draw_i   = argmax_v (logq_s[i,v] + g_{i,v}),  g ~ Gumbel(0,1) from the row's generator   (greedy: g = 0)
    conf_i   = logq_s[i, draw_i] for masked i, −∞ for committed i
    commit   the k_s = ⌊(s+1)L/S⌋ − ⌊sL/S⌋ positions of largest conf (ties: lower position first)
    τ_i      = s + 1 for the committed positions (1-based ``commit_step``)
    q_trace[i,s] = exp(logq_s[i, y_i]) for s < τ_i (the steps up to and including the commit), NaN after

**Notes**

1. Attention is written out (``scaled_dot_product_attention``), not ``nn.TransformerEncoder``: the
   latter switches to a fused fast path in eval mode without grad, which would make the sampler's
   numbers differ from the training forward's.
2. The per-step distributions are kept during sampling and gathered once the canvas is final (the
   committed token of a position is known only at its commit step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class Block(nn.Module):
    """One pre-norm transformer block with bidirectional attention (padding keys masked)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, h: Tensor, keep: Tensor) -> Tensor:
        N, P, W = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(N, P, 3, self.heads, W // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])  # [N,heads,P,W/heads]
        h = h + self.out(att.transpose(1, 2).reshape(N, P, W))  # [N,P,W]
        return h + self.mlp(self.norm2(h))  # [N,P,W]


class Denoiser(nn.Module):
    """(prompt [N,P] left-padded, pad [N,P] bool, canvas [N,L]) -> logits over the real vocabulary [N,L,V]."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, max_prompt: int, length: int):
        super().__init__()
        self.max_prompt = max_prompt
        self.tok = nn.Embedding(vocab + 1, width)  # the last id is [MASK]
        self.pos = nn.Embedding(max_prompt + length, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, prompt: Tensor, pad: Tensor, canvas: Tensor) -> Tensor:
        P, L = prompt.shape[1], canvas.shape[1]
        positions = torch.arange(self.max_prompt - P, self.max_prompt + L)  # prompts end where the canvas starts
        h = self.tok(torch.cat([prompt, canvas], 1)) + self.pos(positions)  # [N,P+L,W]
        keep = torch.cat([~pad, torch.ones_like(canvas, dtype=torch.bool)], 1)  # [N,P+L]
        for block in self.blocks:
            h = block(h, keep)
        return self.head(self.norm(h[:, P:]))  # [N,L,V]


def unmask(
    logq_of: Callable[[Tensor], Tensor], N: int, L: int, S: int, gens: Sequence[torch.Generator] | None, mask_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Sample N canvases by low-confidence remasking (module Math); ``gens`` None = greedy.
    Returns the canvas [N,L] long, ``commit_step`` [N,L] long (1..S) and ``q_trace`` [N,L,S] float64."""
    if not 1 <= S <= L:
        raise ValueError(f"the unmasking sampler needs 1 <= steps <= length, got steps={S}, length={L}")
    canvas = torch.full((N, L), mask_id, dtype=torch.long)  # [N,L]
    commit = torch.zeros(N, L, dtype=torch.long)  # [N,L]
    seen = []  # S × [N,L,V] the step's distributions (Note 2)
    for s in range(S):
        logq = logq_of(canvas)  # [N,L,V]
        seen.append(logq.exp())
        score = logq
        if gens is not None:
            noise = torch.stack([torch.rand(logq.shape[1:], generator=g, dtype=torch.float64) for g in gens])
            score = logq - torch.log(-torch.log(noise.clamp_min(1e-300)))  # [N,L,V] Gumbel-max
        draw = score.argmax(-1)  # [N,L]
        conf = torch.where(canvas == mask_id, logq.gather(-1, draw[..., None])[..., 0], -torch.inf)  # [N,L]
        k = (s + 1) * L // S - s * L // S
        order = torch.sort(conf, dim=-1, descending=True, stable=True).indices[:, :k]  # [N,k]
        canvas.scatter_(1, order, draw.gather(1, order))
        commit.scatter_(1, order, torch.full_like(order, s + 1))
    trace = torch.stack([p.gather(-1, canvas[..., None])[..., 0] for p in seen], -1)  # [N,L,S]
    after = torch.arange(S)[None, None, :] >= commit[..., None]  # [N,L,S] steps after the commit
    return canvas, commit, torch.where(after, torch.nan, trace)
