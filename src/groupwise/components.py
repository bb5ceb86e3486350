"""The component contract of each stage: what a component must define (the ``Protocol`` classes,
structural: components need not inherit) and every optional hook it may define (``HOOKS``, the one
table of them: name, stages, when the library reads it, what it returns).

Every component is a dataclass registered with ``@register(stage, name)``; its fields are its
hyper-parameters. Beyond its stage's protocol, the library reads a member of a component only if
``HOOKS`` declares it; a component's own helpers are ``_``-prefixed. ``check_component`` says what a
class lacks or defines undeclared, and ``tests/test_hooks_table.py`` runs it on every registered
component and checks that every ``hasattr`` / ``getattr`` of the library names a declared member.
``docs/components.md`` is generated from this module (``python -m groupwise.components``).

Whole-batch scope: every component that reads a rollout outside the micro-batched loss (samplers'
``keep``, rollout scorers, advantage estimators and shapers, token weights, schedules, observers)
sees the step's WHOLE batch, gathered from every rank, identical on every rank; the trainer slices
each rank's share afterwards. ``info.prompt_stats`` is the run's shared ``PromptStats``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.registry import STAGES
from groupwise.types import Need, Rollout, StepInfo

# ---------------------------------------------------------------------------------------------- protocols
# What a component of each stage must define. Optional members are hooks (``HOOKS`` below), not here.


class Sampler(Protocol):
    """Stage 1. Which prompts come next (``draw``), and which scored groups are kept (``keep``)."""

    def bind(self, n_rows: int, seed: int) -> None: ...
    def draw(self, n: int, info: StepInfo) -> list[int]: ...
    def keep(self, rollout: Rollout) -> Tensor:  # [B] bool
        ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Policy(Protocol):
    """What the trainer samples from and trains (``groupwise.policy``): an LM (``policy/lm.py``) or
    the flow toy (``modalities/flow.py``). ``generate`` turns requests into one group each (rows past
    a request's ``n`` are padding); ``forward`` gives per-token quantities of a rollout's actions
    (differentiable under grad); ``scoring_models`` / ``score`` serve no-grad needs by model name.
    ``request_options`` are the sampling keys a ``Request.sampling`` may set; ``modality`` must match
    every component's own (``"text"`` when a component declares none), and the extras a component
    ``reads_extras`` must be among those it declares it writes (``row_extras``, ``token_extras``).
    ``encode`` gives the policy's own prompt form: token ids for text, a ``[label]`` or an observation
    vector of floats for a toy (nothing outside the policy reads a non-text encoding as ids). A policy
    is not a component: its optional members are ``POLICY_OPTIONAL``."""

    modality: str
    trainable: bool
    request_options: frozenset[str]
    context: int | None  # the longest prompt + completion, or None

    def generate(self, requests: Sequence[Any], sampling: dict, info: StepInfo) -> Rollout: ...
    def forward(self, rollout: Rollout, quantities: Sequence[str] = ("logp",)) -> dict[str, Tensor]: ...
    def scoring_models(self, with_reference: bool) -> dict[str, Any]: ...
    def score(self, handle: Any, rollout: Rollout, quantities: Sequence[str]) -> dict[str, Tensor]: ...
    def encode(self, prompt: Any) -> list[int]: ...
    def decode(self, rollout: Rollout) -> list[list[str]]: ...
    def check_fits(self, ids: list[int], max_new_tokens: int, where: str) -> None: ...
    def parameters(self) -> list[Any]: ...
    def train(self) -> None: ...
    def eval(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def save(self, folder: Any) -> None: ...


POLICY_OPTIONAL: dict[str, str] = {  # what the library reads from a policy only when it has it
    "token_texts": "token_texts() -> list[str]: the text of each token id (for use_vocabulary; a text policy's)",
    "parameter_names": "parameter_names() -> list[str]: the names of parameters() in order (for use_parameter_names)",
    "encode_completion": "encode_completion(text) -> list[int]: an answer's token ids (the sft phase, the answer NLL)",
    "encode_target": "encode_target(row) -> a demonstration row's target in the policy's form (sft, non-text kinds)",
    "supervised_loss": "supervised_loss(prompts, targets, gen) -> scalar with grad: the demonstration loss (sft)",
    "condition_extras": "condition_extras: {name: n}, the request extras it samples under (its strategy must set them)",
    "quantities": "quantities: frozenset[str], what its forward computes (a need of another is refused at build)",
    "plan_condition": "plan_condition(plan) -> [N,H]: the planner kind's generator condition of a plan (lac_binding "
    "deploys only such a policy)",
    "row_extras": "row_extras: frozenset[str], the row extras its generate writes (a component's reads_extras)",
    "token_extras": "token_extras: frozenset[str], the token extras its generate writes (a component's reads_extras)",
    "sampler_logp": 'sampler_logp: str, "exact" (absent) or "estimate": is logp_sampler the sampler\'s log-prob',
    "end_step": "end_step(step): the policy's own upkeep after each step's observers (the reference sync)",
    "rebase_reference": "rebase_reference(): after an sft phase, the frozen reference becomes the trained policy",
    "hooks": "hooks: frozenset[str], the generation hook kinds its engine applies (groupwise.hooks)",
    "window": "window: int, the frames an autoregressive frame generator's cache holds (ar_flow; read by kv_branches)",
    "run_info": "run_info: dict, what the policy decided at start, kept in summary.json",
    "run_notes": "run_notes: list[str], lines said at the start of the run",
    "policy_file": "policy_file: str, the file a toy kind's save writes in its folder (the average_init phase reads "
    "such folders)",
    "module": "module: the trained torch module (phases that probe the network: steering_vector, e2po_perturbations)",
    "tokenizer": "tokenizer: the Hugging Face tokenizer of a text policy (the agent strategy renders chats with it)",
    "eos": "eos: list[int], the token ids that end a generation (the agent strategy: a turn's stop token)",
    "prompt_encoder": "prompt_encoder: the flow toy's condition encoder (the e2po_perturbations phase)",
    "collective_forward": "collective_forward: bool, every training forward is a collective (weights sharded by "
    'shard() under dist.shard="fsdp2"); such a policy has idle_pass() -> Tensor, a zero loss through every sharded '
    "layer that a rank with fewer micro-batches runs",
    "whole": "whole(): the module with whole weights, gathered on every rank when sharded (before rank 0 saves)",
    "engine": "engine: a text policy's CPUEngine (rollout.backend='server' samples through its contract over HTTP)",
    # what the rollout stage generates with is the policy or, under rollout.backend="server", a view of it
    # (policy/served.py) with these members besides the policy's own
    "after_step": "after_step(trainer): a generation backend's upkeep after each update (push weights, generate ahead)",
    "pop_stats": "pop_stats() -> dict: a generation backend's per-step counts (rows per staleness, dropped rows)",
    "rollout_state": "rollout_state() -> dict: a generation backend's in-flight rollouts, for the checkpoint",
    "load_rollout_state": "load_rollout_state(state, step): the in-flight rollouts a checkpoint holds",
}


class RolloutStrategy(Protocol):
    """Stages 1–3 together: ``strategy(ctx) -> Rollout`` collects the step's whole scored batch
    through ``rollout.context.RolloutContext``. Optional: ``evaluate(ctx, rows, info) -> dict[str,
    float]``, its own held-out evaluation (``heldout.HeldOut.evaluate_strategy``: greedy settings,
    the eval reward; logged as ``eval/<key>``, ``<key>_after``)."""

    def __call__(self, ctx: Any) -> Rollout: ...


class Env(Protocol):
    """A multi-turn environment (``@register("env", NAME)``, a dataclass; ``rollout/env.py`` plays
    it): one instance plays one episode. ``reset(row, seed)`` starts it on a dataset row and returns
    the first observation text; ``step(action)`` applies an action text and returns (observation,
    reward, done). Played by the chat strategy ``agent`` (``rollout/agent.py``), an observation is a
    user message, or a list of messages, and an env may define ``tools() -> list`` (optional): the
    episode's own tools, methods bound to the instance, offered next to ``rollout.params.tools``
    (TRL's ``environment_factory`` classes through the ``trl`` env, ``rollout/trl_env.py``)."""

    def reset(self, row: dict, seed: int) -> str: ...
    def step(self, action: str) -> tuple[str, float, bool]: ...


class Schedule(Protocol):
    """A coefficient that follows the step or a batch statistic (``groupwise.schedules``)."""

    def start(self) -> float: ...
    def __call__(self, info: StepInfo, rollout: Rollout) -> float: ...


class View(Protocol):
    """An edited context that rows are re-scored under (``Need(view=NAME)``). ``apply`` returns a
    Rollout whose token axis is the original one (same ``actions``/``mask`` positions), typically with
    new ``prompt_ids``; a view that edits completion tokens returns ``views.Remapped(rows, positions)``
    instead, ``positions`` [B,G,T] giving each original token's index in the edited rows (−1: none),
    and the resolver maps every quantity back to the original axis (0 where −1). ``encode`` turns a
    prompt text into the policy's prompt token ids."""

    def apply(self, rollout: Rollout, encode: Any) -> Any: ...


class Provider(Protocol):
    """How the trainer computes one ``Need.quantity`` (``groupwise.providers``): ``check`` a need at
    build (a malformed argument is a ``ConfigError``), ``plan`` the forward quantities it reads per
    ``(model, view)``, ``finish`` its value [B,G,T,...] from those results; ``grad_ok``: it may be
    computed with autograd in a micro-batch."""

    grad_ok: bool

    def check(self, need: Need) -> None: ...
    def plan(self, need: Need) -> dict[tuple[str, str], set[str]]: ...
    def finish(self, need: Need, results: dict, model: Any) -> Tensor: ...


class Phase(Protocol):
    """What a run does before its RL steps (``groupwise.phases``): ``kind`` is ``"sft"`` (trains the
    policy) or ``"offline"`` (returns an artifact); ``phase(ctx)`` runs it with a ``PhaseContext``."""

    kind: str

    def __call__(self, ctx: Any) -> dict | None: ...


class Reward(Protocol):
    """Stage 3, a text scorer. TRL's signature: one score per completion, ``None`` = no verdict
    (excluded, counted)."""

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float | None]: ...


class RolloutScorer(Protocol):
    """Stage 3, the other form of a reward: scores the whole batch from tensors (KL in the reward,
    a role's log-probs), called each scoring round after the round's no-grad needs
    (``RewardStage.finish``); one value per row. Defining ``score_rollout`` makes a reward this form."""

    def score_rollout(self, rollout: Rollout, info: StepInfo) -> Tensor:  # [B,G]
        ...


class Advantage(Protocol):
    """Stage 4. An estimator reads ``rollout.rewards`` [B,G]; a shaper reads ``rollout.advantages``.
    Returns [B,G] or [B,G,T] float32. Invalid rows (``group_valid`` False) get 0."""

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor: ...


class TokenWeight(Protocol):
    """Token weights [B,G,T] computed once per step; a weight of 0 removes the token from the loss
    and from every normaliser (``scope``)."""

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor: ...


class Term(Protocol):
    """Stage 5. One objective term: losses per token [b,G,T] or per row [b,G] for a micro-batch.

    ``out`` holds the grad quantities of the micro-batch: ``logp`` [b,G,T] (always), ``entropy``
    when a grad ``Need("entropy")`` is declared. Row-level values [b,G] count once per loss token of
    their row, so a row term and the same value spread over its tokens aggregate alike; token
    weights reach a term as its ``token_weights`` declares (objective.py)."""

    coef: float

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor: ...


class KLEstimator(Protocol):
    """A KL estimator (``kl_estimators.py``): elementwise, from the log-probs of the samples under
    the policy and the reference, shared by objective terms and rewards."""

    def __call__(self, logp: Tensor, logp_ref: Tensor) -> Tensor: ...


class Aggregation(Protocol):
    """How per-token (or per-row) losses become one scalar. ``normalizer`` runs once per optimiser
    step on the whole step batch (all ranks); ``reduce`` on each micro-batch. Summing ``reduce``
    over micro-batches and ranks gives the loss of the whole batch exactly."""

    def normalizer(self, mask: Tensor, info: StepInfo) -> dict[str, Tensor]: ...
    def reduce(self, values: Tensor, mask: Tensor, norm: dict[str, Tensor]) -> Tensor: ...


class Updater(Protocol):
    """Stage 6. ``step(closure)`` where ``closure()`` runs the micro-batched forward/backward and
    returns the loss; the updater may call it several times."""

    def bind(self, params: list, total_steps: int) -> None: ...
    def step(self, closure) -> dict[str, float]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


PROTOCOLS: dict[str, tuple[type, ...]] = {  # a component of the stage provides one of these
    "sampling": (Sampler,),
    "rollout": (RolloutStrategy,),
    "reward": (Reward, RolloutScorer),
    "advantage": (Advantage,),
    "weight": (TokenWeight,),
    "objective": (Term,),
    "kl": (KLEstimator,),
    "aggregation": (Aggregation,),
    "update": (Updater,),
    "pipeline": (),  # no component yet: roles and phases carry the multi-model runs
    "schedule": (Schedule,),
    "view": (View,),
    "provider": (Provider,),
    "phase": (Phase,),
    "env": (Env,),
}


# ---------------------------------------------------------------------------------------------- the hook table
STEP = ("sampling", "rollout", "reward", "advantage", "weight", "objective", "update")  # the trainer's own components
OWNERS = STEP + ("schedule",)  # and the schedules they hold: what the run binds, checks and checkpoints
GROUPS = {  # the sections of the table, in order
    "build": "read when the run is built",
    "step": "read every step",
    "eval": "read by the held-out evaluation",
    "checkpoint": "checkpoints and resume",
    "lifecycle": "called by the code that built the component",
    "declaration": "declarations read by the contract tests (or by no code)",
    "registry": "set by the registry, read by the library",
    "base": "helpers of a library base class, called by the component itself",
}


@dataclass(frozen=True)
class Hook:
    """One optional member a component may define. ``kind``: ``"method"`` (called; ``None`` means
    absent) or ``"attribute"`` (read: a field, class attribute or property). ``when``: who reads it
    and when. ``returns``: a method's signature and return value, an attribute's type."""

    name: str
    stages: tuple[str, ...]
    kind: str
    group: str
    when: str
    returns: str
    doc: str = ""


HOOKS: tuple[Hook, ...] = (
    # -- build
    Hook(
        "needs",
        OWNERS,
        "attribute",
        "build",
        "at build: the trainer collects every component's needs (and its schedules'; a role's components name "
        "the role's model) and `NeedResolver` checks them; each step the no-grad ones are computed on the whole "
        "batch before advantages, the grad ones in each micro-batch's forward (`out[...]`)",
        "tuple[Need, ...]",
        "Model outputs beyond the policy's log-probs (`Need(quantity, model, view, grad)`).",
    ),
    Hook(
        "modality",
        OWNERS,
        "attribute",
        "build",
        "at build: a component whose modality is not the policy's is refused (eval and task scorers too), "
        "unless it declares `reads_extras`, which then decides",
        "str",
        'The policy modality it works on (`"text"`, `"flow"`); absent: any policy. For what a kind only is '
        "(a flow-only step weight); a component that needs a policy's outputs declares `reads_extras` instead.",
    ),
    Hook(
        "reads_extras",
        OWNERS,
        "attribute",
        "build",
        "at build: each must be an extra the policy declares it writes (its `row_extras` / `token_extras`), "
        "else the build fails naming the extra (eval and task scorers too); `modality` is then not matched",
        "tuple[str, ...]",
        "The rollout extras written by the policy that it reads (`x_final`, `keep`, `commit_step`): any policy "
        "kind that writes them will do (a flow reward on the planner kind, issue 41 item 16).",
    ),
    Hook(
        "reads_sampler_logp",
        OWNERS,
        "attribute",
        "build",
        'at build (`check_policy_fit`): refused when the policy\'s `sampler_logp` is not "exact" (an estimate)',
        "bool",
        "It reads `logp_sampler` as the sampler's log-prob (an importance ratio to the sampler).",
    ),
    Hook(
        "rollout_extras",
        OWNERS,
        "attribute",
        "build",
        "at build (`rollout.context.check_strategy`): each must be an extra the configured strategy `collects`",
        "tuple[str, ...]",
        "Extras only a rollout strategy fills that the component reads (ReMax's `baseline_reward`).",
    ),
    Hook(
        "artifacts",
        OWNERS,
        "attribute",
        "build",
        "at build (`phases.check_artifacts`): each must be the artifact of a configured offline phase",
        "tuple[str, ...]",
        "The names of the offline artifacts it reads (each given by `use_artifact`).",
    ),
    Hook(
        "use_artifact",
        OWNERS,
        "method",
        "build",
        "once per name in `artifacts`, after the phases ran or were loaded and before the first RL step "
        "(`phases.inject`)",
        "use_artifact(name: str, value: dict) -> None",
        "Keeps an offline phase's artifact (a probe, a table).",
    ),
    Hook(
        "use_vocabulary",
        OWNERS + ("view",),
        "method",
        "build",
        "once at build (`bind_vocabulary`), with the policy's `token_texts()`; a policy without token texts "
        "(the flow toy) fails such a run at build",
        "use_vocabulary(token_text: list[str]) -> None",
        "For a component that maps token positions to spans of the completion text (a phase or role map from tags).",
    ),
    Hook(
        "use_rows",
        OWNERS + ("view",),
        "method",
        "build",
        "once at build (`bind_rows`), with the train split (the same on every rank); views when they are built",
        "use_rows(rows: list[dict]) -> None",
        "For a component that draws from the training rows (a view that swaps in another row's passage), so that "
        "what it draws does not depend on the batch or world size.",
    ),
    Hook(
        "use_models",
        OWNERS,
        "method",
        "build",
        "once at build (`bind_models`), with the policies of every `roles.NAME` with `frozen = true` (eval and task "
        "scorers too)",
        "use_models(models: dict[str, Policy]) -> None",
        "For a component that calls a frozen role's model itself (a judge asked questions whose contexts are not the "
        "rollout's rows, as DVReward's); it scores through the policy protocol (`scoring_models` / `score`), under "
        "no grad.",
    ),
    Hook(
        "whole_parameters",
        ("update",),
        "attribute",
        "build",
        'at build (`policy.sharding.refusals`): `dist.shard="fsdp2"` refuses an updater that sets it, naming it',
        "bool",
        "True for an updater whose step reads each parameter whole (GXPO flattens every gradient); "
        "absent: it works on sharded parameters too.",
    ),
    Hook(
        "use_parameter_names",
        ("update",),
        "method",
        "build",
        "once after `bind` (`bind_parameter_names`), with the policy's `parameter_names()`: the names of the "
        "parameters `bind` got, in the same order; a policy without names fails such a run at build",
        "use_parameter_names(names: list[str]) -> None",
        "For an updater that treats parameters by what they are (a LoRA-B mask, per-layer gradient norms).",
    ),
    Hook(
        "check",
        ("rollout",),
        "method",
        "build",
        "once at build (`check_strategy`), with the run's components",
        "check(components: list) -> None",
        "The strategy's own build-time check of the others (an env strategy's rewards); raises `ConfigError`.",
    ),
    Hook(
        "request_options",
        ("rollout",),
        "attribute",
        "build",
        "at build (`check_strategy`): each must be one of the policy's `request_options`",
        "tuple[str, ...]",
        "The `Request.sampling` keys the strategy sets (ReMax's `greedy`).",
    ),
    Hook(
        "collects",
        ("rollout",),
        "attribute",
        "build",
        "at build (`check_strategy`): the extras other components may list in `rollout_extras`",
        "tuple[str, ...]",
        "The extras the strategy fills.",
    ),
    Hook(
        "samples_with",
        ("rollout",),
        "attribute",
        "build",
        "at build (`build_actor`'s caller): each must be an actor of the run (`roles.NAME.samples = true`)",
        "tuple[str, ...]",
        "The actors it samples with besides the policy (`ctx.rollout(..., actor=NAME)`); it then returns "
        "one batch per actor.",
    ),
    Hook(
        "hooks",
        ("rollout",),
        "attribute",
        "build",
        "at build (`hooks.check_hooks`): each kind must be one the policy's engine applies (`Policy.hooks`)",
        "tuple[str, ...]",
        "The generation hook kinds (`groupwise.hooks.KINDS`) its requests carry.",
    ),
    Hook(
        "group_relative",
        ("advantage",),
        "attribute",
        "build",
        "at build: an estimator with `group_relative = True` is refused with `rollout.group_size < 2`",
        "bool",
        "Its advantages compare the rows of a group (every advantage would be 0 with one row).",
    ),
    Hook(
        "by",
        ("advantage",),
        "attribute",
        "build",
        'at build, by rollout `alphagrpo_reflect`\'s `check` (with `train_first`): `"prompt"` is refused',
        "str",
        'A field: `"prompt"` when the estimator pools the groups of a prompt.',
    ),
    Hook(
        "baseline",
        ("advantage",),
        "attribute",
        "build",
        'at build, by rollout `alphagrpo_reflect`\'s `check` (with `train_first`): anything but `"group"` is refused',
        "str",
        'A field: which baseline the estimator subtracts (`"group"`: the group\'s own).',
    ),
    Hook(
        "prompt",
        ("view",),
        "method",
        "build",
        "at build (a view in `eval.views` without it is refused), then for each held-out prompt scored under the view",
        "prompt(meta: dict, key: int) -> str | list",
        "The edited prompt of one dataset row (`key` its index), for views that edit only the prompt.",
    ),
    Hook(
        "artifact",
        ("phase",),
        "attribute",
        "build",
        "at build: the phase's name and its artifact's; empty or absent: the registry name",
        "str",
        "A field of the offline phases.",
    ),
    Hook(
        "reads_labels",
        ("phase",),
        "attribute",
        "build",
        "after a pipeline stage (`groupwise pipeline`): its label ledger counts every train row as read with its "
        "label when a phase has it true or absent, as drawn without one when false",
        "bool",
        "False for a phase that reads no labelled column of the train rows (a parameter average, teacher samples).",
    ),
    # -- step
    Hook(
        "prepare",
        STEP,
        "method",
        "step",
        "each step on the whole batch, after advantages and token weights, before the update",
        "prepare(batch: Rollout, info: StepInfo) -> None",
        "Whole-batch statistics a term needs in every micro-batch (so the loss does not depend on the split), stored "
        "on the component or as extras of the batch.",
    ),
    Hook(
        "step_stats",
        STEP,
        "method",
        "step",
        "each step, right after `prepare`: merged into the step's metrics row",
        "step_stats() -> dict[str, float]",
        "What the component measured this step, under its own keys (`edas/...`).",
    ),
    Hook(
        "observe",
        STEP,
        "method",
        "step",
        "once per step after the update, in the order the components are configured, then the shared `PromptStats`",
        "observe(rollout: Rollout, info: StepInfo) -> None",
        "Sees the step's whole batch with rewards, advantages and weights filled (curricula, trackers).",
    ),
    Hook(
        "max_rounds",
        ("sampling",),
        "attribute",
        "step",
        "each step (`RolloutContext`): how many draw / generate / score rounds may fill the batch (absent: 1)",
        "int",
        "Dynamic sampling's refill budget.",
    ),
    Hook(
        "play_heldout",
        ("rollout",),
        "method",
        "eval",
        'by the held-out evaluation (`heldout.py`) when `eval.closed_loop` resolves to true ("auto": for a strategy '
        "that defines it, unless an eval reward scores the first action), before and after training and at "
        "`eval.every`; with `eval.samples = n` also with `n` sampled episodes per row",
        "play_heldout(policy, rows: list[dict], sampling: dict, info: StepInfo, n: int, greedy: bool) -> "
        "list[list[float]]",
        "An environment strategy plays `n` closed-loop episodes of each held-out row (greedy actions, or sampled at "
        "`sampling`) and returns their returns [row][episode]; a positive return is a success "
        "(`rollout.env.heldout_returns` plays them as `play` does).",
    ),
    Hook(
        "on_step",
        ("rollout",),
        "method",
        "step",
        "by the env strategies (`rollout.env.play`) after every turn, for each group that played its k-th action",
        'on_step(group: list[Episode], k: int) -> "continue" | "cut"',
        "A group hook: `\"cut\"` stops the group's live episodes (selective rollout's gate); `None`: no hook.",
    ),
    Hook(
        "weight",
        ("reward",),
        "attribute",
        "step",
        "each scoring: the reward's weight in the total, applied once in `rewards.score.combine` (absent: 1.0)",
        "float",
    ),
    Hook(
        "label",
        ("reward",),
        "attribute",
        "step",
        "each scoring: how errors, counts and `reward/<label>` name the reward (absent: its registry name)",
        "str",
        "The python reward's `module:function`.",
    ),
    Hook(
        "is_async",
        ("reward",),
        "attribute",
        "step",
        "each scoring: whether calling it returns a coroutine (absent: read from its `__call__`)",
        "bool",
        "A reward answering for a user function it wraps.",
    ),
    Hook(
        "accepts_kwarg",
        ("reward",),
        "method",
        "step",
        "each scoring: whether it is passed TRL's keyword `name` (`log_extra`, `log_metric`, `completion_ids`, "
        "`trainer_state`); a built-in reward without it is passed none",
        "accepts_kwarg(name: str) -> bool",
    ),
    Hook(
        "scope",
        ("weight",),
        "attribute",
        "step",
        'each step (`objective.token_weights`): `"token"` (absent) removes its zero-weight tokens from the loss and '
        'every normaliser; `"loss"` only scales the terms',
        "str",
    ),
    Hook(
        "agg",
        ("objective",),
        "attribute",
        "step",
        "at build (the aggregations are built) and in every micro-batch",
        "str | None",
        "The term's aggregation (registry stage `aggregation`); None or absent: `objective.agg`.",
    ),
    Hook(
        "token_weights",
        ("objective",),
        "attribute",
        "step",
        'at build (`objective.check_token_weights`: a `"none"` term with any token weight is refused) and in every '
        'micro-batch: how the token weights reach the term (absent: `"token"`)',
        "str",
        '`"token"` (each per-token value times its weight), `"row:<reduction>"` (the weight reduced per '
        'row: `row:geo_mean`), `"exempt"` (never scaled: KL, entropy bonus), `"none"` (cannot take weights).',
    ),
    Hook(
        "token_weights_reason",
        ("objective",),
        "attribute",
        "step",
        'in the error that refuses token weights to a `token_weights = "none"` term (at build, or in a '
        "micro-batch that carries them)",
        "str",
        "Why the term takes no token weights (a contrast of whole sequences, ...).",
    ),
    Hook(
        "token_subset",
        ("objective",),
        "method",
        "step",
        "each optimiser step on the whole batch (its normaliser, all ranks) and in every micro-batch",
        "token_subset(rollout: Rollout) -> Tensor [B,G,T] bool",
        "The term's own tokens: it is aggregated over them alone and its normaliser counts only them "
        "(LA-GRPO's functional-token anchor).",
    ),
    Hook(
        "stats",
        ("objective",),
        "method",
        "step",
        "in every micro-batch of the first call of each closure, under no grad: averaged by the objective over "
        "the loss mask",
        "stats(mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor [b,G,T] or [b,G]]",
        "Values for logging (clip fractions).",
    ),
    Hook(
        "action_value",
        ("env",),
        "method",
        "step",
        "by reward `env_return` scoring a lone completion",
        "action_value(row: dict, action: str) -> float",
        "The best return reachable after one action from the row's first state.",
    ),
    Hook(
        "outcome",
        ("env",),
        "method",
        "step",
        'by the env strategies after each episode: stored in the row\'s `info[b][g]["env"]`; `episodes` logs each '
        "numeric key's mean over the episodes where it is finite as `env/<key>`",
        "outcome() -> dict",
        "What the finished episode came to (a termination cause, per-step scores).",
    ),
    Hook(
        "action_extra",
        ("env",),
        "attribute",
        "step",
        "by the env runner (`rollout/env.py`) at each step: `step` gets that row extra of the sampled row as a "
        "list instead of its text",
        "str (a row extra's name, e.g. `x_final`)",
        "The env acts on a continuous action (the gymnasium adapter).",
    ),
    Hook(
        "tools",
        ("env",),
        "method",
        "step",
        "by the `agent` strategy after each `reset`: offered next to `rollout.params.tools` for that episode",
        "tools() -> list[Callable]",
        "The episode's own tools, methods bound to the instance (TRL `environment_factory` classes).",
    ),
    Hook(
        "skipped",
        ("update",),
        "attribute",
        "step",
        "at the end of the run: `skipped_updates` in the summary (absent: 0)",
        "int",
        "Optimiser steps the updater rolled back (a non-finite result).",
    ),
    # -- checkpoint
    Hook(
        "state_dict",
        OWNERS,
        "method",
        "checkpoint",
        "at every checkpoint (components by `stage.name`, schedules, roles' components)",
        "state_dict() -> dict",
        "The state of a stateful component (curricula, controllers, trackers), so a resumed run is the "
        "uninterrupted one. Required of samplers and updaters.",
    ),
    Hook(
        "load_state_dict",
        OWNERS,
        "method",
        "checkpoint",
        "on resume, with what `state_dict` returned",
        "load_state_dict(state: dict) -> None",
    ),
    Hook(
        "evaluate",
        ("rollout",),
        "method",
        "lifecycle",
        "at each held-out evaluation (`HeldOut.evaluate_strategy`: greedy settings with `eval.sampling`, the eval "
        "reward, step -1's noise)",
        "evaluate(ctx: RolloutContext, rows: list[dict], info: StepInfo) -> dict[str, float]",
        "The strategy's own held-out measures (a chain, a game, best-of-N), logged as `eval/<key>` and "
        "`<key>_before` / `<key>_after`.",
    ),
    # -- lifecycle
    Hook(
        "close",
        ("reward",),
        "method",
        "lifecycle",
        "by the code that built the component (a script, a test); a run leaves it to the end of the process",
        "close() -> None",
        "Releases what it holds outside Python (the math reward's worker processes).",
    ),
    # -- declarations for the contract tests
    Hook(
        "on_policy_reinforce",
        ("objective",),
        "attribute",
        "declaration",
        "by the contract tests (on-policy, a ratio term's gradient equals REINFORCE's unless False) and "
        "`lope`'s wrapper of another term",
        "bool",
        "False for a ratio term whose on-policy gradient legitimately differs from REINFORCE.",
    ),
    Hook(
        "binary_rewards",
        ("objective",),
        "attribute",
        "declaration",
        "by the contract tests: such a term is given 0/1 rewards",
        "bool",
        "It reads right / wrong verdicts.",
    ),
    Hook(
        "couples",
        ("objective",),
        "attribute",
        "declaration",
        "by no code: micro-batches are sets of whole groups, so every term may couple a group's rows",
        "str",
        '`"group"`: the term couples the rows of a group.',
    ),
    Hook(
        "shaper",
        ("advantage",),
        "attribute",
        "declaration",
        "by the test fixtures: a shaper runs after an estimator (`advantage.shapers`), never alone",
        "bool",
        "It reshapes `rollout.advantages`.",
    ),
    Hook(
        "reads_completions",
        ("advantage",),
        "attribute",
        "declaration",
        "by the test fixtures (`tests/helpers.py`): they decode texts for it",
        "bool",
    ),
    Hook(
        "row_info",
        ("advantage",),
        "attribute",
        "declaration",
        "by the test fixtures (`tests/helpers.py`): they fill a value per row for each column",
        "tuple[str, ...]",
        "The reward `log_extra` columns it reads from `rollout.info` (EDAS's answers).",
    ),
    # -- set by the registry
    Hook(
        "registry_name",
        STAGES,
        "attribute",
        "registry",
        "set by `@register`; read in messages, logs and checkpoint keys",
        "str",
    ),
    Hook("stage", STAGES, "attribute", "registry", "set by `@register`; read in messages and checkpoint keys", "str"),
    Hook(
        "schedules",
        STAGES,
        "attribute",
        "registry",
        "set by `registry.build` when a parameter is scheduled; each step `schedules.resolve` sets the parameter",
        "dict[str, Schedule]",
        "`{parameter: schedule}`; the component only ever sees a number.",
    ),
    # -- helpers of library base classes
    Hook(
        "artifact_value",
        OWNERS,
        "method",
        "base",
        "by the component (`components.ReadsArtifact`)",
        "artifact_value() -> Any",
        "The artifact its `artifact` field names; an error naming the phase to add when it never came.",
    ),
    Hook(
        "phase_hint",
        OWNERS,
        "attribute",
        "base",
        "by `ReadsArtifact.artifact_value`'s error",
        "str",
        "The phase to add, in words.",
    ),
    Hook(
        "role",
        ("reward",),
        "attribute",
        "base",
        "by the component (`rewards._judge.FrozenJudge`)",
        "str | None",
        "The frozen role its `judge` field names.",
    ),
    Hook(
        "judge_model",
        ("reward",),
        "method",
        "base",
        "by the component (`FrozenJudge`)",
        "judge_model() -> Policy",
        "The frozen role's policy given by `use_models`.",
    ),
    Hook(
        "check_judge",
        ("reward",),
        "method",
        "base",
        "by the component at build (`FrozenJudge`)",
        "check_judge(programmatic: str) -> None",
        "Validates the judge fields (`judge`, `template`, `match`, `top_logprobs`).",
    ),
    Hook(
        "make_optimizer",
        ("update",),
        "method",
        "base",
        "by `updates._base.TorchUpdater.bind`",
        "make_optimizer(params: list) -> torch.optim.Optimizer",
    ),
    Hook(
        "torch_optim",
        ("update",),
        "method",
        "base",
        "by `TorchUpdater.step` (the rollback) and its subclasses",
        "torch_optim() -> torch.optim.Optimizer",
    ),
    Hook(
        "fit",
        ("phase",),
        "method",
        "base",
        "by the `sft` phase itself and by `groupwise warmstart` (`models/warmstart.py`)",
        "fit(policy, rows, val, seed, prompt, accuracy, ...) -> dict",
        "The supervised loop of the sft phase.",
    ),
)

HOOKS_BY_NAME: dict[str, Hook] = {hook.name: hook for hook in HOOKS}


def hooks_for(stage: str) -> dict[str, Hook]:
    """The hooks a component of ``stage`` may define, by name."""
    return {hook.name: hook for hook in HOOKS if stage in hook.stages}


def protocol_members(protocol: type) -> tuple[str, ...]:
    """The members a ``Protocol`` class requires: its annotated attributes and its methods (``__call__``
    included; nothing else that starts with ``_``)."""
    names = list(vars(protocol).get("__annotations__", {}))
    names += [name for name, value in vars(protocol).items() if inspect.isfunction(value)]
    return tuple(dict.fromkeys(n for n in names if not n.startswith("_") or n == "__call__"))


def own_members(cls: type) -> dict[str, Any]:
    """The public members ``cls`` defines itself or inherits from a base other than ``object``
    (``__call__`` included), less its dataclass fields: what the library could read of it."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    members: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or klass is Protocol:
            continue
        for name, value in vars(klass).items():
            if (not name.startswith("_") or name == "__call__") and name not in fields:
                members[name] = value
    return members


def provides(cls: type, member: str, fields: set[str]) -> bool:
    """Whether ``cls`` has ``member``: a dataclass field counts; ``__call__`` only when a class below
    ``object`` defines it (every class is callable)."""
    if member == "__call__":
        return any("__call__" in vars(klass) for klass in cls.__mro__ if klass is not object)
    return hasattr(cls, member) or member in fields


def check_component(stage: str, cls: type) -> list[str]:
    """What is wrong with ``cls`` as a component of ``stage``: protocol members it lacks, public members
    that are neither its stage's protocol nor a hook declared for the stage, and hooks of the wrong kind.
    An empty list: it keeps the contract."""
    if stage not in PROTOCOLS:
        raise ConfigError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")
    name = f"{stage} {getattr(cls, 'registry_name', cls.__name__)!r} ({cls.__module__}.{cls.__qualname__})"
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    problems = []
    protocols = PROTOCOLS[stage]
    if protocols:
        lacks = [[m for m in protocol_members(p) if not provides(cls, m, fields)] for p in protocols]
        if all(lacks):
            best = min(range(len(protocols)), key=lambda i: len(lacks[i]))
            forms = " or ".join(p.__name__ for p in protocols)
            problems.append(f"{name} lacks {', '.join(lacks[best])} of the {forms} protocol (components.py)")
    required = {m for p in protocols for m in protocol_members(p)}
    declared = hooks_for(stage)
    for member, value in own_members(cls).items():
        if member in required:
            continue
        hook = declared.get(member)
        if hook is None:
            other = HOOKS_BY_NAME.get(member)
            why = f"a hook of stages {', '.join(other.stages)} only" if other else "not a declared hook"
            problems.append(
                f"{name} defines {member!r}, {why}: prefix a helper with '_', or declare the hook in components.HOOKS"
            )
        elif hook.kind == "attribute" and inspect.isfunction(value):
            problems.append(
                f"{name} defines {member!r} as a method; the hook is an attribute "
                f"(a field, class attribute or property)"
            )
        elif hook.kind == "method" and not (value is None or callable(value) or isinstance(value, classmethod)):
            problems.append(f"{name} defines {member!r} as a {type(value).__name__}; the hook is a method")
    return problems


# ---------------------------------------------------------------------------------------------- base classes
class ReadsArtifact:
    """A component that reads the artifact of one offline phase (``groupwise.phases``), named by its
    ``artifact`` field: ``artifacts`` lists it (checked at build), ``use_artifact`` keeps it,
    ``artifact_value()`` returns it (an error naming the phase to add when it never came)."""

    artifact: str
    phase_hint = "the offline phase that makes it"

    @property
    def artifacts(self) -> tuple[str, ...]:
        return (self.artifact,)

    def use_artifact(self, name: str, value: Any) -> None:
        self._artifact_value = value

    def artifact_value(self) -> Any:
        value = getattr(self, "_artifact_value", None)
        if value is None:
            raise ConfigError(
                f"{getattr(self, 'registry_name', type(self).__name__)}: the "
                f"artifact {self.artifact!r} was not given (add {self.phase_hint})"
            )
        return value


# ---------------------------------------------------------------------------------------------- binding (build time)
def bind_vocabulary(components: list[Any], policy: Any) -> None:
    """Give every component that reads token texts (``use_vocabulary``) the policy's vocabulary."""
    readers = [c for c in components if hasattr(c, "use_vocabulary")]
    if not readers:
        return
    if not hasattr(policy, "token_texts"):
        names = ", ".join(
            f"{getattr(c, 'stage', '')} {getattr(c, 'registry_name', type(c).__name__)!r}" for c in readers
        )
        raise ConfigError(
            f"{names} read token texts, which a {policy.modality} "
            "policy does not have; use a text policy (model.policy)"
        )
    texts = policy.token_texts()
    for component in readers:
        component.use_vocabulary(texts)


def bind_rows(components: list[Any], rows: list[dict]) -> None:
    """Give every component that draws from the training rows (``use_rows``) the run's train split."""
    for component in components:
        if hasattr(component, "use_rows"):
            component.use_rows(rows)


def bind_parameter_names(updater: Any, policy: Any) -> None:
    """Give an updater that reads parameter names (``use_parameter_names``)
    the names of the parameters it was bound to."""
    if not hasattr(updater, "use_parameter_names"):
        return
    if not hasattr(policy, "parameter_names"):
        raise ConfigError(
            f"update {getattr(updater, 'registry_name', type(updater).__name__)!r} reads parameter names, which a "
            f"{policy.modality} policy does not give; use a text policy (model.policy)"
        )
    updater.use_parameter_names(policy.parameter_names())


def bind_models(components: list[Any], models: dict[str, Any]) -> None:
    """Give every component that calls frozen roles' models (``use_models``) those policies by role name."""
    for component in components:
        if hasattr(component, "use_models"):
            component.use_models(models)


# ---------------------------------------------------------------------------------------------- the page
def _stages_text(stages: Sequence[str]) -> str:
    if set(stages) == set(STAGES):
        return "every stage"
    step = set(STEP) <= set(stages)
    return ", ".join((["step components"] if step else []) + [f"`{s}`" for s in stages if not (step and s in STEP)])


def _member_text(protocol: type, member: str) -> str:
    value = vars(protocol).get(member)
    if inspect.isfunction(value):
        params = [p for p in inspect.signature(value).parameters.values() if p.name != "self"]
        stars = {inspect.Parameter.VAR_KEYWORD: "**", inspect.Parameter.VAR_POSITIONAL: "*"}
        args = ", ".join(stars.get(p.kind, "") + p.name for p in params)
        return f"`{member}({args})`"
    return f"`{member}: {vars(protocol)['__annotations__'][member]}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def hooks_markdown() -> str:
    """``docs/components.md``: every stage's protocol, the hook table, and the policy's optional members."""
    lines = [
        "# Components: the contract of each stage and the hook table",
        "",
        "Generated from `src/groupwise/components.py` (`python -m groupwise.components > docs/components.md`);",
        "`tests/test_hooks_table.py` fails when this page is stale, when a registered component defines a public",
        "member that is neither its stage's protocol nor a hook declared for its stage, and when the library reads",
        "(`hasattr` / `getattr`) a member that nothing declares. A component's own helpers start with `_`.",
        "",
        "## What each stage requires (the protocols)",
        "",
        "| stage | protocol | members |",
        "|---|---|---|",
    ]
    for stage in STAGES:
        protocols = PROTOCOLS[stage]
        if not protocols:
            lines.append(f"| `{stage}` | none | no component yet |")
            continue
        names = " or ".join(f"`{p.__name__}`" for p in protocols)
        members = " — or — ".join(", ".join(_member_text(p, m) for m in protocol_members(p)) for p in protocols)
        lines.append(f"| `{stage}` | {names} | {members} |")
    lines += [
        "",
        f"Step components: {', '.join(f'`{s}`' for s in STEP)}",
        "(the trainer's own, read every step); their schedules and a role's components get the same calls.",
        "",
        "## The hook table",
        "",
    ]
    for group, title in GROUPS.items():
        rows = [hook for hook in HOOKS if hook.group == group]
        lines += [
            f"### {title[0].upper()}{title[1:]}",
            "",
            "| hook | kind | stages | when | returns | meaning |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| `{h.name}` | {h.kind} | {_stages_text(h.stages)} | {_cell(h.when)} | `{_cell(h.returns)}` | "
            f"{_cell(h.doc)} |"
            for h in rows
        ]
        lines.append("")
    lines += ["## Hooks by stage", "", "| stage | hooks |", "|---|---|"]
    for stage in STAGES:
        lines.append(f"| `{stage}` | {', '.join(f'`{name}`' for name in hooks_for(stage))} |")
    lines += [
        "",
        "## A policy's optional members",
        "",
        "A policy (`Policy`) is not a component; the library reads these of it only when it has them.",
        "",
        "| member | meaning |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {_cell(text)} |" for name, text in POLICY_OPTIONAL.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(hooks_markdown(), end="")
