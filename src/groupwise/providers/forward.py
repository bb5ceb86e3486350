"""Quantities read from one packed forward pass: ``logp``, ``entropy``, ``topk(k)``, ``hidden(l)``.

Each is the value at completion token t computed from the position that predicts it (the prefix
``context, y_<t``), under the need's model and view, float32, 0 outside the mask. ``topk(k)`` is the
k largest log-probs of the next-token distribution [B,G,T,k] (descending); ``hidden(l)`` the residual
stream after decoder layer l (0 = the embeddings) [B,G,T,H]. ``hidden`` takes the model's own
forward off the functional path only where the functional decoder does not run.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from groupwise.registry import ConfigError, register
from groupwise.types import Need


def _arg_int(need: Need, low: int) -> int:
    arg = need.arg
    if arg is None or not arg.isdigit() or int(arg) < low:
        raise ConfigError(f"need {need.quantity!r}: the argument must be an integer >= {low}, e.g. {need.name}({max(low, 1)})")
    return int(arg)


@dataclass
class _ForwardQuantity:
    grad_ok = True
    takes_arg = False
    low = 0

    def check(self, need: Need) -> None:
        if self.takes_arg:
            _arg_int(need, self.low)
        elif need.arg is not None:
            raise ConfigError(f"need {need.quantity!r}: {need.name} takes no argument")

    def plan(self, need: Need) -> dict[tuple[str, str], set[str]]:
        return {(need.model, need.view): {need.quantity}}

    def finish(self, need: Need, results: dict, model) -> Tensor:
        return results[(need.model, need.view)][need.quantity]


@register("provider", "logp")
@dataclass
class LogProb(_ForwardQuantity):
    """Log-probability of each sampled token [B,G,T]."""


@register("provider", "entropy")
@dataclass
class Entropy(_ForwardQuantity):
    """Entropy of the next-token distribution at each completion token [B,G,T]."""


@register("provider", "topk")
@dataclass
class TopK(_ForwardQuantity):
    """The k largest next-token log-probs at each completion token [B,G,T,k]."""

    takes_arg = True
    low = 1


@register("provider", "hidden")
@dataclass
class Hidden(_ForwardQuantity):
    """Residual-stream hidden state after layer l at the position predicting each token [B,G,T,H]."""

    takes_arg = True
    low = 0
