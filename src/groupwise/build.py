"""The composition root: ``build(cfg)`` builds everything a run is made of and returns it as one
``Parts``: the policy, the rows and their prompts, the component of every stage, the further and
frozen roles, the needs, the held-out views and tasks, and the phases. Every build-time check runs
here, in the order below, so a bad configuration fails before a single step.

``Trainer(parts)`` is the step (``trainer.py``), ``HeldOut(trainer)`` the held-out evaluation
(``heldout.py``) and ``Run(trainer)`` the run around them (``run.py``); ``Run.from_config(cfg)`` is
the three at once. The order of the steps below is the order in which random numbers are drawn
(LoRA initialisation, a role's model, a view's own state): it is part of what makes a run reproducible.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

import torch

from groupwise import dist, roles, schedules
from groupwise.components import bind_models, bind_parameter_names, bind_rows, bind_vocabulary
from groupwise.config import Config, entry_name, toml_value
from groupwise.errors import ConfigError
from groupwise.needs import NeedResolver
from groupwise.objective import Objective
from groupwise.phases import build_phases, check_artifacts
from groupwise.policy import sharding
from groupwise.policy.kinds import build_policy
from groupwise.policy.memory import keep_freed_memory
from groupwise.registry import build as build_component
from groupwise.registry import build_spec, lookup
from groupwise.rewards.stage import RewardStage
from groupwise.rollout.context import check_strategy
from groupwise.stats import PromptStats
from groupwise.tasks import get_task, load_splits
from groupwise.types import Need


class Prompts:
    """The policy's prompt ids of a row: ``prompts(split, rows, index, view=None)``, encoded once per
    ``(split, index)`` (``split@view`` under one of ``eval.views``), in the chat form when
    ``data.system_prompt`` is set, and checked against the model's context."""

    def __init__(self, policy: Any, system_prompt: str, max_new_tokens: int):
        self.policy, self.system_prompt, self.max_new_tokens = policy, system_prompt, max_new_tokens
        self.views: dict[str, Any] = {}  # eval.views by name (set once built): what a view-edited prompt is
        self.cache: dict[tuple[str, int], list[int]] = {}

    def __call__(self, split: str, rows: list[dict], index: int, view: str | None = None) -> list[int]:
        key = (split if view is None else f"{split}@{view}", index)
        if key not in self.cache:
            prompt = rows[index]["prompt"] if view is None else self.views[view].prompt(rows[index], index)
            if self.system_prompt:  # conversational form: the chat template renders the system message
                turns = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
                prompt = [{"role": "system", "content": self.system_prompt}, *turns]
            ids = self.policy.encode(prompt)
            where = f"{split} row {index + 1}" + (f" under view {view!r}" if view else "")
            self.policy.check_fits(ids, self.max_new_tokens, where)
            self.cache[key] = ids
        return self.cache[key]


@dataclass
class Parts:
    """Everything ``build`` makes, bound and checked. The trainer, the held-out evaluation and the run
    read what they use of it by name; nothing else of the run is built anywhere else."""

    cfg: Config
    rank: int
    world: int
    policy: Any  # the trained policy (components.Policy); its module and tokenizer: policy.module, policy.tokenizer
    train_rows: list[dict]
    eval_rows: list[dict]
    rows_skipped: dict[str, int]  # split -> rows dropped by data.on_bad_row="skip"
    prompts: Prompts
    sampling_params: dict[str, Any]  # the rollout's sampling settings
    strategy: Any  # stage rollout
    sampler: Any  # stage sampling, bound to the train rows
    reward_stage: RewardStage  # the run's rewards
    eval_stage: RewardStage  # the held-out reward (failures excluded, counted as wrong)
    estimator: Any  # stage advantage
    shapers: list[Any]  # advantage shapers, in order
    weights: list[Any]  # stage weight (token weights)
    objective: Objective
    updater: Any  # stage update, bound to the policy's parameters
    prompt_stats: PromptStats  # the shared per-prompt table
    roles: list[roles.Trainable]  # further trained models (roles.NAME)
    frozen: dict[str, Any]  # frozen roles' policies by name: they serve needs only
    needs: NeedResolver
    round_needs: list[Need]  # no-grad needs the rollout scorers read (each scored round, before the sampler's keep)
    step_needs: list[Need]  # every no-grad need (once per step, before the advantages)
    grad_quantities: list[str]  # what the policy's training forward computes (entropy is logged)
    params: list[torch.Tensor]  # the policy's trained parameters
    eval_views: dict[str, Any]  # eval.views: held-out prompts also scored under these
    eval_tasks: dict[str, tuple[list[dict], RewardStage]]  # eval.tasks: (rows, reward stage) of further tasks
    closed_loop: bool  # held-out rows are episodes the strategy plays (eval.closed_loop resolved; heldout.py)
    phases: list[Any]  # what runs before the RL steps, in order
    # what the rollout stage generates with: the policy itself (rollout.backend="local") or a ServedPolicy over it
    # (policy/served.py: generation servers, weight pushes, train.max_staleness)
    generation: Any = None
    actors: dict[str, roles.Actor] = dataclasses.field(default_factory=dict)  # roles that sample (samples = true)


def step_components(
    strategy: Any,
    sampler: Any,
    reward_stage: RewardStage,
    estimator: Any,
    shapers: list[Any],
    weights: list[Any],
    objective: Objective,
    updater: Any,
) -> list[Any]:
    """The components of the policy's step, in the one order that checkpoints name their states by."""
    return [strategy, sampler, *reward_stage.scorers, estimator, *shapers, *weights, *objective.terms, updater]


def build(cfg: Config) -> Parts:
    """Build and check everything the run of ``cfg`` is made of (module docstring)."""
    rank, world = dist.init()
    refused = sharding.refusals(cfg) if cfg.dist.shard != "none" else []
    if refused:
        raise ConfigError("; ".join(refused))
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    if cfg.perf.keep_freed_memory:
        keep_freed_memory()  # process-wide: activation-sized blocks are reused, not faulted in afresh each step
    ro, max_new = cfg.rollout, cfg.rollout.max_new_tokens

    # before the model loads (which can take a minute): the data, the rewards, the rollout strategy and the
    # envs it plays, so a bad file, reward or env name fails at once. None of them draws from torch's RNG.
    train_rows, eval_rows, task_reward = load_splits(
        cfg.data, cfg.seed, own_rewards=bool(cfg.rewards), eval_needs_answer=eval_needs_answer(cfg)
    )

    def decode(rollout: Any) -> list[list[str]]:  # the policy's, once it is loaded below
        return policy.decode(rollout)

    reward_stage = RewardStage(cfg.rewards or [task_reward], cfg.reward, decode, max_new)
    # held-out scoring never stops a run: a failed eval reward excludes its sample (counted as wrong)
    eval_stage = RewardStage([cfg.eval.reward or task_reward], _eval_reward_cfg(cfg), decode, max_new)
    strategy = build_component("rollout", ro.name, **ro.params)
    bind_rows([strategy], train_rows)  # an env strategy checks its envs here (use_rows: again below, on the kept rows)

    policy = build_policy(cfg.model, cfg.perf)
    # a prompt that cannot fit the model's context is a bad row too
    prompts = Prompts(policy, cfg.data.system_prompt, max_new)
    rows_skipped: dict[str, int] = {}
    if cfg.data.on_bad_row == "skip":
        train_rows = fitting_rows(policy, "train", train_rows, max_new, rows_skipped)
        eval_rows = fitting_rows(policy, "eval", eval_rows, max_new, rows_skipped)
    if ro.prompts_per_step % world:
        raise ConfigError(f"rollout.prompts_per_step={ro.prompts_per_step} must divide by the world size {world}")
    sampling_params = {"temperature": ro.temperature, "top_p": ro.top_p, "top_k": ro.top_k, "max_new_tokens": max_new}

    # the policy's step: one component (or an ordered list) per stage (the strategy and rewards: above)
    sampler = build_spec("sampling", cfg.sampling)
    sampler.bind(len(train_rows), cfg.seed)
    estimator = build_spec("advantage", cfg.advantage.estimator)
    if ro.group_size < 2 and getattr(estimator, "group_relative", False):
        raise ConfigError(
            f"rollout.group_size={ro.group_size} with the group-relative advantage "
            f"{estimator.registry_name!r}: every advantage would be 0; use group_size >= 2"
        )
    columns = getattr(estimator, "reward_columns", None)  # an estimator with one weight per reward column
    if columns is not None and columns != len(reward_stage.labels):
        raise ConfigError(
            f"advantage {estimator.registry_name!r} weighs {columns} reward columns; the run has "
            f"{len(reward_stage.labels)} reward functions {reward_stage.labels}: give one weight per reward"
        )
    shapers = [build_spec("advantage", spec) for spec in cfg.advantage.shapers]
    weight_specs = list(cfg.objective.weights)
    stale = cfg.train.max_staleness > 0 or cfg.rollout.push_every > 1  # rows from older weights than they train
    if stale and cfg.rollout.backend == "server" and "sampler_is" not in [entry_name(w) for w in weight_specs]:
        weight_specs.append("sampler_is")  # asynchronous rows come from older weights: correct for it by default
    weights = [build_spec("weight", spec) for spec in weight_specs]
    objective = Objective.from_config(cfg.objective.terms, cfg.objective.agg, weights)  # refuses bad term-weight pairs
    updater = build_spec("update", cfg.update)
    prompt_stats = PromptStats()

    # further roles train on the same rollouts; frozen ones only serve the needs that name them
    total_updates = cfg.train.steps * cfg.train.epochs * cfg.train.minibatches
    trained = [
        roles.build_role(name, rc, cfg, policy, reward_stage.labels, total_updates)
        for name, rc in cfg.roles.items()
        if not rc.frozen and not rc.samples
    ]
    frozen = {name: roles.build_frozen(name, rc, cfg, policy) for name, rc in cfg.roles.items() if rc.frozen}
    # actors sample, are scored and train on their own rows (roles.py); the strategy asks for their rows
    actors = {
        name: build_actor(name, rc, cfg, policy, cfg.rewards or [task_reward], total_updates, train_rows)
        for name, rc in cfg.roles.items()
        if rc.samples
    }
    check_actors(strategy, actors)

    # every declared need, checked against the models and views that can serve it. With one mini-batch
    # per epoch, the first epoch's forward runs on the weights that sampled the rollout: its detached
    # log-probs ARE the old log-probs (no extra no-grad pass; ratio 1 in epoch 0).
    step = step_components(strategy, sampler, reward_stage, estimator, shapers, weights, objective, updater)
    owners = [*step, *schedules.all_schedules(step)]
    needs = [n for c in owners for n in getattr(c, "needs", ())]
    needs += [] if cfg.train.minibatches == 1 else [Need("logp")]
    needs += [n for role in trained for n in roles.role_needs(role)]
    models = policy.scoring_models(with_reference=any(n.model == "ref" for n in needs))
    role_policies = dict([*((role.name, role.policy) for role in trained), *frozen.items()])
    models.update({name: p.scoring_models(with_reference=False)["policy"] for name, p in role_policies.items()})
    resolver = policy_resolver(
        needs,
        models,
        cfg,
        policy,
        train_rows,
        score_of={name: p.score for name, p in role_policies.items()},  # each role's model by its own policy
        quantities_of={name: getattr(p, "quantities", None) for name, p in role_policies.items()},
    )

    # held-out prompts are also scored under eval.views, and on the held-out rows of eval.tasks
    eval_views = {name: eval_view(resolver, name) for name in cfg.eval.views}
    prompts.views = eval_views
    eval_tasks = {name: eval_task(cfg, policy, name) for name in cfg.eval.tasks}
    closed_loop = closed_loop_eval(cfg, strategy, task_reward)
    task_scorers = [s for _, stage in eval_tasks.values() for s in stage.scorers]
    role_components = [c for r in trained for c in r.components]

    # each component against the policy it will run with, before anything runs
    check_policy_fit(owners + eval_stage.scorers + task_scorers + role_components, policy, cfg.model.policy)
    generation = served_policy(cfg, policy, world)
    # sampling options it asks for, hooks, extras others read (the actors' trained components too; their rewards
    # are the policy's)
    check_strategy(strategy, generation, owners + [c for actor in actors.values() for c in actor.role.components])
    unknown = set(cfg.eval.sampling) - set(getattr(policy, "request_options", ()))
    if unknown:  # the held-out calls' own settings: keys the policy's requests may set
        raise ConfigError(
            f"eval.sampling sets {sorted(unknown)}, which the {policy.modality} policy does not take "
            f"(it takes {sorted(getattr(policy, 'request_options', ()))})"
        )
    bind_vocabulary(owners + role_components, policy)  # token texts for phase / role maps
    bind_rows(owners, train_rows)  # components that draw from or index the train rows (components.py)
    bind_models(owners + eval_stage.scorers + task_scorers, frozen)  # frozen roles' policies (a judge)
    phases = build_phases(cfg.phases)  # what runs before the RL steps (run.py), and the artifacts it makes
    check_artifacts(phases, owners)

    scorer_needs = set(reward_stage.needs)
    if sharding.wanted(cfg, world):  # after the reference copy was taken whole, before the optimiser sees parameters
        policy.shard()
    params = policy.parameters()
    updater.bind(params, total_updates)
    bind_parameter_names(updater, policy)  # an updater that treats parameters by name (a LoRA-B mask)
    return Parts(
        cfg=cfg,
        rank=rank,
        world=world,
        policy=policy,
        train_rows=train_rows,
        eval_rows=eval_rows,
        rows_skipped=rows_skipped,
        prompts=prompts,
        sampling_params=sampling_params,
        strategy=strategy,
        sampler=sampler,
        reward_stage=reward_stage,
        eval_stage=eval_stage,
        estimator=estimator,
        shapers=shapers,
        weights=weights,
        objective=objective,
        updater=updater,
        prompt_stats=prompt_stats,
        roles=trained,
        frozen=frozen,
        needs=resolver,
        round_needs=[n for n in needs if not n.grad and n in scorer_needs],  # before dynamic sampling's keep
        step_needs=[n for n in needs if not n.grad],
        grad_quantities=sorted({n.quantity for n in needs if n.grad} | {"entropy"}),  # entropy is logged
        params=params,
        eval_views=eval_views,
        eval_tasks=eval_tasks,
        closed_loop=closed_loop,
        phases=phases,
        generation=generation,
        actors=actors,
    )


def check_actors(strategy: Any, actors: dict[str, Any]) -> None:
    """The strategy samples with exactly the run's actors (its ``samples_with``)."""
    name = getattr(strategy, "registry_name", type(strategy).__name__)
    wanted = sorted(getattr(strategy, "samples_with", ()))
    if wanted != sorted(actors):
        raise ConfigError(
            f"rollout strategy {name!r} samples with the actors {wanted}; the run's actors (roles.NAME.samples = "
            f"true) are {sorted(actors)}: add a role for each it samples with, and no other"
        )


def build_actor(
    name: str, rc: Any, cfg: Config, main_policy: Any, reward_specs: list, total_updates: int, train_rows: list[dict]
) -> roles.Actor:
    """Actor ``roles.NAME`` (``samples = true``): its trainable parts, its prompt encoding, the run's
    rewards decoding its rows, and its own needs (``policy`` = its model), each checked as the policy's are."""
    if cfg.rollout.backend != "local":
        raise ConfigError(
            f"roles.{name}.samples = true: actors sample in the trainer's process; set rollout.backend='local' "
            f"(it is {cfg.rollout.backend!r})"
        )
    role = roles.build_role(name, rc, cfg, main_policy, [], total_updates)
    policy, max_new = role.policy, cfg.rollout.max_new_tokens
    reward_stage = RewardStage(reward_specs, cfg.reward, policy.decode, max_new)
    owners = [*reward_stage.scorers, *role.components]
    owners += schedules.all_schedules(owners)
    needs = [n for c in owners for n in getattr(c, "needs", ())]
    needs += [] if cfg.train.minibatches == 1 else [Need("logp")]
    models = policy.scoring_models(with_reference=any(n.model == "ref" for n in needs))
    resolver = policy_resolver(needs, models, cfg, policy, train_rows)
    check_policy_fit(owners, policy, rc.model.policy)
    bind_vocabulary(owners, policy)
    bind_rows(owners, train_rows)
    role.grad_quantities = sorted({n.quantity for n in needs if n.grad} | {"entropy"})
    scorer_needs = set(reward_stage.needs)
    return roles.Actor(
        role,
        Prompts(policy, cfg.data.system_prompt, max_new),
        reward_stage,
        resolver,
        round_needs=[n for n in needs if not n.grad and n in scorer_needs],
        step_needs=[n for n in needs if not n.grad],
    )


def served_policy(cfg: Config, policy: Any, world: int) -> Any:
    """What rollouts generate with: the policy, or under ``rollout.backend = "server"`` a ServedPolicy over it."""
    k, ro = cfg.train.max_staleness, cfg.rollout
    if k < 0:
        raise ConfigError(f"train.max_staleness={k}: must be >= 0 (0 = synchronous)")
    if ro.backend == "local":
        if k > 0:
            raise ConfigError(
                f"train.max_staleness={k} generates ahead on a generation server; set rollout.backend='server'"
            )
        return policy
    if k > 0 and ro.push_every > 1:
        raise ConfigError(
            "train.max_staleness > 0 decides the versions rows are sampled under: leave rollout.push_every=1"
        )
    if k > 0 and world > 1:
        raise ConfigError(f"train.max_staleness={k} runs on one process; run it without torchrun (world size {world})")
    from groupwise.policy.served import ServedPolicy

    # a local server loads the run's model as the run does: its dtype, adapters, products' dtype and perf settings
    args = [f"model.matmul={toml_value(policy.matmul.dtype)}"]
    args += [f"model.{key}={toml_value(getattr(cfg.model, key))}" for key in ("dtype", "lora")]
    args += [f"perf.{k}={toml_value(v)}" for k, v in dataclasses.asdict(cfg.perf).items()]
    return ServedPolicy(policy, cfg, args)


# ---------------------------------------------------------------------------------------------- build steps
def fitting_rows(policy: Any, split: str, rows: list[dict], max_new_tokens: int, skipped: dict[str, int]) -> list[dict]:
    """The rows whose prompt plus ``max_new_tokens`` fits the policy's context (``data.on_bad_row="skip"``);
    the count dropped goes into ``skipped[split]``."""
    kept = []
    for row in rows:
        try:
            policy.check_fits(policy.encode(row["prompt"]), max_new_tokens, split)
            kept.append(row)
        except ValueError:
            continue
    if len(kept) < len(rows):
        skipped[split] = len(rows) - len(kept)
        print(
            f"groupwise: data.on_bad_row=skip: {len(rows) - len(kept)} {split} rows skipped (prompt + "
            f"max_new_tokens longer than the model's context of {policy.context})",
            file=sys.stderr,
        )
    if not kept and rows:
        raise ConfigError(
            f"every {split} prompt is longer than the model's context allows with "
            f"rollout.max_new_tokens={max_new_tokens}"
        )
    return kept


def _eval_reward_cfg(cfg: Config) -> Any:
    """The reward settings of held-out scoring: a failed reward excludes its sample, never stops the run."""
    return dataclasses.replace(cfg.reward, on_error="exclude", max_error_rate=1.0)


def eval_needs_answer(cfg: Config) -> bool:
    """Whether the held-out rows of ``data.eval_path`` need an ``answer``: when held-out evaluation
    compares with it (the default eval reward of user data, 'exact'), not with an eval.reward of
    your own or episodes played closed-loop (``closed_loop_eval``'s rule, before the strategy is built)."""
    plays = hasattr(lookup("rollout", cfg.rollout.name), "play_heldout")
    closed = cfg.eval.closed_loop if cfg.eval.closed_loop != "auto" else plays and not cfg.eval.reward
    return cfg.eval.size > 0 and not cfg.eval.reward and not closed


def closed_loop_eval(cfg: Config, strategy: Any, task_reward: str) -> bool:
    """``eval.closed_loop`` resolved: whether held-out rows are episodes the strategy plays closed-loop
    (its ``play_heldout``). "auto": yes for a strategy that can, unless an eval reward scores the first
    action (``eval.reward``, or a built-in env task's own ``env_return``: Q* of the first move)."""
    plays = hasattr(strategy, "play_heldout")
    name = getattr(strategy, "registry_name", cfg.rollout.name)
    wanted = cfg.eval.closed_loop
    if wanted == "auto":
        wanted = plays and not cfg.eval.reward and task_reward != "env_return"
    if wanted and not plays:
        raise ConfigError(
            f"eval.closed_loop=true: rollout strategy {name!r} plays no episodes to evaluate (no play_heldout); "
            f"use an environment strategy (rollout.name='episodes' or 'grow') or eval.closed_loop=false"
        )
    if wanted and cfg.eval.views:
        raise ConfigError(
            f"eval.views={cfg.eval.views}: a view edits a text prompt, and this run's held-out rows are episodes "
            f"played closed-loop (eval.closed_loop); drop eval.views or set eval.closed_loop=false"
        )
    return bool(wanted)


def eval_view(needs: NeedResolver, name: str) -> Any:
    """``eval.views`` entry ``name``: a built view that edits only the prompt (``prompt(meta, key)``)."""
    view = needs.view(name)
    if not hasattr(view, "prompt"):
        raise ConfigError(
            f"eval.views: view {name!r} edits more than the prompt (no prompt(meta, key)); held-out "
            f"prompts can only be scored under views that edit the prompt, e.g. corrupt_context or "
            f"ground_truth"
        )
    return view


def eval_task(cfg: Config, policy: Any, name: str) -> tuple[list[dict], RewardStage]:
    """``eval.tasks`` entry ``name``: the built-in task's first ``eval.size`` held-out rows and a
    reward stage of its own default reward (failures excluded and counted as wrong, as eval's)."""
    task = get_task(name)
    stage = RewardStage([task.reward], _eval_reward_cfg(cfg), policy.decode, cfg.rollout.max_new_tokens)
    return task.rows("test", 0, cfg.seed)[: cfg.eval.size], stage


def policy_resolver(
    needs: list[Need], models: dict, cfg: Config, policy: Any, train_rows: list[dict], **per_model: Any
) -> NeedResolver:
    """The needs of a run (or of an actor: ``policy`` is then the actor's), scored by ``policy``; its
    views read the policy's token texts and the train rows. ``per_model``: ``score_of`` / ``quantities_of``."""

    def bind_view(view: Any) -> None:  # what a view reads besides the rollout: token texts, the train rows
        bind_vocabulary([view], policy)
        bind_rows([view], train_rows)

    return NeedResolver(
        needs,
        models,
        cfg.views,
        policy.score,
        policy.encode,
        context=policy.context,
        bind_view=bind_view,
        quantities=getattr(policy, "quantities", None),
        **per_model,
    )


def check_policy_fit(components: list[Any], policy: Any, kind: str) -> None:
    """A component that declares ``reads_extras`` runs on any policy that writes those extras (the
    policy's ``row_extras`` / ``token_extras``); one that declares only a ``modality`` runs on policies of
    that modality; one that ``reads_sampler_logp`` needs a policy whose ``logp_sampler`` is the sampler's own
    log-prob (``sampler_logp``, "exact" when absent). Another fails here, not mid-run."""
    written = {*getattr(policy, "row_extras", ()), *getattr(policy, "token_extras", ())}
    for component in components:
        name = getattr(component, "registry_name", type(component).__name__)
        reads = getattr(component, "reads_extras", None)
        if reads is not None:
            missing = [extra for extra in reads if extra not in written]
            if missing:
                raise ConfigError(
                    f"{getattr(component, 'stage', '')} component {name!r} reads the rollout extras {missing}, which "
                    f"the {policy.modality} policy (model.policy={kind!r}) does not write (it writes "
                    f"{sorted(written) or 'none'}); choose a model.policy whose kind writes them, or drop {name!r}"
                )
        if getattr(component, "reads_sampler_logp", False) and getattr(policy, "sampler_logp", "exact") != "exact":
            raise ConfigError(
                f"{getattr(component, 'stage', '')} component {name!r} reads logp_sampler as the sampler's log-prob "
                f"(an importance ratio to the sampler); the {policy.modality} policy (model.policy={kind!r}) stores "
                f"an {policy.sampler_logp} there, so the ratio would measure nothing; drop {name!r} or its "
                "sampler option"
            )
        if reads is None and getattr(component, "modality", policy.modality) != policy.modality:
            raise ConfigError(
                f"{getattr(component, 'stage', '')} component {name!r} works on {component.modality} "
                f"policies; this run's policy is {policy.modality} (model.policy={kind!r})"
            )
