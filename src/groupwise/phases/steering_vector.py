"""VSPO's steering vector: the mean residual-stream difference between prompts that show a behaviour
and prompts that do not (contrastive activation addition), computed once on the policy before RL.

"VSPO: Vector-Steered Policy Optimization", arXiv 2605.15604, https://arxiv.org/abs/2605.15604 —
spec 17 (abstract + a knowledge-graph note; the CAA construction is the spec's reconstruction).

**Change vs GRPO**: none by itself. It produces the artifact the rollout strategy ``vspo``
(``rollout/vspo.py``) steers its groups with.

**Math** (``rollout.vspo.compute_steering_vector``)::

    x+_i = positive_template.format(**row_i),  x−_i = negative_template.format(**row_i)   i < rows
           (or the texts of ``positive`` / ``negative`` when given)
    h_l(x) = residual stream after decoder layer ``layer`` at x's last token (the policy's own forward)
    v      = mean_i h_l(x+_i) − mean_i h_l(x−_i)
    v      ← v / ‖v‖ · mean ‖h_l‖ over all x±          (normalise = "hidden_norm")

**Defaults**

- ``layer = 2`` [INFERRED] a middle layer of the embedded 4-layer model (CAA practice: middle layers).
- ``rows = 32`` [INFERRED] the spec's "steering vector from 32 contrastive prompts".
- ``positive_template = "{prompt}{answer} sure"``, ``negative_template = "{prompt}{answer}"``
  [INFERRED] the spec's toy behaviour (an answer that ends with the word "sure"); ``{name}``
  fields are the dataset row's columns.
- ``positive = []``, ``negative = []`` [INFERRED] explicit contrast texts instead of the templates.
- ``normalise = "hidden_norm"`` [INFERRED] the spec's "unit norm × typical ‖h_l‖"; ``"unit"``, ``"none"``.

**Notes**

1. The texts are encoded as prompts (``policy.encode``: the chat template when the tokenizer has
   one); with templates the first ``rows`` train rows are used, in order.
2. The artifact: ``vector`` [D] float32, ``layer``, and a summary with the raw difference's norm,
   the typical hidden norm, the final norm and the number of contrast texts.
3. No weights change (no gradient is taken); the phase runs under ``torch.no_grad``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from groupwise.errors import ConfigError
from groupwise.phases import PhaseContext
from groupwise.registry import register
from groupwise.rollout.vspo import compute_steering_vector


@register("phase", "steering_vector")
@dataclass
class SteeringVector:
    """CAA steering vector: mean layer-l activation of behaviour-showing minus behaviour-free prompts."""

    kind = "offline"
    artifact: str = "steering_vector"
    layer: int = 2
    rows: int = 32
    positive_template: str = "{prompt}{answer} sure"
    negative_template: str = "{prompt}{answer}"
    positive: list = field(default_factory=list)
    negative: list = field(default_factory=list)
    normalise: str = "hidden_norm"

    def __post_init__(self) -> None:
        if self.layer < 0 or self.rows < 1:
            raise ConfigError(
                f"phase steering_vector: need layer >= 0 (got {self.layer}) and rows >= 1 (got {self.rows})"
            )
        if self.normalise not in ("hidden_norm", "unit", "none"):
            raise ConfigError(
                f"phase steering_vector: normalise={self.normalise!r} must be 'hidden_norm', 'unit' or 'none'"
            )
        if bool(self.positive) != bool(self.negative):
            raise ConfigError(
                "phase steering_vector: give both positive and negative texts, or neither (then the templates are used)"
            )

    def _texts(self, rows: list[dict]) -> tuple[list[str], list[str]]:
        """The contrast texts: the explicit lists, else the templates filled with the first ``rows`` rows."""
        if self.positive:
            return list(self.positive), list(self.negative)
        use = rows[: self.rows]
        try:
            return [self.positive_template.format(**r) for r in use], [self.negative_template.format(**r) for r in use]
        except KeyError as err:
            raise ConfigError(
                f"phase steering_vector: template field {err} is not a column "
                f"of the train rows (columns: {sorted(use[0]) if use else []})"
            ) from None

    def __call__(self, ctx: PhaseContext) -> dict:
        model = getattr(ctx.policy, "module", None)
        if model is None or not hasattr(ctx.policy, "encode"):
            raise ConfigError(
                f"phase steering_vector needs a text policy (this one is {getattr(ctx.policy, 'modality', '?')})"
            )
        pos, neg = self._texts(ctx.train_rows)
        was_training = model.training
        model.eval()
        try:
            vector, stats = compute_steering_vector(
                model,
                self.layer,
                [ctx.policy.encode(t) for t in pos],
                [ctx.policy.encode(t) for t in neg],
                self.normalise,
            )
        finally:
            model.train(was_training)
        summary = {"layer": self.layer, "texts": len(pos) + len(neg), **stats}
        ctx.say(
            f"phase {self.artifact!r}: layer {self.layer}, {len(pos)} + {len(neg)} contrast texts, |v| "
            f"{stats['raw_norm']:.3f} -> {stats['norm']:.3f} (typical |h| {stats['hidden_norm']:.3f})"
        )
        return {"vector": vector, "layer": self.layer, "summary": summary}
