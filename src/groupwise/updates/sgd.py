"""Plain stochastic gradient descent (optionally with momentum).

Standard practice, no paper; the update is ``torch.optim.SGD``. Warm-up, schedule, clipping and
the non-finite skip come from ``updates/_base.py`` (as for ``adamw``).

**Change vs GRPO**: none — not a GRPO variant; it swaps the optimiser only. Its update is the
(clipped) gradient times the learning rate, which makes it the updater of choice for tests that
compare gradients through whole runs (e.g. one step over 2 ranks against one process).

**Math** (per trainable parameter ``p``; ``lr_k = lr · factor(s)`` and the clip exactly as in
``updates/adamw.py``)::

    g   = grad · min(1, max_grad_norm / (‖grad‖ + 1e-6))    (only if max_grad_norm > 0)
    buf = g                                                 at the first step
    buf ← momentum · buf + g                                afterwards   (momentum > 0 only)
    p   ← p − lr_k · (buf if momentum > 0 else g)

A step whose loss or pre-clip gradient norm is not finite is skipped, and one whose result is not
finite is rolled back (both counted in ``skipped``).

**Defaults**

- ``lr = 1e-3`` [INFERRED] no paper prescribes it here.
- ``momentum = 0`` [INFERRED] no paper prescribes it here (torch's default too).
- ``max_grad_norm = 0.0`` (no clipping) [INFERRED] so the update is the raw gradient times ``lr``.
- ``warmup_steps = 0``, ``schedule = "constant"`` [INFERRED] a constant step size, for exact tests.
- ``rollback_nonfinite = True`` [INFERRED] groupwise's guard, not a paper's: weights and optimiser state
  are copied before each step and restored if the step leaves any weight non-finite (counted in
  ``skipped``); ``false`` saves that copy for models too large to hold twice.

**Notes**

1. No weight decay, dampening or Nesterov (torch's defaults, not exposed).
2. With the defaults, one step moves every parameter by exactly ``−lr · grad``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from groupwise.registry import register
from groupwise.updates._base import TorchUpdater


@register("update", "sgd")
@dataclass
class SGD(TorchUpdater):
    """SGD (+ optional momentum), grad-norm clipping, schedule; skips non-finite steps."""

    lr: float = 1e-3
    momentum: float = 0.0
    max_grad_norm: float = 0.0
    warmup_steps: int = 0
    schedule: str = "constant"
    rollback_nonfinite: bool = True  # undo a step that leaves any weight non-finite (costs one copy of weights + state)

    def make_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)
