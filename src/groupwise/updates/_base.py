"""Shared mechanics of updaters that wrap a ``torch.optim`` optimiser: warm-up + decay schedule,
global-norm gradient clipping, skipping a step whose loss or gradient is not finite, and rolling
back a step whose *result* is not finite (``lr=1e39`` on finite gradients): the weights and the
optimiser state return to what they were before it. Both are counted in ``skipped``, so nothing
non-finite ever reaches the weights."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from groupwise import dist
from groupwise.errors import ConfigError

SCHEDULES = ("constant", "linear", "cosine")


class TorchUpdater:
    lr: float
    max_grad_norm: float
    warmup_steps: int
    schedule: str
    rollback_nonfinite: bool = True  # copy weights + optimiser state before each step to undo a non-finite result

    def make_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        raise NotImplementedError

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"update.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        self.skipped = 0

    def bind(self, params: list[torch.nn.Parameter], total_steps: int) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.optimizer = self.make_optimizer(self.params)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: self._lr_factor(s, total_steps))

    def _lr_factor(self, step: int, total: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, total - self.warmup_steps)
        if self.schedule == "linear":
            return max(0.0, 1.0 - progress)
        if self.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    def torch_optim(self) -> torch.optim.Optimizer:
        return self.optimizer

    def step(self, closure: Callable[[], torch.Tensor]) -> dict[str, float]:
        """One update (``_step``); if it leaves any weight non-finite, undo it and count it skipped."""
        if not self.rollback_nonfinite:
            return self._step(closure)
        backup = self._backup = getattr(self, "_backup", None) or WeightBackup(self.params)
        backup.capture(self.torch_optim())
        out = self._step(closure)
        if out.get("skipped") or all_finite(self.params):
            return out
        backup.restore()
        self.skipped += 1
        return {**out, "skipped": 1.0, "nonfinite": 1.0, "rolled_back": 1.0}

    def _step(self, closure: Callable[[], torch.Tensor]) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        loss = closure()
        if self.max_grad_norm and self.max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)  # pre-clip norm
        else:
            grads = [p.grad for p in self.params if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        lr = self.scheduler.get_last_lr()[0]
        if not (torch.isfinite(grad_norm) and torch.isfinite(loss)):
            self.skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            return {"loss": float(loss), "grad_norm": float("nan"), "lr": lr, "skipped": 1.0, "nonfinite": 1.0}
        self.optimizer.step()
        self.scheduler.step()
        return {"loss": float(loss), "grad_norm": float(grad_norm), "lr": lr, "skipped": 0.0, "nonfinite": 0.0}

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_keeping_configuration(self.torch_optim(), self.scheduler, state)
        self.skipped = state["skipped"]


def load_keeping_configuration(optimizer: torch.optim.Optimizer, scheduler: Any, state: dict[str, Any]) -> None:
    """Restore the optimiser's per-parameter state (moments, step counts) and the schedule's position
    from a checkpoint, but keep the hyper-parameters this updater was built with (lr, betas, weight
    decay, eps, momentum): a run resumed with a changed ``update.lr`` (``--resume-allow``) trains with
    the new one. The lr in force is the configured base lr times the schedule's factor at the restored
    step, as ``LambdaLR`` computes it, so an unchanged configuration resumes bit for bit."""
    configured = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(state["optimizer"])
    for group in optimizer.param_groups:  # whole states of sharded parameters: this rank's shard of each
        for p in group["params"]:
            if p in optimizer.state:
                optimizer.state[p] = {k: dist.like(v, p) for k, v in optimizer.state[p].items()}
    scheduler.load_state_dict(state["scheduler"])
    for group, hyper in zip(optimizer.param_groups, configured, strict=True):
        group.update(hyper)
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    step = scheduler.last_epoch
    lrs = [base * factor(step) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = list(lrs)


# ---------------------------------------------------------------------------- helpers for multi-pass updaters
class OptimizerSnapshot:
    """A copy of an optimiser's per-parameter state (Adam moments, step counters, momentum buffers)
    that ``restore()`` writes back in place: state created after the snapshot is dropped, so an
    optimiser that had taken no step returns to its lazy, empty state. Hyper-parameters
    (``param_groups``) are not copied: a multi-pass updater does not change them mid-step."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.state = {
            p: {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
            for p, s in optimizer.state.items()
        }

    def restore(self) -> None:
        live = self.optimizer.state
        for p in [p for p in live if p not in self.state]:
            del live[p]
        for p, saved in self.state.items():
            now = live[p]
            for k in [k for k in now if k not in saved]:
                del now[k]
            for k, v in saved.items():
                if isinstance(v, torch.Tensor) and isinstance(now.get(k), torch.Tensor) and now[k].shape == v.shape:
                    now[k].copy_(v)
                else:
                    now[k] = v.clone() if isinstance(v, torch.Tensor) else v


class WeightBackup:
    """The weights and the optimiser's per-parameter state before a step, copied into buffers kept
    across steps (no allocation per step), so a step whose result is not finite can be undone
    exactly: state the step created (Adam's moments on its first step) is dropped again."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        # sharded parameters (FSDP2): this rank's shard is what it backs up and restores
        self.buffers = [dist.local(p.detach()).clone() for p in params]  # per parameter [*p.shape] or its shard
        self.state: dict[Any, dict[str, Any]] = {}  # parameter -> its optimiser state as captured

    def capture(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        with torch.no_grad():
            torch._foreach_copy_(self.buffers, [dist.local(p.detach()) for p in self.params])
            kept: dict[Any, dict[str, Any]] = {}
            for p, live in optimizer.state.items():
                old = self.state.get(p, {})
                kept[p] = {
                    k: (
                        old[k].copy_(v)
                        if isinstance(v, torch.Tensor)
                        and isinstance(old.get(k), torch.Tensor)
                        and old[k].shape == v.shape
                        else v.detach().clone()
                        if isinstance(v, torch.Tensor)
                        else v
                    )
                    for k, v in live.items()
                }
            self.state = kept

    def restore(self) -> None:
        with torch.no_grad():
            torch._foreach_copy_([dist.local(p.data) for p in self.params], self.buffers)
            live = self.optimizer.state
            for p in [p for p in live if p not in self.state]:
                del live[p]
            for p, saved in self.state.items():
                live[p] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in saved.items()}


def all_finite(params: list[torch.nn.Parameter]) -> bool:
    """Every weight is finite. Fast path: one sum per tensor (NaN and inf propagate); only if that
    overflows or is non-finite are the elements checked one by one (huge finite weights can overflow the sum)."""
    if not params:
        return True
    with torch.no_grad():
        if bool(torch.stack([p.detach().sum() for p in params]).sum().isfinite()):
            return True
        return all(bool(torch.isfinite(p.detach()).all()) for p in params)


def grads_of(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Copies of the current (pre-clip) gradients; zeros where a parameter has none."""
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]


def clip_grads(params: list[torch.nn.Parameter], max_grad_norm: float) -> tuple[torch.Tensor, float]:
    """Global-norm clip in place (off when ``max_grad_norm <= 0``); returns the pre-clip norm and the
    factor the gradients were multiplied by, ``min(1, max_norm / (norm + 1e-6))`` as torch applies it."""
    if max_grad_norm and max_grad_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)  # pre-clip norm
        coef = min(1.0, max_grad_norm / (float(norm) + 1e-6)) if torch.isfinite(norm) else 1.0
        return norm, coef
    grads = [p.grad for p in params if p.grad is not None]
    return (torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())), 1.0
