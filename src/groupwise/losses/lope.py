"""LoPE policy shaping: swapped-in resamples get the unclipped shaped ratio ρ/(ρ+γ); real rollouts keep
the base objective (PPO clip by default).

"Nonsense Helps: Prompt Space Perturbation Broadens Reasoning Exploration", Langlin Huang, Chengsong
Huang, Jinyuan Li, Donghong Cai, Yuyi Yang, Jiaxin Huang, 2026. https://arxiv.org/abs/2605.05566 —
spec 61. Code read: https://github.com/shrango/LoPE ``verl/trainer/core_algos.py``
``compute_policy_loss`` (``policy_shaping``, ``policy_shaping_gamma``, ``real_rollout``).

**Change vs GRPO**: the rows the rollout strategy ``lope`` swapped into a group (the row flag
``injected``, the code's ``real_rollout = False``) were sampled under a Lorem-perturbed prompt δ ⊕ x
(their ``behav_ctx``) but are trained
under x. Their importance ratio compares the current policy on x with the behaviour policy on δ ⊕ x,
is reshaped to ρ' = ρ/(ρ+γ) and is **not clipped**. Every other row gets the ``base`` term's loss
unchanged: this term wraps ``ppo_clip`` (default), ``gspo`` or any other policy term.

**Math** (``mask`` = the loss tokens; ``behav`` = the behaviour log-probs under δ ⊕ x: ``logp_sampler``,
the sampler's, or with ``behaviour = "view"`` the need ``Need("logp", view="behaviour")``)::

    log_rho = logp − behav                                         level = "token"
            = mean_t(mask · (logp − behav))         (every token)  level = "sequence" (GSPO's ratio)
    rho     = exp(clamp(log_rho, −20, 20))
    shaped  = rho / (rho + gamma)                  d shaped / d logp = rho·gamma / (rho + gamma)²
    loss    = −adv · shaped                        injected rows
            = base(mb, out)                        other rows (row losses spread over their tokens)

``shaped`` is at most 1 and its gradient peaks (0.25) at rho = gamma: a swapped-in token the policy
now finds unlikely gets the largest push. ρ = 1 → 0.909091 (gradient 0.082645), ρ = 0.1 → 0.5
(0.25), ρ = 2 → 0.952381 (0.045351).

**Defaults**

- ``gamma = 0.1`` [CODE] ``policy_shaping_gamma = 0.1``.
- ``base = "ppo_clip"``, ``base_params = {}`` [CODE] the default ``loss_type``, with dual clip
  supported through ``base_params``; the dual clip never binds on a shaped row (ρ' < 1 < c).
- ``level = "token"`` [CODE] the ratio of the default loss type; ``"sequence"`` shapes the GSPO
  sequence ratio, as the code does with ``loss_type = "gspo"``.
- ``behaviour = "sampler"`` [INFERRED] the sampler's log-probs under δ ⊕ x (free: the engine
  reports them); ``"view"`` re-scores every row under its behaviour context with the old weights
  (one more no-grad forward a step), which is what the code's actor does before the swap; both are
  the same policy on the same context, equal up to the engine's numerics (1e-4 on the tiny model).
- ``coef = 1.0``, ``agg = None`` (the objective's aggregation) [INFERRED] as every term.

**Notes**

1. Without the row flag ``injected`` (a strategy that injects no rows), or when no row is
   injected, the term is exactly its base, so it passes every contract of the base term (on-policy
   it is the REINFORCE gradient); on injected rows the on-policy gradient is adv·ρ'(1 − ρ')·∇logp
   instead. Any strategy that flags injected rows gets the shaping (``fbos``'s guided EPA rows too).
2. The behaviour log-prob (``behaviour = "sampler"``) is ``logp_sampler`` (the policy's log-probs
   at sampling time, raw temperature-1 distribution, the weights that sampled the rollout): the
   paper's π_old(o | δ ⊕ x). A rollout without ``logp_sampler`` and with injected rows is an error
   naming it. ``behaviour = "view"`` reads ``policy@behaviour.logp`` (views/behaviour.py), the old
   weights' forward under ``behav_ctx``, so it holds for engines that report no log-probs.
3. ``log_rho`` is zeroed outside the mask before ``exp`` and clamped to ±20 (the code's clamp), so
   padding never overflows and masked tokens get exactly zero gradient.
4. ``stats``: the base term's, plus ``lope_shaped`` (the share of loss tokens on swapped rows).
5. Token weights reach the term as they reach its base (``token_weights``, objective.py): per
   token for a per-token base; a base that reduces them per row (``gmpo``) takes none under lope
   (a configuration with a token weight is refused), since its injected rows are per-token losses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.losses._common import required, term_mask, token_advantages
from groupwise.masked import masked_input
from groupwise.registry import build, register
from groupwise.types import INJECTED, Need, Rollout, StepInfo

LEVELS = ("token", "sequence")
BEHAVIOURS = ("sampler", "view")
BEHAVIOUR_NEED = Need("logp", view="behaviour")  # key policy@behaviour.logp


def shaped_ratio(log_ratio: Tensor, gamma: float = 0.1) -> Tensor:
    """ρ/(ρ+γ) of ρ = exp(clamp(log_ratio, −20, 20)), elementwise (differentiable)."""
    rho = torch.exp(log_ratio.clamp(-20.0, 20.0))
    return rho / (rho + gamma)


@register("objective", "lope")
@dataclass
class LoPEShaping:
    """Swapped-in resamples: unclipped ρ/(ρ+γ) against the perturbed-prompt behaviour; other rows: the base term
    (LoPE)."""

    gamma: float = 0.1
    base: str = "ppo_clip"
    base_params: dict = field(default_factory=dict)
    level: str = "token"
    behaviour: str = "sampler"
    coef: float = 1.0
    agg: str | None = None

    def __post_init__(self) -> None:
        if not self.gamma > 0:
            raise ConfigError(f"objective lope: gamma={self.gamma} must be > 0 (the paper's 0.1)")
        if self.level not in LEVELS:
            raise ConfigError(f"objective lope: level={self.level!r} must be one of {LEVELS}")
        if self.behaviour not in BEHAVIOURS:
            raise ConfigError(
                f"objective lope: behaviour={self.behaviour!r} must be one of "
                f"{BEHAVIOURS} (the sampler's log-probs, or the behaviour view's)"
            )
        if self.base == "lope":
            raise ConfigError(
                "objective lope: base='lope' would wrap itself; use a policy term such as 'ppo_clip' or 'gspo'"
            )
        self.inner = build("objective", self.base, **self.base_params)
        if getattr(self.inner, "coef", 1.0) != 1.0 or getattr(self.inner, "agg", None) is not None:
            raise ConfigError(
                "objective lope: set coef and agg on the lope term, not in "
                f"base_params (got coef={self.inner.coef}, agg={self.inner.agg!r})"
            )

    @property
    def needs(self) -> tuple:
        own = (BEHAVIOUR_NEED,) if self.behaviour == "view" else ()
        return tuple(getattr(self.inner, "needs", ())) + own

    @property
    def token_weights(self) -> str:
        """The base term's declaration (objective.py); a base that reduces weights per row takes none here (Note 5)."""
        mode = getattr(self.inner, "token_weights", "token")
        return "none" if mode.startswith("row:") else mode

    @property
    def token_weights_reason(self) -> str:
        mode = getattr(self.inner, "token_weights", "token")
        if mode.startswith("row:"):
            return f"its base {self.base!r} reduces token weights per row ({mode}), which lope's per-token rows cannot"
        return getattr(self.inner, "token_weights_reason", f"its base {self.base!r} takes none")

    @property
    def on_policy_reinforce(self) -> bool:
        return getattr(self.inner, "on_policy_reinforce", True)

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        values = self.inner(mb, out, info)  # [b,G,T] or [b,G]
        injected = mb.flag(INJECTED)  # [b,G]
        if not bool(injected.any()):
            return values
        mask = term_mask(mb)  # [b,G,T]
        if values.dim() == 2:
            # [b,G,T] a row loss on each of its tokens
            values = torch.where(mask, values[..., None], torch.zeros((), dtype=values.dtype))
        behav = (
            required(mb, "logp_sampler", "lope") if self.behaviour == "sampler" else mb.extras.get(BEHAVIOUR_NEED.key)
        )  # [b,G,T]
        if behav is None:
            raise ValueError(
                f"objective lope (behaviour='view') reads {BEHAVIOUR_NEED.key!r}, "
                "which this batch lacks; the trainer fills it from the term's needs"
            )
        log_rho = masked_input(out["logp"], mask) - masked_input(behav, mask)  # [b,G,T]
        if self.level == "sequence":
            seq = log_rho.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # [b,G,1]
            log_rho = torch.where(mask, seq.expand_as(log_rho), torch.zeros((), dtype=log_rho.dtype))  # [b,G,T]
        shaped = -token_advantages(mb, mask, "lope") * shaped_ratio(log_rho, self.gamma)  # [b,G,T]
        swapped = injected[..., None] & mask  # [b,G,T]
        return torch.where(swapped, shaped, values)  # [b,G,T]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        stats = dict(self.inner.stats(mb, out)) if hasattr(self.inner, "stats") else {}
        stats["lope_shaped"] = mb.flag(INJECTED).float()  # [b,G]
        return stats
