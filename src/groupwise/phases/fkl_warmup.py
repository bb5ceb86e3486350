"""Phase ``fkl_warmup``: forward-KL distillation of a frozen teacher into the policy on the teacher's samples.

"Beyond GRPO and On-Policy Distillation: An Empirical Sparse-to-Dense Reward Principle for LLM
Post-Training", Sang et al., arXiv 2605.12483 — https://arxiv.org/html/2605.12483 (abstract and
third-party summaries only; spec: specs/28). The bridge's stage 2a, before on-policy distillation
(the term ``opd``): the student first imitates the teacher where the teacher goes, so that OPD
starts within a small KL of the teacher (the summaries' condition C2).

**Change vs GRPO**: a warm start before RL (kind ``sft``: the policy's weights carry into RL). It
reads no labels: only the train rows' prompts (unlabelled), which the frozen role ``teacher``
completes.

**Math** (a step: P prompts x, y ~ π_T(·|x) at ``temperature``, p_T / p_S the teacher's and the
student's next-token distributions at (x, y_<t), N = the step's completion tokens)::

    full:     L = (1/N) Σ_t Σ_v p_T(v) (log p_T(v) − log p_S(v))          ∂L/∂logits_S = (p_S − p_T)/N
    topk:     p_T restricted to its k most likely tokens and renormalised, then as ``full``
    sampled:  L = −(1/N) Σ_t log p_S(y_t)                                 (SFT on the teacher's text)

Diagnostic (the summaries' C2, not claimed): KL(π_S ‖ π_T) per token, Σ_v p_S (log p_S − log p_T)
averaged over the tokens of the student's own samples (``kl_samples`` per prompt at T = 1 on
``kl_prompts`` fixed train prompts), before and after the warm-up: ``kl_before``, ``kl_after`` in
``summary.json`` under ``phases.fkl_warmup`` (also ``fkl_before`` / ``fkl_after``, the loss on
the teacher's samples of those prompts).

**Defaults**

- ``form = "full"`` [INFERRED] the standard forward KL on teacher samples (spec 28); ``"topk"``
  [INFERRED] (``topk = 8``), ``"sampled"`` [INFERRED] the spec's SFT option.
- ``steps = 150``, ``prompts_per_step = 32``, ``samples = 1``, ``temperature = 1.0`` [INFERRED]
  the toy's budget; ``max_new_tokens = 0``: the run's ``rollout.max_new_tokens``.
- ``update = adamw(lr = 1e-3, betas = (0.9, 0.98), warmup_steps = 10, max_grad_norm = 1.0)``
  [INFERRED] the ``sft`` phase's optimiser with a shorter warm-up.
- ``kl_prompts = 64``, ``kl_samples = 4`` (0 prompts: no diagnostic).

**Notes**

1. Prompts are drawn in seeded epochs over the train rows; the summary's ``prompts_drawn`` counts
   the distinct prompts the teacher completed and ``labels_read = 0``. The phase declares
   ``reads_labels = False``, so a pipeline's label ledger (``groupwise pipeline``) counts the train
   rows as drawn without their labels (design §6).
2. The teacher's samples draw their randomness from ``(seed, −1000 − step, row, j)``, the
   diagnostic's from ``(seed, −999, row, j)`` (before) and ``(seed, −998, row, j)`` (after): RL
   steps (≥ 0) never reuse them.
3. Under torchrun every rank runs the phase with the same seeds (phases/__init__.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.losses.ssopd import token_divergence
from groupwise.masked import masked_sum
from groupwise.phases import PhaseContext
from groupwise.registry import build_spec, register
from groupwise.types import Request, StepInfo

FORMS = ("full", "topk", "sampled")


def topk_teacher(teacher_logprobs: Tensor, k: int) -> Tensor:
    """[...,V] the teacher's log-distribution restricted to its k largest entries and renormalised (−inf elsewhere)."""
    top = teacher_logprobs.topk(min(k, teacher_logprobs.shape[-1]), dim=-1).indices  # [...,k]
    kept = torch.full_like(teacher_logprobs, -torch.inf).scatter(-1, top, teacher_logprobs.gather(-1, top))  # [...,V]
    return kept.log_softmax(-1)  # [...,V]


def forward_kl_tokens(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[...] Σ_v p_T (log p_T − log p_S) per position (0 outside ``mask``); the teacher carries no gradient."""
    return token_divergence(student_logprobs, teacher_logprobs.detach(), mask, "fkl")  # [...]


@register("phase", "fkl_warmup")
@dataclass
class FKLWarmup:
    """Forward-KL warm-up of the policy on a frozen teacher's samples (the sparse-to-dense bridge, spec 28)."""

    kind = "sft"
    reads_labels = False  # only the train rows' prompts, completed by the teacher (Note 1)
    teacher: str = "teacher"  # the frozen role that samples and scores (roles.NAME with frozen = true)
    form: str = "full"  # "full" | "topk" | "sampled" [INFERRED] spec 28
    topk: int = 8  # form = "topk": the teacher's entries kept [INFERRED]
    steps: int = 150
    prompts_per_step: int = 32
    samples: int = 1  # teacher completions per prompt
    temperature: float = 1.0  # the teacher's sampling temperature
    max_new_tokens: int = 0  # 0: the run's rollout.max_new_tokens
    kl_prompts: int = 64  # train prompts of the KL(π_S ‖ π_T) diagnostic (0: none)
    kl_samples: int = 4  # student samples per diagnostic prompt
    update: Any = field(
        default_factory=lambda: {
            "name": "adamw",
            "lr": 1e-3,
            "betas": [0.9, 0.98],
            "warmup_steps": 10,
            "max_grad_norm": 1.0,
        }
    )
    artifact: str = ""  # the phase's name in the run folder and summary (default "fkl_warmup")

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ConfigError(f"phase fkl_warmup: form={self.form!r} is not one of {', '.join(FORMS)}")
        if min(self.steps, self.prompts_per_step, self.samples, self.topk, self.kl_samples) < 1:
            raise ConfigError(
                f"phase fkl_warmup: steps={self.steps}, prompts_per_step={self.prompts_per_step}, "
                f"samples={self.samples}, topk={self.topk}, kl_samples={self.kl_samples} must all be >= 1"
            )
        if self.temperature <= 0 or self.max_new_tokens < 0 or self.kl_prompts < 0:
            raise ConfigError(
                f"phase fkl_warmup: need temperature > 0 (got {self.temperature}), max_new_tokens >= 0 "
                f"(got {self.max_new_tokens}), kl_prompts >= 0 (got {self.kl_prompts})"
            )

    def __call__(self, ctx: PhaseContext) -> dict:
        if self.teacher not in ctx.models:
            raise ConfigError(
                f"phase fkl_warmup: teacher={self.teacher!r} is not a frozen role (frozen roles: "
                f"{sorted(ctx.models) or 'none'}); add roles.{self.teacher} = {{frozen = true, "
                'model = {path = "..."}}'
            )
        max_new = self.max_new_tokens or ctx.max_new_tokens
        if max_new < 1:
            raise ConfigError("phase fkl_warmup: max_new_tokens = 0 and the run gives no generation budget")
        if not ctx.train_rows:
            raise ConfigError("phase fkl_warmup has no train rows to draw prompts from")
        name = self.artifact or "fkl_warmup"
        teacher, student = ctx.models[self.teacher], ctx.policy
        prompts = {}  # row index -> prompt ids, encoded once

        def requests(rows: list[int], n: int) -> list[Request]:
            for i in rows:
                if i not in prompts:
                    prompts[i] = ctx.prompt(f"phase:{name}:train", ctx.train_rows, i)
            return [Request(key=i, n=n, prompt=prompts[i]) for i in rows]

        def sample(model: Any, rows: list[int], n: int, step: int, temperature: float):
            info = StepInfo(step=step, seed=ctx.seed, max_new_tokens=max_new, phase=name)
            sampling = {"temperature": temperature, "top_p": 1.0, "top_k": 0, "max_new_tokens": max_new}
            with torch.no_grad():
                return model.generate(requests(rows, n), sampling, info)

        probe = torch.randperm(len(ctx.train_rows), generator=torch.Generator().manual_seed(ctx.seed + 1))
        probe = probe[: self.kl_prompts].tolist()

        def diagnose(step: int) -> dict[str, float]:
            if not probe:
                return {}
            student.eval()
            with torch.no_grad():
                own = sample(student, probe, self.kl_samples, step, 1.0)
                mask = own.mask & own.group_valid[..., None]  # [B,G,T]
                rkl = token_divergence(
                    student.forward(own, ("logprobs",))["logprobs"],
                    teacher.forward(own, ("logprobs",))["logprobs"],
                    mask,
                    "rkl",
                )  # [B,G,T]
                theirs = sample(teacher, probe, 1, step, self.temperature)
                tmask = theirs.mask & theirs.group_valid[..., None]  # [B,1,T]
                fkl = forward_kl_tokens(
                    student.forward(theirs, ("logprobs",))["logprobs"],
                    teacher.forward(theirs, ("logprobs",))["logprobs"],
                    tmask,
                )  # [B,1,T]
            return {
                "kl": float(masked_sum(rkl, mask) / mask.sum().clamp(min=1)),
                "fkl": float(masked_sum(fkl, tmask) / tmask.sum().clamp(min=1)),
            }

        before = diagnose(-999)
        updater = build_spec("update", self.update)
        updater.bind(student.parameters(), self.steps)
        order_rng, order, drawn, losses = torch.Generator().manual_seed(ctx.seed), [], set(), []
        for step in range(self.steps):
            if len(order) < self.prompts_per_step:  # the next epoch over the train rows, in a seeded order
                order += torch.randperm(len(ctx.train_rows), generator=order_rng).tolist()
            picked, order = order[: self.prompts_per_step], order[self.prompts_per_step :]
            drawn.update(picked)
            roll = sample(teacher, picked, self.samples, -1000 - step, self.temperature)
            with torch.no_grad():
                target = teacher.forward(roll, ("logprobs",))["logprobs"] if self.form != "sampled" else None
            if target is not None and self.form == "topk":
                target = topk_teacher(target, self.topk)  # [B,G,T,V]
            student.train()
            losses.append(float(updater.step(lambda: self._loss(student, roll, target))["loss"]))  # noqa: B023 (called at once)
        student.eval()
        after = diagnose(-998)
        summary = {
            "form": self.form,
            "steps": self.steps,
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "prompts_drawn": len(drawn),
            "labels_read": 0,
            **{f"{key}_before": value for key, value in before.items()},
            **{f"{key}_after": value for key, value in after.items()},
        }
        ctx.say(
            f"phase {name!r}: {self.steps} steps of {self.form} forward KL on the teacher's samples, loss "
            f"{losses[0]:.4f} -> {losses[-1]:.4f}"
            + (f"; KL(student || teacher) {before['kl']:.4f} -> {after['kl']:.4f}" if before else "")
        )
        return {"summary": summary}

    def _loss(self, student: Any, roll: Any, target: Tensor | None) -> Tensor:
        """The step's loss (module docstring) on the teacher's rollout, backward included; returns it detached."""
        mask = roll.mask & roll.group_valid[..., None]  # [B,G,T]
        if target is None:  # sampled: the token mean of −log p_S(y_t)
            logp = student.forward(roll, ("logp",))["logp"]  # [B,G,T]
            loss = -masked_sum(logp, mask) / mask.sum().clamp(min=1)
        else:
            student_logprobs = student.forward(roll, ("logprobs",))["logprobs"]  # [B,G,T,V]
            loss = forward_kl_tokens(student_logprobs, target, mask).sum() / mask.sum().clamp(min=1)
        loss.backward()
        return loss.detach()
