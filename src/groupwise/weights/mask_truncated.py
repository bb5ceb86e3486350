"""Overlong filtering: truncated completions receive no loss (DAPO).

"DAPO: An Open-Source LLM Reinforcement Learning System at Scale", Qiying Yu, Zheng Zhang,
Ruofei Zhu et al., 2025. https://arxiv.org/abs/2503.14476

**Change vs GRPO**: every token of a completion that hit the length limit without EOS gets
weight 0, so a truncated (possibly correct-so-far) answer is not punished as wrong — it leaves the
loss and the normalisers. DAPO calls it "overlong filtering"; TRL ``mask_truncated_completions``.

**Math**::

    w[b,g,t] = 0 if truncated[b,g] else 1

**Defaults**: none [PAPER].

**Notes**

1. The rows still count in the group statistics of the advantage (their rewards are scored as
   usual); only their loss is removed, as in DAPO and TRL.
2. DAPO's other length device, the soft overlong *reward* penalty, is a reward component.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


@register("weight", "mask_truncated")
@dataclass
class MaskTruncated:
    """Zero weight for every token of a truncated completion (DAPO overlong filtering, Yu et al. 2025)."""

    needs = ()
    scope = "token"  # a truncated row leaves the loss and every normaliser (DAPO, TRL mask_truncated_completions)

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        keep = ~rollout.truncated.bool()  # [B,G]
        return keep[..., None].expand(rollout.mask.shape).float()  # [B,G,T]
