"""The flow toy's embedding condition (E²PO's flow form, spec 15): a frozen random prompt encoder and
the per-row conditions of a hooked sampling call, mixed per denoising step by the noise-aware schedule.

E²PO: "Embedding-perturbed Exploration Preference Optimization", arXiv 2605.15803, spec 15 (CPU
implementation: an 8-d prompt embedding through a frozen random MLP "text encoder"). Used by
``modalities/flow.py`` (``FlowPolicy(condition="embedding")``, its Note 5); the schedule γ(σ) and the
mix are the ``embed_delta`` hook's ``noise_aware_gamma`` / ``mix_condition`` (``hooks.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from groupwise.hooks import mix_condition, noise_aware_gamma
from groupwise.types import Request


class PromptEncoder(nn.Module):
    """The frozen random "text encoder" of the embedding condition (spec 15's CPU implementation):
    every label's prompt is one token whose embedding ``tokens[label]`` [embed_dim] is fixed, and
    ``f(E) = W₂ tanh(W₁ E + b₁) + b₂`` maps a (possibly perturbed) token embedding to the condition
    the velocity net reads. Nothing here is trained: the parameters are buffers."""

    def __init__(self, n_labels: int, embed_dim: int = 8, hidden: int = 32, cond_dim: int = 16):
        super().__init__()
        if min(n_labels, embed_dim, hidden, cond_dim) < 1:
            raise ValueError(
                f"PromptEncoder needs positive sizes; got n_labels={n_labels}, "
                f"embed_dim={embed_dim}, hidden={hidden}, cond_dim={cond_dim}"
            )
        self.register_buffer("tokens", torch.randn(n_labels, embed_dim))  # [n_labels,d] the prompts' token embeddings
        self.register_buffer("w1", torch.randn(embed_dim, hidden) / math.sqrt(embed_dim))  # [d,h]
        self.register_buffer("b1", 0.1 * torch.randn(hidden))  # [h]
        self.register_buffer("w2", torch.randn(hidden, cond_dim) / math.sqrt(hidden))  # [h,c]
        self.register_buffer("b2", 0.1 * torch.randn(cond_dim))  # [c]

    def forward(self, emb: Tensor) -> Tensor:
        """[..., d] token embeddings -> [..., cond_dim] conditions (in the buffers' dtype)."""
        return torch.tanh(emb.to(self.w1.dtype) @ self.w1 + self.b1) @ self.w2 + self.b2  # [...,c]


def hooked_conditions(
    encoder: PromptEncoder, requests: Sequence[Request], labels: Tensor, G: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The per-row conditions of one sampling call of ``len(requests)`` labels [B] × G row slots:
    ``c_orig`` [N,c] = f(E), ``c_pert`` [N,c] = f(E + δ_j) for rows an ``embed_delta`` hook
    perturbs, ``perturbed`` [N] bool (rows with a nonzero δ), ``rho`` [N] float64 (the hook's
    schedule; NaN: on at every step)."""
    B, d = len(requests), encoder.tokens.shape[1]
    emb = encoder.tokens[labels].repeat_interleave(G, dim=0)  # [N,d]
    c_orig = encoder(emb)  # [N,c]
    delta = torch.zeros(B, G, d, dtype=emb.dtype)  # [B,G,d]
    rho = torch.full((B, G), float("nan"), dtype=torch.float64)  # [B,G]
    for b, req in enumerate(requests):
        hook = req.hook
        if hook is None:
            continue
        if hook.kind != "embed_delta":
            raise ValueError(f"FlowPolicy.generate applies embed_delta hooks only, got {hook.kind!r}")
        if hook.delta.shape[0] != req.n or hook.delta.shape[2] != d:
            raise ValueError(
                f"EmbedDelta of request {b}: delta {tuple(hook.delta.shape)} must be [n={req.n}, P, embed_dim={d}]"
            )
        if bool((hook.positions != 0).any()):
            raise ValueError(
                f"EmbedDelta of request {b}: positions {hook.positions.tolist()} "
                "outside the flow prompt's one token (position 0)"
            )
        delta[b, : req.n] = hook.delta.to(emb.dtype).sum(1)  # [n,d] (P is 0 or 1: the prompt is one token)
        if hook.rho is not None:
            rho[b, : req.n] = hook.rho
    delta, rho = delta.view(B * G, d), rho.view(B * G)  # [N,d], [N]
    perturbed = delta.abs().sum(-1) > 0  # [N]
    c_pert = c_orig.clone()  # [N,c]
    if perturbed.any():
        c_pert[perturbed] = encoder(emb[perturbed] + delta[perturbed])  # [M,c]
    return c_orig, c_pert, perturbed, rho


def mixed_condition(c_orig: Tensor, c_pert: Tensor, perturbed: Tensor, rho: Tensor, sigma: float) -> Tensor:
    """[N,c] the condition of every row at noise level σ: C(σ) = γ(σ)·C^opt + (1 − γ(σ))·C^orig on
    perturbed rows (γ = 1 without a schedule), C^orig exactly on the others."""
    if not perturbed.any():
        return c_orig
    scheduled = ~torch.isnan(rho)  # [N]
    gamma = torch.ones_like(rho)  # [N]
    for r in rho[scheduled].unique().tolist():  # usually one ρ for the whole call
        gamma[rho == r] = noise_aware_gamma(torch.tensor(sigma, dtype=torch.float64), r)
    mixed = mix_condition(c_orig, c_pert, gamma[:, None])  # [N,c]
    return torch.where(perturbed[:, None], mixed, c_orig)  # [N,c]
