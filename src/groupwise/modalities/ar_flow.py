"""An autoregressive flow over frames with a cache of the last W frames (K5 of the non-text design): the
toy analogue of a streaming video generator, first consumer KVPO (arXiv 2605.14278, spec 21, the
authors' code https://github.com/Richard-Zhang-AI/KVPO as the spec quotes it).

**Change vs GRPO**: a row is a sequence of ``frames`` 2-D points; each frame is drawn by a few-step
flow sampler conditioned on the cache of the W frames before it (``modalities/ar_flow_net.py``).
The "tokens" are the (frame, denoising step) pairs of the trained frames.

**Math** (frame f at sequence position p = 3 + f after the 3 prompt frames; σ_k = 1, .75, .5, .25, 0)::

    x ← ε_f ~ N(0, I)                                       the displacement from the last cached frame
    step k:  v = v_θ(x, σ_k, cache_f, target);  x̂₀ = x − σ_k·v
      ODE (sde = "none"):  x ← x + v·(σ_{k+1} − σ_k)
      SDE (sde = "all"):   x ← Flow-GRPO's Euler SDE step (``flow_sde.sde_step_with_logprob``), logp Gaussian
    frame_f = cache_f[−1] + x;   cache_f = the W frames before p (clean), or routed by a ``kv_route`` hook
    sde = "none":  logp(f, k) = energy(x̂₀^sampled, x̂₀_θ(x, σ_k | clean cache))   (``ar_flow_net.step_energy``)
    sde = "all":   logp(f, k) = the SDE step's Gaussian log-prob under the clean cache (Flow-GRPO)

**Defaults** (the toy's, [INFERRED] unless tagged)

- ``frames = 6``, ``window = 3`` (the spec's CPU implementation), ``steps = 4`` with σ = 1, .75, .5, .25
  [CODE] the authors' 1000/750/500/250; ``hidden = 64``, ``layers = 3``.
- ``sde = "none"``: the deterministic ODE, scored by KVPO's energy; ``"all"``: the Flow-GRPO baseline.
- ``train_from = 2``: the trained frames are frames 2.. (0-based; the fork of the perturbation window
  "frames 3–4"), all ``steps`` of each; ``log_prob_grad_steps = 2`` [CODE]: only the first 2 steps of
  a frame carry gradient (the others are computed by the current net, detached).
- ``energy_floor = 1.0`` [CODE] max(σ, 1) in the energy's denominator.
- ``shared_noise = True``: every row of a request draws the same ε (KVPO: "all branches share the same
  noises"); ``False`` gives each row its own (the SDE baseline's exploration).

**Notes**

1. Seeds: row j of a request draws its noise (ε per frame, then the SDE's per step) from
   ``torch.Generator(sample_seed(seed, step, key, offset + j))``; with ``shared_noise`` every row uses
   the request's row 0 draw, ``offset``.
2. The prompt is 8 numbers: 3 history frames (x, y each, oldest first) then the target point; the
   row extra ``frames`` [B,G,F,2] holds the generated frames and ``x_final`` [B,G,2] the last one.
   Token extras [B,G,T,·] (float32): ``arf_x`` (x at the step), ``arf_x0`` (the sampler's x̂₀),
   ``arf_x_next`` (x after the step), ``arf_frame`` and ``arf_step`` (int64).
3. The net runs in float64 and every stored number is rounded to float32 as it is stored (the state x
   after each step as well), so ``forward`` recomputes the sampler's numbers exactly (flow.py Note 3):
   the anchor's energy is 0 up to float32's rounding of x̂₀.
4. ``kv_route`` (``groupwise.hooks.KvRoute``, ``sde = "none"`` only): the routed rows generate the
   hook's frames with their planned cache; every later frame, and every forward, reads the clean
   cache of the row's own frames: scoring replays under the clean cache.
5. ``entropy`` is 0 under the ODE (a deterministic sampler has none); under the SDE it is the Gaussian
   step's, ½·log(2πe) + log(std_t·√(−dt)).
6. Demonstrations (``sft``): a row's ``target`` is its F frames (2F numbers); the loss is rectified
   flow matching of each frame's displacement given its clean (teacher-forced) cache.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from groupwise.modalities.ar_flow_net import (
    FRAME_DIM,
    PROMPT_FRAMES,
    FrameVelocity,
    clean_cache,
    motion_frame,
    route_sources,
    routed_cache,
    step_energy,
    to_local,
    to_world,
)
from groupwise.modalities.flow_sde import flow_sigmas, sde_step_with_logprob
from groupwise.modalities.net_policy import NetPolicy
from groupwise.seeds import sample_seed
from groupwise.types import Request, Rollout, StepInfo

SDE_MODES = ("none", "all")


class ARFlowPolicy(NetPolicy):
    """Frames drawn one by one by a few-step flow conditioned on a cache of the last W frames (K5)."""

    policy_file = "ar_flow_policy.pt"
    net: FrameVelocity

    def __init__(
        self,
        frames: int = 6,
        window: int = 3,
        steps: int = 4,
        hidden: int = 64,
        layers: int = 3,
        sde: str = "none",
        train_from: int = 2,
        log_prob_grad_steps: int = 2,
        energy_floor: float = 1.0,
        shared_noise: bool = True,
        init_seed: int = 0,
    ):
        if sde not in SDE_MODES:
            raise ValueError(f"ARFlowPolicy: sde must be one of {SDE_MODES}, got {sde!r}")
        if not (frames >= 1 and 2 <= window <= PROMPT_FRAMES and steps >= 1 and 0 <= train_from < frames):
            raise ValueError(
                f"ARFlowPolicy: need frames >= 1, 2 <= window <= {PROMPT_FRAMES}, steps >= 1, 0 <= train_from < "
                f"frames; got frames={frames}, window={window}, steps={steps}, train_from={train_from}"
            )
        if not (0 <= log_prob_grad_steps <= steps and energy_floor > 0):
            raise ValueError(
                f"ARFlowPolicy: need 0 <= log_prob_grad_steps <= steps and energy_floor > 0; got "
                f"{log_prob_grad_steps}, {energy_floor}"
            )
        self.config = {"frames": frames, "window": window, "steps": steps, "hidden": hidden, "layers": layers}
        self.frames, self.window, self.steps = frames, window, steps
        self.sde, self.train_from, self.grad_steps = sde, train_from, log_prob_grad_steps
        self.energy_floor, self.shared_noise = energy_floor, shared_noise
        self.sigmas = flow_sigmas(steps).double()  # [K+1] 1 → 0
        self.sigma_max, self.sigma_min = float(self.sigmas[1]), float(self.sigmas[-1])
        with torch.random.fork_rng(devices=[]):  # seeded init that leaves the global stream alone
            torch.manual_seed(init_seed)
            self.net = FrameVelocity(window, hidden, layers).double()
        self.trainable = True
        self.modality = "ar_flow"
        # what generate writes (build.check_policy_fit): a flow reward reading x_final runs on this kind too
        self.row_extras = frozenset({"frames", "x_final"})
        self.token_extras = frozenset({"arf_x", "arf_x0", "arf_x_next", "arf_frame", "arf_step"})
        self.request_options = frozenset({"greedy"})  # greedy: the ODE whatever sde says
        self.quantities = frozenset({"logp", "entropy"})
        self.hooks = frozenset({"kv_route"}) if sde == "none" else frozenset()  # Note 4
        self.reference: ARFlowPolicy | None = None
        self.context = None

    @property
    def T(self) -> int:
        return (self.frames - self.train_from) * self.steps

    # ------------------------------------------------------------------ encoding
    def encode(self, prompt: Any) -> list[float]:
        """A prompt: 3 history frames then the target, 8 numbers (Note 2)."""
        try:
            values = [float(v) for v in prompt]
        except (TypeError, ValueError):
            values = []
        n = FRAME_DIM * (PROMPT_FRAMES + 1)
        if len(values) != n or not all(math.isfinite(v) for v in values):
            raise ValueError(f"ARFlowPolicy: a prompt is {n} numbers (3 frames, then the target), got {prompt!r}")
        return values

    def decode(self, rollout: Rollout) -> list[list[str]]:
        frames, valid = rollout.extras["frames"].tolist(), rollout.group_valid.tolist()
        return [
            [";".join(f"{x:.3f},{y:.3f}" for x, y in row) if ok else "" for row, ok in zip(rows, oks)]
            for rows, oks in zip(frames, valid)
        ]

    def check_fits(self, ids: list, max_new_tokens: int, where: str) -> None:
        """Nothing to check: a row is ``frames`` frames, not tokens."""

    @staticmethod
    def _prompt_tensor(contexts: Sequence[list]) -> tuple[Tensor, Tensor]:
        """(history [N,3,2], target [N,2]) float64 from prompts rounded to float32 (Note 3)."""
        p = torch.tensor([list(c) for c in contexts], dtype=torch.float32).double().view(-1, PROMPT_FRAMES + 1, 2)
        return p[:, :PROMPT_FRAMES], p[:, PROMPT_FRAMES]

    def _noise(self, requests: Sequence[Request], info: StepInfo, G: int) -> tuple[Tensor, Tensor]:
        """(ε [B,G,F,2], SDE noise [B,G,F,K,2]) by Note 1."""
        F, K = self.frames, self.steps
        eps, sde_eps = (
            torch.zeros(len(requests), G, F, 2, dtype=torch.float64),
            torch.zeros(len(requests), G, F, K, 2, dtype=torch.float64),
        )
        for b, req in enumerate(requests):
            for j in range(req.n):
                row = 0 if self.shared_noise else j
                g = torch.Generator().manual_seed(sample_seed(info.seed, info.step, req.key, req.offset + row))
                eps[b, j] = torch.randn(F, 2, generator=g, dtype=torch.float64)
                sde_eps[b, j] = torch.randn(F, K, 2, generator=g, dtype=torch.float64)
        return eps, sde_eps

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def generate(self, requests: Sequence[Request], sampling: dict, info: StepInfo) -> Rollout:
        if not requests or any(r.n < 1 for r in requests):
            raise ValueError("ARFlowPolicy.generate needs at least one request, each with n >= 1")
        prompts = [self.encode(r.prompt) for r in requests]
        B, G, F, K, W = len(requests), max(r.n for r in requests), self.frames, self.steps, self.window
        sde = self.sde == "all" and not sampling.get("greedy")
        valid = torch.arange(G)[None, :] < torch.tensor([r.n for r in requests])[:, None]  # [B,G]
        history, target = self._prompt_tensor(prompts)  # [B,3,2], [B,2]
        N = B * G
        seq = torch.zeros(N, PROMPT_FRAMES + F, 2, dtype=torch.float64)  # [N,L,2]
        seq[:, :PROMPT_FRAMES] = history.repeat_interleave(G, 0)
        target = target.repeat_interleave(G, 0)  # [N,2]
        if self.sde != "none" and any(r.hook is not None for r in requests):
            raise ValueError("ARFlowPolicy: kv_route hooks need sde = 'none' (the energy replays the clean cache)")
        sources, routed_frames = route_sources(requests, G, F, W, PROMPT_FRAMES)  # [N,F,S] (−1: clean)
        eps, sde_eps = self._noise(requests, info, G)  # [B,G,F,2], [B,G,F,K,2]
        eps, sde_eps = eps.view(N, F, 2), sde_eps.view(N, F, K, 2)
        rec = {k: torch.zeros(N, F, K, 2, dtype=torch.float32) for k in ("arf_x", "arf_x0", "arf_x_next")}
        logp = torch.zeros(N, F, K)  # [N,F,K]
        for f in range(F):
            pos = torch.full((N,), PROMPT_FRAMES + f)
            cache = routed_cache(seq, pos, W, sources[:, f]) if f in routed_frames else clean_cache(seq, pos, W)
            _, scale, rot = motion_frame(cache)
            x = to_world(eps[:, f], scale, rot).float().double()  # [N,2] world units, stored as float32 (Note 3)
            for k in range(K):
                s, s_next = self.sigmas[k], self.sigmas[k + 1]
                v = self.net(x, s.expand(N), cache, target)  # [N,2]
                rec["arf_x"][:, f, k], rec["arf_x0"][:, f, k] = x.float(), (x - s * v).float()
                if sde:
                    x_next = self._sde_step(x, v, k, cache, sde_eps[:, f, k])
                    logp[:, f, k] = self._sde_logp(x, v, k, cache, x_next)[0].float()
                else:
                    x_next = (x + v * (s_next - s)).float().double()  # [N,2] rounded as stored
                x = x_next
                rec["arf_x_next"][:, f, k] = x.float()
            seq[:, PROMPT_FRAMES + f] = (cache[:, -1] + x).float().double()
        return self._rollout(requests, prompts, valid, seq, rec, logp if sde else None)

    def _sde_step(self, x: Tensor, v: Tensor, k: int, cache: Tensor, noise: Tensor) -> Tensor:
        """[N,2] x after Flow-GRPO's SDE step k, taken in the cache's motion frame (its noise scales with the
        motion), rounded to float32 in world units as it is stored."""
        _, scale, rot = motion_frame(cache)
        x_next, *_ = sde_step_with_logprob(
            to_local(v, scale, rot),
            to_local(x, scale, rot),
            self.sigmas[k],
            self.sigmas[k + 1],
            self.sigma_min,
            self.sigma_max,
            noise=noise,
        )
        return to_world(x_next, scale, rot).float().double()

    def _sde_logp(self, x: Tensor, v: Tensor, k: Tensor | int, cache: Tensor, x_next: Tensor) -> tuple[Tensor, ...]:
        """(logp [N], std_t [N], √(−dt) [N]) of the SDE step k ([N] or a number) from x to x_next [N,2]
        (world units, as stored), taken in the cache's motion frame."""
        _, scale, rot = motion_frame(cache)
        k = torch.as_tensor(k)
        _, lp, _, std, sqrt_neg_dt, _ = sde_step_with_logprob(
            to_local(v, scale, rot),
            to_local(x, scale, rot),
            self.sigmas[k],
            self.sigmas[k + 1],
            self.sigma_min,
            self.sigma_max,
            prev_sample=to_local(x_next, scale, rot),
        )
        return lp, std, sqrt_neg_dt

    def _rollout(self, requests, prompts, valid, seq, rec, logp) -> Rollout:
        B, G = valid.shape
        F0, T = self.train_from, self.T
        mask = valid[..., None].expand(B, G, T).clone()  # [B,G,T]
        out = Rollout(
            prompt_ids=[list(p) for p in prompts],
            actions=torch.zeros(B, G, T, dtype=torch.long),  # [B,G,T] the steps live in the extras
            mask=mask,
            group_valid=valid,
            truncated=torch.zeros(B, G, dtype=torch.bool),
            prompt_index=torch.tensor([r.key for r in requests], dtype=torch.long),
            meta=[{"prompt": list(p)} for p in prompts],
            logp_sampler=None if logp is None else logp[:, F0:].reshape(B, G, T) * mask,
        )
        keep = valid[..., None, None]
        for name, t in rec.items():
            out.set_extra(name, (t[:, F0:].reshape(B, G, T, 2) * keep).float(), "token")  # [B,G,T,2]
        frame = torch.arange(F0, self.frames).repeat_interleave(self.steps)  # [T]
        out.set_extra("arf_frame", frame.expand(B, G, T).clone(), "token")  # [B,G,T]
        out.set_extra("arf_step", torch.arange(self.steps).repeat(self.frames - F0).expand(B, G, T).clone(), "token")
        frames = seq[:, PROMPT_FRAMES:].view(B, G, self.frames, 2).float() * keep  # [B,G,F,2]
        out.set_extra("frames", frames, "row")
        out.set_extra("x_final", frames[:, :, -1], "row")  # [B,G,2]
        out.completions = self.decode(out)
        return out

    # ------------------------------------------------------------------ scoring and training
    def forward(self, rollout: Rollout, quantities: Sequence[str] = ("logp",)) -> dict[str, Tensor]:
        """``logp`` [B,G,T]: the energy (ODE) or the SDE log-prob of each stored step under the clean
        cache; ``entropy`` [B,G,T] (Note 5)."""
        unknown = [q for q in quantities if q not in self.quantities]
        if unknown:
            raise ValueError(f"ARFlowPolicy.forward computes {sorted(self.quantities)}, not {unknown}")
        if "frames" not in rollout.extras or "arf_x" not in rollout.extras:
            raise ValueError(
                "ARFlowPolicy.forward needs the extras 'frames' and 'arf_x', written by ARFlowPolicy.generate"
            )
        B, G, T = rollout.shape
        contexts = [c if c else [0.0] * 8 for row in rollout.row_contexts() for c in row]  # B*G
        history, target = self._prompt_tensor(contexts)  # [N,3,2], [N,2]
        seq = torch.cat([history, rollout.extras["frames"].double().view(B * G, self.frames, 2)], 1)  # [N,L,2]
        frame, step = rollout.extras["arf_frame"].reshape(-1), rollout.extras["arf_step"].reshape(-1)  # [N*T]
        rows = torch.arange(B * G).repeat_interleave(T)  # [N*T]
        cache = clean_cache(seq[rows], PROMPT_FRAMES + frame, self.window)  # [N*T,W,2]
        x = rollout.extras["arf_x"].double().reshape(-1, 2)  # [N*T,2]
        sigma = self.sigmas[step]  # [N*T]
        v = self.net(x, sigma, cache, target[rows])  # [N*T,2]
        if self.sde == "none":
            lp = step_energy(rollout.extras["arf_x0"].reshape(-1, 2), x - sigma[:, None] * v, sigma, self.energy_floor)
            lp = torch.where(step < self.grad_steps, lp, lp.detach())  # [N*T] Note: only the first steps carry grad
            ent = torch.zeros_like(lp)
        else:
            x_next = rollout.extras["arf_x_next"].double().reshape(-1, 2)
            lp, std, sqrt_neg_dt = self._sde_logp(x, v, step, cache, x_next)
            ent = 0.5 * math.log(2 * math.pi * math.e) + torch.log(std * sqrt_neg_dt)  # [N*T]
        sel = rollout.mask.bool()  # [B,G,T]
        zero = torch.zeros((), dtype=lp.dtype)
        out = {"logp": torch.where(sel, lp.view(B, G, T), zero).float()}
        if "entropy" in quantities:
            out["entropy"] = torch.where(sel, ent.detach().view(B, G, T), zero).float()
        return out

    # ------------------------------------------------------------------ demonstrations (M1)
    def encode_target(self, row: dict) -> Tensor:
        """A demonstration row's ``target``: its ``frames`` frames, 2·frames numbers, as [F,2] float64."""
        if "target" not in row:
            raise ValueError(
                f"ARFlowPolicy.encode_target: a demonstration row needs a `target` column, got {sorted(row)}"
            )
        t = torch.as_tensor(row["target"], dtype=torch.float64)
        if t.numel() != 2 * self.frames or not bool(torch.isfinite(t).all()):
            raise ValueError(
                f"ARFlowPolicy.encode_target: `target` must be {2 * self.frames} finite numbers (the frames), "
                f"got {row['target']!r}"
            )
        return t.view(self.frames, 2)

    def supervised_loss(self, prompts: Sequence[list], targets: Sequence[Tensor], gen: torch.Generator) -> Tensor:
        """Rectified flow matching of every frame's displacement d = frame − cache[−1] given its clean cache:
        mean (v_θ(x_σ, σ, cache, target) − (ε − d))², x_σ = (1 − σ)·d + σ·ε; σ [N,F] then ε [N,F,2] from ``gen``."""
        if len(prompts) != len(targets) or not prompts:
            raise ValueError(
                "ARFlowPolicy.supervised_loss: need as many prompts as targets (>= 1), "
                f"got {len(prompts)}, {len(targets)}"
            )
        history, goal = self._prompt_tensor([self.encode(p) for p in prompts])  # [N,3,2], [N,2]
        demo = torch.stack([torch.as_tensor(t, dtype=torch.float64).view(self.frames, 2) for t in targets])  # [N,F,2]
        N, F = demo.shape[:2]
        seq = torch.cat([history, demo], 1)  # [N,L,2]
        pos = (PROMPT_FRAMES + torch.arange(F)).repeat(N)  # [N*F]
        rows = torch.arange(N).repeat_interleave(F)  # [N*F]
        cache = clean_cache(seq[rows], pos, self.window)  # [N*F,W,2]
        _, scale, rot = motion_frame(cache)
        d = to_local(demo.reshape(-1, 2) - cache[:, -1], scale, rot)  # [N*F,2] in the motion frame
        sigma = torch.rand(N * F, generator=gen, dtype=torch.float64)  # [N*F]
        noise = torch.randn(N * F, 2, generator=gen, dtype=torch.float64)  # [N*F,2]
        x = (1 - sigma[:, None]) * d + sigma[:, None] * noise
        return ((self.net.local(x, sigma, cache, goal[rows]) - (noise - d)) ** 2).mean()
