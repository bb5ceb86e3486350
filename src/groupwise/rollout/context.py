"""What a rollout strategy is given: ``strategy(ctx) -> Rollout`` owns the collection of a step's batch.

A strategy decides which prompts to ask for, how many rows each, in how many rounds, and what to
keep; the context does the mechanics the same way for every strategy:

- ``draw(n, round)`` — the next ``n`` prompt ids from the sampler (identical on every rank);
- ``rollout(requests, round)`` — the whole scored batch for these requests (a request's own
  ``prompt``, when set, is its context; otherwise its dataset row's prompt): each rank generates
  its share with the policy, the text rewards and the round's no-grad needs run on that share, the
  shares are gathered, and the rollout scorers and the weighted total run on the whole batch
  (``rewards`` [B,G], ``group_valid``); identical on every rank. A request's ``extras`` (row
  labels, e.g. a steering intensity) are set as row extras before anything is scored;
- ``keep(batch)`` — the sampler's whole-batch verdict per group ([B] bool), ``max_rounds``;
- ``generate(requests, round)`` — the generated rows only (decoded ``completions``, no rewards, no
  needs), each rank its share, gathered: for strategies that assemble their rows themselves (the
  env runner, ``rollout/env.py``), which then hand the assembled batch, its text reward columns
  filled, to ``finish(batch, round)``: the round's needs, the rollout scorers and the weighted total.

A request may override the step's sampling settings (``Request.sampling``, e.g. ``{"greedy":
True}``): requests with the same overrides are generated together, and the rows come back in the
order requested. ``check_strategy`` fails the build when a strategy uses a sampling key the policy
does not offer, uses a generation hook (``Request.hook``, ``groupwise.hooks``) the policy's engine
cannot apply, or a component reads an extra no strategy collects.

A request may also force a completion prefix (``Request.prefix``, token ids; any policy with
``encode``): the engine samples after ``prompt + prefix`` (so greedy, hooked and overridden requests
compose with it), and each row becomes ``actions = prefix + sampled`` under the request's prompt.
The forced tokens are ``loss_mask`` holes (they carry no loss) unless ``Request.train_prefix`` (a
strategy that enumerates counterfactual decisions and trains them, ``rollout/dpa_game.py``); their
``logp_sampler`` is the policy's exact log-prob of the imposed tokens, from one no-grad forward
(``force_prefixes``), so a decision's probability is read off a forced branch without sampling it;
the rows carry the row flag ``forced`` (``types.FORCED``).

Actors (``roles.NAME.samples = true``, M9) sample too: ``rollout``, ``generate`` and ``finish`` take
``actor=NAME`` (default ``"policy"``, the trained policy) and then use that actor's policy, prompt
encoding, reward stage (its own ``decode``) and no-grad needs; ``policy_of(NAME)`` is its policy (to
encode a context or retokenize text, ``groupwise.tokens``), and ``score(batch, round, actor)`` scores
rows a strategy assembled from tokens (decode, text rewards, then ``finish``). A strategy that samples with actors
returns ``dict[str, Rollout]``, one batch per actor (``"policy"`` required).

It also counts, over every batch it scored, how many rows had a finite reward (``finite_fraction``),
which the trainer uses to stop a run whose rewards are never finite.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from groupwise import dist
from groupwise.errors import ConfigError
from groupwise.hooks import check_hooks
from groupwise.types import _LEVELS, FORCED, Request, Rollout, StepInfo


def check_strategy(strategy: Any, policy: Any, components: list[Any]) -> None:
    """At build: the strategy's ``request_options`` are offered by the policy, every extra a
    component lists in ``rollout_extras`` is one the strategy ``collects`` or the policy writes (its
    ``row_extras`` / ``token_extras``), and every request extra the policy samples under (its
    ``condition_extras``: the flow toy's discrete conditions) is one the strategy collects."""
    name = getattr(strategy, "registry_name", type(strategy).__name__)
    missing = set(getattr(strategy, "request_options", ())) - set(getattr(policy, "request_options", ()))
    if missing:
        raise ConfigError(
            f"rollout strategy {name!r} asks for sampling options {sorted(missing)} that the {policy.modality} "
            f"policy does not offer (it offers {sorted(getattr(policy, 'request_options', ()))})"
        )
    check_hooks(strategy, policy)  # the generation hooks it samples under (groupwise.hooks)
    # a strategy's own build-time check of the run's components (env runs: their rewards)
    if hasattr(strategy, "check"):
        strategy.check(components)
    collected = set(getattr(strategy, "collects", ()))
    conditions = sorted(set(getattr(policy, "condition_extras", None) or ()) - collected)
    if conditions:  # a policy that samples under request extras needs a strategy that sets them
        raise ConfigError(
            f"the {policy.modality} policy samples under the request extras {conditions} (model.params "
            f"condition_extras), which the rollout strategy {name!r} does not set (it collects "
            f"{sorted(collected) or 'nothing'}); pick a strategy that sets them, or drop condition_extras"
        )
    written = {*getattr(policy, "row_extras", ()), *getattr(policy, "token_extras", ())}
    for component in components:
        for extra in getattr(component, "rollout_extras", ()):
            if extra not in collected | written:
                who = (
                    f"{getattr(component, 'stage', '')} component "
                    f"{getattr(component, 'registry_name', type(component).__name__)!r}"
                )
                raise ConfigError(
                    f"{who} reads {extra!r}, which the rollout strategy {name!r} does "
                    f"not collect (it collects {sorted(collected) or 'nothing'}); pick a "
                    "strategy that does, e.g. rollout.name='remax' for 'baseline_reward'"
                )


@dataclass
class ActorIO:
    """What the context samples and scores an actor's rows with (the trained policy's are the context's own)."""

    policy: Any  # what generates its rows
    reward_stage: Any  # the run's rewards, decoding with this actor's tokenizer
    fill_needs: Callable[[Rollout], None]  # its round needs, ``policy`` meaning this actor
    prompt: Callable[[int], Any]  # a train row's prompt in this actor's encoding


class RolloutContext:
    def __init__(
        self,
        policy: Any,
        sampler: Any,
        reward_stage: Any,
        fill_needs: Callable[[Rollout], None],
        prompt: Callable[[int], Any],
        meta: Callable[[int], dict],
        info: Callable[[int], StepInfo],
        sampling: dict,
        batch_size: int,
        group_size: int,
        actors: dict[str, ActorIO] | None = None,
    ):
        self.policy, self.sampler, self.reward_stage, self.fill_needs = policy, sampler, reward_stage, fill_needs
        self.prompt, self.meta, self.info, self.sampling = prompt, meta, info, sampling
        self.batch_size, self.group_size = batch_size, group_size
        self.max_rounds = max(1, getattr(sampler, "max_rounds", 1))
        self.finite, self.scored = 0, 0
        self.actors = dict(actors or {})  # the other actors by name

    def actor(self, name: str) -> ActorIO:
        """What actor ``name`` samples and scores with; ``"policy"``: the context's own (as they are now)."""
        if name == "policy":
            return ActorIO(self.policy, self.reward_stage, self.fill_needs, self.prompt)
        if name not in self.actors:
            raise ConfigError(
                f"a rollout strategy sampled with actor {name!r}; this run's actors are "
                f"{sorted(['policy', *self.actors])} (an actor is a role with roles.{name}.samples = true)"
            )
        return self.actors[name]

    def policy_of(self, actor: str) -> Any:
        """The policy actor ``actor`` samples with."""
        return self.actor(actor).policy

    def draw(self, n: int, round_: int = 0) -> list[int]:
        return self.sampler.draw(n, self.info(round_))

    def rollout(self, requests: list[Request], round_: int = 0, actor: str = "policy") -> Rollout:
        io, info = self.actor(actor), self.info(round_)
        start, stop = dist.shard_bounds(len(requests))
        mine = [dataclasses.replace(r, prompt=self._context(r, io)) for r in requests[start:stop]]
        local = self._generate(mine, info, io.policy)
        local.meta = [self.meta(r.key) for r in mine]
        io.reward_stage.score_local(local, info)
        io.fill_needs(local)
        batch = dist.gather_rollout(local)
        real = batch.group_valid.clone()  # [B,G] rows that exist (not the padding of ragged groups)
        io.reward_stage.finish(batch, info)
        self.finite += int((torch.isfinite(batch.rewards) & real).sum())
        self.scored += int(real.sum())
        return batch

    def generate(self, requests: list[Request], round_: int = 0, actor: str = "policy") -> Rollout:
        """The generated rows of these requests with their decoded ``completions`` and dataset
        ``meta``, NOT scored: each rank generates its share, the shares are gathered."""
        io, info = self.actor(actor), self.info(round_)
        start, stop = dist.shard_bounds(len(requests))
        mine = [dataclasses.replace(r, prompt=self._context(r, io)) for r in requests[start:stop]]
        local = self._generate(mine, info, io.policy)
        local.meta = [self.meta(r.key) for r in mine]
        local.completions = io.policy.decode(local)  # [B][G]
        return dist.gather_rollout(local)

    def finish(self, batch: Rollout, round_: int = 0, actor: str = "policy") -> Rollout:
        """Score a batch the strategy assembled (whole, identical on every rank) whose text reward
        columns it filled itself (``reward_parts`` [B,G,K_text], extra ``reward_failed`` [B,G]): the
        round's no-grad needs, the rollout scorers and the weighted total, as ``rollout`` does."""
        io = self.actor(actor)
        real = batch.group_valid.clone()  # [B,G]
        io.fill_needs(batch)
        io.reward_stage.finish(batch, self.info(round_))
        self.finite += int((torch.isfinite(batch.rewards) & real).sum())
        self.scored += int(real.sum())
        return batch

    def score(self, batch: Rollout, round_: int = 0, actor: str = "policy") -> Rollout:
        """Score rows the strategy assembled from tokens (whole, identical on every rank; e.g. text
        retokenized from another actor, ``groupwise.tokens``): decoded with ``actor``'s tokenizer, its
        text rewards, then ``finish``."""
        self.actor(actor).reward_stage.score_local(batch, self.info(round_))
        return self.finish(batch, round_, actor)

    def _context(self, request: Request, io: ActorIO | None = None) -> Any:
        """The request's own context (checked against the model's length), else its dataset row's
        prompt; with a forced ``prefix``, the context and the prefix are checked together."""
        io = io or self.actor("policy")
        prompt = io.prompt(request.key) if request.prompt is None else request.prompt
        if request.prompt is not None or request.prefix:
            where = "a request's own context" if request.prompt is not None else "a request's prompt"
            io.policy.check_fits(
                list(prompt) + list(request.prefix or ()),
                self.sampling["max_new_tokens"],
                f"{where}{' and forced prefix' if request.prefix else ''} for row {request.key}",
            )
        return prompt

    def _generate(self, requests: list[Request], info: StepInfo, policy: Any = None) -> Rollout:
        """The requests' rows with their forced prefixes (``force_prefixes``) and ``extras`` set (``_sample``)."""
        policy = self.policy if policy is None else policy
        if any(r.prefix for r in requests):
            if not hasattr(policy, "encode"):
                raise ValueError(
                    f"Request.prefix forces completion tokens, which the {policy.modality} policy cannot take "
                    "(it has no encode); drop the prefix or use a text policy"
                )
            sampled = [
                dataclasses.replace(r, prompt=list(r.prompt) + list(r.prefix)) if r.prefix else r for r in requests
            ]
            out = force_prefixes(self._sample(sampled, info, policy), requests, policy)
        else:
            out = self._sample(requests, info, policy)
        names = sorted({name for r in requests for name in (r.extras or {})})
        for name in names:
            values = torch.zeros(out.shape[0], out.shape[1])  # [B,G]
            for b, r in enumerate(requests):
                if r.extras and name in r.extras:
                    values[b, : r.n] = torch.as_tensor(r.extras[name], dtype=torch.float32)
            out.set_extra(name, values, "row")
        return out

    def _sample(self, requests: list[Request], info: StepInfo, policy: Any = None) -> Rollout:
        """One policy call per distinct sampling override (usually one call), rows in request order."""
        policy = self.policy if policy is None else policy
        by_override: dict[tuple, list[int]] = {}
        offered = getattr(policy, "request_options", frozenset())
        hooks = set(getattr(policy, "hooks", ()))
        for i, r in enumerate(requests):
            if r.hook is not None and r.hook.kind not in hooks:
                raise ValueError(
                    f"Request.hook of kind {r.hook.kind!r} cannot be applied by the "
                    f"{policy.modality} policy's engine (it applies {sorted(hooks) or 'none'})"
                )
            if set(r.sampling or ()) - offered:
                raise ValueError(
                    f"Request.sampling keys {sorted(set(r.sampling) - offered)} "
                    f"are not offered by the policy (it offers {sorted(offered)})"
                )
            by_override.setdefault(tuple(sorted((r.sampling or {}).items())), []).append(i)
        if len(by_override) == 1:
            override = dict(next(iter(by_override)))
            return policy.generate(requests, {**self.sampling, **override}, info)
        if len({max(requests[i].n for i in index) for index in by_override.values()}) > 1:
            raise ValueError(
                "requests with different sampling overrides in one rollout "
                "call must have the same largest n; make one call per override"
            )
        parts, order = [], []
        for override, index in by_override.items():
            parts.append(policy.generate([requests[i] for i in index], {**self.sampling, **dict(override)}, info))
            order += index
        joined = Rollout.concat(parts)
        return joined.select(torch.tensor(order).argsort())  # back to the order requested

    def keep(self, batch: Rollout) -> torch.Tensor:
        return self.sampler.keep(batch)  # [B] bool

    @property
    def finite_fraction(self) -> float:
        return self.finite / max(1, self.scored)


def force_prefixes(batch: Rollout, requests: list[Request], policy: Any) -> Rollout:
    """``batch`` (sampled after ``prompt + prefix``) as rows of ``prefix + sampled`` under each request's
    ``prompt``: every token-level field shifts right by its group's prefix length P_b (module
    docstring). The forced positions get ``actions`` = the prefix, ``mask`` on valid rows,
    ``loss_mask`` only with ``train_prefix``, the segment of the row's first sampled token, and
    ``logp_sampler`` = the policy's no-grad log-prob of the prefix after the prompt; 0 in other
    token fields. Rows of a request with a prefix get the row flag ``forced``."""
    B, G, T = batch.shape
    lengths = [len(r.prefix or ()) for r in requests]  # [B] P_b
    T2 = T + max(lengths)
    valid = batch.group_valid  # [B,G]

    def shift(v: torch.Tensor, fill: Any = 0) -> torch.Tensor:  # [B,G,T,...] -> [B,G,T2,...]
        out = torch.full((B, G, T2, *v.shape[3:]), fill, dtype=v.dtype)
        for b, p in enumerate(lengths):
            out[b, :, p : p + T] = v[b]
        return out

    fields: dict[str, Any] = {}
    for name, v in batch.fields():
        level, fill = _LEVELS[name]
        token = level == "token" or (level == "auto" and isinstance(v, torch.Tensor) and v.dim() == 3)
        if isinstance(v, torch.Tensor) and token:
            fields[name] = shift(v, fill)
        elif name == "extras":
            fields[name] = {k: shift(t) if batch.extra_levels[k] == "token" else t for k, t in v.items()}
        else:
            fields[name] = v
    loss_mask = shift(batch.loss_mask if batch.loss_mask is not None else batch.mask, False)  # [B,G,T2]
    segment = fields["segment_id"]  # [B,G,T2] or None
    for b, (r, p) in enumerate(zip(requests, lengths)):
        if not p:
            continue
        fields["actions"][b, :, :p] = torch.tensor(r.prefix, dtype=torch.long)
        fields["mask"][b, :, :p] = valid[b, :, None]
        loss_mask[b, :, :p] = valid[b, :, None] & r.train_prefix
        if segment is not None:
            segment[b, :, :p] = segment[b, :, p : p + 1]  # the prefix belongs to the turn it starts
    fields["loss_mask"] = loss_mask
    fields["prompt_ids"] = [list(r.prompt) for r in requests]
    out = Rollout(**fields)
    forced = torch.tensor(lengths)[:, None].gt(0) & valid  # [B,G]
    out.set_flag(FORCED, forced)
    if out.logp_sampler is not None:  # the imposed tokens' exact log-probs: one no-grad forward, one row per group
        chosen = [b for b, p in enumerate(lengths) if p]
        P = max(lengths)
        probe_actions = torch.zeros(len(chosen), 1, P, dtype=torch.long)  # [K,1,P]
        for k, b in enumerate(chosen):
            probe_actions[k, 0, : lengths[b]] = torch.tensor(requests[b].prefix, dtype=torch.long)
        probe = Rollout(
            prompt_ids=[list(requests[b].prompt) for b in chosen],
            actions=probe_actions,  # [K,1,P]
            mask=torch.arange(P)[None, None, :] < torch.tensor([lengths[b] for b in chosen])[:, None, None],  # [K,1,P]
            group_valid=torch.ones(len(chosen), 1, dtype=torch.bool),  # [K,1]
            truncated=torch.zeros(len(chosen), 1, dtype=torch.bool),  # [K,1]
            prompt_index=out.prompt_index[chosen],  # [K]
        )
        with torch.no_grad():
            logp = policy.forward(probe, ("logp",))["logp"].float()  # [K,1,P]
        for k, b in enumerate(chosen):
            out.logp_sampler[b, :, : lengths[b]] = logp[k, 0, : lengths[b]] * valid[b, :, None]
    return out
