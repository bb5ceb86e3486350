"""The GRPO loop: sample prompts → generate G completions each → score → advantages → μ epochs of
micro-batched updates of the composed objective → log → checkpoint.

The trainer names no variant: every choice is a component built from the config, and every
extra input a component needs is declared as a ``Need`` and computed here once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import sys
import time
import tomllib
from typing import Any

import numpy as np
import torch

from groupwise import checkpoint, dist, runfolder, schedules
from groupwise.config import Config, to_dict, to_toml
from groupwise.engines.memory import keep_freed_memory
from groupwise.evaluation import pass_at_k
from groupwise.logging import MetricsLog, append_jsonl, cut_back, plot_rewards, progress_bar, sample_rows
from groupwise.needs import NeedResolver
from groupwise.objective import Objective, token_weights
from groupwise.policy import build_policy
from groupwise.registry import ConfigError, build, build_spec
from groupwise.rewards.stage import RewardStage
from groupwise.rollout.context import RolloutContext
from groupwise.stats import PromptStats
from groupwise.tasks import load_splits
from groupwise.types import Need, Request, Rollout, StepInfo
from groupwise.updates._base import all_finite


class Trainer:
    def __init__(self, cfg: Config, console: Any = None):
        self.cfg, self.console = cfg, console
        self.rank, self.world = dist.init()
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        if cfg.perf.keep_freed_memory:
            keep_freed_memory()  # process-wide: activation-sized blocks are reused, not faulted in afresh each step
        self.out = cfg.out_dir
        self.policy = build_policy(cfg.model, cfg.perf)
        self.train_rows, self.eval_rows, task_reward = load_splits(cfg.data, cfg.seed, own_rewards=bool(cfg.rewards))
        self._prompt_cache: dict[tuple[str, int], list[int]] = {}

        ro = cfg.rollout
        if ro.prompts_per_step % self.world:
            raise ConfigError(f"rollout.prompts_per_step={ro.prompts_per_step} must divide by the world size {self.world}")
        self.sampling_params = {"temperature": ro.temperature, "top_p": ro.top_p, "top_k": ro.top_k, "max_new_tokens": ro.max_new_tokens}
        self.strategy = build("rollout", ro.name, **ro.params)
        self.sampler = build_spec("sampling", cfg.sampling)
        self.sampler.bind(len(self.train_rows), cfg.seed)
        self.reward_stage = RewardStage(cfg.rewards or [task_reward], cfg.reward, self.policy.decode, ro.max_new_tokens)
        # held-out scoring never stops a run: a failed eval reward excludes its sample (counted as wrong)
        self.eval_stage = RewardStage([cfg.eval.reward or task_reward], dataclasses.replace(cfg.reward, on_error="exclude", max_error_rate=1.0),
                                      self.policy.decode, ro.max_new_tokens)
        self.estimator = build_spec("advantage", cfg.advantage.estimator)
        if ro.group_size < 2 and getattr(self.estimator, "group_relative", False):
            raise ConfigError(f"rollout.group_size={ro.group_size} with the group-relative advantage {self.estimator.registry_name!r}: "
                              f"every advantage would be 0; use group_size >= 2")
        self.shapers = [build_spec("advantage", spec) for spec in cfg.advantage.shapers]
        self.weights = [build_spec("weight", spec) for spec in cfg.objective.weights]
        self.objective = Objective.from_config(cfg.objective.terms, cfg.objective.agg)
        self.updater = build_spec("update", cfg.update)
        self.prompt_stats = PromptStats()

        # With one mini-batch per epoch, the first epoch's forward runs on the weights that sampled the
        # rollout: its detached log-probs ARE the old log-probs (no extra no-grad pass; ratio 1 in epoch 0).
        self.old_from_first_pass = cfg.train.minibatches == 1
        owners = [*self._components(), *schedules.all_schedules(self._components())]
        needs = [n for c in owners for n in getattr(c, "needs", ())] + ([] if self.old_from_first_pass else [Need("logp")])
        models = self.policy.scoring_models(with_reference=any(n.model == "ref" for n in needs))
        self.needs = NeedResolver(needs, models, cfg.views, self.policy.score, self.policy.encode, context=self.policy.context)
        for component in owners + self.eval_stage.scorers:  # a component made for another modality's rollouts fails here, not mid-run
            if getattr(component, "modality", self.policy.modality) != self.policy.modality:
                raise ConfigError(f"{getattr(component, 'stage', '')} component {getattr(component, 'registry_name', type(component).__name__)!r} works on {component.modality} policies; "
                                  f"this run's policy is {self.policy.modality} (model.policy={cfg.model.policy!r})")
        scorer_needs = set(self.reward_stage.needs)
        self.round_needs = [n for n in needs if not n.grad and n in scorer_needs]  # before dynamic sampling's keep
        self.step_needs = [n for n in needs if not n.grad]
        self.grad_quantities = sorted({n.quantity for n in needs if n.grad} | {"entropy"})  # entropy is logged
        self.params = self.policy.parameters()
        self.updater.bind(self.params, cfg.train.steps * cfg.train.epochs * cfg.train.minibatches)
        self.step = 0
        self.summary: dict[str, Any] = {}
        self._stop_requested: str | None = None  # the signal's name once SIGTERM / SIGINT arrived
        self._skipped_in_row = 0  # optimiser steps in a row with a non-finite loss, gradient or result
        self._empty_in_row = 0  # steps in a row in which no sample had a finite reward

    # ------------------------------------------------------------------ set-up helpers
    @property
    def model(self) -> Any:
        """The trained module (``policy.module``)."""
        return self.policy.module

    @property
    def tokenizer(self) -> Any:
        return self.policy.tokenizer

    def _components(self) -> list[Any]:
        return [self.strategy, self.sampler, *self.reward_stage.scorers, self.estimator, *self.shapers, *self.weights, *self.objective.terms, self.updater]

    def _named_components(self) -> dict[str, Any]:
        """The components by ``stage.name`` (``#2``, ``#3`` for repeats): checkpoint states are matched by name."""
        named: dict[str, Any] = {}
        for component in self._components():
            key = f"{getattr(component, 'stage', type(component).__module__)}.{getattr(component, 'registry_name', type(component).__name__)}"
            k, n = key, 1
            while k in named:
                n += 1
                k = f"{key}#{n}"
            named[k] = component
        return named

    def _say(self, message: str) -> None:
        if self.rank == 0:
            if self.console is not None:
                self.console.print(message, soft_wrap=True, markup=False, highlight=False)  # one line: greppable
            else:
                print(message, file=sys.stderr)

    def _info(self, round_: int = 0) -> StepInfo:
        return StepInfo(self.step, self.cfg.seed, self.cfg.rollout.max_new_tokens, self.world, self.rank, round_,
                        total_steps=self.cfg.train.steps, phase="rl", prompt_stats=self.prompt_stats)

    def _prompt_ids(self, split: str, rows: list[dict], index: int) -> list[int]:
        key = (split, index)
        if key not in self._prompt_cache:
            ids = self.policy.encode(rows[index]["prompt"])
            self.policy.check_fits(ids, self.cfg.rollout.max_new_tokens, f"{split} row {index + 1}")
            self._prompt_cache[key] = ids
        return self._prompt_cache[key]

    def _share(self, batch: Rollout) -> Rollout:
        """This rank's groups of the whole batch (the batch itself at world size 1)."""
        if self.world == 1:
            return batch
        start, stop = dist.shard_bounds(batch.shape[0])
        return batch.select(list(range(start, stop)))

    # ------------------------------------------------------------------ stage 1–3: collect the step's whole scored batch
    def collect(self) -> Rollout:
        """The rollout strategy collects the step's whole scored batch (identical on every rank)."""
        ro = self.cfg.rollout
        ctx = RolloutContext(self.policy, self.sampler, self.reward_stage, lambda rollout: self.needs.fill(rollout, self.round_needs),
                             lambda i: self._prompt_ids("train", self.train_rows, i), lambda i: self.train_rows[i], self._info,
                             self.sampling_params, ro.prompts_per_step, ro.group_size)
        batch = self.strategy(ctx)
        self._finite_reward_frac = ctx.finite_fraction  # over every scored round: a step whose groups were all dropped still had rewards
        return batch

    # ------------------------------------------------------------------ no-grad needs, schedules, advantages, weights
    def prepare(self, batch: Rollout) -> Rollout:
        """The no-grad needs (each rank scores its share, then the whole batch is gathered again),
        this step's scheduled coefficients, advantages, shapers and token weights, all on the whole
        batch. Returns the whole batch."""
        local = self._share(batch)
        self.needs.fill(local, self.step_needs)
        batch = dist.gather_rollout(local)
        info = self._info()
        self._coefficients = schedules.resolve(self._components(), info, batch)
        batch.advantages = self.estimator(batch, info)  # [B,G] or [B,G,T]
        for shaper in self.shapers:
            batch.advantages = shaper(batch, info)
        if self.weights:
            batch.weight, counted = token_weights(self.weights, batch, info)  # [B,G,T], [B,G,T]
            batch.set_extra("counted", counted, "token")
        for component in self._components():
            if hasattr(component, "prepare"):  # whole-batch statistics a term needs in every micro-batch (micro-batch invariance)
                component.prepare(batch, info)
            if hasattr(component, "step_stats"):
                self._coefficients.update(component.step_stats())
        return batch

    def observe(self, batch: Rollout) -> None:
        """After the update: every component that observes, then the shared per-prompt table."""
        info = self._info()
        for component in self._components():
            if hasattr(component, "observe"):
                component.observe(batch, info)
        self.prompt_stats.update(batch, info)

    # ------------------------------------------------------------------ stage 5–6: μ epochs of micro-batched updates
    def update(self, rollout: Rollout) -> dict[str, float]:
        cfg = self.cfg.train
        B = rollout.shape[0]
        stats: list[dict[str, float]] = []
        self._entropy = [0.0, 0.0]  # masked sum, count: logged every step
        for epoch in range(cfg.epochs):
            order = torch.randperm(B, generator=torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.step * 101 + epoch)) if cfg.epochs > 1 or cfg.minibatches > 1 else torch.arange(B)
            for mb_groups in torch.tensor_split(order, cfg.minibatches):
                batch = rollout.select(mb_groups)
                if not int(dist.all_reduce_sum(self.objective.loss_mask(batch).sum())):
                    stats.append({"loss": 0.0, "skipped": 1.0})  # no token gets loss anywhere: leave the weights alone
                    continue
                norms = self.objective.normalizers(batch, self._info(), dist.all_reduce_sum if self.world > 1 else None)
                stats.append(self.updater.step(self._closure(batch, norms)))
                if rollout.logp_old is None and batch.logp_old is not None:  # epoch 0 of one mini-batch filled them
                    rollout.logp_old = torch.zeros_like(batch.logp_old).index_copy(0, mb_groups, batch.logp_old)  # [B,G,T]
        row = {key: float(np.nanmean([s.get(key, float("nan")) for s in stats])) for key in stats[0]} if stats else {}
        row["skipped"] = float(sum(s.get("skipped", 0.0) for s in stats))
        row["nonfinite"] = float(sum(s.get("nonfinite", 0.0) for s in stats))
        reduce = dist.all_reduce_sum if self.world > 1 else None
        row.update(self.objective.pop_stats(reduce))
        entropy = torch.tensor(self._entropy, dtype=torch.float64)  # [2] masked sum, count
        entropy = reduce(entropy) if reduce else entropy
        row["entropy"] = float(entropy[0] / entropy[1].clamp(min=1.0))
        return row

    def _closure(self, batch: Rollout, norms: dict):
        """The micro-batched forward/backward of one mini-batch, safe to call any number of times:
        the old log-probs are taken once (by the first call, on the weights that sampled the rollout),
        and statistics are recorded by the first call only, so a second call after an optimiser step
        sees ratio ≠ 1 and counts nothing twice."""
        calls = 0

        def closure() -> torch.Tensor:
            nonlocal calls
            calls += 1
            return self._accumulate_gradients(batch, norms, first=calls == 1)

        return closure

    def _accumulate_gradients(self, batch: Rollout, norms: dict, first: bool) -> torch.Tensor:
        size = self.cfg.train.micro_batch_groups or max(1, batch.shape[0])
        take_old = batch.logp_old is None  # epoch 0 of a single mini-batch: its own forward gives the old log-probs
        if take_old:
            batch.logp_old = torch.zeros_like(batch.mask, dtype=torch.float32)  # [b,G,T] filled below
        total = torch.zeros(())
        for start in range(0, batch.shape[0], size):
            groups = list(range(start, min(start + size, batch.shape[0])))
            mb = batch.select(groups)
            out = self.policy.forward(mb, self.grad_quantities)
            if first:
                with torch.no_grad():
                    self._entropy[0] += float(out["entropy"][mb.row_mask].sum())
                    self._entropy[1] += float(mb.row_mask.sum())
            if take_old:
                mb.logp_old = out["logp"].detach()  # [b,G,T] the weights have not moved yet: ratio = 1, no extra forward
                batch.logp_old[start : start + len(groups)] = mb.logp_old
            loss = self.objective.loss(mb, out, norms, self._info(), record=first)
            if loss.requires_grad:
                loss.backward()
            total = total + loss.detach()
        dist.all_reduce_grads(self.params)
        return dist.all_reduce_sum(total)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> float:
        """Held-out greedy accuracy (share of prompts whose eval reward is ≥ 1)."""
        rows = self.eval_rows[: self.cfg.eval.size]
        if not rows:
            return float("nan")
        correct, info = 0, self._info()
        for start in range(0, len(rows), 256):
            chunk = list(range(start, min(start + 256, len(rows))))
            requests = [Request(key=i, n=1, prompt=self._prompt_ids("eval", self.eval_rows, i)) for i in chunk]
            gen = self.policy.generate(requests, {**self.sampling_params, "greedy": True}, info)
            gen.meta = [rows[i] for i in chunk]
            self.eval_stage.score_local(gen)
            self.eval_stage.finish(gen, info)
            correct += int((gen.rewards[:, 0] >= 1.0 - 1e-6).sum())  # NaN (excluded) counts as wrong
        return correct / len(rows)

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
        info, correct = dataclasses.replace(self._info(), step=-1), []
        for start in range(0, len(rows), max(1, 256 // n)):
            chunk = list(range(start, min(start + max(1, 256 // n), len(rows))))
            gen = self.policy.generate([Request(key=i, n=n, prompt=self._prompt_ids("eval", self.eval_rows, i)) for i in chunk], self.sampling_params, info)
            gen.meta = [rows[i] for i in chunk]
            self.eval_stage.score_local(gen)
            self.eval_stage.finish(gen, info)
            correct += ((gen.rewards >= 1.0 - 1e-6) & gen.group_valid).sum(1).tolist()  # [b] correct samples per prompt
        out = {f"mean@{n}": sum(correct) / (n * len(rows))}
        out.update({f"pass@{k}": sum(pass_at_k(n, c, k) for c in correct) / len(rows) for k in ks})
        return out

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "policy": self.policy.state_dict(),
            "components": {key: c.state_dict() for key, c in self._named_components().items() if hasattr(c, "state_dict")},
            "schedules": [s.state_dict() if hasattr(s, "state_dict") else None for s in schedules.all_schedules(self._components())],
            "prompt_stats": self.prompt_stats.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
            "summary": self.summary,
            "in_row": {"skipped": self._skipped_in_row, "empty": self._empty_in_row},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.policy.load_state_dict(state["policy"])
        named = {key: c for key, c in self._named_components().items() if hasattr(c, "state_dict")}
        if sorted(named) != sorted(state["components"]):
            raise ConfigError(f"the checkpoint holds the states of components {sorted(state['components'])}, this configuration builds "
                              f"{sorted(named)}; resume with the components the run started with, or train into a new folder with out=...")
        for key, component in named.items():
            component.load_state_dict(state["components"][key])
        for schedule, sub in zip(schedules.all_schedules(self._components()), state.get("schedules", [])):
            if sub is not None:
                schedule.load_state_dict(sub)
        # the values in force before the resumed run's first resolve (a reward scored before it): the last step's
        last = StepInfo(max(self.step - 1, 0), self.cfg.seed, self.cfg.rollout.max_new_tokens, self.world, self.rank, total_steps=self.cfg.train.steps)
        for component in self._components():
            for attr, schedule in schedules.scheduled(component).items():
                setattr(component, attr, schedule.start() if hasattr(schedule, "state_dict") else schedule(last, None))
        if "prompt_stats" in state:
            self.prompt_stats.load_state_dict(state["prompt_stats"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        self.summary = state["summary"]
        self._skipped_in_row, self._empty_in_row = state["in_row"]["skipped"], state["in_row"]["empty"]

    def save_checkpoint(self) -> None:
        if not all_finite(self.policy.parameters()):  # the updater rolls such steps back; never write one
            raise RuntimeError(f"refusing to checkpoint step {self.step}: the model has non-finite weights")
        if self.rank == 0:
            checkpoint.save(self.out, self.step, self.state_dict(), self.cfg.checkpoint.keep_last)
        dist.barrier()

    # ------------------------------------------------------------------ the run
    def train(self, resume_allow: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
        """The whole run in its folder, which it holds locked: resume (or start), train until done,
        stopped (SIGTERM / Ctrl-C: checkpoint, then return) or out of time, evaluate, write outputs."""
        self.out.mkdir(parents=True, exist_ok=True)
        lock = runfolder.RunLock(self.out).acquire() if self.rank == 0 else None
        try:
            return self._train(list(resume_allow))
        finally:
            if lock is not None:
                lock.release()

    def _resume(self, allow: list[str]) -> None:
        """Load the newest intact checkpoint if there is one, after checking the configuration is the
        one the run started with (else refused, naming each changed key); then record the config."""
        current = tomllib.loads(to_toml(to_dict(self.cfg)))  # as stored: compared like for like
        resume = checkpoint.latest_intact(self.out)
        stored = self.out / "config.toml"
        if resume is not None and stored.exists():
            runfolder.check_resume({**tomllib.loads(stored.read_text()), "out": None}, {**current, "out": None}, allow)
        if resume is not None:
            self.load_state_dict(checkpoint.load(resume))
            self._say(f"resuming {self.out} from step {self.step} (checkpoint {resume.relative_to(self.out)})")
        if self.rank == 0:
            runfolder.write_atomic(stored, to_toml(to_dict(self.cfg)))

    def _finished(self) -> bool:
        out_of_time = bool(self.cfg.train.max_seconds) and self.summary.get("wall_seconds", 0.0) > self.cfg.train.max_seconds
        return bool(self.summary.get("finished")) and (self.step >= self.cfg.train.steps or out_of_time)

    def _train(self, allow: list[str]) -> dict[str, Any]:
        self._resume(allow)
        if self._finished():
            self._say(f"{self.out} finished at step {self.step} already (summary.json); nothing to do. To train further, raise "
                      f"train.steps and add --resume-allow train.steps; for a new run, pick another out=")
            return self.summary
        log = MetricsLog(self.out / "metrics.jsonl", self.step - 1 if self.step else None) if self.rank == 0 else None
        if self.rank == 0:
            cut_back(self.out / "samples.jsonl", self.step - 1 if self.step else None)
        previous = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:  # the handlers stay until the outputs are written: a signal during the final evaluation waits for it
            return self._steps(log)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _steps(self, log: MetricsLog | None) -> dict[str, Any]:
        """Evaluate (once), train until done / stopped / out of time with the checkpoints due, then
        the final evaluation and outputs (not after a stop: the rerun continues)."""
        cfg = self.cfg
        start = time.perf_counter() - self.summary.get("wall_seconds", 0.0)
        if "accuracy_before" not in self.summary:
            self.summary["evals"] = []
            self._record_eval("accuracy_before", 0)
        last_save = time.perf_counter()
        stop, out_of_time = dist.agree([self._stop_requested is not None, False])
        with progress_bar(self.console) if self.rank == 0 else _Quiet() as bar:
            task = bar.add_task(cfg.name, total=cfg.train.steps, completed=self.step, reward=0.0, speed=0.0)
            while self.step < cfg.train.steps and not (stop or out_of_time):
                row = self.run_step()
                self._check_health(row)
                if cfg.eval.every and (self.step + 1) % cfg.eval.every == 0 and cfg.eval.size and self.eval_rows:
                    row["eval_accuracy"] = self.evaluate()
                    self.summary["evals"].append((self.step + 1, row["eval_accuracy"]))
                if log:
                    log.write(row)
                    if cfg.log.samples and self.step % cfg.log.samples_every == 0:
                        append_jsonl(self.out / "samples.jsonl", sample_rows(self._last_batch, self.step, cfg.log.samples))
                bar.update(task, advance=1, reward=row.get("reward_mean", 0.0), speed=row.get("tokens_per_s", 0.0))
                self.step += 1
                self.summary["wall_seconds"] = time.perf_counter() - start
                # decided together: every rank stops, and checkpoints, at the same step
                ck = cfg.checkpoint
                due = (ck.every and self.step % ck.every == 0) or (ck.minutes and time.perf_counter() - last_save > 60 * ck.minutes)
                stop, out_of_time, due = dist.agree([self._stop_requested is not None, bool(cfg.train.max_seconds) and self.summary["wall_seconds"] > cfg.train.max_seconds, bool(due)])
                if due or stop or out_of_time:
                    self.save_checkpoint()
                    last_save = time.perf_counter()
        if stop:
            self._say(f"stopped by {self._stop_requested or 'another rank'} at step {self.step} (checkpointed). Rerun the same command to resume.")
            return self.summary
        if out_of_time and self.step < cfg.train.steps:  # the demo's 170 s budget cuts longer runs short: say so
            self.summary["stopped_early"] = f"train.max_seconds={cfg.train.max_seconds:g} reached after step {self.step} of {cfg.train.steps}"
            self._say(f"{self.summary['stopped_early']}; raise train.max_seconds (0 = no limit) to train longer")
        self._record_eval("accuracy_after", self.step)
        self.summary.update(steps=self.step, wall_seconds=time.perf_counter() - start, skipped_updates=getattr(self.updater, "skipped", 0), finished=True)
        self.save_checkpoint()
        if self.rank == 0:
            self._write_outputs(log)
        return self.summary

    def _record_eval(self, key: str, step: int) -> None:
        """A held-out accuracy (and, with ``eval.samples``, the sampled metrics as ``<key>_sampled``)
        into the summary; without held-out rows, ``None`` and a note saying why."""
        if self.cfg.eval.samples:
            self.summary[f"{key}_sampled"] = self.evaluate_sampled()
        accuracy = self.evaluate()
        if accuracy != accuracy:  # NaN: nothing to evaluate on
            self.summary[key] = None
            self.summary["eval_note"] = f"no held-out evaluation: eval.size={self.cfg.eval.size} and {len(self.eval_rows)} held-out rows"
            return
        self.summary[key] = accuracy
        self.summary["evals"].append((step, accuracy))

    def _check_health(self, row: dict[str, Any]) -> None:
        """Abort (before anything is saved) a run that cannot learn: optimiser steps that keep going
        non-finite, or steps in which no sample has a finite reward."""
        cfg = self.cfg
        self._skipped_in_row = self._skipped_in_row + 1 if row.get("nonfinite") else 0
        if self._skipped_in_row >= cfg.train.max_skipped_in_row:
            raise RuntimeError(f"{self._skipped_in_row} optimiser steps in a row had a non-finite loss, gradient or result and were skipped or "
                               f"rolled back (train.max_skipped_in_row={cfg.train.max_skipped_in_row}); check update.lr and the rewards")
        self._empty_in_row = self._empty_in_row + 1 if row.get("reward_finite_frac", 1.0) == 0 else 0
        if self._empty_in_row >= cfg.reward.max_empty_steps:
            raise RuntimeError(f"{self._empty_in_row} steps in a row had no sample with a finite reward (every reward None, NaN or inf; "
                               f"reward.max_empty_steps={cfg.reward.max_empty_steps}): nothing can be learned; check the reward functions")

    def run_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.policy.eval()
        batch = self.collect()  # the whole batch, identical on every rank
        t_gen = time.perf_counter() - t0
        batch = self.prepare(batch)
        self.policy.train()
        local = self._share(batch)
        row: dict[str, Any] = {"step": self.step}
        update = self.update(local) if batch.shape[0] else {"loss": 0.0, "skipped": 1.0}  # nothing kept: no step
        row.update(_rollout_stats(local))  # after the update: the old log-probs may come from its first pass
        row.update(_reward_means(batch, self.reward_stage.labels))
        row.update(update)
        row.update(self._coefficients)
        self.observe(batch)
        if hasattr(self.policy, "end_step"):  # a policy's own per-step upkeep (the reference sync)
            self.policy.end_step(self.step)
        self._last_batch = batch  # for samples.jsonl
        seconds = time.perf_counter() - t0
        generated = float(dist.all_reduce_sum(local.mask.sum()))
        row.update(step_seconds=seconds, generation_seconds=t_gen, tokens_per_s=generated / seconds, reward_excluded=self.reward_stage.excluded,
                   reward_finite_frac=self._finite_reward_frac)
        return row

    def _request_stop(self, signum: int, frame: Any) -> None:
        if self._stop_requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: leave now, without waiting for the step's checkpoint
        self._stop_requested = signal.Signals(signum).name

    def _write_outputs(self, log: MetricsLog | None) -> None:
        """``final/`` (written aside, then swapped in as a whole), ``summary.json`` (atomic), the curve."""
        staging = self.out / f".final.tmp{os.getpid()}"
        if staging.exists():
            shutil.rmtree(staging)
        self.policy.save(staging)
        runfolder.publish_dir(staging, self.out / "final")
        runfolder.write_atomic(self.out / "summary.json", json.dumps(self.summary, indent=2, allow_nan=False) + "\n")
        if log is not None:
            plot_rewards(log.rows, self.summary["evals"], self.out / "reward.png")


def _rollout_stats(rollout: Rollout) -> dict[str, float]:
    """Batch statistics logged every step, over the groups of every rank."""
    from groupwise.masked import group_std, masked_mean

    valid = dist.all_gather_rows(rollout.group_valid)  # [B,G]
    rewards = torch.nan_to_num(dist.all_gather_rows(rollout.rewards)).double()  # [B,G] float64: rewards near 3e38 square to inf in float32
    lengths = dist.all_gather_rows(rollout.mask.sum(-1)).float()  # [B,G]
    stats = {
        "groups": valid.shape[0],
        "reward_mean": float(masked_mean(rewards, valid)),
        "reward_std": float(rewards[valid].std()) if valid.sum() > 1 else 0.0,
        "zero_std_frac": float((group_std(rewards, valid) == 0).float().mean()),
        "completion_len": float(lengths[valid].mean()) if valid.any() else 0.0,
        "truncated_frac": float(dist.all_gather_rows(rollout.truncated)[valid].float().mean()) if valid.any() else 0.0,
    }
    if rollout.logp_ref is not None and rollout.logp_old is not None:
        log_ratio = rollout.logp_ref - rollout.logp_old  # [B,G,T]
        k3 = (log_ratio.exp() - log_ratio - 1)[rollout.row_mask]  # [n]
        total = dist.all_reduce_sum(torch.stack([k3.sum(), torch.tensor(float(k3.numel()))]))  # [2]
        stats["kl"] = float(total[0] / total[1].clamp(min=1))
    return stats


def _reward_means(batch: Rollout, labels: list[str]) -> dict[str, float]:
    """``reward/<label>``: each reward function's own (unweighted) mean over the step's rows with a verdict."""
    out = {}
    real = batch.group_valid | ~torch.isfinite(batch.rewards)  # [B,G] excluded rows too: their other parts count
    for k, label in enumerate(labels):
        part = batch.reward_parts[..., k]  # [B,G]
        seen = real & torch.isfinite(part)  # [B,G]
        out[f"reward/{label}"] = float(part[seen].double().mean()) if seen.any() else float("nan")
    return out


class _Quiet:
    """Stand-in for the progress bar on ranks other than 0."""

    def __enter__(self) -> "_Quiet":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def add_task(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def update(self, *args: Any, **kwargs: Any) -> None:
        return None
