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
- ``loss = "ce"`` (the token mean above). ``loss = "cb_stream"``: StreamPro's class-balanced loss
  (spec 42, ``phases/cb_stream.py``): the first answer token of a row is its decision, of class
  ``decision_column`` (an integer column, 0..num_classes − 1); decisions get effective-number
  class weights (``cb_beta``, counted over the train rows with ``cb_counts = "dataset"`` or per
  batch with ``"batch"``), the rest ordinary CE, ``L = L_dec + L_con`` [INFERRED] spec 42.

**Notes**

1. A text policy (``encode_completion``) needs rows with an ``answer`` column; a non-text policy
   fits demonstrations instead (Note 5).
2. Reports ``steps``, ``val_accuracy`` and ``history`` ([step, accuracy] pairs) under the phase's
   name in ``summary.json``.
3. ``task`` (with ``train_size``) trains on a built-in task's train rows instead of the run's, so
   runs on different data (a forward-only baseline and a forward + reverse run, claim 40-dgpo) can
   share one warm start; an unknown task fails at the phase's start with the list of tasks.
4. The optimiser is the phase's own: its state does not carry into RL (RL's updater starts fresh,
   as it does after the shipped warm start).
5. A policy with ``supervised_loss(prompts, targets, gen)`` (the non-text kinds: the flow toy's
   flow matching, ``modalities/flow.py`` Note 7) is fitted with it instead: rows need the column
   its ``encode_target(row)`` reads (``target``), ``loss`` must be ``"ce"`` (the text losses do
   not apply), and the loss's draws come from a ``torch.Generator`` seeded by (run seed, phase
   step), so a rerun of the phase is identical. A text policy has no ``supervised_loss``: its path
   is the token mean above, unchanged.
6. ``p_uncond`` (default 0, off) is classifier-free guidance's condition dropout for a policy that
   samples under discrete conditions (the flow toy's ``condition_extras``, read from each
   demonstration row's columns of those names): each demonstration's conditions are replaced by
   the null condition with that probability, so the fitted net knows the unconditional velocity a
   guided sampler (``cfg_w``) mixes in (``modalities/flow.py`` Note 10; [INFERRED] 0.1 in DIAL,
   spec 26). A policy whose ``supervised_loss`` takes no ``p_uncond`` is refused at the phase's start.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from groupwise.errors import ConfigError
from groupwise.phases import PhaseContext
from groupwise.phases.cb_stream import COUNTS, balanced_from_ce, check_beta, class_balanced_weights
from groupwise.registry import build_spec, register
from groupwise.seeds import sample_seed
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
    update: Any = field(
        default_factory=lambda: {
            "name": "adamw",
            "lr": 1e-3,
            "betas": [0.9, 0.98],
            "warmup_steps": 50,
            "max_grad_norm": 1.0,
        }
    )
    artifact: str = ""  # the phase's name in the run folder and summary (default "sft")
    # train on this built-in task's train rows instead of the run's (a warm start shared by runs on different data)
    task: str = ""
    train_size: int = 0  # with task: that many of its train rows (0 = all)
    # "ce" (token mean) or "cb_stream" (class-balanced decisions, phases/cb_stream.py) [INFERRED] spec 42
    loss: str = "ce"
    cb_beta: float = 0.999  # cb_stream: the effective-number beta in [0, 1) [INFERRED] spec 42
    # cb_stream: class counts over the train rows ("dataset") or each batch ("batch") [INFERRED] spec 42
    cb_counts: str = "dataset"
    decision_column: str = "decision"  # cb_stream: the rows' decision class column [INFERRED]
    num_classes: int = 2  # cb_stream: decision classes (silence / respond) [ABSTRACT] spec 42
    # classifier-free guidance: the probability a demonstration's conditions are dropped to the null one
    # (a policy whose supervised_loss takes p_uncond: the flow toy with condition_extras; Note 6); 0 = off
    p_uncond: float = 0.0

    def __post_init__(self) -> None:
        if self.loss not in ("ce", "cb_stream"):
            raise ConfigError(f"phase sft: loss={self.loss!r} is not one of 'ce', 'cb_stream'")
        if self.loss == "cb_stream":
            check_beta(self.cb_beta, "phase sft: cb_beta")
            if self.cb_counts not in COUNTS or self.num_classes < 2:
                raise ConfigError(
                    f"phase sft: cb_counts={self.cb_counts!r} must be one "
                    f"of {COUNTS} and num_classes={self.num_classes} >= 2"
                )
        if self.steps < 1 or self.batch_size < 1:
            raise ConfigError(f"phase sft: steps={self.steps} and batch_size={self.batch_size} must be >= 1")
        if not 0.0 <= self.target_accuracy <= 1.0:
            raise ConfigError(f"phase sft: target_accuracy={self.target_accuracy} must be in [0, 1]")
        if not 0.0 <= self.p_uncond <= 1.0:
            raise ConfigError(f"phase sft: p_uncond={self.p_uncond} must be in [0, 1]")

    def __call__(self, ctx: PhaseContext) -> dict:
        rows = list(ctx.train_rows) if not self.task else get_task(self.task).rows("train", self.train_size, ctx.seed)
        random.Random(ctx.seed).shuffle(rows)
        val, rows = (rows[: self.val_size], rows[self.val_size :]) if self.target_accuracy else ([], rows)
        name = self.artifact or "sft"
        result = self.fit(
            ctx.policy,
            rows,
            val,
            ctx.seed,
            lambda split, r, i: ctx.prompt(f"phase:{name}:{split}", r, i),
            lambda policy, r, split: ctx.accuracy(policy, r, f"phase:{name}:{split}"),
        )
        ctx.say(
            f"phase {name!r}: {result['steps']} steps"
            + (f", validation accuracy {result['val_accuracy']:.3f}" if self.target_accuracy else "")
        )
        return {"summary": result}

    def fit(
        self,
        policy: Any,
        rows: list[dict],
        val: list[dict],
        seed: int,
        prompt: Callable,
        accuracy: Callable,
        on_step: Callable[[int, float, float], None] | None = None,
    ) -> dict:
        """Train ``policy`` on ``rows`` until ``steps`` or the target accuracy on ``val``; ``prompt(split, rows, i)``
        gives a row's prompt ids, ``accuracy(policy, rows, split)`` a greedy accuracy. Returns the summary."""
        demos = hasattr(policy, "supervised_loss")  # a policy with its own demonstration loss (Note 5)
        options = self._fit_options(policy, demos)  # {} unless p_uncond is set (Note 6)
        if demos:
            prompts, targets = self._demonstrations(policy, rows, prompt)
        else:
            if not hasattr(policy, "encode_completion"):
                raise ConfigError(
                    f"phase sft needs a text policy or one with a demonstration loss (the {policy.modality} policy "
                    f"has neither encode_completion nor supervised_loss)"
                )
            if not rows or "answer" not in rows[0]:
                raise ConfigError("phase sft needs train rows with an `answer` column")
            prompts = [prompt("train", rows, i) for i in range(len(rows))]
            answers = [policy.encode_completion(str(r["answer"])) for r in rows]
        classes = self._classes(rows)  # [N] decision class of each row (cb_stream), else None
        weights = None
        if classes is not None and self.cb_counts == "dataset":
            weights = class_balanced_weights(torch.bincount(classes, minlength=self.num_classes), self.cb_beta)  # [C]
        updater = build_spec("update", self.update)
        updater.bind(policy.parameters(), self.steps)
        order_rng, order = torch.Generator().manual_seed(seed), []
        history, val_accuracy, step = [], 0.0, 0
        policy.train()
        while step < self.steps:
            if len(order) < self.batch_size:  # the next epoch, in a seeded order
                order += torch.randperm(len(rows), generator=order_rng).tolist()
            picked, order = order[: self.batch_size], order[self.batch_size :]
            if demos:
                gen = torch.Generator().manual_seed(sample_seed(seed, step, 0, -1))  # the step's draws (t, noise)
                loss = float(
                    updater.step(
                        lambda: _demonstration_loss(
                            policy,
                            [prompts[i] for i in picked],  # noqa: B023 (called at once, inside this iteration)
                            [targets[i] for i in picked],  # noqa: B023
                            gen,  # noqa: B023
                            options,
                        )
                    )["loss"]
                )
            elif classes is None:
                batch = teacher_forced([prompts[i] for i in picked], [answers[i] for i in picked])
                loss = float(updater.step(lambda: _loss(policy, batch))["loss"])  # noqa: B023 (called at once, inside this iteration)
            else:
                batch = teacher_forced([prompts[i] for i in picked], [answers[i] for i in picked])
                picked_classes = classes[picked]  # [n]
                w = (
                    weights
                    if weights is not None
                    else class_balanced_weights(
                        torch.bincount(picked_classes, minlength=self.num_classes), self.cb_beta
                    )
                )
                loss = float(updater.step(lambda: _balanced_loss(policy, batch, picked_classes, w))["loss"])  # noqa: B023 (called at once, inside this iteration)
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
        return {
            "steps": step,
            "val_accuracy": val_accuracy if self.target_accuracy else None,
            "reached_target": reached,
            "history": history,
        }

    def _fit_options(self, policy: Any, demos: bool) -> dict[str, Any]:
        """The keyword options of ``supervised_loss`` this phase sets: ``p_uncond`` when it is not 0."""
        if not self.p_uncond:
            return {}
        if not demos or "p_uncond" not in inspect.signature(policy.supervised_loss).parameters:
            raise ConfigError(
                f"phase sft: p_uncond={self.p_uncond} (classifier-free guidance's condition dropout) needs a policy "
                f"whose supervised_loss takes p_uncond (the flow toy with model.params.condition_extras); the "
                f"{policy.modality} policy's does not: set p_uncond = 0"
            )
        return {"p_uncond": self.p_uncond}

    def _demonstrations(self, policy: Any, rows: list[dict], prompt: Callable) -> tuple[list, list]:
        """The prompts and ``encode_target`` targets of a non-text policy's demonstration rows."""
        if self.loss != "ce":
            raise ConfigError(
                f"phase sft: loss={self.loss!r} is a text loss; the {policy.modality} policy fits demonstrations "
                f'with its own supervised_loss (leave loss = "ce")'
            )
        if not rows:
            raise ConfigError("phase sft has no train rows to fit")
        if not hasattr(policy, "encode_target"):
            raise ConfigError(
                f"phase sft: the {policy.modality} policy has supervised_loss but no encode_target(row) to read a "
                "demonstration's target; define both (components.POLICY_OPTIONAL)"
            )
        try:
            targets = [policy.encode_target(r) for r in rows]
        except ValueError as err:
            raise ConfigError(f"phase sft: {err}") from None
        return [prompt("train", rows, i) for i in range(len(rows))], targets

    def _classes(self, rows: list[dict]) -> torch.Tensor | None:
        if self.loss != "cb_stream":
            return None
        try:
            classes = torch.tensor([int(r[self.decision_column]) for r in rows], dtype=torch.long)  # [N]
        except (KeyError, TypeError, ValueError):
            raise ConfigError(
                f"phase sft: loss='cb_stream' needs an integer {self.decision_column!r} column in every train row "
                f"(the decision class; task 'clue_stream' has one); set decision_column"
            ) from None
        if bool(((classes < 0) | (classes >= self.num_classes)).any()):
            raise ConfigError(
                f"phase sft: column {self.decision_column!r} holds classes "
                f"outside 0..{self.num_classes - 1}; set num_classes"
            )
        return classes


def teacher_forced(prompts: list[list[int]], answers: list[list[int]]) -> Rollout:
    """One-row groups whose actions are the given answers: the policy's forward scores them."""
    T = max(len(a) for a in answers)
    actions = torch.zeros(len(answers), 1, T, dtype=torch.long)  # [N,1,T]
    for i, a in enumerate(answers):
        actions[i, 0, : len(a)] = torch.tensor(a)
    lengths = torch.tensor([len(a) for a in answers])  # [N]
    mask = (torch.arange(T)[None, :] < lengths[:, None])[:, None, :]  # [N,1,T]
    N = len(answers)
    return Rollout(
        prompt_ids=prompts,
        actions=actions,
        mask=mask,
        group_valid=torch.ones(N, 1, dtype=torch.bool),
        truncated=torch.zeros(N, 1, dtype=torch.bool),
        prompt_index=torch.arange(N),
    )


def _loss(policy: Any, batch: Rollout) -> torch.Tensor:
    logp = policy.forward(batch, ("logp",))["logp"]  # [N,1,T]
    loss = -(logp * batch.mask).sum() / batch.mask.sum()  # token mean over the answers and EOS
    loss.backward()
    return loss.detach()


def _demonstration_loss(
    policy: Any, prompts: list, targets: list, gen: torch.Generator, options: dict[str, Any]
) -> torch.Tensor:
    # a scalar with grad (the policy's own demonstration loss)
    loss = policy.supervised_loss(prompts, targets, gen, **options)
    loss.backward()
    return loss.detach()


def _balanced_loss(policy: Any, batch: Rollout, classes: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """CB-Stream: the first answer token of each row is its decision (class ``classes`` [N])."""
    logp = policy.forward(batch, ("logp",))["logp"][:, 0]  # [N,T]
    valid = batch.mask[:, 0]  # [N,T]
    decision = torch.zeros_like(valid)  # [N,T]
    decision[:, 0] = True
    loss, _ = balanced_from_ce(-logp, valid, decision, classes[:, None].expand_as(valid), weights)
    loss.backward()
    return loss.detach()
