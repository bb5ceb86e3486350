"""The GRPO loop: sample prompts → generate G completions each → score → advantages → μ epochs of
micro-batched updates of the composed objective → log → checkpoint.

The trainer names no variant: every choice is a component built from the config, and every
extra input a component needs is declared as a ``Need`` and computed here once.
"""

from __future__ import annotations

import json
import random
import signal
import time
from typing import Any

import numpy as np
import torch

from groupwise import checkpoint, dist
from groupwise.config import Config, to_dict, to_toml
from groupwise.engines.cpu import CPUEngine
from groupwise.engines.memory import keep_freed_memory
from groupwise.logging import MetricsLog, plot_rewards, progress_bar
from groupwise.objective import Objective
from groupwise.policy.forward import completion_logprobs
from groupwise.policy.lm import Reference, encode_prompt, eos_ids, load_policy
from groupwise.registry import ConfigError, build, build_spec
from groupwise.rewards.score import score
from groupwise.tasks import load_splits
from groupwise.types import Need, Rollout, StepInfo

NO_GRAD_QUANTITIES = {("logp", "ref"), ("logp", "policy"), ("entropy", "policy")}


class Trainer:
    def __init__(self, cfg: Config, console: Any = None):
        self.cfg, self.console = cfg, console
        self.rank, self.world = dist.init()
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        if cfg.perf.keep_freed_memory:
            keep_freed_memory()  # process-wide: activation-sized blocks are reused, not faulted in afresh each step
        self.out = cfg.out_dir
        self.model, self.tokenizer = load_policy(cfg.model.path, cfg.model.dtype, cfg.model.lora or None)
        perf = cfg.perf
        self.engine = CPUEngine(self.model, eos_ids(self.model, self.tokenizer), self.tokenizer.pad_token_id,
                                share_prefix=perf.share_prefix, drop_finished=perf.drop_finished, functional=perf.functional)
        self.train_rows, self.eval_rows, task_reward = load_splits(cfg.data, cfg.seed)
        self._prompt_cache: dict[tuple[str, int], list[int]] = {}

        ro = cfg.rollout
        if ro.prompts_per_step % self.world:
            raise ConfigError(f"rollout.prompts_per_step={ro.prompts_per_step} must divide by the world size {self.world}")
        self.sampling_params = {"temperature": ro.temperature, "top_p": ro.top_p, "top_k": ro.top_k}
        self.strategy = build("rollout", ro.name, **ro.params)
        self.sampler = build_spec("sampling", cfg.sampling)
        self.sampler.bind(len(self.train_rows), cfg.seed)
        reward_specs = cfg.rewards or [task_reward]
        self.rewards = [build_spec("reward", spec) for spec in reward_specs]
        self.eval_reward = build_spec("reward", cfg.eval.reward or task_reward)
        self.estimator = build_spec("advantage", cfg.advantage.estimator)
        self.shapers = [build_spec("advantage", spec) for spec in cfg.advantage.shapers]
        self.weights = [build_spec("weight", spec) for spec in cfg.objective.weights]
        self.objective = Objective.from_config(cfg.objective.terms, cfg.objective.agg)

        self.updater = build_spec("update", cfg.update)
        self.needs = self._collect_needs()
        self.reference = Reference(self.model) if any(n.model == "ref" for n in self.needs) else None
        # With one mini-batch per epoch, the first epoch's forward runs on the weights that sampled the
        # rollout: its detached log-probs ARE the old log-probs (no extra no-grad pass; ratio 1 in epoch 0).
        self.old_from_first_pass = cfg.train.minibatches == 1
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.updater.bind(self.params, cfg.train.steps * cfg.train.epochs * cfg.train.minibatches)
        self.step = 0
        self.summary: dict[str, Any] = {}
        self._stop_requested = False
        self._skipped_in_row = 0

    # ------------------------------------------------------------------ set-up helpers
    def _components(self) -> list[Any]:
        return [self.strategy, self.sampler, *self.rewards, self.estimator, *self.shapers, *self.weights, *self.objective.terms, self.updater]

    def _collect_needs(self) -> list[Need]:
        needs = [n for c in self._components() for n in getattr(c, "needs", ())]
        for n in needs:
            if not n.grad and (n.quantity, n.model) not in NO_GRAD_QUANTITIES:
                raise ConfigError(f"no component can provide {n}; available: {sorted(NO_GRAD_QUANTITIES)}")
            if n.grad and (n.quantity not in ("logp", "entropy") or n.model != "policy"):
                raise ConfigError(f"a grad need must be the policy's logp or entropy, got {n}")
        return needs

    def _info(self, round_: int = 0) -> StepInfo:
        return StepInfo(self.step, self.cfg.seed, self.cfg.rollout.max_new_tokens, self.world, self.rank, round_)

    def _prompt_ids(self, split: str, rows: list[dict], index: int) -> list[int]:
        key = (split, index)
        if key not in self._prompt_cache:
            ids = encode_prompt(self.tokenizer, rows[index]["prompt"])
            context = getattr(self.model.config, "max_position_embeddings", None)
            if context and len(ids) + self.cfg.rollout.max_new_tokens > context:
                raise ValueError(f"{split} row {index + 1}: prompt of {len(ids)} tokens + max_new_tokens={self.cfg.rollout.max_new_tokens} exceeds the model's context of {context}")
            self._prompt_cache[key] = ids
        return self._prompt_cache[key]

    # ------------------------------------------------------------------ stage 1–3: collect a scored rollout
    def collect(self) -> Rollout:
        cfg = self.cfg.rollout
        local_b = cfg.prompts_per_step // self.world
        parts, kept = [], 0
        for round_ in range(max(1, getattr(self.sampler, "max_rounds", 1))):
            info = self._info(round_)
            ids = self.sampler.draw(cfg.prompts_per_step, info)  # same on every rank
            local = ids[self.rank * local_b : (self.rank + 1) * local_b]
            prompt_ids = [self._prompt_ids("train", self.train_rows, i) for i in local]
            rollout = self.strategy(self.engine, prompt_ids, local, cfg.group_size, cfg.max_new_tokens, self.sampling_params, info)
            rollout.meta = [self.train_rows[i] for i in local]
            self.score_text(rollout)
            keep = self.sampler.keep(rollout)  # [B] bool
            parts.append(rollout.select(keep.nonzero().flatten()))
            kept += int(keep.sum())
            if kept >= local_b:
                break
        return Rollout.concat(parts).select(list(range(min(kept, local_b))))

    def score_text(self, rollout: Rollout) -> None:
        B, G, T = rollout.shape
        lengths = rollout.mask.sum(-1)  # [B,G]
        eos = set(self.engine.eos_token_ids)
        actions, counts = rollout.actions.tolist(), lengths.tolist()  # [B][G][T], [B][G] host ints, converted once
        tokens = [[t for t in actions[b][g][: counts[b][g]] if t not in eos] for b in range(B) for g in range(G)]
        flat = self.tokenizer.batch_decode(tokens, skip_special_tokens=True) if tokens else []
        texts = [flat[b * G : (b + 1) * G] for b in range(B)]
        rollout.completions = texts
        prompts = [meta["prompt"] for meta in rollout.meta for _ in range(G)]
        columns = {key: [meta.get(key) for meta in rollout.meta for _ in range(G)] for key in rollout.meta[0] if key != "prompt"} if B else {}
        columns.update(completion_lengths=lengths.flatten().tolist(), truncated=rollout.truncated.flatten().tolist(), max_new_tokens=self.cfg.rollout.max_new_tokens)
        text_rewards = [r for r in self.rewards if not hasattr(r, "score_rollout")]
        policy = self.cfg.reward
        result = score(text_rewards, prompts, [t for row in texts for t in row], columns, on_error=policy.on_error, missing=policy.missing, timeout_s=policy.timeout_s or None)
        errors = sum(v for k, v in result.counts.items() if k.endswith("/error"))
        if errors > policy.max_error_rate * max(1, B * G):
            raise RuntimeError(f"reward functions failed on {errors} of {B * G} samples this step (reward.max_error_rate={policy.max_error_rate}): {result.counts}")
        rollout.rewards = result.total.view(B, G)  # [B,G] float32, NaN where excluded
        rollout.reward_parts = result.parts.view(B, G, -1)  # [B,G,K]
        rollout.group_valid = rollout.group_valid & torch.isfinite(rollout.rewards)  # [B,G]
        self._reward_counts = result.counts

    # ------------------------------------------------------------------ no-grad needs, scorers, advantages, weights
    def forward(self, model: Any, rollout: Rollout, want_entropy: bool) -> dict[str, torch.Tensor]:
        perf = self.cfg.perf
        return completion_logprobs(model, rollout.prompt_ids, rollout.actions, rollout.mask, rollout.group_valid, want_entropy=want_entropy,
                                   packed=perf.packed, share_prefix=None if perf.share_prefix else False, functional=perf.functional)

    def prepare(self, rollout: Rollout) -> None:
        wanted = {(n.quantity, n.model) for n in self.needs if not n.grad}
        if wanted & {("logp", "policy"), ("entropy", "policy")} or not self.old_from_first_pass:
            with torch.no_grad():
                out = self.forward(self.model, rollout, want_entropy=("entropy", "policy") in wanted)
            rollout.logp_old = out["logp"]  # [B,G,T]
            if "entropy" in out:
                rollout.set_extra("entropy", out["entropy"], "token")
        if ("logp", "ref") in wanted:
            with torch.no_grad(), self.reference.model() as ref:
                rollout.logp_ref = self.forward(ref, rollout, want_entropy=False)["logp"]  # [B,G,T]
        for scorer in (r for r in self.rewards if hasattr(r, "score_rollout")):
            rollout.rewards = rollout.rewards + scorer.weight * scorer.score_rollout(rollout, self._info())  # [B,G]
        rollout.advantages = self._estimate_advantages(rollout)
        for shaper in self.shapers:
            rollout.advantages = shaper(rollout, self._info())
        if self.weights:
            weight = torch.ones_like(rollout.mask, dtype=torch.float32)  # [B,G,T]
            for component in self.weights:
                weight = weight * component(rollout, self._info())  # [B,G,T]
            rollout.weight = weight

    def _estimate_advantages(self, rollout: Rollout) -> torch.Tensor:
        if self.world == 1:
            return self.estimator(rollout, self._info())
        # batch-level statistics must see every rank's groups: estimate on the gathered rewards
        rewards = dist.all_gather_rows(rollout.rewards)  # [W*b,G]
        valid = dist.all_gather_rows(rollout.group_valid)  # [W*b,G]
        everyone = Rollout([], torch.zeros(*rewards.shape, 1, dtype=torch.long), valid[..., None], valid, torch.zeros_like(valid), torch.zeros(rewards.shape[0], dtype=torch.long), rewards=rewards)
        adv = self.estimator(everyone, self._info())  # [W*b,G]
        b, start = rollout.rewards.shape[0], dist.rank_offset(rollout.rewards.shape[0])
        return adv[start : start + b]

    # ------------------------------------------------------------------ stage 5–6: μ epochs of micro-batched updates
    def update(self, rollout: Rollout) -> dict[str, float]:
        cfg = self.cfg.train
        B = rollout.shape[0]
        stats: list[dict[str, float]] = []
        self._entropy = [0.0, 0.0]  # masked sum, count: logged every step
        self._first_pass_logp = None
        for epoch in range(cfg.epochs):
            order = torch.randperm(B, generator=torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.step * 101 + epoch)) if cfg.epochs > 1 or cfg.minibatches > 1 else torch.arange(B)
            if epoch == 1 and rollout.logp_old is None:
                rollout.logp_old = self._first_pass_logp  # [B,G,T] recorded by epoch 0
            for mb_groups in torch.tensor_split(order, cfg.minibatches):
                batch = rollout.select(mb_groups)
                if batch.logp_old is None:  # epoch 0 of a single mini-batch: its own forward gives the old log-probs
                    self._first_pass_logp = torch.zeros_like(rollout.mask, dtype=torch.float32)  # [B,G,T]
                    self._first_pass_groups = mb_groups
                if not int(dist.all_reduce_sum(self.objective.loss_mask(batch).sum())):
                    stats.append({"loss": 0.0, "skipped": 1.0})  # no token gets loss anywhere: leave the weights alone
                    continue
                norms = self.objective.normalizers(batch, self._info(), dist.all_reduce_sum if self.world > 1 else None)
                stats.append(self.updater.step(lambda: self._accumulate_gradients(batch, norms)))
        if rollout.logp_old is None and self._first_pass_logp is not None:
            rollout.logp_old = self._first_pass_logp  # [B,G,T] for the step's statistics
        row = {key: float(np.nanmean([s.get(key, float("nan")) for s in stats])) for key in stats[0]} if stats else {}
        row["skipped"] = float(sum(s.get("skipped", 0.0) for s in stats))
        row["nonfinite"] = float(sum(s.get("nonfinite", 0.0) for s in stats))
        reduce = dist.all_reduce_sum if self.world > 1 else None
        row.update(self.objective.pop_stats(reduce))
        entropy = torch.tensor(self._entropy, dtype=torch.float64)  # [2] masked sum, count
        entropy = reduce(entropy) if reduce else entropy
        row["entropy"] = float(entropy[0] / entropy[1].clamp(min=1.0))
        return row

    def _accumulate_gradients(self, batch: Rollout, norms: dict) -> torch.Tensor:
        size = self.cfg.train.micro_batch_groups or max(1, batch.shape[0])
        total = torch.zeros(())
        for start in range(0, batch.shape[0], size):
            mb = batch.select(list(range(start, min(start + size, batch.shape[0]))))
            out = self.forward(self.model, mb, want_entropy=True)  # entropy is logged; cheap next to the logits
            with torch.no_grad():
                self._entropy[0] += float(out["entropy"][mb.row_mask].sum())
                self._entropy[1] += float(mb.row_mask.sum())
            if mb.logp_old is None:
                mb.logp_old = out["logp"].detach()  # [b,G,T] the weights have not moved yet: ratio = 1, no extra forward
                self._first_pass_logp[self._first_pass_groups[start : start + size]] = mb.logp_old
            loss = self.objective.loss(mb, out, norms, self._info())
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
        correct = 0
        for start in range(0, len(rows), 256):
            chunk = list(range(start, min(start + 256, len(rows))))
            prompt_ids = [self._prompt_ids("eval", self.eval_rows, i) for i in chunk]
            gen = self.engine.generate(prompt_ids, 1, torch.zeros(len(chunk), dtype=torch.long), self.cfg.rollout.max_new_tokens, greedy=True)
            eos = set(self.engine.eos_token_ids)
            texts = [self.tokenizer.decode([t for t in gen.tokens[i, 0, : int(gen.lengths[i, 0])].tolist() if t not in eos], skip_special_tokens=True) for i in range(len(chunk))]
            sub = [rows[i] for i in chunk]
            columns = {k: [r.get(k) for r in sub] for k in sub[0] if k != "prompt"}
            columns.update(completion_lengths=gen.lengths[:, 0].tolist(), truncated=gen.truncated[:, 0].tolist(), max_new_tokens=self.cfg.rollout.max_new_tokens)
            values = score([self.eval_reward], [r["prompt"] for r in sub], texts, columns, on_error="exclude").total
            correct += int((values >= 1.0 - 1e-6).sum())
        return correct / len(rows)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "model": self.model.state_dict(),
            "components": [c.state_dict() if hasattr(c, "state_dict") else None for c in self._components()],
            "reference": self.reference.state_dict() if self.reference else {},
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
            "summary": self.summary,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.model.load_state_dict(state["model"])
        for component, sub in zip(self._components(), state["components"]):
            if sub is not None:
                component.load_state_dict(sub)
        if self.reference:
            self.reference.load_state_dict(state["reference"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        self.summary = state["summary"]

    def save_checkpoint(self) -> None:
        if self.rank == 0:
            checkpoint.save(self.out, self.step, self.state_dict(), self.cfg.checkpoint.keep_last)
        dist.barrier()

    # ------------------------------------------------------------------ the run
    def train(self) -> dict[str, Any]:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            (self.out / "config.toml").write_text(to_toml(to_dict(cfg)))
        resume = checkpoint.latest(self.out)
        if resume is not None:
            self.load_state_dict(checkpoint.load(resume))
        log = MetricsLog(self.out / "metrics.jsonl", self.step - 1 if resume else None) if self.rank == 0 else None
        previous = signal.signal(signal.SIGTERM, self._request_stop)
        start = time.perf_counter() - self.summary.get("wall_seconds", 0.0)
        if "accuracy_before" not in self.summary:
            self.summary["accuracy_before"] = self.evaluate()
            self.summary["evals"] = [(0, self.summary["accuracy_before"])]
        with progress_bar(self.console) if self.rank == 0 else _Quiet() as bar:
            task = bar.add_task(cfg.name, total=cfg.train.steps, completed=self.step, reward=0.0, speed=0.0)
            while self.step < cfg.train.steps and not self._stop_requested:
                row = self.run_step()
                self._skipped_in_row = self._skipped_in_row + 1 if row.get("nonfinite") else 0
                if self._skipped_in_row >= cfg.train.max_skipped_in_row:
                    raise RuntimeError(f"{self._skipped_in_row} optimiser steps in a row had a non-finite loss or gradient (train.max_skipped_in_row); stopping before anything non-finite is saved")
                if cfg.eval.every and (self.step + 1) % cfg.eval.every == 0:
                    row["eval_accuracy"] = self.evaluate()
                    self.summary["evals"].append((self.step + 1, row["eval_accuracy"]))
                if log:
                    log.write(row)
                bar.update(task, advance=1, reward=row.get("reward_mean", 0.0), speed=row.get("tokens_per_s", 0.0))
                self.step += 1
                self.summary["wall_seconds"] = time.perf_counter() - start
                over_time = cfg.train.max_seconds and self.summary["wall_seconds"] > cfg.train.max_seconds
                if (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0) or self._stop_requested or over_time:
                    self.save_checkpoint()
                if over_time:
                    break
        signal.signal(signal.SIGTERM, previous)
        if self._stop_requested:
            return self.summary
        self.summary["accuracy_after"] = self.evaluate()
        self.summary["evals"].append((self.step, self.summary["accuracy_after"]))
        self.summary.update(steps=self.step, wall_seconds=time.perf_counter() - start, skipped_updates=getattr(self.updater, "skipped", 0))
        self.save_checkpoint()
        if self.rank == 0:
            self._write_outputs(log)
        return self.summary

    def run_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        switch_modes = not self.engine.functional  # the functional maths has no dropout: skip two module-tree walks
        if switch_modes:
            self.model.eval()
        rollout = self.collect()
        t_gen = time.perf_counter() - t0
        self.prepare(rollout)
        if switch_modes:
            self.model.train()
        row: dict[str, Any] = {"step": self.step}
        groups_everywhere = int(dist.all_reduce_sum(torch.tensor(rollout.shape[0])))
        update = self.update(rollout) if groups_everywhere else {"loss": 0.0, "skipped": 1.0}  # nothing kept: no step
        row.update(_rollout_stats(rollout))  # after the update: the old log-probs may come from its first pass
        row.update(update)
        seconds = time.perf_counter() - t0
        generated = float(rollout.mask.sum())
        row.update(step_seconds=seconds, generation_seconds=t_gen, tokens_per_s=generated / seconds, reward_excluded=self._reward_counts.get("excluded", 0))
        return row

    def _request_stop(self, signum: int, frame: Any) -> None:
        self._stop_requested = True

    def _write_outputs(self, log: MetricsLog | None) -> None:
        final = self.out / "final"
        model = self.model.merge_and_unload() if hasattr(self.model, "merge_and_unload") else self.model
        model.save_pretrained(final)
        self.tokenizer.save_pretrained(final)
        finite = {k: (None if isinstance(v, float) and v != v else v) for k, v in self.summary.items()}  # NaN is not JSON
        (self.out / "summary.json").write_text(json.dumps(finite, indent=2) + "\n")
        if log is not None:
            plot_rewards(log.rows, self.summary["evals"], self.out / "reward.png")


def _rollout_stats(rollout: Rollout) -> dict[str, float]:
    """Batch statistics logged every step, over the groups of every rank."""
    from groupwise.masked import group_std, masked_mean

    valid = dist.all_gather_rows(rollout.group_valid)  # [B,G]
    rewards = torch.nan_to_num(dist.all_gather_rows(rollout.rewards))  # [B,G]
    lengths = dist.all_gather_rows(rollout.mask.sum(-1)).float()  # [B,G]
    stats = {
        "groups": valid.shape[0],
        "reward_mean": float(masked_mean(rewards, valid)),
        "reward_std": float(rewards[valid].std()) if valid.sum() > 1 else 0.0,
        "zero_std_frac": float((group_std(rewards, valid) == 0).float().mean()),
        "completion_len": float(lengths[valid].mean()) if valid.any() else 0.0,
        "truncated_frac": float(dist.all_gather_rows(rollout.truncated).float().mean()),
    }
    if rollout.logp_ref is not None and rollout.logp_old is not None:
        log_ratio = rollout.logp_ref - rollout.logp_old  # [B,G,T]
        k3 = (log_ratio.exp() - log_ratio - 1)[rollout.row_mask]  # [n]
        total = dist.all_reduce_sum(torch.stack([k3.sum(), torch.tensor(float(k3.numel()))]))  # [2]
        stats["kl"] = float(total[0] / total[1].clamp(min=1))
    return stats


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
