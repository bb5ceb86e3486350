"""Planning and computing every ``Need`` of a run through registered providers, models and views.

Built once from the components' declared needs: an unknown quantity, model or view, a malformed
argument, or a grad need that its provider cannot compute with autograd is a ``ConfigError`` at
build time naming what exists. Each step, :meth:`NeedResolver.fill` computes the no-grad needs that
are still missing on a rollout: the providers' plans are merged, so every ``(model, view)`` pair
runs ONE packed forward for all the quantities read from it, and each result is stored under the
need's ``key`` (the policy's default ``logp`` is ``logp_old``, the reference's ``logp_ref``; anything
else a token-level extra). A forward of the policy's own context always refreshes ``logp_old``: it
is the sampling policy's log-prob, computed anyway.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from groupwise.registry import ConfigError, build, lookup, names
from groupwise.types import Need, Rollout

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

    def __init__(self, needs: list[Need], models: dict[str, Callable[[], contextlib.AbstractContextManager]],
                 view_params: dict[str, dict], forward: Callable[..., dict], encode: Callable[[Any], list[int]], context: int | None = None):
        self.models, self.forward, self.encode, self.view_params, self.context = models, forward, encode, view_params, context
        self.providers: dict[str, Any] = {}
        self.views: dict[str, Any] = {}
        for need in needs:
            self.check(need)

    def check(self, need: Need) -> None:
        """Build-time validation of one need (also builds its provider and views)."""
        view_params = self.view_params
        if need.name not in self.providers:
            try:
                lookup("provider", need.name)
            except ConfigError:
                raise ConfigError(f"no provider computes {need}; quantities: {', '.join(names('provider'))}") from None
            self.providers[need.name] = build("provider", need.name)
        provider = self.providers[need.name]
        provider.check(need)
        if need.grad and not (provider.grad_ok and need.model == "policy" and need.view == "default"):
            raise ConfigError(f"{need} cannot be computed with autograd: grad needs are the policy's own "
                              f"forward quantities ({', '.join(n for n in names('provider') if build('provider', n).grad_ok)})")
        for model, view in provider.plan(need):
            if model not in self.models:
                raise ConfigError(f"{need} names model {model!r}; models: {', '.join(sorted(self.models))}")
            if view != "default" and view not in self.views:
                try:
                    self.views[view] = build("view", view, **view_params.get(view, {}))
                except ConfigError as err:
                    raise ConfigError(f"{need} names view {view!r}: {err}") from None

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
            rows = rollout
            if view != "default":
                rows = self.views[view].apply(rollout, self.encode)
                check_view_rollout(view, rollout, rows, self.context)
            with self._scoring(model_name) as model:
                out = self.forward(model, rows, quantities=sorted(quantities))
            out["scored"] = rows.row_mask.bool()  # [B,G,T]
            results[(model_name, view)] = out
            if (model_name, view) == ("policy", "default"):
                rollout.logp_old = out["logp"]  # [B,G,T] the sampling policy's log-probs
        for need in missing:
            with self._scoring(need.model) as model:
                store(rollout, need, self.providers[need.name].finish(need, results, model))


def check_view_rollout(view_name: str, before: Rollout, after: Rollout, context: int | None = None) -> None:
    """A view must keep the token axis (same actions shape and mask) and fit the model's context."""
    if before.ctx:
        raise ValueError(f"view {view_name!r} edits the group's prompt, but these rows have their own contexts (rollout.ctx); "
                         f"a view cannot re-score them")
    if after.actions.shape != before.actions.shape or not torch.equal(after.mask, before.mask):
        raise ValueError(f"view {view_name!r} changed the token axis; a view edits the context and maps positions back")
    longest = max((len(p) for p in after.prompt_ids), default=0) + after.shape[2]
    if context and longest > context:
        raise ValueError(f"view {view_name!r}: an edited prompt plus the completion is {longest} tokens, more than the model's context of {context}; "
                         f"shorten the view's template (views.{view_name}.template) or rollout.max_new_tokens")
