"""The Env runner: play ``n`` episodes of a multi-turn environment per dataset row through the
rollout context, one generation call per turn for every live episode together.

An env (``@register("env", NAME)``, protocol ``components.Env``) is a dataclass; one copy plays one
episode: ``reset(row, seed) -> observation``, ``step(action) -> (observation, reward, done)``. The
rollout strategies built on this runner are ``grow`` (every turn a sample under its local state)
and ``episodes`` (one row per episode, the whole transcript); both fill reward ``env_return``.

Per turn ``t`` of episode ``e`` of row ``key`` (``e < n``, ``t < max_turns``)::

    context = encode(o_t)                                        (local: the current observation)
            | encode(o_0) + Σ_{i<t} (a_i + encode(separator + o_{i+1}))   (history: the transcript)
    a_t     = the policy's sample for Request(key, n=1, offset=e·max_turns + t, prompt=context)
    o_{t+1}, r_t, done = env.step(decode(a_t))

Randomness: ``reset`` gets ``sample_seed(seed, step, key, ENV_STREAM + e)`` and the action of
``(e, t)`` samples with ``sample_seed(seed, step, key, e·max_turns + t)``: an episode depends only
on (seed, step, row, episode), never on the batch it shares or the rank that generates it.

Cuts (the per-group bounds): an episode stops at ``done``, after ``max_turns`` actions
(``cut = "max_turns"``), or in history mode before a turn whose context plus
``rollout.max_new_tokens`` would pass ``min(model context, max_context)`` (``cut = "context"``).
A cut episode keeps the rewards it got (the reach game's: 0, it never reached the goal).

Actions: ``step`` gets the sample's text, unless the env names a row extra in ``action_extra`` (a
class attribute): then it gets that extra of the sampled row as a list (a continuous policy's
``x_final``, the gymnasium adapter ``rollout/gym_env.py``).

Episode facts: an env may define ``outcome() -> dict`` (what the episode came to: a termination
cause, per-step scores, the turn it answered on); after play it is stored in ``Episode.facts``, the
strategies put it in each row's ``info[b][g]["env"]``, and ``Played.fact_means()`` averages each
numeric key over the episodes whose value is finite (NaN = "not applicable to this episode"), which
``episodes`` logs as ``env/<key>`` step stats. ``index_base`` numbers the episodes ``index_base + e``
(their seeds follow): a strategy that plays a row again (a resample) gives the new episodes fresh indices.

Group hook: ``on_step(group, k) -> "continue" | "cut"`` (optional) is called after every turn, with
``k`` the number of actions played so far, for each group (a row's ``n`` episodes) in which some
episode played its ``k``-th action in that turn. ``"cut"`` stops the group's live episodes there
(``cut = "gate"``) and marks the group in ``Played.gated``; the strategy decides what a gated group
becomes (selective rollout drops it from the batch, ``rollout/selective.py``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from groupwise.errors import ConfigError
from groupwise.registry import build
from groupwise.rollout.context import RolloutContext
from groupwise.seeds import sample_seed
from groupwise.types import Request, Rollout

ENV_STREAM = 1 << 40  # reset seeds live apart from the sample indices of the actions


@dataclass
class Episode:
    """One played episode: ``observations`` o_0..o_k, and per action its context, tokens, text, reward."""

    key: int
    index: int
    observations: list[str]
    contexts: list[list[int]] = field(default_factory=list)  # the prompt ids each action was generated under
    actions: list[list[int]] = field(default_factory=list)  # each action's generated token ids (EOS included)
    texts: list[str] = field(default_factory=list)  # each action decoded
    rewards: list[float] = field(default_factory=list)  # r_t
    rows: list[int] = field(default_factory=list)  # each action's group in Played.turns
    # history mode: encode(separator + o_{t+1}) after each non-final action
    env_tokens: list[list[int]] = field(default_factory=list)
    done: bool = False
    cut: str = ""  # "" (done or still live), "max_turns", "context", "gate" (the group hook)
    # the env's ``outcome()`` after the episode (optional protocol method), else {}
    facts: dict = field(default_factory=dict)

    @property
    def ret(self) -> float:
        return float(sum(self.rewards))


@dataclass
class Played:
    episodes: list[list[Episode]]  # [B][n]
    turns: Rollout  # every action: one group of one row (its own context), in the order played
    gated: list[bool] = field(default_factory=list)  # [B] the group hook cut the group

    def fact_means(self, prefix: str = "env/") -> dict[str, float]:
        """Each numeric ``outcome()`` key's mean over the episodes where it is finite (NaN when none is);
        text and list facts (a cause, per-step scores) are left to the components that read them."""

        def numeric(value: Any) -> bool:
            return isinstance(value, (int, float))  # bools count (a share of episodes)

        keys = sorted({k for g in self.episodes for ep in g for k, v in ep.facts.items() if numeric(v)})
        out = {}
        for k in keys:
            vals = [
                float(ep.facts[k])
                for g in self.episodes
                for ep in g
                if numeric(ep.facts.get(k)) and math.isfinite(float(ep.facts[k]))
            ]
            out[prefix + k] = sum(vals) / len(vals) if vals else float("nan")
        return out

    @property
    def actions(self) -> int:
        """Actions played (environment steps) over every episode."""
        return sum(len(ep.actions) for group in self.episodes for ep in group)


def _extra_action(gen: Rollout, name: str, i: int, who: str) -> list:
    """Row ``i``'s value of the row extra ``name`` (group 0) as a list, for an env with ``action_extra``."""
    if name not in gen.extras:
        raise ConfigError(
            f"rollout {who}: the env acts on the row extra {name!r}, which this policy's samples do not have "
            f"(they have {sorted(gen.extras)}); use a policy kind that writes it (x_final: model.policy='gaussian')"
        )
    return gen.extras[name][i, 0].tolist()


class EnvCopies:
    """The envs of one rollout call: each env name (``env``, else the row's ``env`` column) built once with
    ``env_params``, and a deep copy of it per episode (one instance plays one episode)."""

    def __init__(self, env: str | None, env_params: dict | None, who: str):
        self.env, self.env_params, self.who = env, env_params or {}, who
        self.protos: dict[str, Any] = {}

    def __call__(self, row: dict) -> Any:
        name = env_name(self.env, row, self.who)
        if name not in self.protos:
            self.protos[name] = build("env", name, **self.env_params)
        return copy.deepcopy(self.protos[name])


def env_name(env: str | None, row: dict, who: str) -> str:
    name = env or row.get("env")
    if not name:
        raise ConfigError(
            f"rollout {who}: no env to play: set rollout.params.env (a registered env) "
            "or use a task whose rows name one in an 'env' column (data.task='reach')"
        )
    return name


def play(
    ctx: Any,
    keys: list[int],
    n: int,
    max_turns: int,
    env: str | None = None,
    env_params: dict | None = None,
    *,
    history: bool = False,
    separator: str = " ",
    max_context: int | None = None,
    who: str = "env",
    sampling: dict | None = None,
    on_step: Callable[[list[Episode], int], str] | None = None,
    index_base: int = 0,
) -> Played:
    """Play ``n`` episodes of each row in ``keys`` (see the module docstring; ``on_step``: the group hook)."""
    if max_turns < 1 or n < 1:
        raise ConfigError(
            f"rollout {who}: need max_turns >= 1 and group_size >= 1, got max_turns={max_turns}, group_size={n}"
        )
    info, encode = ctx.info(0), _cached(ctx.policy.encode)
    limit = min(x for x in (getattr(ctx.policy, "context", None), max_context, 1 << 62) if x)
    budget = ctx.sampling["max_new_tokens"]
    fresh = EnvCopies(env, env_params, who)
    episodes, envs = [], {}
    for key in keys:
        row = ctx.meta(key)
        group = []
        for e in range(n):
            instance = fresh(row)
            ep = Episode(
                key,
                index_base + e,
                [instance.reset(row, sample_seed(info.seed, info.step, key, ENV_STREAM + index_base + e))],
            )
            envs[id(ep)] = instance
            group.append(ep)
        episodes.append(group)
    parts, seen, gated = [], 0, [False] * len(episodes)
    for t in range(max_turns):
        requests, chosen = [], []
        for ep in (ep for group in episodes for ep in group if not ep.done and not ep.cut):
            if history:
                context = encode(ep.observations[0]) + [x for a, o in zip(ep.actions, ep.env_tokens) for x in a + o]
            else:
                context = encode(ep.observations[-1])
            if len(context) + budget > limit:
                ep.cut = "context"
                continue
            requests.append(
                Request(key=ep.key, n=1, offset=ep.index * max_turns + t, prompt=context, sampling=sampling)
            )
            chosen.append((ep, context))
        if not requests:
            break
        gen = ctx.generate(requests, 0)  # [R,1,T] gathered, in request order
        lengths = gen.mask[:, 0].sum(-1).tolist()  # [R]
        for i, (ep, context) in enumerate(chosen):
            text = gen.completions[i][0]
            # an env that acts on a row extra of the sample (a continuous action) gets that instead of the text
            extra = getattr(envs[id(ep)], "action_extra", None)
            obs, reward, done = envs[id(ep)].step(_extra_action(gen, extra, i, who) if extra else text)
            ep.contexts.append(context)
            ep.actions.append(gen.actions[i, 0, : lengths[i]].tolist())
            ep.texts.append(text)
            ep.rewards.append(float(reward))
            ep.observations.append(obs)
            ep.rows.append(seen + i)
            ep.done = bool(done)
            if history and not ep.done:
                ep.env_tokens.append(encode(separator + obs))
        parts.append(gen)
        seen += len(chosen)
        if on_step is not None:
            _group_hook(episodes, gated, {id(ep) for ep, _ in chosen}, t + 1, on_step, who)
    for ep in (ep for group in episodes for ep in group if not ep.done and not ep.cut):
        ep.cut = "max_turns"
    for ep in (ep for group in episodes for ep in group):
        outcome = getattr(envs[id(ep)], "outcome", None)
        ep.facts = dict(outcome()) if outcome is not None else {}
    if not parts:
        raise ConfigError(
            f"rollout {who}: no episode could take a single turn (the first "
            f"observation plus rollout.max_new_tokens={budget} exceeds the context "
            f"limit {limit}); raise max_context or shorten the observations"
        )
    return Played(episodes, Rollout.concat(parts), gated)


def _group_hook(
    episodes: list[list[Episode]], gated: list[bool], acted: set[int], k: int, on_step: Callable, who: str
) -> None:
    """After turn ``k``: ``on_step`` for every group with an episode that played its k-th action now;
    a cut stops its live episodes."""
    for b, group in enumerate(episodes):
        if gated[b] or not any(id(ep) in acted for ep in group):
            continue
        verdict = on_step(group, k)
        if verdict not in ("continue", "cut"):
            raise ValueError(f"rollout {who}: on_step must return 'continue' or 'cut', got {verdict!r}")
        if verdict == "cut":
            gated[b] = True
            for ep in group:
                if not ep.done and not ep.cut:
                    ep.cut = "gate"


class _Rows(RolloutContext):
    """A rollout context over a list of rows, for held-out play: only what ``play`` uses."""

    def __init__(self, policy: Any, rows: list[dict], sampling: dict, info: Any):
        self.policy, self.sampling = policy, sampling
        self.info, self.meta = (lambda round_=0: info), rows.__getitem__
        # generate() reads these of the actor "policy"; nothing is scored, and play gives every request its context
        self.reward_stage, self.fill_needs, self.prompt = None, lambda rollout: None, _own_context_only


def _own_context_only(key: int) -> Any:
    raise ValueError(f"held-out play: request {key} has no context of its own (Request.prompt); play sets each one")


def heldout_returns(
    policy: Any,
    rows: list[dict],
    sampling: dict,
    info: Any,
    n: int,
    max_turns: int,
    *,
    greedy: bool,
    **play_options: Any,
) -> list[list[float]]:
    """The returns [row][episode] of ``n`` closed-loop episodes of each of ``rows`` played by
    ``policy`` (greedy actions, or sampled at ``sampling``'s settings): what an env strategy's
    ``play_heldout`` gives the held-out evaluation (``play_options`` as for ``play``)."""
    if not rows:
        return []
    played = play(
        _Rows(policy, rows, sampling, info),
        list(range(len(rows))),
        n,
        max_turns,
        sampling={"greedy": True} if greedy else None,
        **play_options,
    )
    return [[ep.ret for ep in group] for group in played.episodes]


def greedy_success(
    policy: Any, rows: list[dict], sampling: dict, info: Any, max_turns: int = 16, **play_options: Any
) -> float:
    """The share of ``rows`` whose greedy closed-loop episode (one per row) ends with a positive
    return: the held-out success of a multi-turn policy (``play_options`` as for ``play``)."""
    returns = heldout_returns(policy, rows, sampling, info, 1, max_turns, greedy=True, **play_options)
    return sum(r[0] > 0 for r in returns) / max(1, len(rows))


def check_envs(env: str | None, env_params: dict | None, rows: list[dict], who: str) -> None:
    """At build: every env the strategy will play (its ``env`` parameter, else each row's ``env``
    column) is registered or importable as ``module:Class`` and takes ``env_params``; a bad name
    fails here, naming where it was given, not at the first rollout."""
    where = {env: f"rollout.params.env={env!r}"} if env else {}
    if not env:
        for i, row in enumerate(rows):
            if row.get("env") and row["env"] not in where:
                where[row["env"]] = f"the 'env' column of train row {i + 1} ({row['env']!r})"
    if not where and rows:
        env_name(env, rows[0], who)  # neither: the error that says how to name one
    for name, given in where.items():
        try:
            build("env", name, **(env_params or {}))
        except ConfigError as err:
            raise ConfigError(
                f"rollout {who}: {given} cannot be built: {err}. Your own environment: name it as "
                f"'module:Class' (a file next to the recipe or in the working directory) or register it with "
                f"@register('env', NAME) in a module listed in plugins (docs/extending.md, 'An environment')"
            ) from None


def _cached(encode):
    table: dict = {}

    def cached(text: str | list) -> list:
        key = text if isinstance(text, str) else tuple(text)  # an observation vector (gymnasium) as a key
        if key not in table:
            table[key] = list(encode(text))
        return list(table[key])

    return cached


# ---------------------------------------------------------------------------------------------- rewards
def check_env_rewards(components: list[Any], who: str) -> None:
    """At build: an env run's text rewards are all ``env_return`` (there is one, at least)."""
    from groupwise.rewards.env_return import EnvReturn

    text = [c for c in components if getattr(c, "stage", "") == "reward" and not hasattr(c, "score_rollout")]
    others = sorted({getattr(c, "registry_name", type(c).__name__) for c in text if not isinstance(c, EnvReturn)})
    if others:
        raise ConfigError(
            f"rollout strategy {who!r} plays an environment: its rows are scored by the env's "
            f"return (reward 'env_return'), so the text rewards {others} have nothing to score; "
            "use rewards=['env_return'] (rollout scorers such as 'kl_penalty' may be added)"
        )
    if not text:
        raise ConfigError(
            f"rollout strategy {who!r} plays an environment but no reward is "
            "'env_return': add it (rewards=['env_return'], the env tasks' default)"
        )


def score_returns(ctx: Any, batch: Rollout, returns: torch.Tensor, who: str = "env") -> Rollout:
    """Each row's return ``returns`` [B,G] into every ``env_return`` column, then ``ctx.finish``
    (needs, rollout scorers, the weighted total)."""
    stage = ctx.reward_stage
    check_env_rewards(stage.text, who)
    B, G, _ = batch.shape
    parts = returns.double()[..., None].expand(B, G, len(stage.text)).clone()  # [B,G,K_text]
    parts[~batch.group_valid] = float("nan")  # padding rows: no verdict, as the text scorers leave them
    batch.reward_parts = parts
    batch.set_extra("reward_failed", torch.zeros(B, G, dtype=torch.bool), "row")
    return ctx.finish(batch, 0)
