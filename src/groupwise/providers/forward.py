"""Quantities read from one forward pass: ``logp``, ``logprobs``, ``entropy``, ``topk(k)``, ``hidden(l)``;
``attn_at(l)``, ``hidden_at(l)``.

Standard practice, no paper: GRPO's ratio and KL terms need the per-token log-probs of the sampled
completion under the policy and the reference model (DeepSeekMath, Shao et al. 2024,
https://arxiv.org/abs/2402.03300). The other quantities come from the same forward pass, for the
variants that read them.

**Change vs GRPO**: none — ``logp`` is the quantity GRPO uses; ``logprobs``, ``entropy``, ``topk(k)``
and ``hidden(l)`` only add outputs of the same forward (e.g. the ``top_entropy`` token weight reads
``entropy``, the ``ssopd`` term reads ``logprobs`` under its own context and a hint view).

**Math** (``logq = log_softmax(logits.float())``, the output head at the position that predicts
completion token ``y_t``, i.e. given the prefix ``context, y_<t``)::

    logp[b,g,t]      = logq[y_t]                                    # [B,G,T]
    logprobs[b,g,t]  = logq                                         # [B,G,T,V]  vocabulary order
    entropy[b,g,t]   = -Σ_v exp(logq[v]) · logq[v]                  # [B,G,T]
    topk(k)[b,g,t]   = the k largest logq[v], descending            # [B,G,T,k]
    hidden(l)[b,g,t] = residual stream after decoder layer l         # [B,G,T,H]   (0 = embeddings)

at the position OF completion token t (q = P + t, P the row's prompt length; extra eager pass):
    attn_at(l)[b,g,t,h,k] = A_l[h, q, k]                             # [B,G,T,heads,S]  (l >= 1)
                       k = key position in the row's prompt + completion (0 = its first prompt token);
                       S = longest prompt + T; 0 at future keys and past the row's end
    hidden_at(l)[b,g,t]   = the model's own hidden_states[l] at q    # [B,G,T,H]  (l = layers: after the final norm)

masked-diffusion LMs (``modalities/mdlm.py`` Note 4), at each canvas position t:
    strat_logp(K)[b,g,t] = log p_θ(y_t | x, y with t's stratum masked), K strata    # [B,G,T]
    elbo(M)[b,g,t]       = t's Monte-Carlo ELBO term from M mask draws                  # [B,G,T]

continuous policies (the flow toy, ``modalities/flow.py`` Note 9), at each trained step t:
    step_mean[b,g,t] = the mean of the step's Gaussian kernel (Euler SDE or consistency)  # [B,G,T,D]
    x0_pred[b,g,t]   = x̂₀ = x_t − σ_t·v_θ(x_t, σ_t), the clean-sample prediction          # [B,G,T,D]

Each is the value at completion token t computed from the position that predicts it (the prefix
``context, y_<t``), under the need's model and view, float32, 0 outside the mask.

**Defaults**: none; the providers have no fields. ``topk`` and ``hidden`` take their argument from
the need's name: ``topk(k)`` with an integer k ≥ 1, ``hidden(l)`` with l ≥ 0, ``strat_logp(K)`` and ``elbo(M)``
with K, M ≥ 1.

**Notes**

1. ``hidden`` takes the model's own forward off the functional path only where the functional
   decoder does not run.
2. The logits are the raw model's (temperature 1, after the architecture's own logit scaling or
   soft-capping): the rollout's sampling temperature does not enter.
3. ``topk(k)`` with k larger than the vocabulary pads the missing entries with ``-inf``. ``topk``
   keeps only the values (sorted, no token ids); ``logprobs`` keeps the whole distribution in
   vocabulary order, for a divergence between two contexts' distributions that needs a gradient (a
   no-grad one is cheaper as ``kl_to(VIEW)``). It is [B,G,T,V] float32 on every row and token: fine
   for a small vocabulary, 4·V bytes a token for a large one.
4. ``attn_at(l)``: the attention probabilities of decoder layer l (1-based), every head, of the
   query AT token t (attention describes the token's own row, as the spec-03 features read it; the
   other quantities sit at the position predicting t). They need eager attention
   (``output_attentions=True``), so the forward runs the model's own forward once more on
   right-padded rows (``policy.forward._eager_states``), switching an SDPA model to eager for the
   call: not packed, not on the functional path, no autograd (``grad_ok = False``). ``hidden_at(l)``
   comes from the same pass (without attention outputs when asked alone): the state AT token t,
   so the state after a turn's last token (its EOS) is readable. Memory is ``[B,G,T,heads,S]`` per
   layer: meant for short multi-turn toys (first reader: PAIR, spec 03, ``rewards/pair.py``). A
   layer above the model's count is a ``ValueError`` at the first forward.
5. ``check`` runs at build time: a missing or non-integer argument of ``topk``/``hidden`` (or one
   below its minimum), or any argument given to ``logp``/``entropy``, is a ``ConfigError``.
6. ``grad_ok = True``: these may be computed with autograd inside a micro-batch, but only as the
   policy's own default-view quantities (``needs.NeedResolver.check``). ``plan`` asks the forward
   of the need's ``(model, view)`` for the quantity, and all quantities of one pair share one pass.
7. A policy declares the quantities its forward computes (``Policy.quantities``); a need of another
   (``step_mean`` on a text policy, ``topk`` on the flow toy) is a ``ConfigError`` at build.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.types import Need


def _arg_int(need: Need, low: int) -> int:
    arg = need.arg
    if arg is None or not arg.isdigit() or int(arg) < low:
        raise ConfigError(
            f"need {need.quantity!r}: the argument must be an integer >= {low}, e.g. {need.name}({max(low, 1)})"
        )
    return int(arg)


@dataclass
class _ForwardQuantity:
    grad_ok = True
    _takes_arg = False
    _low = 0

    def check(self, need: Need) -> None:
        if self._takes_arg:
            _arg_int(need, self._low)
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


@register("provider", "logprobs")
@dataclass
class LogProbs(_ForwardQuantity):
    """The whole next-token log-distribution at each completion token [B,G,T,V] (vocabulary order)."""


@register("provider", "entropy")
@dataclass
class Entropy(_ForwardQuantity):
    """Entropy of the next-token distribution at each completion token [B,G,T]."""


@register("provider", "topk")
@dataclass
class TopK(_ForwardQuantity):
    """The k largest next-token log-probs at each completion token [B,G,T,k]."""

    _takes_arg = True
    _low = 1


@register("provider", "step_mean")
@dataclass
class StepMean(_ForwardQuantity):
    """The mean of each trained Gaussian step of a continuous policy [B,G,T,D] (Euler SDE or consistency).

    ``modalities/flow.py`` Note 9; a policy kind without it is refused at build."""


@register("provider", "x0_pred")
@dataclass
class X0Pred(_ForwardQuantity):
    """The clean-sample prediction x̂₀ = x − σ·v_θ at each trained step of a flow policy [B,G,T,D]."""


@register("provider", "strat_logp")
@dataclass
class StratifiedLogProb(_ForwardQuantity):
    """A masked-diffusion LM's stratified-masking log-prob of each canvas token with K strata [B,G,T]
    (K = 1: mean-field; ``modalities/mdlm_likelihood.py``); the strata come from the row's seed."""

    _takes_arg = True
    _low = 1


@register("provider", "elbo")
@dataclass
class ElboTerms(_ForwardQuantity):
    """A masked-diffusion LM's per-token Monte-Carlo ELBO terms from M mask draws [B,G,T] (their sum over T is
    the row's ELBO estimate; ``modalities/mdlm_likelihood.py``)."""

    _takes_arg = True
    _low = 1


@register("provider", "hidden")
@dataclass
class Hidden(_ForwardQuantity):
    """Residual-stream hidden state after layer l at the position predicting each token [B,G,T,H]."""

    _takes_arg = True
    _low = 0


@dataclass
class _EagerQuantity(_ForwardQuantity):
    """A quantity of the extra eager pass (Note 3): a layer argument, no autograd."""

    grad_ok = False
    _takes_arg = True


@register("provider", "attn_at")
@dataclass
class AttentionAt(_EagerQuantity):
    """Layer l's attention probabilities (every head, every key position of the row) of the query at each token
    [B,G,T,heads,S]; no grad."""

    _low = 1


@register("provider", "hidden_at")
@dataclass
class HiddenAt(_EagerQuantity):
    """The model's own hidden_states[l] at each token's own position [B,G,T,H] (the eager pass); no grad."""
