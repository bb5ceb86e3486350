"""Run configuration: TOML recipes, dotted ``key=value`` overrides, validation.

A recipe is a TOML file; every section is a dataclass below, so an unknown key is an error that
names the valid ones. Component entries (``rewards``, ``objective.terms``, ...) are a registry
name or a table ``{name = "...", <param> = ...}``; their parameters are checked when the
component is built.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from groupwise.errors import ConfigError
from groupwise.validate import check_type

RECIPES = Path(__file__).resolve().parent / "recipes"  # the standard ones; a paper's: papers/NN_slug/recipes/


@dataclass
class ModelCfg:
    # "default" = the tiny model shipped in the package (a toy kind: fresh weights); or a folder / hub id (a toy kind:
    # the folder its save wrote, <path>/flow_policy.pt, gaussian_policy.pt, mdlm_policy.pt or subset_policy.pt, e.g. a
    # run's final/)
    path: str = "default"
    # float32 | bfloat16: the dtype the WEIGHTS are loaded and trained in (bfloat16 weights have no float32 master; for
    # bfloat16 products over float32 weights use `matmul`)
    dtype: str = "float32"
    # float32 | bfloat16 | auto: the dtype of the model's matrix products over float32 master weights (generation and
    # training); norms, attention softmax, log-probs, ratios, advantages and losses stay float32. auto: a GEMM probe at
    # start turns bfloat16 on where it measures >= 1.3x faster (the decision and both GFLOP/s are said and kept in
    # summary.json `matmul`)
    matmul: str = "float32"
    # cpu | cuda | cuda:N | auto (cuda when available); under torchrun each rank takes cuda:LOCAL_RANK
    device: str = "cpu"
    lora: dict = field(default_factory=dict)  # PEFT LoraConfig arguments; empty = full fine-tuning
    # lm: a Hugging Face causal LM at `path`; flow: the 2-D flow-matching toy; unified: think tokens then the flow
    # (the planner kind's think_lm planner under its old names); planner: a planner's K actions (latent: Gaussian
    # latents, think_lm: think tokens) then the flow (K4);
    # gaussian: observation -> N(mu(s), sigma^2 I); mdlm: a masked-diffusion LM sampled by iterative unmasking
    # subset: k of N items, a Plackett-Luce ranking by Gumbel-top-k
    # ar_flow: frames drawn one by one by a few-step flow over a cache of the last frames (K5; KVPO)
    # (arguments of the toy kinds in `params`)
    policy: str = "lm"
    params: dict = field(default_factory=dict)  # the non-LM policy's arguments, e.g. {steps = 10, sde = "one_shared"}
    # every N steps mix the policy into the reference: ref = α·policy + (1−α)·ref (TR-DPO; TRL sync_ref_model); 0 =
    # never
    ref_sync_every: int = 0
    ref_sync_alpha: float = 0.6  # α of that mix [CODE] TRL ref_model_mixup_alpha = 0.6


@dataclass
class DataCfg:
    task: str = "arithmetic"  # a built-in task, used when `path` is empty
    path: str = ""  # JSONL / parquet / datasets folder of user data
    columns: dict = field(default_factory=dict)  # our name -> the data's column, e.g. {prompt = "question"}
    eval_path: str = ""  # held-out data for user data (default: none)
    train_size: int = 0  # rows of the train split to use (0 = all)
    on_bad_row: str = "raise"  # raise | skip
    system_prompt: str = ""  # a system message put before every prompt (needs a tokenizer with a chat template)
    resample_eval: bool = False  # true: each seed scores its own sample of eval.size test prompts


@dataclass
class RolloutCfg:
    name: str = "sample"  # rollout strategy
    group_size: int = 8  # G completions per prompt
    prompts_per_step: int = 16  # B prompts per optimiser step (over all ranks)
    max_new_tokens: int = 16  # generation budget per completion (tokens)
    temperature: float = 1.0  # sampling temperature of the rollouts (greedy evaluation ignores it)
    top_p: float = 1.0  # nucleus sampling (1 = off)
    top_k: int = 0  # top-k sampling (0 = off)
    params: dict = field(default_factory=dict)  # extra parameters of the rollout strategy
    # local: the trainer's own engine samples; server: generation servers (`groupwise serve`, policy/served.py)
    backend: str = "local"
    servers: list = field(default_factory=list)  # server URLs, load-balanced (empty: start one local server)
    # backend server, train.max_staleness = 0: push the weights after every N-th update (rows up to N - 1 versions
    # stale; N > 1 adds the sampler_is weight)
    push_every: int = 1
    server_threads: int = 1  # the torch threads of the local server that rollout.servers = [] starts

    def __post_init__(self) -> None:
        if self.backend not in ("local", "server"):
            raise ConfigError(f"rollout.backend={self.backend!r}; choices: local, server")
        if self.servers and self.backend != "server":
            raise ConfigError("rollout.servers is set but rollout.backend='local'; set rollout.backend='server'")
        if self.push_every < 1 or self.server_threads < 1:
            raise ConfigError("rollout.push_every and rollout.server_threads must be >= 1")


@dataclass
class RewardCfg:
    # raise: a reward function that raises stops the run; exclude: its samples are excluded and counted
    on_error: str = "raise"
    missing: str = "exclude"  # None/NaN verdicts: exclude the sample (counted) or count as zero (TRL's nansum)
    timeout_s: float = 300.0  # per reward-function call: a hung reward fails the step after this (0 = no limit)
    max_error_rate: float = 0.1  # with on_error=exclude: abort when more than this share of a step's samples failed
    max_empty_steps: int = 3  # abort after this many steps in a row in which no sample had a finite reward


@dataclass
class AdvantageCfg:
    estimator: Any = "grpo"  # the advantage estimator (a component of stage advantage)
    shapers: list = field(default_factory=list)  # advantage shapers applied after the estimator, in order


@dataclass
class ObjectiveCfg:
    agg: str = "seq_mean_token_mean"  # default aggregation of every term
    # objective terms (components of stage objective), summed; an entry's rows = {extra = NAME, equals = V} restricts
    # it to the rows whose row extra NAME is V, or the tokens whose token extra NAME is V (objective.py: a KL per game
    # role; a clip per part of the planner kind's rows)
    terms: list = field(default_factory=lambda: ["ppo_clip"])
    weights: list = field(default_factory=list)  # token-weight components


@dataclass
class TrainCfg:
    steps: int = 100  # rollouts (each followed by `epochs * minibatches` optimiser steps)
    epochs: int = 1  # μ: passes over each rollout
    minibatches: int = 1  # optimiser steps per pass
    micro_batch_groups: int = 0  # groups per forward/backward (0 = the whole mini-batch)
    max_seconds: float = 0.0  # stop early after this wall time (0 = no limit)
    max_skipped_in_row: int = 5  # abort after this many optimiser steps skipped for non-finite loss/gradients
    # rollout.backend = server: generation runs up to k policy versions ahead of the update (step t samples under
    # version max(0, t - k)); rows staler than k are dropped and counted; k > 0 adds the sampler_is weight. 0 =
    # synchronous
    max_staleness: int = 0


@dataclass
class EvalCfg:
    size: int = 200  # held-out prompts scored greedily before and after training (0 = skip)
    every: int = 0  # also evaluate every N steps (0 = only before/after)
    # reward used for accuracy (default: the task's): a name, or a reward entry as in `rewards`
    # ({name = "python", fn = "my_rewards:exact"}, a "module:Class" plug-in)
    reward: str | dict = ""
    # an environment run (rollout.name = "episodes", "grow", ...): true plays each held-out row's episode
    # closed-loop, as training does (accuracy = the share of greedy episodes with a positive return, return_after =
    # their mean return; with eval.samples, mean@n / pass@k of sampled episodes and return@n); false scores one greedy
    # completion per prompt with eval.reward. "auto": closed-loop unless an eval reward scores the first action
    # (eval.reward, or a built-in env task's own env_return, Q* of the first move, as reach's recipes measure)
    closed_loop: bool | str = "auto"
    # also sample n completions per held-out prompt (rollout temperature): mean@n and pass@k (0 = greedy only)
    samples: int = 0
    pass_at: list = field(default_factory=list)  # the k of pass@k (each 1..samples; empty = [1, samples])
    # a held-out column (e.g. fobar's direction): also the accuracy of each of its values, eval_accuracy/VALUE at
    # eval.every and accuracy_after/VALUE in summary.json
    by: str = ""
    # views the held-out prompts are also scored under (prompt views, e.g. corrupt_context): logs eval_accuracy@VIEW and
    # eval_gap@VIEW (accuracy minus it) at eval.every, and accuracy_after@VIEW in summary.json
    views: list = field(default_factory=list)
    # further built-in tasks whose first eval.size held-out prompts are also scored greedily, each with its own default
    # reward (what training did to another skill): logs eval_accuracy@task:NAME and eval_nll@task:NAME (mean token NLL
    # of its answers) at eval.every, and accuracy_after@task:NAME, nll_after@task:NAME in summary.json
    tasks: list = field(default_factory=list)
    # sampling settings of the greedy held-out calls, merged over the rollout's (keys from the policy's request
    # options): e.g. {sampler = "consistency", steps = 4} deploys a flow policy with another sampler than it trained on
    sampling: dict = field(default_factory=dict)


@dataclass
class CheckpointCfg:
    every: int = 0  # steps between checkpoints (0 = by time only)
    minutes: float = 5.0  # also checkpoint when this many minutes passed since the last one (0 = off)
    keep_last: int = 2  # complete checkpoints kept (older ones pruned after a new one is published)


@dataclass
class LogCfg:
    # completions per logged step written to samples.jsonl (prompt, completion, reward, advantage); 0 = off
    samples: int = 4
    samples_every: int = 10  # steps between logged samples
    # steps between console tables of log.samples completions with their rewards and advantages (0 = off)
    table_every: int = 100
    # also log each step's metrics to: tensorboard, wandb, trackio (offline; pip install 'groupwise[NAME]');
    # metrics.jsonl is always written
    backends: list = field(default_factory=list)

    def __post_init__(self) -> None:
        from groupwise.tracking import check_backends

        check_backends(self.backends)


@dataclass
class PerfCfg:
    """Speed techniques; each one leaves the maths unchanged (tests/test_plain_path.py), so turning
    all of them off gives the plain reference path."""

    functional: bool = True  # Llama-family float32 models: groupwise's functional decoder and training forward
    share_prefix: bool = True  # a prompt's KV once per group in generation; tree attention in training where it pays
    packed: bool = True  # training forward on packed rows (no padding); false = one padded batch
    drop_finished: bool = True  # finished rows leave the decode batch
    # glibc keeps freed blocks for reuse instead of page-faulting fresh ones (policy/memory.py)
    keep_freed_memory: bool = True
    # functional training forward: each MLP recomputes gate|up in the backward (less memory, one more GEMM)
    recompute_mlp: bool = False
    # training forward: each decoder layer keeps only its input and runs again in the backward (activations of one
    # layer at a time instead of all of them; about one more forward of compute)
    activation_checkpointing: bool = False


@dataclass
class DistCfg:
    """How the ranks of a torchrun launch hold the model (docs/scaling.md)."""

    # none: every rank holds the whole model, its gradients and optimiser state (data parallel, gradients
    # all-reduced); fsdp2: each rank holds 1/W of every trained parameter, gradient and optimiser state (FSDP2
    # fully_shard per decoder layer and at the root; whole weights gathered once per rollout phase for generation)
    shard: str = "none"


@dataclass
class RoleCfg:
    """A further model (``roles.NAME``): trained on the policy's rollouts (CoDistill's large model),
    or with ``frozen = true`` a fixed model that only serves needs (``Need(model=NAME)``: a frozen
    teacher, judge or embedder). It shares the policy's tokenizer. With ``samples = true`` it is an
    actor: it samples and trains on its own rows, with its own tokenizer (Mutual RL's peer)."""

    model: ModelCfg = field(default_factory=ModelCfg)  # the role's model, as [model]
    objective: ObjectiveCfg = field(default_factory=ObjectiveCfg)  # the role's objective, as [objective]
    update: Any = field(default_factory=lambda: {"name": "adamw"})  # the role's updater (a component of stage update)
    advantage: AdvantageCfg = field(default_factory=AdvantageCfg)  # the role's advantage estimator, as [advantage]
    # labels of the reward functions whose weighted sum is this role's reward (empty: the policy's total)
    rewards: list = field(default_factory=list)
    # a fixed model that is never trained: it only serves needs of model=NAME (objective, update, advantage, rewards
    # unused)
    frozen: bool = False
    # an actor: it samples its own rows (with its own tokenizer and prompt encoding), is scored by the run's rewards
    # and trains on its own batch; the rollout strategy decides what it samples (rollout.context: actor=NAME)
    samples: bool = False

    def __post_init__(self) -> None:
        if self.frozen and self.rewards:
            raise ConfigError(
                "a frozen role is not trained: roles.NAME.rewards has no use there; remove it or set frozen = false"
            )
        if self.samples and self.frozen:
            raise ConfigError("roles.NAME: an actor (samples = true) trains on its rows; it cannot be frozen as well")
        if self.samples and self.rewards:
            raise ConfigError(
                "roles.NAME.rewards picks reward columns of the policy's rows; an actor (samples = true) is scored "
                "on its own rows by the run's rewards: remove rewards"
            )
        if isinstance(self.update, dict) and "name" not in self.update:
            self.update = {"name": "adamw", **self.update}


@dataclass
class Config:
    name: str = "grpo"  # run name (default run folder runs/<name>)
    seed: int = 0  # run seed: prompts drawn, sample noise, initialisation
    out: str = ""  # run folder (default runs/<name>)
    threads: int = 0  # torch threads (0 = torch's default)
    model: ModelCfg = field(default_factory=ModelCfg)
    data: DataCfg = field(default_factory=DataCfg)
    rollout: RolloutCfg = field(default_factory=RolloutCfg)
    sampling: Any = "uniform"  # prompt sampler (a component of stage sampling)
    rewards: list = field(default_factory=list)  # empty = the task's default reward
    reward: RewardCfg = field(default_factory=RewardCfg)  # how reward failures are handled
    advantage: AdvantageCfg = field(default_factory=AdvantageCfg)
    objective: ObjectiveCfg = field(default_factory=ObjectiveCfg)
    # the policy's updater (a component of stage update; `update.lr=...` keeps adamw)
    update: Any = field(default_factory=lambda: {"name": "adamw"})
    train: TrainCfg = field(default_factory=TrainCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)
    checkpoint: CheckpointCfg = field(default_factory=CheckpointCfg)
    log: LogCfg = field(default_factory=LogCfg)
    perf: PerfCfg = field(default_factory=PerfCfg)
    dist: DistCfg = field(default_factory=DistCfg)
    # parameters of the views needs name, e.g. {ground_truth = {template = "..."}}
    views: dict = field(default_factory=dict)
    # further trainable models by name: {teacher = {model = {...}, objective = {...}, update = {...}}}
    roles: dict = field(default_factory=dict)
    # what runs before the RL steps, in order (components of stage phase): [{name = "sft", steps = 200}]
    phases: list = field(default_factory=list)
    plugins: list = field(default_factory=list)  # your component modules, imported before any build (docs/extending.md)

    def __post_init__(self) -> None:
        if self.plugins:  # before any component is built or named (groupwise.plugins)
            from groupwise.plugins import import_plugins

            import_plugins(self.plugins)
        # `update.lr=...` alone names no component: keep the default one
        if isinstance(self.update, dict) and "name" not in self.update:
            self.update = {"name": "adamw", **self.update}
        if isinstance(self.sampling, dict) and "name" not in self.sampling:
            self.sampling = {"name": "uniform", **self.sampling}
        for name, role in list(self.roles.items()):
            if name in ("policy", "ref"):
                raise ConfigError(
                    f"roles.{name}: 'policy' and 'ref' are the trained "
                    "policy and its reference; name the role otherwise"
                )
            if isinstance(role, dict):
                self.roles[name] = _from_dict(RoleCfg, role, f"roles.{name}.")

    @property
    def out_dir(self) -> Path:
        return Path(self.out or f"runs/{self.name}")


def _from_dict(cls: type, data: dict, where: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f" (did you mean {where}{close[0]}?)" if close else ""
            raise ConfigError(f"unknown config key {where}{key!r}{hint}; valid keys: {', '.join(fields)}")
        sub = fields[key].type
        sub_cls = globals().get(sub) if isinstance(sub, str) else sub
        if dataclasses.is_dataclass(sub_cls):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {where}{key} must be a table, got {value!r}")
            value = _from_dict(sub_cls, value, f"{where}{key}.")
        else:
            check_type(f"config key {where}{key}", fields[key].type, value)
        kwargs[key] = value
    cfg = cls(**kwargs)
    for key, (test, allowed) in _RANGES.get(cls.__name__, {}).items():
        if not test(getattr(cfg, key)):
            raise ConfigError(f"config key {where}{key}={getattr(cfg, key)!r} is out of range; allowed: {allowed}")
    return cfg


_RANGES: dict[str, dict[str, tuple[Any, str]]] = {
    "RolloutCfg": {
        "group_size": (
            lambda v: v >= 1,
            "an integer >= 1 (G completions per prompt; >= 2 for a group-relative advantage)",
        ),
        "prompts_per_step": (lambda v: v >= 1, "an integer >= 1"),
        "max_new_tokens": (lambda v: v >= 1, "an integer >= 1"),
        "temperature": (lambda v: v > 0, "a number > 0 (greedy decoding is eval's, not the rollout's)"),
        "top_p": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
        "top_k": (lambda v: v >= 0, "an integer >= 0 (0 = off)"),
    },
    "TrainCfg": {
        "steps": (lambda v: v >= 0, "an integer >= 0"),
        "epochs": (lambda v: v >= 1, "an integer >= 1"),
        "minibatches": (lambda v: v >= 1, "an integer >= 1"),
        "micro_batch_groups": (lambda v: v >= 0, "an integer >= 0 (0 = the whole mini-batch)"),
        "max_seconds": (lambda v: v >= 0, "a number >= 0 (0 = no limit)"),
    },
    "ModelCfg": {
        "ref_sync_every": (lambda v: v >= 0, "an integer >= 0 (0 = never)"),
        "ref_sync_alpha": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
        "matmul": (lambda v: v in ("float32", "bfloat16", "auto"), "one of float32, bfloat16, auto"),
    },
    "DistCfg": {"shard": (lambda v: v in ("none", "fsdp2"), "one of none, fsdp2")},
    "LogCfg": {
        "samples": (lambda v: v >= 0, "an integer >= 0 (0 = off)"),
        "samples_every": (lambda v: v >= 1, "an integer >= 1"),
        "table_every": (lambda v: v >= 0, "an integer >= 0 (0 = off)"),
    },
    "RewardCfg": {
        "timeout_s": (lambda v: v >= 0, "a number >= 0 (0 = no limit)"),
        "max_empty_steps": (lambda v: v >= 1, "an integer >= 1"),
    },
    "EvalCfg": {
        "size": (lambda v: v >= 0, "an integer >= 0"),
        "every": (lambda v: v >= 0, "an integer >= 0"),
        "samples": (lambda v: v >= 0, "an integer >= 0 (0 = greedy accuracy only)"),
        "closed_loop": (lambda v: v is True or v is False or v == "auto", 'true, false or "auto"'),
    },
    "CheckpointCfg": {
        "every": (lambda v: v >= 0, "an integer >= 0"),
        "minutes": (lambda v: v >= 0, "a number >= 0 (0 = off)"),
        "keep_last": (lambda v: v >= 1, "an integer >= 1"),
    },
}


def parse_value(text: str) -> Any:
    """A TOML value (number, bool, string, array, inline table), else the raw string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(data: dict, dotted: str) -> None:
    """Set one dotted ``key=value`` in the raw config dict.

    Inside a list of component entries (``objective.terms``, ``rewards``, ``advantage.shapers``, ...)
    a path part picks one entry, by position (``objective.terms.0.eps_high=0.28``) or by its ``key``
    or registry ``name`` (``objective.terms.ppo_clip.eps_high=0.28``), so one parameter changes and
    the other entries stay. A name that no entry has appends ``{name = ...}`` (``objective.terms.kl.coef=0.1``
    adds a KL term); a name two entries share is an error asking for ``key`` or a position."""
    if "=" not in dotted:
        raise ConfigError(f"override {dotted!r} must look like key=value (e.g. train.steps=50)")
    key, text = dotted.split("=", 1)
    parts = key.strip().split(".")
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = _list_entry(node, part, ".".join(parts[:depth]))
            continue
        if part not in node:
            default = _default_at(parts[: depth + 1])
            node[part] = default if isinstance(default, list) else {}
        node = node[part]
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"override {key!r}: {part!r} is not a table")
    if isinstance(node, list):
        raise ConfigError(f"override {key!r}: name an entry's parameter, e.g. {key}.coef=..., or set the whole list")
    node[parts[-1]] = parse_value(text.strip())


def _entry_key(entry: Any) -> Any:
    return entry if isinstance(entry, str) else entry.get("key", entry.get("name")) if isinstance(entry, dict) else None


def _list_entry(entries: list, part: str, where: str) -> dict:
    """The entry of a component list that ``part`` names (made a table so a parameter can be set)."""
    if part.isdigit():
        index = int(part)
        if index >= len(entries):
            raise ConfigError(f"override {where}.{part}: {where} has {len(entries)} entries")
    else:
        matches = [i for i, entry in enumerate(entries) if _entry_key(entry) == part]
        if len(matches) > 1:
            raise ConfigError(
                f"override {where}.{part}: entries {matches} are all named "
                f"{part!r}; give them distinct `key`s or use a position"
            )
        if not matches:
            entries.append({"name": part})
            matches = [len(entries) - 1]
        index = matches[0]
    if isinstance(entries[index], str):
        entries[index] = {"name": entries[index]}
    if not isinstance(entries[index], dict):
        raise ConfigError(f"override {where}.{part}: entry {entries[index]!r} is not a component table")
    return entries[index]


def _default_at(parts: list[str]) -> Any:
    """The dataclass default at a dotted path of ``Config`` (None where there is none)."""
    cls: Any = Config
    value: Any = None
    for part in parts:
        if not dataclasses.is_dataclass(cls):
            return None
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            return None
        f = fields[part]
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        sub = f.type if not isinstance(f.type, str) else globals().get(f.type)
        cls = sub
    return copy.deepcopy(value)


def shipped_recipes() -> dict[str, Path]:
    """``{name: path}`` of every shipped recipe: ``recipes/`` (the standard ones) and each paper
    folder's ``papers/NN_slug/recipes/``; a name found twice is an error naming both files."""
    from groupwise.papers import named_files

    return named_files(RECIPES, "recipes")


def resolve_recipe(name_or_path: str | None) -> Path | None:
    if not name_or_path:
        return None
    path = Path(name_or_path)
    if path.exists():
        return path
    shipped = shipped_recipes()
    if name_or_path in shipped:
        return shipped[name_or_path]
    raise ConfigError(f"no recipe file or shipped recipe named {name_or_path!r}; shipped recipes: {', '.join(shipped)}")


def component_entries(cfg: Config) -> list[tuple[str, Any, str]]:
    """(stage, spec, where) of every component a config names, defaults included, in config order:
    sampling, rollout, rewards (the task's default when none), advantage and shapers, token weights,
    objective terms and aggregation, update, phases, the roles' own, eval views. A table's nested
    entry naming a component of the same stage (``update.inner``) is listed after it."""
    from groupwise.registry import names

    out: list[tuple[str, Any, str]] = []

    def add(stage: str, spec: Any, where: str) -> None:
        out.append((stage, spec, where))
        if isinstance(spec, dict):
            for key, value in spec.items():
                if isinstance(value, (str, dict)) and key != "name" and entry_name(value) in names(stage):
                    add(stage, value, f"{where}.{key}")

    def add_training(prefix: str, objective: ObjectiveCfg, advantage: AdvantageCfg, update: Any) -> None:
        add("advantage", advantage.estimator, f"{prefix}advantage.estimator")
        for i, spec in enumerate(advantage.shapers):
            add("advantage", spec, f"{prefix}advantage.shapers[{i}]")
        for i, spec in enumerate(objective.weights):
            add("weight", spec, f"{prefix}objective.weights[{i}]")
        for i, spec in enumerate(objective.terms):
            add("objective", spec, f"{prefix}objective.terms[{i}]")
        add("aggregation", objective.agg, f"{prefix}objective.agg")
        add("update", update, f"{prefix}update")

    add("sampling", cfg.sampling, "sampling")
    add("rollout", {"name": cfg.rollout.name, **cfg.rollout.params}, "rollout")
    if cfg.rewards:
        for i, spec in enumerate(cfg.rewards):
            add("reward", spec, f"rewards[{i}]")
    elif not cfg.data.path:
        from groupwise.tasks import get_task

        add("reward", get_task(cfg.data.task).reward, f"the default reward of task {cfg.data.task!r}")
    add_training("", cfg.objective, cfg.advantage, cfg.update)
    for i, spec in enumerate(cfg.phases):
        add("phase", spec, f"phases[{i}]")
    for name, role in cfg.roles.items():
        if not role.frozen:
            add_training(f"roles.{name}.", role.objective, role.advantage, role.update)
    if cfg.eval.reward:
        add("reward", cfg.eval.reward, "eval.reward")
    for i, spec in enumerate(cfg.eval.views):
        add("view", spec, f"eval.views[{i}]")
    return out


def entry_name(spec: Any) -> str:
    """The component name of a spec: ``"ppo_clip"`` or ``{name = "ppo_clip", ...}`` -> ``"ppo_clip"`` ("" otherwise)."""
    return spec if isinstance(spec, str) else str(spec.get("name", "")) if isinstance(spec, dict) else ""


def load_config(recipe: str | None = None, overrides: list[str] = ()) -> tuple[Config, dict]:
    """Config from a recipe (file or shipped name) plus overrides; returns it and its raw dict."""
    data: dict = {}
    path = resolve_recipe(recipe)
    if path is not None:
        # a user's recipe: its folder holds its plug-ins (groupwise.plugins)
        if not path.resolve().is_relative_to(RECIPES.parent):
            from groupwise.plugins import add_recipe_dir

            add_recipe_dir(path.resolve().parent)
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    for item in overrides:
        apply_override(data, item)
    return _from_dict(Config, data, ""), data


def with_defaults(stored: dict) -> dict:
    """A run folder's stored ``config.toml`` (as a dict) with every key it lacks set to today's default:
    a key added to groupwise after the run started (``plugins``) is not a change on resume when the
    current run leaves it at its default. Keys the stored config has are kept as they are."""

    def fill(data: dict, defaults: dict) -> dict:
        out = dict(data)
        for key, default in defaults.items():
            if key not in out:
                out[key] = default
            elif isinstance(default, dict) and isinstance(out[key], dict) and default:
                out[key] = fill(out[key], default)
        return out

    as_stored = tomllib.loads(to_toml(to_dict(Config())))  # defaults written and read back as a run folder does
    filled = fill(stored, as_stored)
    role_defaults = tomllib.loads(to_toml({"role": dataclasses.asdict(RoleCfg())}))["role"]
    if isinstance(filled.get("roles"), dict):
        filled["roles"] = {
            name: fill(role, role_defaults) if isinstance(role, dict) else role
            for name, role in filled["roles"].items()
        }
    return filled


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def changed_keys(cfg: Config, base: Config) -> list[str]:
    """``key=value`` for every config key (dotted) whose value in ``cfg`` differs from ``base``'s, in
    the order of ``groupwise config``: what the command line changed of a recipe."""

    def flat(data: dict, prefix: str = "") -> dict[str, Any]:  # sections into their keys; a key's table stays whole
        out: dict[str, Any] = {}
        for key, value in data.items():
            if (
                not prefix
                and isinstance(value, dict)
                and hasattr(cfg, key)
                and dataclasses.is_dataclass(getattr(cfg, key))
            ):
                out.update(flat(value, f"{key}."))
            else:
                out[prefix + key] = value
        return out

    mine, theirs = flat(to_dict(cfg)), flat(to_dict(base))
    return [f"{k}={json.dumps(v)}" for k, v in mine.items() if theirs.get(k, object()) != v]


def to_toml(data: dict) -> str:
    """A small TOML writer for the resolved config (scalars, arrays, inline tables, sections)."""
    lines: list[str] = []
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    for key, value in scalars.items():
        lines.append(f"{key} = {toml_value(value)}")
    for key, table in tables.items():
        lines.append(f"\n[{key}]")
        for sub, value in table.items():
            lines.append(f"{toml_key(sub)} = {toml_value(value)}")
    return "\n".join(lines) + "\n"


def toml_key(key: str) -> str:
    """A key as TOML: bare when it may be (letters, digits, ``_``, ``-``), else a quoted string
    (PEFT ``rank_pattern`` keys are module-name regexes: ``"model\\.layers\\.0\\.self_attn\\.q_proj"``)."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", str(key)) else toml_value(str(key))


def toml_value(value: Any) -> str:
    """One value as TOML (also what `key=value` overrides take)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):  # a TOML basic string: backslash, quote and control characters escaped
        escaped = (
            value.replace("\\", "\\\\")
            .replace('"', '\\"')
            .replace("\n", "\\n")
            .replace("\t", "\\t")
            .replace("\r", "\\r")
        )
        return '"' + "".join(f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c for c in escaped) + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    if value is None:
        return '""'
    if callable(value) and hasattr(value, "__qualname__"):  # a function given in Python (a TRL-style tools list)
        if not value.__qualname__.isidentifier() or value.__module__ in (None, "__main__"):
            raise ConfigError(
                f"cannot write {value!r} to TOML: a function in a config is stored as 'module:function', so define "
                f"it at the top level of an importable module (not in __main__, a lambda or a nested function)"
            )
        return toml_value(f"{value.__module__}:{value.__qualname__}")  # its spelling in a recipe
    raise ConfigError(f"cannot write {value!r} to TOML")


def reference_markdown() -> str:
    """The config reference (``docs/config.md``, ``groupwise config``): every section and key with
    its type, default and the comment beside its field, read from the dataclasses so it cannot drift."""
    import inspect

    def comments(cls: type) -> dict[str, str]:
        # a field's meaning is the comment on its line, or else the comment lines right above it
        out, above = {}, []
        for line in inspect.getsource(cls).splitlines():
            stripped = line.strip()
            if stripped.startswith("#"):
                above.append(stripped.lstrip("# ").rstrip())
                continue
            name, _, rest = stripped.partition(":")
            if name.isidentifier() and rest:
                if "#" in rest:
                    out[name] = rest.split("#", 1)[1].strip()
                elif above:
                    out[name] = " ".join(above)
            above = []
        return out

    def default(f: dataclasses.Field) -> str:
        if f.default is not dataclasses.MISSING:
            return repr(f.default)
        value = f.default_factory()  # type: ignore[misc]
        return "(section)" if dataclasses.is_dataclass(value) else repr(value)

    lines = [
        "# Configuration reference",
        "",
        "Generated from `src/groupwise/config.py` (`groupwise config` prints it; `tests/test_config.py`",
        "checks this page is current). Every key can be set in a recipe's TOML or as `key=value` on the command",
        "line (`rollout.group_size=4`, `objective.terms.ppo_clip.eps_high=0.28`); component parameters are",
        "documented by `groupwise explain NAME`.",
        "",
    ]
    sections = [("(top level)", Config)] + [
        (f.name, globals()[f.type] if isinstance(f.type, str) else f.type)
        for f in dataclasses.fields(Config)
        if isinstance(f.type, str) and f.type in globals() and dataclasses.is_dataclass(globals()[f.type])
    ]
    sections.append(("roles.NAME", RoleCfg))
    for title, cls in sections:
        notes = comments(cls)
        lines += [f"## `[{title}]`" if title != "(top level)" else "## Top level", ""]
        doc = inspect.getdoc(cls)
        if doc and cls is not Config and not doc.startswith(f"{cls.__name__}("):  # not the generated signature
            lines += [" ".join(doc.split()), ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            if (
                title == "(top level)"
                and isinstance(f.type, str)
                and f.type in globals()
                and dataclasses.is_dataclass(globals()[f.type])
            ):
                continue  # a section of its own below
            meaning = notes.get(f.name, "").replace("|", "\\|")
            kind = str(f.type).replace("|", "\\|")  # `str | dict`: a table cell, not two
            lines.append(f"| `{f.name}` | `{kind}` | `{default(f)}` | {meaning} |")
        lines.append("")
    return "\n".join(lines)
