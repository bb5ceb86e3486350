"""The component contract of each stage (structural protocols; components need not inherit).

Every component is a dataclass registered with ``@register(stage, name)``; its fields are its
hyper-parameters. A component that needs model outputs beyond the policy's log-probs declares
``needs: tuple[Need, ...]`` (a class attribute or property). Stateful components add
``state_dict()`` / ``load_state_dict()`` so a resumed run equals the uninterrupted one.

Whole-batch scope: every component that reads a rollout outside the micro-batched loss (samplers'
``keep``, rollout scorers, advantage estimators and shapers, token weights, schedules, observers)
sees the step's WHOLE batch, gathered from every rank, identical on every rank; the trainer slices
each rank's share afterwards. Any component may define ``observe(rollout, info)``: it is called once
per step, after the update, with that whole batch (rewards, advantages and weights filled), in the
order the components are configured. ``info.prompt_stats`` is the run's shared ``PromptStats``.

Token texts: a component that maps token positions to spans of the completion text (a phase or
role map from tags) defines ``use_vocabulary(token_text: list[str])``; the trainer calls it once at
build with the policy's ``token_texts()`` (text of each token id). A policy without token texts
(the flow toy) fails such a run at build.

Dataset rows: a component that draws from the run's training rows (a view that swaps in another
row's passage) defines ``use_rows(rows: list[dict])``; the trainer calls it once at build with the
train split (the same on every rank), so what it draws does not depend on the batch or world size.
Views get both calls too, when they are built.

Parameter names: an updater that treats parameters by what they are (a LoRA-B mask, per-layer
gradient norms) defines ``use_parameter_names(names: list[str])``; the trainer calls it once after
``bind`` with the policy's ``parameter_names()``, the names of the parameters ``bind`` got, in
the same order. A policy without names fails such a run at build.

Frozen models: a component that calls a frozen role's model itself (a judge asked questions whose
contexts are not the rollout's rows, as DVReward's) defines ``use_models(models: dict[str, Policy])``;
the trainer calls it once at build with the policies of every ``roles.NAME`` with ``frozen = true``,
which it then scores through the policy protocol (``scoring_models`` / ``score``), under no grad.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from torch import Tensor

from groupwise.registry import ConfigError
from groupwise.types import Need, Rollout, StepInfo


class Sampler(Protocol):
    """Stage 1. Which prompts come next (``draw``), and which scored groups are kept (``keep``)."""

    def bind(self, n_rows: int, seed: int) -> None: ...
    def draw(self, n: int, info: StepInfo) -> list[int]: ...
    def keep(self, rollout: Rollout) -> Tensor:  # [B] bool
        ...
    max_rounds: int  # how many draw/generate/score rounds a step may take to fill the batch
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Policy(Protocol):
    """What the trainer samples from and trains (``groupwise.policy``): an LM (``policy/lm.py``) or
    the flow toy (``modalities/flow.py``). ``generate`` turns requests into one group each (rows past
    a request's ``n`` are padding); ``forward`` gives per-token quantities of a rollout's actions
    (differentiable under grad); ``scoring_models`` / ``score`` serve no-grad needs by model name.
    ``request_options`` are the sampling keys a ``Request.sampling`` may set; ``modality`` must match
    every component's own (``"text"`` when a component declares none)."""

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
    def save(self, folder: Any) -> None: ...


class RolloutStrategy(Protocol):
    """Stages 1–3 together: ``strategy(ctx) -> Rollout`` collects the step's whole scored batch
    through ``rollout.context.RolloutContext``. ``request_options`` are the ``Request.sampling`` keys
    it uses (checked against the policy's at build); ``collects`` names the extras it fills, which
    other components list in their ``rollout_extras`` (checked at build)."""

    request_options: tuple[str, ...]
    collects: tuple[str, ...]
    def __call__(self, ctx: Any) -> Rollout: ...


class Env(Protocol):
    """A multi-turn environment (``@register("env", NAME)``, a dataclass; ``rollout/env.py`` plays
    it): one instance plays one episode. ``reset(row, seed)`` starts it on a dataset row and returns
    the first observation text; ``step(action)`` applies an action text and returns (observation,
    reward, done). Optional: ``action_value(row, action) -> float``, the best return reachable after
    one action from the row's first state (reward ``env_return`` scores a lone completion with it);
    ``outcome() -> dict``, what the finished episode came to (a termination cause, per-step scores,
    the turn it answered on), stored in each row's ``info[b][g]["env"]`` by the env strategies; the
    ``episodes`` strategy logs each numeric key's mean over the episodes where it is finite as step
    stat ``env/<key>``."""

    def reset(self, row: dict, seed: int) -> str: ...
    def step(self, action: str) -> tuple[str, float, bool]: ...


class Observer(Protocol):
    """Any component: sees the step's whole scored batch once, after the update (curricula, trackers)."""

    def observe(self, rollout: Rollout, info: StepInfo) -> None: ...


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
    prompt text into the policy's prompt token ids. Optional ``prompt(meta, key)``: the edited prompt
    of one dataset row (``key`` its index), for views that edit only the prompt (``eval.views``)."""

    def apply(self, rollout: Rollout, encode: Any) -> Any: ...


class Reward(Protocol):
    """Stage 3. TRL's signature: one score per completion, ``None`` = no verdict (excluded, counted)."""

    weight: float
    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float | None]: ...


class Advantage(Protocol):
    """Stage 4. An estimator reads ``rollout.rewards`` [B,G]; a shaper reads ``rollout.advantages``.
    Returns [B,G] or [B,G,T] float32. Invalid rows (``group_valid`` False) get 0. One that reads an
    extra only a rollout strategy collects lists it in ``rollout_extras`` (ReMax's greedy baseline)."""

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor: ...


class TokenWeight(Protocol):
    """Token weights [B,G,T] computed once per step; a weight of 0 removes the token from the loss
    and from every normaliser."""

    needs: tuple[Need, ...]
    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor: ...


class Term(Protocol):
    """Stage 5. One objective term: losses per token [b,G,T] or per row [b,G] for a micro-batch.

    ``out`` holds the grad quantities of the micro-batch: ``logp`` [b,G,T] (always), ``entropy``
    when a grad ``Need("entropy")`` is declared. ``agg`` names the aggregation (None = the
    objective's default). ``couples = "group"`` keeps groups whole across micro-batches (always
    true here: micro-batches are sets of whole groups). Row-level values [b,G] count once per loss
    token of their row, so a row term and the same value spread over its tokens aggregate alike;
    token weights reach a row term only through the mask. Optional ``token_subset(rollout) -> [B,G,T]
    bool``: the term's own tokens; it is aggregated over them alone and its normaliser counts only
    them (whole step batch, all ranks: ``objective.py``), e.g. LA-GRPO's functional-token anchor."""

    coef: float
    agg: str | None
    needs: tuple[Need, ...]
    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor: ...
    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        """Optional: per-token [b,G,T] (or per-row [b,G]) values for logging, averaged by the
        objective over the loss mask (e.g. clip fractions). A ratio term whose on-policy gradient
        legitimately differs from REINFORCE sets ``on_policy_reinforce = False`` (contract tests)."""
        ...


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


def bind_vocabulary(components: list[Any], policy: Any) -> None:
    """Give every component that reads token texts (``use_vocabulary``) the policy's vocabulary."""
    readers = [c for c in components if hasattr(c, "use_vocabulary")]
    if not readers:
        return
    if not hasattr(policy, "token_texts"):
        names = ", ".join(f"{getattr(c, 'stage', '')} {getattr(c, 'registry_name', type(c).__name__)!r}" for c in readers)
        raise ConfigError(f"{names} read token texts, which a {policy.modality} policy does not have; use a text policy (model.policy)")
    texts = policy.token_texts()
    for component in readers:
        component.use_vocabulary(texts)


def bind_rows(components: list[Any], rows: list[dict]) -> None:
    """Give every component that draws from the training rows (``use_rows``) the run's train split."""
    for component in components:
        if hasattr(component, "use_rows"):
            component.use_rows(rows)


def bind_parameter_names(updater: Any, policy: Any) -> None:
    """Give an updater that reads parameter names (``use_parameter_names``) the names of the parameters it was bound to."""
    if not hasattr(updater, "use_parameter_names"):
        return
    if not hasattr(policy, "parameter_names"):
        raise ConfigError(f"update {getattr(updater, 'registry_name', type(updater).__name__)!r} reads parameter names, which a "
                          f"{policy.modality} policy does not give; use a text policy (model.policy)")
    updater.use_parameter_names(policy.parameter_names())


def bind_models(components: list[Any], models: dict[str, Any]) -> None:
    """Give every component that calls frozen roles' models (``use_models``) those policies by role name."""
    for component in components:
        if hasattr(component, "use_models"):
            component.use_models(models)
