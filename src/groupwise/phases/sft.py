"""Supervised fine-tuning as a phase: teach the policy the task's answers before RL (the warm start).

**Change vs GRPO**: none to GRPO itself; it runs before the RL steps. The policy is trained to
produce each train row's ``answer`` (then EOS) after its prompt, with the loss on the answer and
EOS tokens only — the warm start that made the embedded model (``groupwise warmstart``).

**Math** (a batch of rows ``i`` with prompt ``x_i`` and answer tokens ``y_i`` then EOS)::

    loss = − Σ_i Σ_t log π(y_{i,t} | x_i, y_{i,<t}) / Σ_i |y_i|        (token mean, as cross-entropy)

The log-probs come from the policy's own training forward (``policy.forward``: the packed, prompt-
sharing path of RL), so an SFT step and an RL step read the model alike. Rows are drawn in seeded
epochs; every ``eval_every`` steps (``fine_eval_every`` once half of ``target_accuracy`` is
reached) greedy exact-match accuracy on ``val_size`` train rows carved out before training (never
trained on) is measured, and the phase stops once it reaches ``target_accuracy`` (0 = run all
``steps``).

**Defaults** (the settings that built the shipped model, ``models/default/warmstart.json``)

- ``steps = 5000`` (an upper bound), ``batch_size = 64``, ``target_accuracy = 0.0`` (off),
  ``eval_every = 25``, ``fine_eval_every = 5``, ``val_size = 500`` [CODE] ``groupwise warmstart``.
- ``update = adamw(lr = 1e-3, betas = (0.9, 0.98), warmup_steps = 50, max_grad_norm = 1.0,
  weight_decay = 0)`` [CODE] ``groupwise warmstart``.

**Notes**

1. Needs a text policy (``encode_completion``); rows need an ``answer`` column.
2. Reports ``steps``, ``val_accuracy`` and ``history`` ([step, accuracy] pairs) under the phase's
   name in ``summary.json``.
3. ``task`` (with ``train_size``) trains on a built-in task's train rows instead of the run's, so
   runs on different data (a forward-only baseline and a forward + reverse run, claims/40) can
   share one warm start; an unknown task fails at the phase's start with the list of tasks.
4. The optimiser is the phase's own: its state does not carry into RL (RL's updater starts fresh,
   as it does after the shipped warm start).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from groupwise.phases import PhaseContext
from groupwise.registry import ConfigError, build_spec, register
from groupwise.tasks import get_task
from groupwise.types import Rollout


@register("phase", "sft")
@dataclass
class SFT:
    """Supervised fine-tuning on the task's answers, stopping at a target validation accuracy (the warm start)."""

    kind = "sft"
    steps: int = 5000
    batch_size: int = 64
    target_accuracy: float = 0.0
    eval_every: int = 25
    fine_eval_every: int = 5
    val_size: int = 500
    update: Any = field(default_factory=lambda: {"name": "adamw", "lr": 1e-3, "betas": [0.9, 0.98], "warmup_steps": 50, "max_grad_norm": 1.0})
    artifact: str = ""  # the phase's name in the run folder and summary (default "sft")
    task: str = ""  # train on this built-in task's train rows instead of the run's (a warm start shared by runs on different data)
    train_size: int = 0  # with task: that many of its train rows (0 = all)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ConfigError(f"phase sft: steps={self.steps} and batch_size={self.batch_size} must be >= 1")
        if not 0.0 <= self.target_accuracy <= 1.0:
            raise ConfigError(f"phase sft: target_accuracy={self.target_accuracy} must be in [0, 1]")

    def __call__(self, ctx: PhaseContext) -> dict:
        rows = list(ctx.train_rows) if not self.task else get_task(self.task).rows("train", self.train_size, ctx.seed)
        random.Random(ctx.seed).shuffle(rows)
        val, rows = (rows[: self.val_size], rows[self.val_size :]) if self.target_accuracy else ([], rows)
        name = self.artifact or "sft"
        result = self.fit(ctx.policy, rows, val, ctx.seed, lambda split, r, i: ctx.prompt(f"phase:{name}:{split}", r, i),
                          lambda policy, r, split: ctx.accuracy(policy, r, f"phase:{name}:{split}"))
        ctx.say(f"phase {name!r}: {result['steps']} steps" + (f", validation accuracy {result['val_accuracy']:.3f}" if self.target_accuracy else ""))
        return {"summary": result}

    def fit(self, policy: Any, rows: list[dict], val: list[dict], seed: int, prompt: Callable, accuracy: Callable,
            on_step: Callable[[int, float, float], None] | None = None) -> dict:
        """Train ``policy`` on ``rows`` until ``steps`` or the target accuracy on ``val``; ``prompt(split, rows, i)``
        gives a row's prompt ids, ``accuracy(policy, rows, split)`` a greedy accuracy. Returns the summary."""
        if not hasattr(policy, "encode_completion"):
            raise ConfigError(f"phase sft needs a text policy (the {policy.modality} policy cannot encode an answer)")
        if not rows or "answer" not in rows[0]:
            raise ConfigError("phase sft needs train rows with an `answer` column")
        prompts = [prompt("train", rows, i) for i in range(len(rows))]
        answers = [policy.encode_completion(str(r["answer"])) for r in rows]
        updater = build_spec("update", self.update)
        updater.bind(policy.parameters(), self.steps)
        order_rng, order = torch.Generator().manual_seed(seed), []
        history, val_accuracy, step = [], 0.0, 0
        policy.train()
        while step < self.steps:
            if len(order) < self.batch_size:  # the next epoch, in a seeded order
                order += torch.randperm(len(rows), generator=order_rng).tolist()
            picked, order = order[: self.batch_size], order[self.batch_size :]
            batch = teacher_forced([prompts[i] for i in picked], [answers[i] for i in picked])
            loss = float(updater.step(lambda: _loss(policy, batch))["loss"])
            step += 1
            every = self.eval_every if val_accuracy < self.target_accuracy / 2 else self.fine_eval_every
            if self.target_accuracy and step % every == 0:
                policy.eval()
                val_accuracy = accuracy(policy, val, "val")
                policy.train()
                history.append({"step": step, "loss": round(loss, 4), "val_accuracy": val_accuracy})
            if on_step is not None:
                on_step(step, loss, val_accuracy)
            if self.target_accuracy and val_accuracy >= self.target_accuracy:
                break
        policy.eval()
        reached = bool(self.target_accuracy) and val_accuracy >= self.target_accuracy
        return {"steps": step, "val_accuracy": val_accuracy if self.target_accuracy else None, "reached_target": reached, "history": history}


def teacher_forced(prompts: list[list[int]], answers: list[list[int]]) -> Rollout:
    """One-row groups whose actions are the given answers: the policy's forward scores them."""
    T = max(len(a) for a in answers)
    actions = torch.zeros(len(answers), 1, T, dtype=torch.long)  # [N,1,T]
    for i, a in enumerate(answers):
        actions[i, 0, : len(a)] = torch.tensor(a)
    lengths = torch.tensor([len(a) for a in answers])  # [N]
    mask = (torch.arange(T)[None, :] < lengths[:, None])[:, None, :]  # [N,1,T]
    N = len(answers)
    return Rollout(prompt_ids=prompts, actions=actions, mask=mask, group_valid=torch.ones(N, 1, dtype=torch.bool),
                   truncated=torch.zeros(N, 1, dtype=torch.bool), prompt_index=torch.arange(N))


def _loss(policy: Any, batch: Rollout) -> torch.Tensor:
    logp = policy.forward(batch, ("logp",))["logp"]  # [N,1,T]
    loss = -(logp * batch.mask).sum() / batch.mask.sum()  # token mean over the answers and EOS
    loss.backward()
    return loss.detach()
