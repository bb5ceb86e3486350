"""Mean anchor: keep a Gaussian policy's mean near a frozen reference's, λ·‖μ_θ − μ_ref‖².

Newton's Lantern (arXiv 2605.11102, spec 37): the RL-tuned warm-start model perturbs the supervised
one f0, and an anchor term ``λ ||μ_θ(s) − f0(s)||²`` [INFERRED] keeps it close (the abstract gives no
formula; spec 37 "Math", "KL/anchor term"). For two Gaussians of the same fixed σ it is the KL up to
a factor: KL(N(μ_θ, σ²I) ‖ N(μ_ref, σ²I)) = ‖μ_θ − μ_ref‖²/(2σ²).

**Change vs GRPO**: GRPO anchors with a per-token KL estimate on sampled tokens; this term anchors
the policy's mean action in closed form, no sample needed.

**Math** (μ = ``out["step_mean"]`` [b,G,T,D] with grad, μ_ref the reference's, stored by
``Need("step_mean", model="ref")`` as ``extras["ref.step_mean"]``)::

    loss[b,g,t] = Σ_d (μ[b,g,t,d] − μ_ref[b,g,t,d])²       (the objective multiplies by coef = λ)

**Defaults**

- ``coef = 1.0`` [INFERRED] λ: spec 37 names no value; the recipe sets it (``papers/37_newtons_lantern``).
- ``agg = None`` (the objective's default aggregation over positions).

**Notes**

1. Declared for the gaussian kind (``modality``), whose ``step_mean`` is μ_θ(s) itself; the flow
   toy's ``step_mean`` (each trained step's kernel mean) has the same shape but another meaning,
   and a quantity is not an extra (``reads_extras``), so the build's modality check keeps the term
   to the kind it was tested on.
2. The reference is the frozen snapshot the policy keeps (``scoring_models(with_reference=True)``);
   after an ``sft`` phase it is the fitted f0 (``rebase_reference``).
3. ``token_weights = "exempt"``: a regulariser, as the KL terms are, is not reweighted by an
   importance weight of the sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from groupwise.losses._common import term_mask
from groupwise.masked import masked_input
from groupwise.registry import register
from groupwise.types import Need, Rollout, StepInfo


@register("objective", "mean_anchor")
@dataclass
class MeanAnchor:
    """λ·‖μ_θ − μ_ref‖² of the policy's step mean against the frozen reference's (spec 37's anchor to f0)."""

    coef: float = 1.0
    agg: str | None = None

    needs = (Need("step_mean", grad=True), Need("step_mean", model="ref"))
    token_weights = "exempt"  # Note 3
    modality = "gaussian"  # Note 1

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        if "step_mean" not in out or "ref.step_mean" not in mb.extras:
            raise ValueError(
                "mean_anchor needs out['step_mean'] (the grad Need('step_mean')) and extras['ref.step_mean'] "
                "(Need('step_mean', model='ref')); use a policy whose quantities include step_mean"
            )
        diff = out["step_mean"] - mb.extras["ref.step_mean"].to(out["step_mean"].dtype)  # [b,G,T,D]
        return masked_input((diff**2).sum(-1), term_mask(mb))  # [b,G,T]
