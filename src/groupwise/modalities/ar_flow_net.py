"""The parts of the autoregressive frame flow (``modalities/ar_flow.py``, K5) that are not the policy:
the velocity net over one frame given a cache of earlier frames, the cache (clean or routed), and
KVPO's per-step energy.

KVPO (arXiv 2605.14278, spec 21; the authors' ``models/longlive/trainer/kvpo.py`` as the spec quotes
it) defines the energy; the net and the cache are the toy's [INFERRED] analogue of a causal video
generator's local attention window (``local_attn_size`` frames of KV cache).

**Math** (a frame is a 2-D point; ``cache`` [N,W,2] the W frames the generator sees, oldest first;
the motion frame of a cache: its last frame c, its last step m = c − cache[:, −2], scale |m| and the
rotation Q whose first column is m/|m|; local(p) = Qᵀp/|m|, world(q) = |m|·Q·q)::

    v_θ(x, σ, cache, target) = world(MLP([local(x), σ, sin(πkσ), cos(πkσ) (k = 1..4),
                                          dir(local(cache[:, :−1] − c)), local(target − c)]))
    dir(q) = q/‖q‖                        the net reads the direction of each older frame, not its distance
    x̂₀ = x − σ·v_θ                        x the displacement from c (world units), at noise level σ
    energy(x̂₀_branch, x̂₀_θ, σ) = −mean_d (x̂₀_branch − x̂₀_θ)² / (2·max(σ, floor)²)     floor = 1

The net works in the motion frame of its cache (translation-, rotation- and scale-equivariant) and
reads where the older frames lie, not how far: the "storyline" it continues is the bend of the cached
frames, so a cache of other frames (routing) makes it continue another bend at the same speed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from groupwise.hooks import KvRoute
from groupwise.types import Request

FRAME_DIM = 2
PROMPT_FRAMES = 3  # the prompt's history frames (positions 0..2 of a row's sequence)


def motion_frame(cache: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(last frame c [N,2], scale |m| [N], rotation Q [N,2,2]) of caches [N,W,2] (module Math)."""
    last = cache[:, -1]  # [N,2]
    step = last - cache[:, -2]  # [N,2]
    scale = step.norm(dim=-1).clamp(min=1e-6)  # [N]
    e = step / scale[:, None]  # [N,2]
    rot = torch.stack([e, torch.stack([-e[:, 1], e[:, 0]], -1)], dim=-1)  # [N,2,2] columns e, e⊥
    return last, scale, rot


def to_local(p: Tensor, scale: Tensor, rot: Tensor) -> Tensor:
    """Qᵀp/|m| for p [N,2] or [N,K,2]."""
    q = p @ rot if p.dim() == 3 else (p[:, None, :] @ rot)[:, 0]  # [N,(K,)2] rows times Q = (Qᵀ p)ᵀ
    return q / (scale[:, None, None] if p.dim() == 3 else scale[:, None])


def to_world(q: Tensor, scale: Tensor, rot: Tensor) -> Tensor:
    """|m|·Q·q for q [N,2]."""
    return scale[:, None] * (rot @ q[..., None])[..., 0]  # [N,2]


class FrameVelocity(nn.Module):
    """v_θ(x [N,2], σ [N], cache [N,W,2], target [N,2]) -> [N,2] in world units (module Math; silu MLP)."""

    def __init__(self, window: int = 3, hidden: int = 64, layers: int = 3, freqs: int = 4):
        super().__init__()
        if window < 2 or hidden < 1 or layers < 2 or freqs < 1:
            raise ValueError(
                f"FrameVelocity needs window >= 2, hidden >= 1, layers >= 2, freqs >= 1; got {window}, {hidden}, "
                f"{layers}, {freqs}"
            )
        self.register_buffer("freqs", math.pi * torch.arange(1, freqs + 1, dtype=torch.float32))  # [F]
        n_in = FRAME_DIM + 1 + 2 * freqs + FRAME_DIM * (window - 1) + FRAME_DIM
        sizes = [n_in] + [hidden] * (layers - 1) + [FRAME_DIM]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def local(self, x: Tensor, sigma: Tensor, cache: Tensor, target: Tensor) -> Tensor:
        """The velocity in the cache's motion frame, [N,2], for x [N,2] given in that frame."""
        dtype = self.freqs.dtype
        x, sigma, cache, target = x.to(dtype), sigma.to(dtype), cache.to(dtype), target.to(dtype)
        last, scale, rot = motion_frame(cache)
        f = sigma[:, None] * self.freqs  # [N,F]
        older = to_local(cache[:, :-1] - last[:, None], scale, rot)  # [N,W−1,2]
        older = (older / older.norm(dim=-1, keepdim=True).clamp(min=1e-6)).flatten(1)  # [N,2(W−1)] directions only
        goal = to_local(target - last, scale, rot)  # [N,2]
        h = torch.cat([x, sigma[:, None], torch.sin(f), torch.cos(f), older, goal], dim=-1)  # [N,n_in]
        for i, layer in enumerate(self.layers):
            h = layer(h)  # [N,H] or [N,2]
            if i < len(self.layers) - 1:
                h = nn.functional.silu(h)
        return h  # [N,2]

    def forward(self, x: Tensor, sigma: Tensor, cache: Tensor, target: Tensor) -> Tensor:
        _, scale, rot = motion_frame(cache.to(self.freqs.dtype))
        return to_world(self.local(to_local(x.to(self.freqs.dtype), scale, rot), sigma, cache, target), scale, rot)


def step_energy(x0_branch: Tensor, x0_pred: Tensor, sigma: Tensor, floor: float = 1.0) -> Tensor:
    """[N] KVPO's per-step energy −mean_d (x̂₀_branch − x̂₀_θ)² / (2·max(σ, floor)²) (a Gibbs surrogate's
    log-weight, not a normalised log-prob); ``sigma`` [N] or a number."""
    sigma = torch.as_tensor(sigma, dtype=x0_pred.dtype).expand(x0_pred.shape[0])  # [N]
    denom = 2 * sigma.clamp(min=floor) ** 2  # [N]
    return -((x0_branch.to(x0_pred.dtype) - x0_pred) ** 2).mean(-1) / denom  # [N]


def clean_cache(seq: Tensor, pos: Tensor, window: int) -> Tensor:
    """[N,W,2] the W frames before sequence position ``pos`` [N] (oldest first) of ``seq`` [N,L,2]."""
    idx = pos[:, None] - window + torch.arange(window)[None, :]  # [N,W]
    return torch.gather(seq, 1, idx[..., None].expand(-1, -1, FRAME_DIM))  # [N,W,2]


def routed_cache(seq: Tensor, pos: Tensor, window: int, sources: Tensor) -> Tensor:
    """[N,W,2] the cache before ``pos`` [N] with its S oldest slots replaced by the frames at ``sources`` [N,S]
    (rows whose sources are all −1 keep the clean cache)."""
    cache = clean_cache(seq, pos, window)  # [N,W,2]
    S = sources.shape[1]
    routed = (sources >= 0).all(-1)  # [N]
    picked = torch.gather(seq, 1, sources.clamp(min=0)[..., None].expand(-1, -1, FRAME_DIM))  # [N,S,2]
    head = torch.where(routed[:, None, None], picked, cache[:, :S])  # [N,S,2]
    return torch.cat([head, cache[:, S:]], dim=1)  # [N,W,2]


def route_sources(
    requests: Sequence[Request], G: int, frames: int, window: int, prompt_frames: int
) -> tuple[Tensor, set[int]]:
    """([B*G,F,S] the cache sources of every row and frame, −1 = the clean cache; the routed frames) of the
    requests' ``kv_route`` hooks (``hooks.KvRoute``), each checked against the cache it routes."""
    hooks = [r.hook for r in requests if r.hook is not None]
    if any(not isinstance(h, KvRoute) for h in hooks):
        raise ValueError(f"ARFlowPolicy applies kv_route hooks only, got {[type(h).__name__ for h in hooks]}")
    S = max([h.sources.shape[2] for h in hooks], default=1)
    if not 1 <= S < window:
        raise ValueError(f"ARFlowPolicy: a kv_route hook fills 1..{window - 1} cache slots, got {S}")
    sources = torch.full((len(requests), G, frames, S), -1, dtype=torch.long)  # [B,G,F,S]
    routed: set[int] = set()
    for b, req in enumerate(requests):
        h = req.hook
        if h is None:
            continue
        if h.sources.shape[0] != req.n or h.sources.shape[2] != S:
            raise ValueError(
                f"kv_route hook of request {b}: sources {tuple(h.sources.shape)} must be [n={req.n}, P, {S}]"
            )
        for p, f in enumerate(h.frames.tolist()):
            if not 0 <= f < frames:
                raise ValueError(f"kv_route hook of request {b}: frame {f} outside 0..{frames - 1}")
            src = h.sources[:, p]  # [n,S]
            limit = prompt_frames + f - (window - S)  # the cache keeps the window − S frames from here on
            if bool((src >= limit).any()):
                raise ValueError(
                    f"kv_route hook of request {b}: frame {f}'s sources {src.tolist()} must be older than the "
                    f"{window - S} frames the cache keeps (positions < {limit})"
                )
            sources[b, : req.n, f] = src
            routed.add(f)
    return sources.view(-1, frames, S), routed
