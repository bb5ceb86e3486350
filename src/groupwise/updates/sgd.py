"""Plain stochastic gradient descent (optionally with momentum).

Its update is the (clipped) gradient times the learning rate, which makes it the updater of
choice for tests that compare gradients through whole runs (e.g. one step over 2 ranks against
one process). Defaults: ``lr=1e-3``, ``momentum=0`` [INFERRED: no paper prescribes it here].
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

    def make_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)
