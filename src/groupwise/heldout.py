"""Held-out evaluation of the trained policy: greedy accuracy (under ``eval.views`` and on
``eval.tasks``), the answer NLL of another task, and sampled ``mean@n`` / ``pass@k``.

``HeldOut(trainer)`` holds the trainer: it reads the trainer's policy and step (the ``StepInfo`` its
calls get) and, of the parts, the held-out rows, the eval reward stage and the prompts; it changes
nothing of the run's state but the prompt cache. The views and tasks it scores under are built with
everything else (``build.py``); the run (``run.py``) decides when to evaluate and what to record.

**Environment runs** (``Parts.closed_loop``, from ``eval.closed_loop``): a held-out row is an episode,
played closed-loop by the rollout strategy's ``play_heldout`` (``components.py``), as training plays
it; a completion scored alone would measure only the first action. An episode succeeds when its
return is positive (``rollout.env.greedy_success``'s rule)::

    accuracy  = share of rows whose greedy episode succeeds          (evaluate)
    return    = mean return of those greedy episodes                 (evaluate_detail)
    mean@n    = share of the n·rows sampled episodes that succeed    (evaluate_sampled; pass@k over
    return@n  = their mean return                                      each row's n episodes)

Held-out episodes take their env seeds (and sampled actions their noise) from step −1, so the
evaluation before and after training plays the same episodes and differs by the weights.

**Continuous rewards and other samplers** (issue 37 M4). The greedy calls take the rollout's
sampling settings with ``eval.sampling`` merged over them (a flow policy deployed with another
sampler than it trained on). ``evaluate_detail`` also gives the mean eval reward over the held-out
rows (rows whose reward failed are left out of the mean; they count as wrong in the accuracy) and
the eval reward's ``log_metric`` means (``metric/<name>``): the measures of a continuous reward,
where "reward ≥ 1" is not the question. A rollout strategy may define its own held-out evaluation,
``evaluate(ctx, rows, info) -> dict[str, float]`` (a chain, best-of-N: what "the policy's answer"
means is the strategy's); ``evaluate_strategy`` calls it with a rollout context over the held-out
rows, the eval reward, the greedy settings (with ``eval.sampling``) and step −1's noise, and the run
logs each key as ``eval/<key>`` and ``<key>_before`` / ``<key>_after``.
"""

from __future__ import annotations

import copy
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
        self.closed_loop, self.strategy = parts.closed_loop, parts.strategy

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
        compares with the row's own answer. ``stage`` scores instead of the eval reward (``eval.tasks``).
        An environment run (``closed_loop``): the share of rows whose greedy episode succeeds."""
        return self.evaluate_detail(policy, rows, split, view, stage)["accuracy"]

    def evaluate_actor(self, actor: Any) -> float:
        """``evaluate`` of an actor (``roles.Actor``): its own prompt encoding, the eval reward decoding its tokens."""
        return self.evaluate_detail(actor.policy, stage=self._actor_stage(actor), prompts=actor.prompts)["accuracy"]

    def _actor_stage(self, actor: Any) -> RewardStage:
        """The eval reward decoding an actor's tokens."""
        stage = copy.copy(self.eval_stage)
        stage.decode, stage.counts, stage.metrics = actor.policy.decode, {}, {}
        return stage

    @torch.no_grad()
    def evaluate_detail(
        self,
        policy: Any = None,
        rows: list[dict] | None = None,
        split: str = "eval",
        view: str | None = None,
        stage: RewardStage | None = None,
        prompts: Any = None,
    ) -> dict[str, float]:
        """``evaluate``'s greedy pass with all it measures (module docstring): ``accuracy``,
        ``reward_mean`` (the mean eval reward over the rows whose reward did not fail; NaN when none)
        and ``metric/<name>`` (the mean of each ``log_metric`` of the eval reward over these rows); an
        environment run's held-out episodes give ``accuracy`` and ``return``, the mean return of the
        greedy episodes. ``prompts``: another encoding of the prompts (an actor's own, ``evaluate_actor``)."""
        policy = policy or self.trainer.policy
        prompts = prompts or self.prompts
        rows = self.eval_rows[: self.cfg.eval.size] if rows is None else rows
        if not rows:
            return {"accuracy": float("nan"), "reward_mean": float("nan")}
        if self.closed_loop and view is None and stage is None:
            returns = self._episode_returns(policy, rows, 1, greedy=True)  # [rows][1]
            return {
                "accuracy": sum(r[0] > 0 for r in returns) / len(rows),
                "return": sum(r[0] for r in returns) / len(rows),
            }
        stage = stage or self.eval_stage
        correct, total, counted, info = 0, 0.0, 0, self.trainer.info()
        stage.pop_metrics()  # drop what other calls left, so the metrics below are these rows' own
        sampling = {**self.sampling_params, **self.cfg.eval.sampling, "greedy": True}
        for start in range(0, len(rows), 256):
            chunk = list(range(start, min(start + 256, len(rows))))
            requests = [Request(key=i, n=1, prompt=prompts(split, rows, i, view)) for i in chunk]
            gen = policy.generate(requests, sampling, info)
            gen.meta = [rows[i] for i in chunk]
            stage.score_local(gen, info)
            stage.finish(gen, info)
            reward = gen.rewards[:, 0].double()  # [n] NaN where the reward failed
            correct += int((reward >= 1.0 - 1e-6).sum())  # NaN (excluded) counts as wrong
            total += float(reward[torch.isfinite(reward)].sum())
            counted += int(torch.isfinite(reward).sum())
        metrics = {f"metric/{k.split('/', 1)[1]}": v for k, v in stage.pop_metrics().items()}
        reward_mean = total / counted if counted else float("nan")
        return {"accuracy": correct / len(rows), "reward_mean": reward_mean, **metrics}

    @torch.no_grad()
    def evaluate_strategy(self) -> dict[str, float]:
        """The rollout strategy's own held-out measures (module docstring); {} when it defines none."""
        rows = self.eval_rows[: self.cfg.eval.size]
        if not hasattr(self.strategy, "evaluate") or not rows:
            return {}
        from groupwise.rollout.context import ActorIO, RolloutContext

        info = dataclasses.replace(self.trainer.info(), step=-1)
        actors = {  # a strategy that plays with actors plays them here too, each in its own tokens
            name: ActorIO(
                actor.policy,
                self._actor_stage(actor),
                lambda rollout: None,
                lambda i, actor=actor: actor.prompts("eval", rows, i),
            )
            for name, actor in self.trainer.actors.items()
        }
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
            actors=actors,
        )
        return {str(k): float(v) for k, v in self.strategy.evaluate(ctx, rows, info).items()}

    def _episode_returns(self, policy: Any, rows: list[dict], n: int, greedy: bool) -> list[list[float]]:
        """[row][episode] returns of ``n`` closed-loop episodes per row, by the strategy's ``play_heldout``."""
        info = dataclasses.replace(self.trainer.info(), step=-1)
        returns = self.strategy.play_heldout(policy, rows, self.sampling_params, info, n, greedy)
        if len(returns) != len(rows) or any(len(r) != n for r in returns):
            raise ValueError(
                f"rollout strategy {getattr(self.strategy, 'registry_name', '?')!r}: play_heldout must return "
                f"{len(rows)} rows of {n} returns, got {[len(r) for r in returns]}"
            )
        return returns

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
        ``eval.samples = n`` samples each at the rollout's sampling settings (an environment run: ``n``
        sampled episodes each, and ``return@n``). The samples take their noise from step −1, so before
        and after training see the same noise and differ by the weights."""
        n, rows = self.cfg.eval.samples, self.eval_rows[: self.cfg.eval.size]
        ks = sorted(set(self.cfg.eval.pass_at or [1, n]))
        if not rows or not n:
            return {}
        if any(not 1 <= k <= n for k in ks):
            raise ConfigError(f"eval.pass_at={ks}: every k must be in 1..eval.samples={n}")
        if self.closed_loop:
            returns = self._episode_returns(self.trainer.policy, rows, n, greedy=False)  # [rows][n]
            correct = [sum(x > 0 for x in r) for r in returns]  # successful episodes per row
            out = {f"mean@{n}": sum(correct) / (n * len(rows)), f"return@{n}": sum(map(sum, returns)) / (n * len(rows))}
            out.update({f"pass@{k}": sum(pass_at_k(n, c, k) for c in correct) / len(rows) for k in ks})
            return out
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
