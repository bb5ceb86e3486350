"""Generation hooks: perturbations the engine applies while it SAMPLES a request's rows, never while
the policy is trained or scored.

A rollout strategy that explores under a perturbed model (E²PO's prompt-embedding perturbations,
VSPO's steering vectors) puts a hook on its ``Request`` (``Request.hook``); the policy's engine
applies it to that request's rows only, and the rows come back as if sampled from the clean policy:
``prompt_ids`` and ``actions`` are the clean prompt and the sampled tokens, ``logp_sampler`` the
log-probs of the *hooked* model (the behaviour policy). Every later forward (old log-probs, needs,
the training loss) runs the clean model on the clean prompt: the update is on the clean condition.

Capabilities, checked at build: a strategy lists the hook kinds it uses in ``hooks`` (a tuple of
names); a policy lists the kinds its engine can apply in ``hooks`` (a frozenset; a policy without
the attribute applies none). ``rollout.context.check_strategy`` fails the build when the strategy
uses a kind the policy cannot apply, and ``RolloutContext`` refuses a hooked request the same way at
run time. The kinds:

- ``embed_delta`` (:class:`EmbedDelta`): ``delta[j]`` [P,D] is added to the input embeddings of
  the prompt tokens at ``positions`` [P] for row j of the request (the prefill only; generated
  tokens embed as usual). A row whose delta is zero is the clean prompt. The flow toy's embedding
  condition (``modalities/flow.py``, ``condition = "embedding"``) applies it too: its prompt is one
  token, the perturbed embedding goes through its frozen prompt encoder, and with ``rho`` set the
  condition of each denoising step is mixed by E²PO's noise-aware schedule γ(σ); the text engine
  has no noise levels and refuses a ``rho``.
- ``residual_add`` (:class:`ResidualAdd`): ``alpha[j] · vector`` [D] is added to the residual
  stream after decoder layer ``layer`` (0: to the embeddings) at every position, prompt and
  generated tokens, for row j. ``alpha[j] = 0`` is the clean model.
- ``kv_route`` (:class:`KvRoute`): a plan, for each row of the request, of which older frames fill
  which cache slots of an autoregressive frame generator while it generates the frames of a
  perturbation window (KVPO's KV-cache routing, spec 21; the ``ar_flow`` policy,
  ``modalities/ar_flow.py``, applies it). ``sources[j, p]`` [S] are the sequence positions whose
  frames replace the S oldest of the cache's W slots when row j generates frame ``frames[p]`` (the
  W − S most recent frames stay); a row whose sources are all −1 samples with the clean cache (the
  anchor). Scoring replays every row under the clean cache.

The text engine (``policy/engine.py``) applies both on either decoding path: the functional decoder
(``policy/functional.py``, which declares the kinds it supports in ``DecodeState.hooks``) adds them
inside its own layer loop; a call whose hooks the functional decoder does not support falls back to
the model's own forward, with ``inputs_embeds`` for ``embed_delta`` and a forward hook on the layer
module for ``residual_add``. A hooked call prefills every row separately (its prompt's keys and
values differ from row to row), so it does not share the prompt's KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from groupwise.errors import ConfigError

KINDS = ("embed_delta", "residual_add", "kv_route")


def noise_aware_gamma(sigma: Tensor, rho: float) -> Tensor:
    """γ(σ) = clip((σ − (1 − ρ)) / ρ, 0, 1): the perturbation's weight at normalised noise level σ (1 → 0),
    an ``embed_delta`` hook's ``rho`` schedule (E²PO, arXiv 2605.15803, spec 15)."""
    if not 0 < rho <= 1:
        raise ValueError(f"rho={rho} must be in (0, 1]")
    return ((sigma - (1.0 - rho)) / rho).clamp(0.0, 1.0)


def mix_condition(c_orig: Tensor, c_opt: Tensor, gamma: Tensor) -> Tensor:
    """C(t) = γ · C^opt + (1 − γ) · C^orig."""
    return gamma * c_opt + (1.0 - gamma) * c_orig


@dataclass
class EmbedDelta:
    """Row j of the request samples with ``delta[j]`` added to the embeddings of its prompt tokens at ``positions``."""

    kind: ClassVar[str] = "embed_delta"
    positions: Tensor  # [P] int64, indices into the request's prompt ids
    delta: Tensor  # [n,P,D] float32, one perturbation per row of the request
    # the noise-aware schedule γ(σ) of an engine that samples over noise levels (flow); None: on at every step
    rho: float | None = None

    def __post_init__(self) -> None:
        if self.positions.dim() != 1 or self.delta.dim() != 3 or self.delta.shape[1] != self.positions.shape[0]:
            raise ValueError(
                f"EmbedDelta: positions [P] and delta [n,P,D] do not agree (positions {tuple(self.positions.shape)}, "
                f"delta {tuple(self.delta.shape)})"
            )
        if self.rho is not None and not 0 < self.rho <= 1:
            raise ValueError(f"EmbedDelta: rho={self.rho} must be in (0, 1] (or None: no schedule)")


@dataclass
class ResidualAdd:
    """Row j of the request samples with ``alpha[j] * vector`` added to the
    residual stream after decoder layer ``layer``."""

    kind: ClassVar[str] = "residual_add"
    layer: int  # 0 = the embeddings, l = after decoder layer l (1-based, like policy.functional.hidden_states' layers)
    vector: Tensor  # [D]
    alpha: Tensor  # [n] float32

    def __post_init__(self) -> None:
        if self.layer < 0 or self.vector.dim() != 1 or self.alpha.dim() != 1:
            raise ValueError(
                f"ResidualAdd: need layer >= 0, vector [D] and alpha [n]; got layer={self.layer}, vector "
                f"{tuple(self.vector.shape)}, alpha {tuple(self.alpha.shape)}"
            )


@dataclass
class KvRoute:
    """Row j generates frame ``frames[p]`` with the frames at sequence positions ``sources[j, p]`` in the
    oldest cache slots (−1: that row's clean cache)."""

    kind: ClassVar[str] = "kv_route"
    frames: Tensor  # [P] int64, the generated frames (0-based) whose cache is routed
    sources: Tensor  # [n,P,S] int64, sequence positions (prompt frames first), −1 = the clean cache

    def __post_init__(self) -> None:
        if self.frames.dim() != 1 or self.sources.dim() != 3 or self.sources.shape[1] != self.frames.shape[0]:
            raise ValueError(
                f"KvRoute: frames [P] and sources [n,P,S] do not agree (frames {tuple(self.frames.shape)}, "
                f"sources {tuple(self.sources.shape)})"
            )
        clean = (self.sources < 0).all(-1)  # [n,P]
        if bool(((self.sources < 0).any(-1) & ~clean).any()):
            raise ValueError(
                "KvRoute: the sources of one row and frame must be all >= 0 (routed) or all −1 (the clean cache)"
            )


def hook_kinds(hooks: Sequence[Any]) -> set[str]:
    """The kinds of the (non-None) hooks."""
    return {h.kind for h in hooks if h is not None}


def check_hooks(strategy: Any, policy: Any) -> None:
    """At build: every hook kind ``strategy`` uses is one the policy's engine can apply."""
    used = set(getattr(strategy, "hooks", ()))
    unknown = used - set(KINDS)
    name = getattr(strategy, "registry_name", type(strategy).__name__)
    if unknown:
        raise ConfigError(
            f"rollout strategy {name!r} declares unknown hook kinds {sorted(unknown)}; known: {list(KINDS)}"
        )
    offered = set(getattr(policy, "hooks", ()))
    missing = used - offered
    if missing:
        raise ConfigError(
            f"rollout strategy {name!r} samples under generation hooks {sorted(missing)} that the "
            f"{policy.modality} policy's engine cannot apply (it applies {sorted(offered) or 'none'}); "
            "use a text policy (model.policy) or another rollout strategy"
        )


def row_hooks(
    hooks: Sequence[Any], n: int, prompt_lengths: Sequence[int], width: int, dim: int
) -> tuple[Tensor | None, tuple[int, Tensor] | None]:
    """The per-row form the decoders apply, for a call of ``B`` prompts with ``n`` rows each
    (rows ``b*n .. b*n+n-1`` are prompt b), left-padded to ``width``:

    ``embed_add`` [B*n,width,D] (None without an ``embed_delta``): what each row adds to its prompt's
    input embeddings (prompt position p of prompt b sits in column ``width − len_b + p``);
    ``steer`` = (layer, add [B*n,D]) (None without a ``residual_add``): what each row adds to the
    residual stream after that layer. All ``residual_add`` hooks of one call must name one layer."""
    embed_add, steer_layer, steer = None, None, None
    R = len(hooks) * n
    for b, hook in enumerate(hooks):
        if hook is None:
            continue
        if isinstance(hook, EmbedDelta):
            if hook.rho is not None:
                raise ValueError(
                    f"EmbedDelta of prompt {b}: rho={hook.rho} is a noise-level schedule; "
                    "the text engine has no noise levels (it applies the delta to the "
                    "whole completion): leave rho unset (rollout e2po: rho = none)"
                )
            if hook.delta.shape[0] != n or hook.delta.shape[2] != dim:
                raise ValueError(
                    f"EmbedDelta of prompt {b}: delta {tuple(hook.delta.shape)} must be [n={n}, P, D={dim}]"
                )
            if bool((hook.positions < 0).any()) or bool((hook.positions >= prompt_lengths[b]).any()):
                raise ValueError(
                    f"EmbedDelta of prompt {b}: positions {hook.positions.tolist()} "
                    f"outside its {prompt_lengths[b]} prompt tokens"
                )
            if embed_add is None:
                embed_add = torch.zeros(R, width, dim)  # [R,W,D]
            columns = width - prompt_lengths[b] + hook.positions  # [P]
            embed_add[b * n : (b + 1) * n, columns] = hook.delta.float()
        elif isinstance(hook, ResidualAdd):
            if hook.alpha.shape[0] != n or hook.vector.shape[0] != dim:
                raise ValueError(
                    f"ResidualAdd of prompt {b}: alpha {tuple(hook.alpha.shape)} "
                    f"must be [n={n}] and vector {tuple(hook.vector.shape)} [D={dim}]"
                )
            if steer_layer is not None and hook.layer != steer_layer:
                raise ValueError(
                    f"ResidualAdd hooks of one call name layers {steer_layer} "
                    f"and {hook.layer}; generate them in separate calls"
                )
            if steer is None:
                steer_layer, steer = hook.layer, torch.zeros(R, dim)  # [R,D]
            steer[b * n : (b + 1) * n] = hook.alpha.float()[:, None] * hook.vector.float()[None, :]
        elif isinstance(hook, KvRoute):
            raise ValueError(
                f"prompt {b}: a kv_route hook routes the frame cache of an autoregressive frame generator "
                "(model.policy = 'ar_flow'); the text engine cannot apply it"
            )
        else:
            raise ValueError(f"unknown generation hook {type(hook).__name__}; known kinds: {list(KINDS)}")
    return embed_add, (None if steer is None else (steer_layer, steer))


def residual_module(model, layer: int):
    """The module whose output is the residual stream after decoder layer ``layer`` (0: the input embeddings)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if layer == 0:
        return base.get_input_embeddings()
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, "model", base)
    layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None)
    if layers is None:
        raise ValueError(
            f"residual_add hook: no decoder layer list found on {type(base).__name__} (looked for .layers and .h)"
        )
    if not 1 <= layer <= len(layers):
        raise ValueError(
            f"residual_add hook: layer={layer} but the model has decoder layers 1..{len(layers)} (0: the embeddings)"
        )
    return layers[layer - 1]
