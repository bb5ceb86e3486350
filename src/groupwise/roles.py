"""Trainable roles: what one optimiser trains — a policy, its objective, its updater.

The trainer holds its own policy as the role ``policy`` and, for each ``roles.NAME`` of the
config, a further role trained on the same rollouts (CoDistill-GRPO's large model learns from the
small model's samples). Such a role shares the policy's tokenizer; it does not sample. Each step,
after the policy's update, it trains on a *view* of the step's batch:

- ``rewards``: the weighted sum of the reward functions it names (``roles.NAME.rewards``; all of
  them by default), so a reward that only the policy should see (a KD term) can be left out;
- ``advantages``: its own estimator on those rewards (computed on the whole batch in ``prepare``);
- ``logp_old``: its own no-grad log-probs (``Need("logp", model=NAME)``);
- ``logp_sampler``: the policy's log-probs — the behaviour policy that sampled the rows — so an
  importance weight (``sampler_is``) corrects for learning off-policy.

Its components' needs of ``model="policy"`` are read from its own model; ``ref`` is not offered.

A role with ``samples = true`` is an **actor** (``Actor``): it samples its own rows with its own
policy, tokenizer and prompt encoding (the rollout strategy asks for them: ``ctx.rollout(...,
actor=NAME)``), is scored by the run's rewards decoded with its own tokenizer, and trains on its own
batch with its estimator, weights, objective and updater; its needs of ``model="policy"`` mean its
own model (its own ``NeedResolver``). It may have another tokenizer than the policy's (text moves
between the two through ``groupwise.tokens``).

A role with ``frozen = true`` is not trained and has no components: its model only serves the needs
that name it (``Need("logp", model="teacher")``: a fixed teacher, a judge, an embedder), and it is
not checkpointed (it never changes; a resumed run loads it from ``model.path`` again).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from groupwise import dist, schedules
from groupwise.components import bind_parameter_names
from groupwise.errors import ConfigError
from groupwise.objective import Objective, token_weights
from groupwise.policy import sharding
from groupwise.policy.kinds import build_policy
from groupwise.registry import build_spec
from groupwise.rewards.score import combine
from groupwise.types import Need, Rollout, StepInfo


@dataclass
class Trainable:
    """What one optimiser step trains (the trainer's own policy is one too)."""

    name: str
    policy: Any
    objective: Objective
    updater: Any
    grad_quantities: list[str]
    estimator: Any = None
    weights: list = field(default_factory=list)
    reward_columns: list[int] | None = None  # columns of reward_parts that make its reward (None: the policy's total)

    @property
    def params(self) -> list:
        return self.policy.parameters()

    @property
    def components(self) -> list:
        return [self.estimator, *self.weights, *self.objective.terms, self.updater]


@dataclass
class Actor:
    """A role that samples (module docstring): the trainable parts, and what its rows are sampled,
    scored and prepared with."""

    role: Trainable
    prompts: Any  # build.Prompts over its own policy: a train row's prompt in its encoding
    reward_stage: Any  # the run's rewards, decoding its rows with its tokenizer
    needs: Any  # its NeedResolver ("policy" = its own model)
    round_needs: list[Need]  # the needs its rollout scorers read (each scored round)
    step_needs: list[Need]  # every no-grad need (once per step, before its advantages)

    @property
    def name(self) -> str:
        return self.role.name

    @property
    def policy(self) -> Any:
        return self.role.policy

    @property
    def components(self) -> list:
        """Its stateful parts, in the order its checkpoint lists their states."""
        return [*self.reward_stage.scorers, *self.role.components]

    def state_dict(self) -> dict[str, Any]:
        """Its model, its stateful components' and schedules' states (by position)."""
        return {
            "policy": self.policy.state_dict(),
            "components": [c.state_dict() if hasattr(c, "state_dict") else None for c in self.components],
            "schedules": [
                s.state_dict() if hasattr(s, "state_dict") else None for s in schedules.all_schedules(self.components)
            ],
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.policy.load_state_dict(saved["policy"])
        for component, sub in zip(self.components, saved["components"], strict=True):
            if sub is not None:
                component.load_state_dict(sub)
        for schedule, sub in zip(schedules.all_schedules(self.components), saved["schedules"], strict=True):
            if sub is not None:
                schedule.load_state_dict(sub)


def actor_batches(
    collected: Rollout | dict[str, Rollout], actors: dict[str, Actor], strategy: Any
) -> tuple[Rollout, dict[str, Rollout]]:
    """The policy's batch and each actor's, from what the rollout strategy returned (one batch, or one
    per actor with ``"policy"`` among them); another set of batches than the run's actors is refused."""
    name = getattr(strategy, "registry_name", type(strategy).__name__)
    if not isinstance(collected, dict):
        if actors:
            raise ConfigError(
                f"the run has actors {sorted(actors)} (roles.NAME.samples = true), and rollout strategy "
                f"{name!r} returned one batch; use a strategy that samples with actors (one batch per actor)"
            )
        return collected, {}
    if sorted(collected) != sorted(["policy", *actors]):
        raise ConfigError(
            f"rollout strategy {name!r} returned batches for {sorted(collected)}; this run's actors are "
            f"{sorted(['policy', *actors])} (one batch each, 'policy' included)"
        )
    return collected["policy"], {k: collected[k] for k in actors}


def build_frozen(name: str, cfg: Any, run_cfg: Any, main_policy: Any) -> Any:
    """A frozen role's policy: built, checked, set to eval and never given to an optimiser."""
    policy = build_policy(_on_policy_device(cfg.model, run_cfg.model), run_cfg.perf)
    _check_tokenizer(name, cfg, policy, main_policy)
    for p in policy.parameters():
        p.requires_grad_(False)
    policy.eval()
    return policy


def _check_tokenizer(name: str, cfg: Any, policy: Any, main_policy: Any) -> None:
    if (
        getattr(policy, "tokenizer", None) is not None
        and policy.tokenizer.get_vocab() != main_policy.tokenizer.get_vocab()
    ):
        raise ConfigError(
            f"roles.{name}: model {cfg.model.path!r} has another tokenizer "
            "than the policy's; a role scores the policy's tokens"
        )


def _on_policy_device(model_cfg: Any, main_cfg: Any) -> Any:
    """A role's model lives where the policy's does unless its own ``model.device`` names another than cpu."""
    import dataclasses

    return (
        dataclasses.replace(model_cfg, device=main_cfg.device)
        if getattr(model_cfg, "device", "cpu") == "cpu"
        else model_cfg
    )


def build_role(
    name: str, cfg: Any, run_cfg: Any, main_policy: Any, reward_labels: list[str], total_updates: int
) -> Trainable:
    policy = build_policy(_on_policy_device(cfg.model, run_cfg.model), run_cfg.perf)
    if not cfg.samples:  # an actor scores its own tokens
        _check_tokenizer(name, cfg, policy, main_policy)
    unknown = [r for r in cfg.rewards if r not in reward_labels]
    if unknown:
        raise ConfigError(f"roles.{name}.rewards names {unknown}; the run's reward functions are {reward_labels}")
    weights = [build_spec("weight", spec) for spec in cfg.objective.weights]
    objective = Objective.from_config(cfg.objective.terms, cfg.objective.agg, weights)  # refuses bad term-weight pairs
    role = Trainable(
        name,
        policy,
        objective,
        build_spec("update", cfg.update),
        [],
        build_spec("advantage", cfg.advantage.estimator),
        weights,
        [reward_labels.index(r) for r in cfg.rewards] or None,
    )
    own = [n for c in role.components for n in getattr(c, "needs", ())]
    if any(n.model == "ref" for n in own) and not cfg.samples:
        raise ConfigError(f"roles.{name}: its components ask for the reference model, which a role does not have")
    role.grad_quantities = sorted({n.quantity for n in own if n.grad} | {"entropy"})
    if sharding.wanted(run_cfg, dist.world_size()):  # before its optimiser sees its parameters
        policy.shard()
    role.updater.bind(role.params, total_updates)
    bind_parameter_names(role.updater, role.policy)
    return role


def role_needs(role: Trainable) -> list[Need]:
    """The role's no-grad needs, ``policy`` meaning the role's own model, and its old log-probs."""
    own = [n for c in role.components for n in getattr(c, "needs", ()) if not n.grad]
    return [dataclasses.replace(n, model=role.name) if n.model == "policy" else n for n in own] + [
        Need("logp", model=role.name)
    ]


def role_rewards(role: Trainable, batch: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards [B,G], valid [B,G]) of the role: its reward columns, weighted, or the policy's total."""
    if role.reward_columns is None or batch.shape[0] == 0:  # the policy's total (or nothing kept this step)
        return batch.rewards, batch.group_valid
    cols = role.reward_columns
    weights = batch.extras["reward_weights"][0, cols].tolist()
    total, excluded = combine(
        batch.reward_parts[..., cols], weights, torch.zeros(batch.group_valid.shape, dtype=torch.bool)
    )  # [B,G], [B,G]
    return total, batch.group_valid & ~excluded


def advantages(role: Trainable, batch: Rollout, info: StepInfo) -> torch.Tensor:
    """The role's advantages on the whole batch (its estimator on its own rewards)."""
    view = copy.copy(batch)
    view.rewards, view.group_valid = role_rewards(role, batch)
    return role.estimator(view, info)  # [B,G] or [B,G,T]


def view(role: Trainable, batch: Rollout, behaviour_logp: torch.Tensor, info: StepInfo) -> Rollout:
    """The step's batch as the role trains on it (see the module docstring)."""
    out = copy.copy(batch)
    out.extras, out.extra_levels = dict(batch.extras), dict(batch.extra_levels)
    out.rewards, out.group_valid = role_rewards(role, batch)
    out.advantages = batch.extras[f"{role.name}.advantages"]
    out.logp_old, out.logp_sampler, out.logp_ref, out.weight = (
        batch.extras[f"{role.name}.logp"],
        behaviour_logp,
        None,
        None,
    )
    for need in role_needs(role):  # its components read "policy" quantities under their usual keys
        if need.model == role.name and need.quantity != "logp":
            out.set_extra(dataclasses.replace(need, model="policy").key, batch.extras[need.key], "token")
    out.extras.pop("counted", None)  # the policy's token weights are not the role's
    out.extra_levels.pop("counted", None)
    if role.weights:
        out.weight, counted = token_weights(role.weights, out, info)  # [B,G,T], [B,G,T]
        out.set_extra("counted", counted, "token")
    return out
