"""``model.policy = "unified"``: spec 27's toy "unified model" (a tiny causal LM writes a few think
tokens, then the 2-D flow model draws a sample conditioned on them; one row, one advantage, the joint
text + image loss), which is the planner kind with ``planner = "think_lm"`` (``modalities/planner.py``)
under the names it had before the planner kind existed.

"AlphaGRPO: GRPO over a unified AR+diffusion model with decompositional verifiable reward",
Huang, Wu, Yang, Liu, Zhao (ICML 2026), https://arxiv.org/abs/2605.12495 — spec 27 ("Small-scale
analogue": think tokens from a small vocabulary, then a conditional 2-D flow model; the loss's text
part GRPO-SURR, its image part Flow-GRPO per denoising step, the same advantage for both).

**What the alias keeps** (so recipe ``alphagrpo_unified``, its tests and saved runs are unchanged):
the parameters ``n_think`` (= ``n_plan``), ``think_hidden`` (= ``plan_hidden``) and
``flow_sees_label`` (true = ``generator_sees = "label"``, false = ``"none"``) and the ``config`` made
of them; the checkpoint file ``flow_policy.pt``; the token extra ``image_token`` (the planner kind's
``part``; ``alphagrpo_joint`` reads either); ``modality = "unified"``. The think LM, its seed stream
(``+1``), the row extra ``think_ids`` and the checkpoint keys ``think`` / ``reference_think`` are the
think-LM planner's own.

**Defaults** (all [INFERRED]: the spec's toy): ``n_think = 3`` tokens of ``THINK_VOCAB`` (RIGHT LEFT
UP DOWN NEAR MID FAR: one token can name each attribute of a ``flow_attrs`` prompt);
``flow_sees_label = false`` (the plan is what carries the prompt to the image); ``think_hidden = 32``.
``decode`` is the flow sample ``"x,y"``; ``think_text(rollout)`` gives the plans as text.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from groupwise.modalities.planner import PlannerPolicy
from groupwise.modalities.planner_heads import THINK_VOCAB, ThinkLM

__all__ = ["THINK_VOCAB", "ThinkLM", "UnifiedPolicy"]

_NO_DEMONSTRATIONS = (
    "the unified policy has no demonstration fit (its flow is conditioned on think tokens a target row does not give); "
    'fit a model.policy = "flow" instead'
)


class UnifiedPolicy(PlannerPolicy):
    """The think-LM planner kind under the unified policy's parameter names, file and extras (module docstring)."""

    policy_file = "flow_policy.pt"
    part_extra = "image_token"

    def __init__(
        self,
        n_labels: int = 12,
        hidden: int = 64,
        layers: int = 3,
        steps: int = 10,
        sde: str = "all",
        sde_window: int | None = None,
        shift: float = 1.0,
        init_seed: int = 0,
        n_think: int = 3,
        think_hidden: int = 32,
        flow_sees_label: bool = False,
    ):
        if n_think < 1 or think_hidden < 1:
            raise ValueError(f"UnifiedPolicy: need n_think >= 1 and think_hidden >= 1; got {n_think}, {think_hidden}")
        sees = "label" if flow_sees_label else "none"
        think = {"planner": "think_lm", "generator_sees": sees, "n_plan": n_think, "plan_hidden": think_hidden}
        super().__init__(n_labels, hidden, layers, steps, sde, sde_window, shift, init_seed, **think)
        for key in ("planner", "generator_sees", "n_plan", "plan_hidden"):
            del self.config[key]  # the unified config (and so its checkpoints) stays as it was
        self.config.update(n_think=n_think, think_hidden=think_hidden, flow_sees_label=flow_sees_label)
        self.n_think, self.flow_sees_label, self.vocab = n_think, flow_sees_label, len(THINK_VOCAB)
        self.modality = "unified"

    @property
    def think_lm(self) -> ThinkLM:
        return self.planner.lm  # type: ignore[union-attr]  # always the think-LM planner

    @property
    def think_emb(self) -> nn.Embedding:
        return self.planner.emb  # type: ignore[union-attr]

    def encode_target(self, row: dict) -> Tensor:
        """Not defined: a demonstration would need the think tokens' plan too; the flow policy's fit does not apply."""
        raise ValueError(_NO_DEMONSTRATIONS)

    def supervised_loss(self, prompts: Sequence[list[int]], targets: Sequence[Tensor], gen: torch.Generator) -> Tensor:
        """Not defined (see :meth:`encode_target`)."""
        raise ValueError(_NO_DEMONSTRATIONS)
