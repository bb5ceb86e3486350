"""AdamW (Loshchilov & Hutter 2019, arXiv 1711.05101): the standard GRPO updater.

"Decoupled Weight Decay Regularization", Ilya Loshchilov, Frank Hutter, 2019,
https://arxiv.org/abs/1711.05101; the update is ``torch.optim.AdamW``. Warm-up, schedule,
clipping and the non-finite skip come from ``updates/_base.py``.

**Change vs GRPO**: none — standard practice, not a variant: TRL trains GRPO with torch's AdamW
(transformers ``TrainingArguments.optim``), and this is the same optimiser.

**Math** (per trainable parameter ``p``; ``s`` = 0, 1, … counts calls to ``step`` (skipped ones
included), ``k`` = 1, 2, … the steps AdamW actually took)::

    g     = grad · min(1, max_grad_norm / (‖grad‖ + 1e-6))     global norm over all parameters
                                                              (torch clip_grad_norm_; off if <= 0)
    lr_k  = lr · factor(s)                                    (updates/_base.py, W = warmup_steps)
    factor(s) = (s + 1) / W                                   if s < W
              = 1 | max(0, 1 − u) | (1 + cos(π·min(u, 1))) / 2     constant | linear | cosine,
                u = (s − W) / max(1, total_steps − W)
    p     ← p − lr_k · weight_decay · p
    m     ← β1·m + (1 − β1)·g ;   v ← β2·v + (1 − β2)·g²       (betas = (β1, β2))
    p     ← p − lr_k · (m / (1 − β1^k)) / (sqrt(v / (1 − β2^k)) + eps)

A step whose loss or pre-clip gradient norm is not finite is skipped: no parameter moves, the
gradients are dropped, the schedule still advances, and ``skipped`` counts it.
A step whose *result* is not finite (``lr = 1e39``) is rolled back the same way (``rollback_nonfinite``).

**Defaults**

- ``lr = 1e-6`` [PAPER] DeepSeekMath §4.2; [CODE] TRL ``GRPOConfig.learning_rate = 1e-6``.
- ``betas = (0.9, 0.99)``: β1 = 0.9 [CODE] TRL ``GRPOConfig`` (transformers ``adam_beta1``);
  β2 = 0.99 [INFERRED]. TRL's ``GRPOConfig`` keeps transformers' ``adam_beta2 = 0.999``, so
  ``betas = [0.9, 0.999]`` reproduces TRL.
- ``weight_decay = 0.0`` and ``max_grad_norm = 1.0`` [CODE] TRL ``GRPOConfig`` (transformers
  ``TrainingArguments`` defaults).
- ``eps = 1e-8`` [CODE] transformers ``adam_epsilon`` (also torch's default).
- ``warmup_steps = 0`` [CODE] transformers ``warmup_steps``.
- ``schedule = "constant"`` [INFERRED] a constant learning rate. TRL's default is transformers'
  ``lr_scheduler_type = "linear"`` (decay to 0 after the warm-up), whose decay
  ``schedule = "linear"`` matches (transformers' warm-up starts from 0, this one from 1/W).
- ``fused = True`` [CODE] transformers' default optimiser is ``adamw_torch_fused`` for torch ≥ 2.8.
- ``rollback_nonfinite = True`` [INFERRED] groupwise's guard, not a paper's: weights and optimiser state
  are copied before each step and restored if the step leaves any weight non-finite (counted in
  ``skipped``); ``false`` saves that copy for models too large to hold twice.

**Notes**

1. ``fused=True`` (default) runs torch's one-pass AdamW kernel where the parameters allow it
   (CPU/CUDA floating point): the same update as the per-op loop, ~6x faster on the tiny model.
   Where they do not (or with ``fused=False``) torch picks its own implementation.
2. Weight decay applies to every trainable parameter (one parameter group). transformers exempts
   biases and LayerNorm weights; this only matters when ``weight_decay > 0``.
3. ``schedule`` is one of ``constant``, ``linear``, ``cosine``; anything else is a
   ``ConfigError``. ``total_steps`` is the one the trainer passes to ``bind``.
4. The logged ``grad_norm`` is the pre-clip norm, ``lr`` the rate the step used.
   ``state_dict`` holds the optimiser, the scheduler and ``skipped``, so a resumed run continues
   from the same state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from groupwise.registry import register
from groupwise.updates._base import TorchUpdater


@register("update", "adamw")
@dataclass
class AdamW(TorchUpdater):
    """AdamW + grad-norm clipping + warm-up/decay schedule; skips non-finite steps."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    schedule: str = "constant"
    fused: bool = True  # the fused kernel where torch has one (same update, fewer passes over memory)
    rollback_nonfinite: bool = True  # undo a step that leaves any weight non-finite (costs one copy of weights + state)

    def make_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        # The fused kernel updates each tensor in one pass (6x faster than the per-op loop on a CPU);
        # it covers floating-point tensors on CPU and CUDA.
        fused = self.fused and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
        return torch.optim.AdamW(
            params,
            lr=self.lr,
            betas=tuple(self.betas),
            eps=self.eps,
            weight_decay=self.weight_decay,
            fused=fused or None,
        )
