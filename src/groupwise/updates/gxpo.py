"""GXPO: two probe optimiser steps, per-coordinate geometric extrapolation, a corrective step, a z-score shutoff gate.

"Gradient Extrapolation-Based Policy Optimization", Ismam Nur Swapnil, Aranya Saha, Tanvir Ahmed
Khan, Mohammad Ariful Haque, Ser-Nam Lim, 2026. https://arxiv.org/abs/2605.06755 — "Algorithm 1" of
the authors' code (github.com/SwapniL-afk-now/final-gxpo: ``gxpo_state.py``, ``dp_actor.py``).

**Change vs GRPO** (the loss is GRPO's, unchanged; only the update rule differs, per mini-batch):

- two fast optimiser steps on the same batch, θ0 → θ1 → θ2, recording the raw gradients g0, g1;
- per coordinate the gradient retention r = c1·g1 / (c0·g0) extrapolates the two-step displacement
  to a virtual K-step one (geometric series); the weights move α of the way there (θ̃);
- the optimiser state is rolled back to θ0's and a corrective step is taken with the true gradient
  at θ̃: 3 backward passes per outer step;
- a z-score gate on the corrective gradient norm falls back to plain GRPO (1 backward pass).

**Math** (``c`` = the grad-clip factors of the probes, ``opt_step`` = the inner AdamW / SGD step)::

    active = |g0| > delta
    r      = clip(c1*g1 / (c0*g0), r_min, r_max), NaN -> 1;      r = 1 where not active
    S_K    = sum_{k<K} r^k  (Horner),  S_2 = 1 + r
    scale  = clamp(S_K / S_2 if |S_2| > delta else 1,  1, K/2 + 1); scale = 1 where not active
    theta_tilde = theta0 + alpha * scale * (theta2 - theta0)
    theta_new   = opt_step(theta_tilde, g(theta_tilde), optimiser state of theta0)   (transactional)
    H = ||g(theta_tilde)||,  z = (H - mean(window)) / (std(window) + 1e-9);  z >= tau `patience` times -> off

On a separable quadratic GD has g_{k+1} = r·g_k with r = 1 − lr·h, so θ_K − θ0 = −lr·g0·S_K(r) and
θ2 − θ0 = −lr·g0·S_2(r): with α = 1 the extrapolated point is the K-step point exactly.

**Defaults** (library defaults = the authors' paper-matrix launcher ``experiments/gxpo_efficiency/common.sh``)

- ``K=5`` [CODE common.sh; the k10 variants use 10], ``alpha=0.5`` [CODE common.sh; 0.3 variants],
  ``delta=1e-8`` [CODE GXPOState]; ``r_min, r_max = -2, 3`` and the scale clamp [1, K/2+1] [CODE];
  ``min_effective_multiplier=None`` (off; a floor on α·scale) [CODE].
- ``tau=3.0``, ``window=30``, ``patience=3``, ``gate_warmup=50`` [CODE common.sh];
  ``gate_mode="trajectory_aware"``, ``fallback_mode="permanent"``, ``fallback_window=10`` [CODE GXPOState].
- ``state_mode="transactional"`` [CODE]; ``retention_space="grad"`` [CODE "Algorithm 1" legacy estimator].
- ``lr=1e-6`` [CODE common.sh]; ``optimizer="adamw"``, ``betas=(0.9, 0.999)``, ``weight_decay=0.01``,
  ``eps=1e-8`` [CODE verl fsdp_workers AdamW]; ``max_grad_norm=1.0`` [CODE verl ppo_trainer.yaml
  grad_clip]; ``warmup_steps=0``, ``schedule="constant"`` [CODE ppo_trainer.yaml]; ``momentum=0``
  (SGD only) [INFERRED]. ``gate_ddof=0`` (population std of the window) [INFERRED: not stated].

**Notes**

1. ``loss`` and ``grad_norm`` are those of θ0 (comparable with a plain step); ``backward_passes`` is 3
   on an extrapolated step, 1 on a fallback; ``gxpo_enabled`` = 1 when the step extrapolated.
2. Fallback (one closure call, a plain optimiser step): the gate is off, or ‖g0‖ ≤ 1e-8 [CODE]. A
   non-finite loss or gradient at any pass skips the step as ``TorchUpdater`` does: weights and
   optimiser state return to θ0's and ``skipped`` counts it. The LR schedule advances once per outer step.
3. The gate sees extrapolated steps only (fallbacks leave its window frozen, so ``temporary`` re-arms
   on the pre-trip baseline) [CODE]. z is computed once the window holds ``window`` values, the
   current value excluded (z = 0 before). Outer steps < ``gate_warmup`` fill the window but cannot
   trip it. A trip at step s disables steps ≥ s+1; ``temporary`` re-enables at s+1+fallback_window.
4. ``transactional_fast_state`` keeps the probe moments (Adam's step counter advances 3× a step).
5. ``retention_space="adamw_direction"`` [CODE ``gxpo_retention_space``]: r from the optimiser's own
   directions d_t = (c·θ_t − θ_{t+1})/lr, c = 1 − lr·weight_decay for AdamW (1 for SGD, whose decay
   is in the gradient); clipping is inside d, so c0 = c1 = 1; active = |d0| > delta [INFERRED].
   The Muon per-matrix variant is not implemented (there is no Muon here).
6. Gradients are all-reduced by the closure, so r, scale and the gate agree on every rank.
7. The spec's ``GXPOStep`` is this updater's ``step(closure)``; ``OptimizerSnapshot`` lives in
   ``updates/_base.py``. ``self.optimizer`` is the choice of inner optimiser (a name); the torch
   optimiser is ``self.torch_optimizer``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.updates._base import OptimizerSnapshot, TorchUpdater, clip_grads, grads_of, load_keeping_configuration
from groupwise.updates._gxpo_gate import GXPOGate
from groupwise.updates.adamw import AdamW

__all__ = ["GXPO", "GXPOGate", "OptimizerSnapshot", "gxpo_retention_scale"]


def gxpo_retention_scale(
    g0: Tensor,
    g1: Tensor,
    K: int,
    delta: float,
    c0: float = 1.0,
    c1: float = 1.0,
    r_min: float = -2.0,
    r_max: float = 3.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-coordinate retention r, extrapolation scale S_K/S_2 (clamped to [1, K/2+1]) and the active mask."""
    g0, g1 = g0.float(), g1.float()  # [n]
    ones = torch.ones_like(g0)  # [n]
    active = g0.abs() > delta  # [n]
    r = ((c1 * g1) / (c0 * g0)).clamp(r_min, r_max).nan_to_num(nan=1.0)  # [n] (0/0 → NaN → 1)
    r = torch.where(active, r, ones)  # [n]
    s_k = ones.clone()  # [n] S_1 = 1
    for _ in range(K - 1):
        s_k = 1.0 + r * s_k  # [n] Horner: S_{k+1} = 1 + r·S_k
    s_2 = 1.0 + r  # [n]
    scale = torch.where(s_2.abs() > delta, s_k / s_2, ones).clamp(1.0, K / 2 + 1)  # [n]
    return r, torch.where(active, scale, ones), active


def _finite(*xs: Tensor) -> bool:
    return all(bool(torch.isfinite(torch.as_tensor(x)).all()) for x in xs)


@register("update", "gxpo")
@dataclass
class GXPO(TorchUpdater):
    """GXPO: two probe steps, per-coordinate geometric extrapolation to K steps, a corrective step, z-score shutoff
    (Swapnil et al. 2026)."""

    optimizer: str = "adamw"
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    eps: float = 1e-8
    momentum: float = 0.0
    fused: bool = True
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    schedule: str = "constant"
    K: int = 5
    alpha: float = 0.5
    delta: float = 1e-8
    r_min: float = -2.0
    r_max: float = 3.0
    min_effective_multiplier: float | None = None
    state_mode: str = "transactional"
    retention_space: str = "grad"
    tau: float = 3.0
    window: int = 30
    patience: int = 3
    gate_mode: str = "trajectory_aware"
    fallback_mode: str = "permanent"
    fallback_window: int = 10
    gate_warmup: int = 50
    gate_ddof: int = 0
    rollback_nonfinite: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, value, allowed in (
            ("optimizer", self.optimizer, ("adamw", "sgd")),
            ("state_mode", self.state_mode, ("transactional", "transactional_fast_state")),
            ("retention_space", self.retention_space, ("grad", "adamw_direction")),
        ):
            if value not in allowed:
                raise ConfigError(f"gxpo: {name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.K < 2 or not self.alpha > 0 or not self.r_min < self.r_max:
            raise ConfigError(
                f"gxpo: need K >= 2, alpha > 0, r_min < r_max; got K={self.K}, "
                f"alpha={self.alpha}, r=[{self.r_min}, {self.r_max}]"
            )
        self.gate = GXPOGate(
            self.tau,
            self.window,
            self.patience,
            self.gate_mode,
            self.fallback_mode,
            self.gate_warmup,
            self.fallback_window,
            self.gate_ddof,
        )
        self.t = 0  # outer steps taken (the gate's clock)

    def make_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if self.optimizer == "adamw":
            return AdamW(
                lr=self.lr, betas=self.betas, weight_decay=self.weight_decay, eps=self.eps, fused=self.fused
            ).make_optimizer(params)
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)

    def bind(self, params: list[torch.nn.Parameter], total_steps: int) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.torch_optimizer = self.make_optimizer(self.params)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.torch_optimizer, lambda s: self._lr_factor(s, total_steps)
        )

    def _backward(self, closure: Callable[[], Tensor]) -> Tensor:
        self.torch_optimizer.zero_grad(set_to_none=True)
        return closure()

    def _skip(
        self, out: dict[str, float], theta0: list[Tensor] | None, snap: OptimizerSnapshot | None
    ) -> dict[str, float]:
        if theta0 is not None:  # a probe went non-finite: back to θ0 and its optimiser state
            with torch.no_grad():
                for p, t0 in zip(self.params, theta0):
                    p.copy_(t0)
            snap.restore()
        self.skipped += 1
        self.torch_optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return {**out, "skipped": 1.0, "nonfinite": 1.0}

    def torch_optim(self) -> torch.optim.Optimizer:
        return self.torch_optimizer

    def _step(self, closure: Callable[[], Tensor]) -> dict[str, float]:
        params, opt, s = self.params, self.torch_optimizer, self.t
        self.t += 1
        lr = self.scheduler.get_last_lr()[0]
        on = self.gate.enabled(s)
        loss = self._backward(closure)  # pass 1 at θ0
        g0 = grads_of(params) if on else None  # per parameter [*p.shape], raw (before clipping)
        norm0, c0 = clip_grads(params, self.max_grad_norm)
        out = {
            "loss": float(loss),
            "grad_norm": float(norm0),
            "lr": lr,
            "skipped": 0.0,
            "nonfinite": 0.0,
            "gxpo_enabled": 0.0,
            "gxpo_scale_mean": 1.0,
            "gxpo_active_frac": 0.0,
            "gxpo_z": 0.0,
            "backward_passes": 1.0,
        }
        if not _finite(loss, norm0):
            return self._skip({**out, "grad_norm": float("nan")}, None, None)
        if not on or float(norm0) <= 1e-8:  # fallback: the plain GRPO step
            opt.step()
            self.scheduler.step()
            return out
        theta0 = [p.detach().clone() for p in params]  # per parameter [*p.shape]
        snap = OptimizerSnapshot(opt)
        direction = self.retention_space == "adamw_direction"
        decay = 1.0 - lr * self.weight_decay if self.optimizer == "adamw" else 1.0  # c of d_t = (c·θ_t − θ_{t+1})/lr
        opt.step()  # θ1
        if direction:
            g0 = [(decay * t0 - p.detach()) / lr for p, t0 in zip(params, theta0)]  # d0 per parameter [*p.shape]
        loss1 = self._backward(closure)  # pass 2 at θ1
        norm1, c1 = clip_grads(params, self.max_grad_norm)  # p.grad = c1·g1 now
        if not _finite(loss1, norm1):
            return self._skip({**out, "backward_passes": 2.0}, theta0, snap)
        if direction:
            before = [decay * p.detach() for p in params]  # c·θ1 per parameter [*p.shape]
            opt.step()  # θ2
            g1, c0, c1 = (
                [(b - p.detach()) / lr for p, b in zip(params, before)],
                1.0,
                1.0,
            )  # d1 per parameter [*p.shape]
        else:
            g1, c1 = (
                [p.grad if p.grad is not None else torch.zeros_like(p) for p in params],
                1.0,
            )  # c1·g1 per parameter [*p.shape]
        scales, n_active, n_total, scale_sum = [], 0, 0, 0.0
        for a, b in zip(g0, g1):
            _, scale, active = gxpo_retention_scale(
                a.flatten(), b.flatten(), self.K, self.delta, c0, c1, self.r_min, self.r_max
            )  # [n] each
            scales.append(scale.view_as(a))  # [*p.shape]
            n_active, n_total, scale_sum = (
                n_active + int(active.sum()),
                n_total + active.numel(),
                scale_sum + float(scale.sum()),
            )
        if not direction:
            opt.step()  # θ2; r was read first: some optimiser paths change p.grad in place
        with torch.no_grad():
            for p, t0, scale in zip(params, theta0, scales):
                mult = self.alpha * scale  # [*p.shape]
                if self.min_effective_multiplier is not None:
                    mult = mult.clamp(min=self.min_effective_multiplier)  # [*p.shape]
                p.copy_(t0 + mult.to(p.dtype) * (p - t0))  # θ̃ = θ0 + α·scale ⊙ (θ2 − θ0)
        if self.state_mode == "transactional":
            snap.restore()
        loss2 = self._backward(closure)  # pass 3 at θ̃
        norm2, _ = clip_grads(params, self.max_grad_norm)
        if not _finite(loss2, norm2):
            return self._skip({**out, "backward_passes": 3.0}, theta0, snap)
        opt.step()  # corrective step from θ̃
        self.scheduler.step()
        z, _ = self.gate.update(self.gate.statistic(float(norm0), float(norm2)), s)
        return {
            **out,
            "gxpo_enabled": 1.0,
            "gxpo_scale_mean": scale_sum / max(1, n_total),
            "gxpo_active_frac": n_active / max(1, n_total),
            "gxpo_z": z,
            "backward_passes": 3.0,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.torch_optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "skipped": self.skipped,
            "t": self.t,
            "gate": self.gate.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_keeping_configuration(self.torch_optimizer, self.scheduler, state)
        self.skipped, self.t = state["skipped"], state["t"]
        self.gate.load_state_dict(state["gate"])
