"""Planning and computing every ``Need`` of a run through registered providers, models and views.

Built once from the components' declared needs: an unknown quantity, model or view, a malformed
argument, or a grad need that its provider cannot compute with autograd is a ``ConfigError`` at
build time naming what exists. Each step, :meth:`NeedResolver.fill` computes the no-grad needs that
are still missing on a rollout: the providers' plans are merged, so every ``(model, view)`` pair
runs ONE packed forward for all the quantities read from it, and each result is stored under the
need's ``key`` (the policy's default ``logp`` is ``logp_old``, the reference's ``logp_ref``; anything
else a token-level extra). A forward of the policy's own context always refreshes ``logp_old``: it
is the sampling policy's log-prob, computed anyway. Each model is scored by its own policy
(``score_of[name]``: a frozen flow teacher by its flow policy), and a need of a quantity that model's
policy does not compute (``quantities_of[name]``) is refused at build naming the role.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from groupwise.errors import ConfigError
from groupwise.providers.forward import _ForwardQuantity
from groupwise.registry import build, lookup, names
from groupwise.types import Need, Rollout
from groupwise.views import Remapped

SLOTS = {("logp", "policy", "default"): "logp_old", ("logp", "ref", "default"): "logp_ref"}


def has_need(rollout: Rollout, need: Need) -> bool:
    slot = SLOTS.get((need.quantity, need.model, need.view))
    return getattr(rollout, slot) is not None if slot else need.key in rollout.extras


def store(rollout: Rollout, need: Need, value: torch.Tensor) -> None:
    slot = SLOTS.get((need.quantity, need.model, need.view))
    if slot:
        setattr(rollout, slot, value)
    else:
        rollout.set_extra(need.key, value, "token")


class NeedResolver:
    """Every need of the run, checked at build; ``fill`` computes the missing no-grad ones."""

    def __init__(
        self,
        needs: list[Need],
        models: dict[str, Callable[[], contextlib.AbstractContextManager]],
        view_params: dict[str, dict],
        forward: Callable[..., dict],
        encode: Callable[[Any], list[int]],
        context: int | None = None,
        bind_view: Callable[[Any], None] | None = None,
        quantities: frozenset[str] | None = None,
        score_of: dict[str, Callable[..., dict]] | None = None,
        quantities_of: dict[str, frozenset[str] | None] | None = None,
    ):
        self.models, self.forward, self.encode, self.view_params, self.context = (
            models,
            forward,
            encode,
            view_params,
            context,
        )
        # called once on each view built (the trainer gives it token texts and the train rows)
        self.bind_view = bind_view
        self.quantities = quantities  # what the policy's forward computes, when it declares it (Policy.quantities)
        # one scoring function per model (a role's own policy's `score`), and what each computes; a model
        # not named here is scored by `forward` and computes `quantities` (the policy and its reference)
        self.score_of = dict(score_of or {})
        self.quantities_of = dict(quantities_of or {})
        self.providers: dict[str, Any] = {}
        self.views: dict[str, Any] = {}
        for need in needs:
            self.check(need)

    def check(self, need: Need) -> None:
        """Build-time validation of one need (also builds its provider and views)."""
        if need.name not in self.providers:
            try:
                lookup("provider", need.name)
            except ConfigError:
                raise ConfigError(f"no provider computes {need}; quantities: {', '.join(names('provider'))}") from None
            self.providers[need.name] = build("provider", need.name)
        provider = self.providers[need.name]
        provider.check(need)
        if isinstance(provider, _ForwardQuantity):
            for model, _ in provider.plan(need):
                own = self.quantities_of.get(model, self.quantities)
                if own is None or need.name in own:
                    continue
                if model in self.quantities_of:
                    raise ConfigError(
                        f"{need}: model {model!r} (roles.{model}) computes {sorted(own)}, not {need.name!r}; "
                        f"name a role whose policy kind computes it (roles.{model}.model.policy)"
                    )
                raise ConfigError(
                    f"{need}: this run's policy computes {sorted(own)}, not {need.name!r} "
                    f"(a quantity of another policy kind, model.policy)"
                )
        if need.grad and not (provider.grad_ok and need.model == "policy" and need.view == "default"):
            raise ConfigError(
                f"{need} cannot be computed with autograd: grad needs are the policy's own "
                f"forward quantities ({', '.join(n for n in names('provider') if build('provider', n).grad_ok)})"
            )
        for model, view in provider.plan(need):
            if model not in self.models:
                raise ConfigError(f"{need} names model {model!r}; models: {', '.join(sorted(self.models))}")
            if view != "default" and view not in self.views:
                try:
                    self.view(view)
                except ConfigError as err:
                    raise ConfigError(f"{need} names view {view!r}: {err}") from None

    def view(self, name: str) -> Any:
        """The run's view ``name`` (built once with its ``views.NAME`` parameters;
        shared by needs and ``eval.views``)."""
        if name not in self.views:
            view = build("view", name, **self.view_params.get(name, {}))
            if self.bind_view is not None:
                self.bind_view(view)
            self.views[name] = view
        return self.views[name]

    def plan(self, needs: list[Need]) -> dict[tuple[str, str], set[str]]:
        merged: dict[tuple[str, str], set[str]] = {}
        for need in needs:
            for pair, quantities in self.providers[need.name].plan(need).items():
                merged.setdefault(pair, {"logp"}).update(quantities)
        return merged

    @contextlib.contextmanager
    def _scoring(self, model_name: str) -> Iterator[Any]:
        with torch.no_grad(), self.models[model_name]() as model:
            yield model

    def fill(self, rollout: Rollout, needs: list[Need]) -> None:
        """Compute every no-grad need missing on ``rollout`` (a rank's share of the step batch)."""
        missing = [n for n in needs if not n.grad and not has_need(rollout, n)]
        if not missing:
            return
        for need in missing:
            self.check(need)
        results: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        for (model_name, view), quantities in self.plan(missing).items():
            rows, positions = rollout, None
            if view != "default":
                rows = self.views[view].apply(rollout, self.encode)
                if isinstance(rows, Remapped):
                    rows, positions = rows.rows, rows.positions
                check_view_rollout(view, rollout, rows, self.context, positions)
            with self._scoring(model_name) as model:
                out = self.score_of.get(model_name, self.forward)(model, rows, quantities=sorted(quantities))
            if positions is None:
                out["scored"] = rows.row_mask.bool()  # [B,G,T]
            else:  # the view edited the completions: every quantity back on the original token axis
                out = remap_back(out, positions, rollout.row_mask.bool())
            results[(model_name, view)] = out
            if (model_name, view) == ("policy", "default"):
                rollout.logp_old = out["logp"]  # [B,G,T] the sampling policy's log-probs
        for need in missing:
            with self._scoring(need.model) as model:
                store(rollout, need, self.providers[need.name].finish(need, results, model))


def remap_back(
    out: dict[str, torch.Tensor], positions: torch.Tensor, row_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Token quantities [B,G,T',...] of a view's edited rows -> [B,G,T,...] on the original axis:
    token t takes the value at ``positions[b,g,t]``; 0 where it has no counterpart (−1) or is off
    ``row_mask``. ``scored`` [B,G,T] marks the tokens that got a value."""
    scored = row_mask & (positions >= 0)  # [B,G,T]
    index = positions.clamp(min=0)  # [B,G,T]
    back = {}
    for key, value in out.items():
        idx = index.view(*index.shape, *([1] * (value.dim() - 3))).expand(*index.shape, *value.shape[3:])  # [B,G,T,...]
        got = value.gather(2, idx.to(value.device))  # [B,G,T,...]
        keep = scored.view(*scored.shape, *([1] * (value.dim() - 3))).to(value.device)  # [B,G,T,1..]
        back[key] = torch.where(keep, got, torch.zeros((), dtype=value.dtype, device=value.device))
    back["scored"] = scored
    return back


def check_view_rollout(
    view_name: str, before: Rollout, after: Rollout, context: int | None = None, positions: torch.Tensor | None = None
) -> None:
    """A view must keep the token axis (same actions shape and mask) and fit the model's context; one that
    edits the groups' prompts cannot re-score rows with their own contexts (it may set ``ctx`` itself). A view
    that edits completions (``positions`` given) must keep the groups and rows, and map each original
    token either to the same token id inside the edited row's mask or to −1."""
    if before.ctx and after.ctx == before.ctx and after.prompt_ids != before.prompt_ids:
        raise ValueError(
            f"view {view_name!r} edits the group's prompt, but these rows have their own contexts (rollout.ctx); "
            f"a view cannot re-score them"
        )
    if positions is None:
        if after.actions.shape != before.actions.shape or not torch.equal(after.mask, before.mask):
            raise ValueError(
                f"view {view_name!r} changed the token axis; a view edits the context, or returns views.Remapped "
                f"with the position of each original token in its edited rows"
            )
    else:
        B, G, T = before.shape
        T2 = after.shape[2]
        if (
            tuple(after.actions.shape[:2]) != (B, G)
            or tuple(positions.shape) != (B, G, T)
            or positions.dtype != torch.long
        ):
            raise ValueError(
                f"view {view_name!r}: edited rows {tuple(after.actions.shape)} and "
                f"positions {tuple(positions.shape)} ({positions.dtype}) must keep the {B} "
                f"groups x {G} rows and give a long index per original token [{B},{G},{T}]"
            )
        mapped = (positions >= 0) & before.mask  # [B,G,T]
        if bool(((positions >= 0) & ~before.mask).any()) or bool((positions >= T2).any()):
            raise ValueError(
                f"view {view_name!r}: positions map padding tokens, or point past the edited rows' {T2} tokens"
            )
        index = positions.clamp(min=0, max=max(T2 - 1, 0))  # [B,G,T]
        if T2 == 0:
            same = ~mapped
        else:
            same = (after.actions.gather(2, index) == before.actions) & after.mask.gather(2, index)  # [B,G,T]
        if bool((mapped & ~same).any()):
            raise ValueError(
                f"view {view_name!r}: a mapped token is not the same token inside the edited row's mask; "
                f"positions must point at the original token's copy"
            )
    longest = max((len(c) for row in after.row_contexts() for c in row), default=0) + after.shape[2]
    if context and longest > context:
        raise ValueError(
            f"view {view_name!r}: an edited prompt plus the completion is {longest} "
            f"tokens, more than the model's context of {context}; shorten the "
            f"view's template (views.{view_name}.template) or rollout.max_new_tokens"
        )
