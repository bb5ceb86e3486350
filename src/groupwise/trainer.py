"""The GRPO step: the rollout strategy collects a scored batch → no-grad needs, advantages, token
weights → μ epochs of micro-batched updates of the composed objective (the policy, then every
further role) → observers.

``Trainer(parts)`` takes what ``build(cfg)`` built (``build.py``) and holds the state of the step:
the step count and what one step leaves for the next (the coefficients in force, the last batch).
The run around it — folder, resume, signals, checkpoints, outputs — is ``Run(trainer)`` (``run.py``);
held-out evaluation is ``HeldOut(trainer)`` (``heldout.py``).

The trainer names no variant: every choice is a component built from the config, and every
extra input a component needs is declared as a ``Need`` and computed here once.

Actors (``roles.NAME.samples = true``, ``roles.Actor``) sample their own rows: the strategy then
returns one batch per actor (``{"policy": ..., NAME: ...}``), and after the policy's step each actor
prepares, updates and observes on its own batch with its own needs and components; its logs are
``NAME/<key>``. Without actors the step is the policy's alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from groupwise import dist, roles, schedules
from groupwise.build import Parts, step_components
from groupwise.errors import ConfigError
from groupwise.objective import token_weights
from groupwise.rollout.context import ActorIO, RolloutContext
from groupwise.types import Rollout, StepInfo


class Trainer:
    """One RL step at a time: ``collect`` → ``prepare`` → ``update`` → ``observe`` (``run_step``)."""

    def __init__(self, parts: Parts):
        if not isinstance(parts, Parts):
            raise TypeError(
                f"Trainer takes the Parts that build(cfg) returns (from groupwise.build import build), "
                f"not a {type(parts).__name__}: Trainer(build(cfg)) for the step alone, "
                f"groupwise.Run.from_config(cfg) for a whole run"
            )
        self.parts, self.cfg = parts, parts.cfg
        self.rank, self.world = parts.rank, parts.world
        # what the step uses of the parts (the policy's module and tokenizer: policy.module, policy.tokenizer)
        self.policy, self.prompts, self.train_rows = parts.policy, parts.prompts, parts.train_rows
        self.sampling_params, self.prompt_stats, self.needs = parts.sampling_params, parts.prompt_stats, parts.needs
        self.strategy, self.sampler, self.reward_stage = parts.strategy, parts.sampler, parts.reward_stage
        self.estimator, self.shapers, self.weights = parts.estimator, parts.shapers, parts.weights
        self.objective, self.updater, self.params = parts.objective, parts.updater, parts.params
        self.roles, self.grad_quantities = parts.roles, parts.grad_quantities
        self.round_needs, self.step_needs = parts.round_needs, parts.step_needs
        self.actors = parts.actors  # roles that sample their own rows, by name
        # what rollouts generate with: the policy, or a generation-server view of it (rollout.backend)
        self.generation = parts.generation if parts.generation is not None else parts.policy
        # the state of the step
        self.step = 0
        self.last_batch: Rollout | None = None  # the last step's whole batch (the run logs its samples)
        self.coefficients: dict[str, float] = {}  # this step's scheduled coefficients and components' step_stats
        self.finite_reward_frac = 1.0  # the share of this step's scored rows with a finite reward
        self._entropy = [0.0, 0.0]  # masked sum, count of the training forward's entropy (logged)

    @property
    def main(self) -> roles.Trainable:
        """The trainer's own policy as a trainable role (built from the current attributes)."""
        return roles.Trainable("policy", self.policy, self.objective, self.updater, self.grad_quantities)

    def components(self) -> list[Any]:
        """The policy's step components, in the order checkpoints name their states by."""
        return step_components(
            self.strategy,
            self.sampler,
            self.reward_stage,
            self.estimator,
            self.shapers,
            self.weights,
            self.objective,
            self.updater,
        )

    def info(self, round_: int = 0) -> StepInfo:
        """What a component is told of the current step (``round_``: the strategy's scoring round)."""
        return StepInfo(
            self.step,
            self.cfg.seed,
            self.cfg.rollout.max_new_tokens,
            self.world,
            self.rank,
            round_,
            total_steps=self.cfg.train.steps,
            phase="rl",
            prompt_stats=self.prompt_stats,
        )

    def _share(self, batch: Rollout) -> Rollout:
        """This rank's groups of the whole batch (the batch itself at world size 1)."""
        if self.world == 1:
            return batch
        start, stop = dist.shard_bounds(batch.shape[0])
        return batch.select(list(range(start, stop)))

    # ----------------------------------------------------------------- stage 1–3: collect the step's whole scored batch
    def collect(self) -> Rollout | dict[str, Rollout]:
        """The rollout strategy collects the step's whole scored batch (identical on every rank); one
        batch per actor (``{"policy": ..., NAME: ...}``) when the run has actors."""
        ro = self.cfg.rollout
        ctx = RolloutContext(
            self.generation,
            self.sampler,
            self.reward_stage,
            lambda rollout: self.needs.fill(rollout, self.round_needs),
            lambda i: self.prompts("train", self.train_rows, i),
            lambda i: self.train_rows[i],
            self.info,
            self.sampling_params,
            ro.prompts_per_step,
            ro.group_size,
            actors={
                name: ActorIO(
                    actor.policy,
                    actor.reward_stage,
                    lambda rollout, actor=actor: actor.needs.fill(rollout, actor.round_needs),
                    lambda i, actor=actor: actor.prompts("train", self.train_rows, i),
                )
                for name, actor in self.actors.items()
            },
        )
        batch = self.strategy(ctx)
        # over every scored round: a step whose groups were all dropped still had rewards
        self.finite_reward_frac = ctx.finite_fraction
        return batch

    # ------------------------------------------------------------------ no-grad needs, schedules, advantages, weights
    def prepare(self, batch: Rollout) -> Rollout:
        """The no-grad needs (each rank scores its share, then the whole batch is gathered again),
        this step's scheduled coefficients, advantages, shapers and token weights, all on the whole
        batch. Returns the whole batch."""

        def advantages(batch: Rollout, info: StepInfo) -> None:
            batch.advantages = self.estimator(batch, info)  # [B,G] or [B,G,T]
            for shaper in self.shapers:
                batch.advantages = shaper(batch, info)
            for role in self.roles:  # each further role's own advantages, on the whole batch
                adv = roles.advantages(role, batch, info)  # [B,G] or [B,G,T]
                batch.set_extra(f"{role.name}.advantages", adv, "row" if adv.dim() == 2 else "token")

        batch, self.coefficients = self._prepare_whole(
            batch, self.needs, self.step_needs, self.components(), advantages, self.weights
        )
        return batch

    def _prepare_whole(
        self,
        batch: Rollout,
        needs: Any,
        step_needs: list,
        components: list,
        advantages: Callable[[Rollout, StepInfo], None],
        weights: list,
    ) -> tuple[Rollout, dict[str, float]]:
        """``prepare`` of one sampler's batch (the policy's, or an actor's with its own needs and
        components): the whole batch and its step statistics (scheduled coefficients, components' stats)."""
        local = self._share(batch)
        needs.fill(local, step_needs)
        batch = dist.gather_rollout(local)
        info = self.info()
        stats = schedules.resolve(components, info, batch)
        advantages(batch, info)
        if weights:
            batch.weight, counted = token_weights(weights, batch, info)  # [B,G,T], [B,G,T]
            batch.set_extra("counted", counted, "token")
        for component in components:
            # whole-batch statistics a term needs in every micro-batch (micro-batch invariance)
            if hasattr(component, "prepare"):
                component.prepare(batch, info)
            if hasattr(component, "step_stats"):
                stats.update(component.step_stats())
        return batch, stats

    def prepare_actor(self, actor: roles.Actor, batch: Rollout) -> tuple[Rollout, dict[str, float]]:
        """``prepare`` for an actor on its own batch: its no-grad needs, scheduled coefficients,
        advantages and token weights. Returns the whole batch and its step statistics."""

        def advantages(batch: Rollout, info: StepInfo) -> None:
            batch.advantages = actor.role.estimator(batch, info)  # [B,G] or [B,G,T]

        return self._prepare_whole(
            batch, actor.needs, actor.step_needs, actor.components, advantages, actor.role.weights
        )

    def step_actor(self, actor: roles.Actor, batch: Rollout) -> dict[str, float]:
        """An actor's share of the step on its own batch: prepare, update, observe. Its log row (unprefixed)."""
        if not batch.shape[0]:  # it played nothing this step
            return {"groups": 0, "loss": 0.0, "skipped": 1.0}
        batch, coefficients = self.prepare_actor(actor, batch)
        local = self._share(batch)
        actor.policy.train()
        update = self.update(local, actor.role)
        actor.policy.eval()
        row = {**_rollout_stats(local), **_reward_means(batch, actor.reward_stage.labels)}
        row.update(actor.reward_stage.pop_metrics())
        row.update(update)
        row.update(coefficients)
        info = self.info()
        for component in actor.components:
            if hasattr(component, "observe"):
                component.observe(batch, info)
        if hasattr(actor.policy, "end_step"):
            actor.policy.end_step(self.step)
        return row

    def observe(self, batch: Rollout) -> None:
        """After the update: every component that observes, then the shared per-prompt table."""
        info = self.info()
        for component in self.components():
            if hasattr(component, "observe"):
                component.observe(batch, info)
        self.prompt_stats.update(batch, info)

    # ------------------------------------------------------------------ stage 5–6: μ epochs of micro-batched updates
    def update(self, rollout: Rollout, role: Any = None) -> dict[str, float]:
        """μ epochs of micro-batched updates of ``role`` (default: the trainer's own policy) on this rank's share."""
        role = role or self.main
        cfg = self.cfg.train
        B = rollout.shape[0]
        stats: list[dict[str, float]] = []
        self._entropy = [0.0, 0.0]  # masked sum, count: logged every step
        for epoch in range(cfg.epochs):
            order = (
                torch.randperm(
                    B, generator=torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.step * 101 + epoch)
                )
                if cfg.epochs > 1 or cfg.minibatches > 1
                else torch.arange(B)
            )
            for mb_groups in torch.tensor_split(order, cfg.minibatches):
                batch = rollout.select(mb_groups)
                if not int(dist.all_reduce_sum(role.objective.loss_mask(batch).sum())):
                    stats.append({"loss": 0.0, "skipped": 1.0})  # no token gets loss anywhere: leave the weights alone
                    continue
                norms = role.objective.normalizers(batch, self.info(), dist.all_reduce_sum if self.world > 1 else None)
                stats.append(role.updater.step(self._closure(batch, norms, role)))
                if rollout.logp_old is None and batch.logp_old is not None:  # epoch 0 of one mini-batch filled them
                    # [B,G,T]
                    rollout.logp_old = torch.zeros_like(batch.logp_old).index_copy(0, mb_groups, batch.logp_old)
        row = {key: float(np.nanmean([s.get(key, float("nan")) for s in stats])) for key in stats[0]} if stats else {}
        row["skipped"] = float(sum(s.get("skipped", 0.0) for s in stats))
        row["nonfinite"] = float(sum(s.get("nonfinite", 0.0) for s in stats))
        reduce = dist.all_reduce_sum if self.world > 1 else None
        row.update(role.objective.pop_stats(reduce))
        entropy = torch.tensor(self._entropy, dtype=torch.float64)  # [2] masked sum, count
        entropy = reduce(entropy) if reduce else entropy
        row["entropy"] = float(entropy[0] / entropy[1].clamp(min=1.0))
        return row

    def _closure(self, batch: Rollout, norms: dict, role: Any):
        """The micro-batched forward/backward of one mini-batch, safe to call any number of times:
        the old log-probs are taken once (by the first call, on the weights that sampled the rollout),
        and statistics are recorded by the first call only, so a second call after an optimiser step
        sees ratio ≠ 1 and counts nothing twice."""
        calls = 0

        def closure() -> torch.Tensor:
            nonlocal calls
            calls += 1
            return self._accumulate_gradients(batch, norms, role, first=calls == 1)

        return closure

    def _accumulate_gradients(self, batch: Rollout, norms: dict, role: Any, first: bool) -> torch.Tensor:
        size = self.cfg.train.micro_batch_groups or max(1, batch.shape[0])
        take_old = batch.logp_old is None  # epoch 0 of a single mini-batch: its own forward gives the old log-probs
        if take_old:
            batch.logp_old = torch.zeros_like(batch.mask, dtype=torch.float32)  # [b,G,T] filled below
        total = torch.zeros(())
        starts = range(0, batch.shape[0], size)
        # a sharded model's forward and backward are collectives: every rank runs as many (a rank with
        # fewer micro-batches than another runs idle passes, which add nothing)
        collective = getattr(role.policy, "collective_forward", False)
        for _ in range(dist.all_max(len(starts)) - len(starts) if collective else 0):
            role.policy.idle_pass().backward()
        for start in starts:
            groups = list(range(start, min(start + size, batch.shape[0])))
            mb = batch.select(groups)
            out = role.policy.forward(mb, role.grad_quantities)
            if first:
                with torch.no_grad():
                    self._entropy[0] += float(out["entropy"][mb.row_mask].sum())
                    self._entropy[1] += float(mb.row_mask.sum())
            if take_old:
                # [b,G,T] the weights have not moved yet: ratio = 1, no extra forward
                mb.logp_old = logp_old = out["logp"].detach()
                _present(batch.logp_old)[start : start + len(groups)] = logp_old
            loss = role.objective.loss(mb, out, norms, self.info(), record=first)
            if collective and not loss.requires_grad:  # no token of this micro-batch has a loss: still a backward
                loss = loss + 0.0 * out["logp"].sum()
            if loss.requires_grad:
                loss.backward()
            total = total + loss.detach()
        dist.all_reduce_grads(role.params)
        return dist.all_reduce_sum(total)

    def run_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.policy.eval()
        for actor in self.actors.values():
            actor.policy.eval()
        # the whole batch, identical on every rank (and each actor's own)
        batch, actor_batches = roles.actor_batches(self.collect(), self.actors, self.strategy)
        t_gen = time.perf_counter() - t0
        batch = self.prepare(batch)
        self.policy.train()
        local = self._share(batch)
        row: dict[str, Any] = {"step": self.step}
        update = self.update(local) if batch.shape[0] else {"loss": 0.0, "skipped": 1.0}  # nothing kept: no step
        row.update(_rollout_stats(local))  # after the update: the old log-probs may come from its first pass
        row.update(_reward_means(batch, self.reward_stage.labels))
        # reward functions' log_metric values, averaged over the step and ranks
        row.update(self.reward_stage.pop_metrics())
        row.update(update)
        # further roles learn from the same rollouts, behaviour = the policy's log-probs
        for role in self.roles if batch.shape[0] else ():
            # [B,G,T]
            behaviour = batch.logp_old if batch.logp_old is not None else dist.all_gather_rows(_present(local.logp_old))
            stats = self.update(self._share(roles.view(role, batch, behaviour, self.info())), role)
            row.update({f"{role.name}/{k}": v for k, v in stats.items()})
        for name, actor_batch in actor_batches.items():  # each actor on its own rows
            row.update({f"{name}/{k}": v for k, v in self.step_actor(self.actors[name], actor_batch).items()})
        row.update(self.coefficients)
        self.observe(batch)
        if hasattr(self.policy, "end_step"):  # a policy's own per-step upkeep (the reference sync)
            self.policy.end_step(self.step)
        if hasattr(self.generation, "after_step"):  # a generation backend's: push weights, generate ahead
            self.generation.after_step(self)
        if hasattr(self.generation, "pop_stats"):  # rows per staleness, dropped rows (policy/served.py)
            row.update(self.generation.pop_stats())
        self.last_batch = batch  # for samples.jsonl
        seconds = time.perf_counter() - t0
        generated = float(dist.all_reduce_sum(local.mask.sum()))
        row.update(
            step_seconds=seconds,
            generation_seconds=t_gen,
            tokens_per_s=generated / seconds,
            reward_excluded=self.reward_stage.excluded,
            reward_finite_frac=self.finite_reward_frac,
        )
        return row

    def score(self, rollout: Rollout, info: StepInfo) -> Rollout:
        """``rollout`` scored as a step's is (text rewards, the round's needs, rollout scorers, the
        weighted total): a phase's rollout (``PhaseContext.score``). The step's reward metrics are left
        as they were."""
        metrics = {k: list(v) for k, v in self.reward_stage.metrics.items()}
        self.reward_stage.score_local(rollout, info)
        self.needs.fill(rollout, self.round_needs)
        self.reward_stage.finish(rollout, info)
        self.reward_stage.metrics = metrics
        return rollout

    # ------------------------------------------------------------------ the step's state, for checkpoints
    def named_components(self) -> dict[str, Any]:
        """The components by ``stage.name`` (``#2``, ``#3`` for repeats): checkpoint states are matched by name."""
        named: dict[str, Any] = {}
        for component in self.components():
            key = (
                f"{getattr(component, 'stage', type(component).__module__)}."
                f"{getattr(component, 'registry_name', type(component).__name__)}"
            )
            k, n = key, 1
            while k in named:
                n += 1
                k = f"{key}#{n}"
            named[k] = component
        return named

    def named_schedules(self) -> dict[str, Any]:
        """Every schedule by ``<component key>.<attribute>``: controller states are matched by name."""
        return {
            f"{key}.{attr}": schedule
            for key, component in self.named_components().items()
            for attr, schedule in sorted(schedules.scheduled(component).items())
        }

    def state_dict(self) -> dict[str, Any]:
        """The step's state: the step count, the policy, every stateful component and schedule by name,
        the prompt table and each further role (its model and components). The run adds its own."""
        return {
            "step": self.step,
            "policy": self.policy.state_dict(),
            "components": {
                key: c.state_dict() for key, c in self.named_components().items() if hasattr(c, "state_dict")
            },
            "schedules": {key: s.state_dict() for key, s in self.named_schedules().items() if hasattr(s, "state_dict")},
            "prompt_stats": self.prompt_stats.state_dict(),
            "roles": {
                r.name: {
                    "policy": r.policy.state_dict(),
                    "components": [c.state_dict() if hasattr(c, "state_dict") else None for c in r.components],
                }
                for r in self.roles
            },
            **(
                {"rollout": self.generation.rollout_state()} if hasattr(self.generation, "rollout_state") else {}
            ),  # in-flight rollouts of a generation backend
            **({"actors": {name: actor.state_dict() for name, actor in self.actors.items()}} if self.actors else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The state ``state_dict`` returned; another set of stateful components, schedules or roles
        than this configuration builds is refused, naming both."""
        self.step = state["step"]
        self.policy.load_state_dict(state["policy"])
        named = {key: c for key, c in self.named_components().items() if hasattr(c, "state_dict")}
        if sorted(named) != sorted(state["components"]):
            raise ConfigError(
                f"the checkpoint holds the states of components {sorted(state['components'])}, "
                f"this configuration builds {sorted(named)}; resume with the components the "
                "run started with, or train into a new folder with out=..."
            )
        for key, component in named.items():
            component.load_state_dict(state["components"][key])
        self._load_schedules(state.get("schedules", {}))
        # the values in force before the resumed run's first resolve (a reward scored before it): the last step's
        last = StepInfo(
            max(self.step - 1, 0),
            self.cfg.seed,
            self.cfg.rollout.max_new_tokens,
            self.world,
            self.rank,
            total_steps=self.cfg.train.steps,
        )
        for component in self.components():
            for attr, schedule in schedules.scheduled(component).items():
                setattr(component, attr, schedule.start() if hasattr(schedule, "state_dict") else schedule(last, None))
        if "prompt_stats" in state:
            self.prompt_stats.load_state_dict(state["prompt_stats"])
        if sorted(state.get("roles", {})) != sorted(r.name for r in self.roles):
            raise ConfigError(
                f"the checkpoint holds roles {sorted(state.get('roles', {}))}, "
                f"this configuration builds {[r.name for r in self.roles]}"
            )
        if hasattr(self.generation, "load_rollout_state"):
            self.generation.load_rollout_state(state.get("rollout", {}), self.step)
        for role in self.roles:
            saved = state["roles"][role.name]
            role.policy.load_state_dict(saved["policy"])
            for component, sub in zip(role.components, saved["components"], strict=True):
                if sub is not None:
                    component.load_state_dict(sub)
        if sorted(state.get("actors", {})) != sorted(self.actors):
            raise ConfigError(
                f"the checkpoint holds actors {sorted(state.get('actors', {}))}, "
                f"this configuration builds {sorted(self.actors)} (roles.NAME.samples = true)"
            )
        for name, actor in self.actors.items():
            actor.load_state_dict(state["actors"][name])

    def _load_schedules(self, saved: dict[str, Any] | list[Any]) -> None:
        """The controllers' states by name; another set of stateful schedules is refused, naming both."""
        if isinstance(saved, list):  # a checkpoint from before states were named: by position
            for schedule, sub in zip(schedules.all_schedules(self.components()), saved):
                if sub is not None:
                    schedule.load_state_dict(sub)
            return
        stateful = {key: s for key, s in self.named_schedules().items() if hasattr(s, "state_dict")}
        if sorted(stateful) != sorted(saved):
            raise ConfigError(
                f"the checkpoint holds the states of the scheduled coefficients {sorted(saved)}, this "
                f"configuration schedules {sorted(stateful)} with a stateful controller; resume with the "
                f"schedules the run started with, or train into a new folder with out=..."
            )
        for key, schedule in stateful.items():
            try:
                schedule.load_state_dict(saved[key])
            except ConfigError as err:
                raise ConfigError(f"{key}: {err}") from None


def _rollout_stats(rollout: Rollout) -> dict[str, float]:
    """Batch statistics logged every step, over the groups of every rank."""
    from groupwise.masked import group_std, masked_mean

    valid = dist.all_gather_rows(rollout.group_valid)  # [B,G]
    # [B,G] float64: rewards near 3e38 square to inf in float32
    rewards = torch.nan_to_num(dist.all_gather_rows(_present(rollout.rewards))).double()
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


def _present(x: torch.Tensor | None) -> torch.Tensor:
    """``x``, which the step has filled by the time it is read (rewards after scoring, log-probs after the forward)."""
    if x is None:
        raise RuntimeError("a rollout field was read before the step filled it")
    return x


def _reward_means(batch: Rollout, labels: list[str]) -> dict[str, float]:
    """``reward/<label>``: each reward function's own (unweighted) mean over the step's rows with a verdict."""
    out = {}
    # [B,G] excluded rows too: their other parts count
    real = batch.group_valid | ~torch.isfinite(_present(batch.rewards))
    for k, label in enumerate(labels):
        part = _present(batch.reward_parts)[..., k]  # [B,G]
        seen = real & torch.isfinite(part)  # [B,G]
        out[f"reward/{label}"] = float(part[seen].double().mean()) if seen.any() else float("nan")
    return out
