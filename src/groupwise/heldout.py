"""Held-out evaluation of the trained policy: greedy accuracy (under ``eval.views`` and on
``eval.tasks``), the answer NLL of another task, and sampled ``mean@n`` / ``pass@k``.

The greedy calls take the rollout's sampling settings with ``eval.sampling`` merged over them (a
flow policy deployed with another sampler than it trained on, issue 37 M4). ``evaluate_full``
also gives the mean eval reward over the held-out rows (rows whose reward failed are left out of
the mean; they count as wrong in the accuracy) and the eval reward's ``log_metric`` means: the
measures of a continuous reward, where "reward ≥ 1" is not the question. A rollout strategy may
define its own held-out evaluation, ``evaluate(ctx, rows, info) -> dict[str, float]`` (a chain, a
game, best-of-N: what "the policy's answer" means is the strategy's); ``evaluate_strategy`` calls
it with a rollout context over the held-out rows, the eval reward, the greedy settings (with
``eval.sampling``) and step −1's noise (as ``evaluate_sampled``), and the run logs each key as
``eval/<key>`` and ``<key>_before`` / ``<key>_after``.

``HeldOut(trainer)`` holds the trainer: it reads the trainer's policy and step (the ``StepInfo`` its
calls get) and, of the parts, the held-out rows, the eval reward stage and the prompts; it changes
nothing of the run's state but the prompt cache. The views and tasks it scores under are built with
everything else (``build.py``); the run (``run.py``) decides when to evaluate and what to record.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from groupwise.errors import ConfigError
from groupwise.evaluation import pass_at_k
from groupwise.phases.sft import teacher_forced
from groupwise.rewards.stage import RewardStage
from groupwise.types import Request

if TYPE_CHECKING:
    from groupwise.trainer import Trainer


class HeldOut:
    """``evaluate``, ``answer_nll`` and ``evaluate_sampled`` of a trainer's policy (module docstring)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        parts = trainer.parts
        self.cfg, self.eval_rows, self.eval_stage = parts.cfg, parts.eval_rows, parts.eval_stage
        self.prompts, self.sampling_params = parts.prompts, parts.sampling_params

    @torch.no_grad()
    def evaluate(
        self,
        policy: Any = None,
        rows: list[dict] | None = None,
        split: str = "eval",
        view: str | None = None,
        stage: RewardStage | None = None,
    ) -> float:
        """Held-out greedy accuracy (share of prompts whose eval reward is ≥ 1) of ``policy`` (default: the
        trained policy) on ``rows`` (default: the first ``eval.size`` held-out rows; ``split`` names them),
        with each prompt edited by ``view`` (one of ``eval.views``) when given; the reward still
        compares with the row's own answer. ``stage`` scores instead of the eval reward (``eval.tasks``)."""
        return self.evaluate_full(policy, rows, split, view, stage)["accuracy"]

    @torch.no_grad()
    def evaluate_full(
        self,
        policy: Any = None,
        rows: list[dict] | None = None,
        split: str = "eval",
        view: str | None = None,
        stage: RewardStage | None = None,
    ) -> dict[str, float]:
        """:meth:`evaluate`'s greedy pass, with all it measures: ``accuracy``, ``reward_mean`` (the mean
        eval reward over the rows whose reward did not fail; NaN when none) and ``metric/<name>``
        (the mean of each ``log_metric`` of the eval reward over these rows); NaNs without rows."""
        policy, stage = policy or self.trainer.policy, stage or self.eval_stage
        rows = self.eval_rows[: self.cfg.eval.size] if rows is None else rows
        if not rows:
            return {"accuracy": float("nan"), "reward_mean": float("nan")}
        correct, total, counted, info = 0, 0.0, 0, self.trainer.info()
        stage.pop_metrics()  # drop what other calls left, so the metrics below are these rows' own
        for start in range(0, len(rows), 256):
            chunk = list(range(start, min(start + 256, len(rows))))
            requests = [Request(key=i, n=1, prompt=self.prompts(split, rows, i, view)) for i in chunk]
            sampling = {**self.sampling_params, **self.cfg.eval.sampling, "greedy": True}
            gen = policy.generate(requests, sampling, info)
            gen.meta = [rows[i] for i in chunk]
            stage.score_local(gen, info)
            stage.finish(gen, info)
            reward = gen.rewards[:, 0].double()  # [n] NaN where the reward failed
            correct += int((reward >= 1.0 - 1e-6).sum())  # NaN (excluded) counts as wrong
            total += float(reward[torch.isfinite(reward)].sum())
            counted += int(torch.isfinite(reward).sum())
        metrics = {f"metric/{k.split('/', 1)[1]}": v for k, v in stage.pop_metrics().items()}
        return {"accuracy": correct / len(rows), "reward_mean": total / counted if counted else float("nan"), **metrics}

    @torch.no_grad()
    def evaluate_strategy(self) -> dict[str, float]:
        """The rollout strategy's own held-out measures (module docstring); {} when it defines none."""
        strategy = self.trainer.strategy
        rows = self.eval_rows[: self.cfg.eval.size]
        if not hasattr(strategy, "evaluate") or not rows:
            return {}
        from groupwise.rollout.context import RolloutContext

        info = dataclasses.replace(self.trainer.info(), step=-1)
        ctx = RolloutContext(
            self.trainer.policy,
            self.trainer.sampler,
            self.eval_stage,
            lambda rollout: None,  # no needs: nothing is trained on these rows
            lambda i: self.prompts("eval", rows, i),
            lambda i: rows[i],
            lambda round_=0: info,
            {**self.sampling_params, **self.cfg.eval.sampling, "greedy": True},
            len(rows),
            self.cfg.rollout.group_size,
        )
        return {str(k): float(v) for k, v in strategy.evaluate(ctx, rows, info).items()}

    @torch.no_grad()
    def answer_nll(self, rows: list[dict], split: str, policy: Any = None) -> float:
        """Mean negative log-likelihood per token of each row's ``answer`` then EOS after its prompt,
        teacher-forced (the ``sft`` phase's loss, over all the rows' tokens); NaN for a policy that
        cannot encode an answer (``eval.tasks``: what training did to another task's likelihood)."""
        policy = policy or self.trainer.policy
        if not rows or not hasattr(policy, "encode_completion"):
            return float("nan")
        total, count = 0.0, 0
        for start in range(0, len(rows), 256):
            chunk = range(start, min(start + 256, len(rows)))
            batch = teacher_forced(
                [self.prompts(split, rows, i) for i in chunk],
                [policy.encode_completion(str(rows[i]["answer"])) for i in chunk],
            )
            logp = policy.forward(batch, ("logp",))["logp"]  # [n,1,T]
            total += float(-(logp * batch.mask).sum())
            count += int(batch.mask.sum())
        return total / count

    @torch.no_grad()
    def evaluate_sampled(self) -> dict[str, float]:
        """``mean@n`` and unbiased ``pass@k`` (``groupwise.evaluation``) over the held-out prompts, from
        ``eval.samples = n`` samples each at the rollout's sampling settings. The samples take their
        noise from step −1, so before and after training see the same noise and differ by the weights."""
        n, rows = self.cfg.eval.samples, self.eval_rows[: self.cfg.eval.size]
        ks = sorted(set(self.cfg.eval.pass_at or [1, n]))
        if not rows or not n:
            return {}
        if any(not 1 <= k <= n for k in ks):
            raise ConfigError(f"eval.pass_at={ks}: every k must be in 1..eval.samples={n}")
        info, correct = dataclasses.replace(self.trainer.info(), step=-1), []
        for start in range(0, len(rows), max(1, 256 // n)):
            chunk = list(range(start, min(start + max(1, 256 // n), len(rows))))
            requests = [Request(key=i, n=n, prompt=self.prompts("eval", self.eval_rows, i)) for i in chunk]
            gen = self.trainer.policy.generate(requests, self.sampling_params, info)
            gen.meta = [rows[i] for i in chunk]
            self.eval_stage.score_local(gen, info)
            self.eval_stage.finish(gen, info)
            correct += ((gen.rewards >= 1.0 - 1e-6) & gen.group_valid).sum(1).tolist()  # [b] correct samples per prompt
        out = {f"mean@{n}": sum(correct) / (n * len(rows))}
        out.update({f"pass@{k}": sum(pass_at_k(n, c, k) for c in correct) / len(rows) for k in ks})
        return out
