"""SRPO: role-aware positive token weights — perception tokens by context dependency,
reasoning tokens by consistency with the perception.

"Structured Role-Aware Policy Optimization for Multimodal Reasoning", Bingqing Jiang, Difan Zou
(HKU), 2026. https://arxiv.org/abs/2605.07274 (spec: specs/51; abstract only, no code). Views:
``views/corrupt_context.py`` (ṽ), ``views/ablate_role.py`` (P̸); role map: ``textspans``.

**Change vs GRPO**

- The GRPO sequence advantage A_i is kept; each token's share becomes w_t·A_i with w_t > 0, so
  the reward and the direction of the update are GRPO's and only relative magnitudes move.
- Two self-distilled on-policy contrasts (the same policy, two extra no-grad forwards): a
  perception token counts by how much it depends on the context (original vs corrupted passage),
  a reasoning token by how much it depends on the generated perception (kept vs emptied).
- A token weight (stage ``weight``): w > 0, so weighting the PPO-clip loss is exactly the
  surrogate with Ã = w·A.

**Math** (row i; ``logp`` = ``logp_old``, the sampling policy; P / R = the tokens inside the
perception / reasoning segments, ``textspans.segment_ids``; all detached)::

    d_t  = logp_t − logp@corrupt_context_t           t ∈ P     log π(y_t|v,q,y_<t) − log π(y_t|ṽ,q,y_<t)
    c_t  = logp_t − logp@ablate_role_t               t ∈ R     log π(y_t|v,q,P,R_<t) − log π(y_t|v,q,P̸,R_<t)
    s_t  = d_t on P, c_t on R;   (role_norm: each role z-scored over the whole batch first)
    b_i  = mean_{t ∈ P∪R} s_t
    u_t  = exp(κ · clip(s_t − b_i, −c, c))
    w_t  = u_t / mean_{t' ∈ P∪R} u_t'      on P∪R;   w_t = 1 on other loss tokens (tags, answer, EOS)
    adv_tok[i,t] = A_i · w_t                        (apply_token_weights)

**Defaults**

- ``kappa = 1.0``, ``clip = 3.0`` [INFERRED] the spec's κ = 1, c = 3.
- ``role_norm = False`` [INFERRED] the spec's unit test; True z-scores d over the batch's P tokens
  and c over its R tokens (population std, ``eps = 1e-6``) [INFERRED] before the shared baseline.
- ``perception_tags = ["<perception>", "</perception>"]``, ``reasoning_tags = ["<reasoning>",
  "</reasoning>"]`` [INFERRED] the spec's response format; they must match the ``ablate_role``
  view's ``tags`` (``views.ablate_role.tags``). The ``srpo`` recipe's ``evidence`` task writes the
  short ``<p>…</p><r>…</r><a>…</a>``.

**Notes**

1. Runs once per step on the whole (all-rank) batch before micro-batching; reads ``logp_old`` and the
   two view log-probs (declared needs ``logp``, ``logp@corrupt_context``, ``logp@ablate_role``).
2. Role tokens: loss tokens of valid rows (``row_mask``) inside a segment, with a finite contrast.
   A token of a segment whose contrast is not finite (a non-finite log-prob: a "NaN row") falls
   back to w = 1, as does every loss token of a row without role tokens; tokens off the mask get 0.
3. One role token in a row: s − b = 0, so w = 1. A row's weights average exactly 1 over its role
   tokens, so Σ_t w_t equals its loss-token count and no normaliser moves.
4. Perception tokens ablated by the view get no ``logp@ablate_role`` (0): only R tokens read c.
   The two views cost two extra forwards per step.
5. ``step_stats()``: ``srpo/perc_frac``, ``srpo/reas_frac`` (role tokens per loss token),
   ``srpo/w_perc``, ``srpo/w_reas`` (mean weight per role; the spec expects > 1 on perception tokens
   that copy answer-bearing facts), ``srpo/d_mean``, ``srpo/c_mean`` (mean raw contrasts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.textspans import check_tags, segment_ids
from groupwise.types import Need, Rollout, StepInfo

CORRUPT = Need("logp", view="corrupt_context")
ABLATE = Need("logp", view="ablate_role")


def srpo_token_weights(
    d: Tensor,
    c: Tensor,
    perc_mask: Tensor,
    reas_mask: Tensor,
    kappa: float = 1.0,
    clip: float = 3.0,
    role_norm: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """The spec's interface: d, c, masks [N,T] -> w [N,T] float64 (Math); 1 off the role tokens."""
    perc, reas = perc_mask.bool() & torch.isfinite(d), reas_mask.bool() & ~perc_mask.bool() & torch.isfinite(c)  # [N,T]
    s = torch.where(perc, d.double(), torch.where(reas, c.double(), torch.zeros((), dtype=torch.float64)))  # [N,T]
    if role_norm:
        for m in (perc, reas):
            if m.any():
                x = s[m]  # [M]
                z = (
                    (x - x.mean()) / (x.std(unbiased=False) + eps)
                    if x.numel() > 1 and x.max() > x.min()
                    else torch.zeros_like(x)
                )
                s = s.masked_scatter(m, z)
    role = perc | reas  # [N,T]
    n = role.sum(-1, keepdim=True).double()  # [N,1]
    b = torch.where(role, s, torch.zeros_like(s)).sum(-1, keepdim=True) / n.clamp(min=1)  # [N,1] b_i
    u = torch.exp(kappa * (s - b).clamp(-clip, clip))  # [N,T]
    u = torch.where(role, u, torch.zeros_like(u))  # [N,T]
    w = u / (u.sum(-1, keepdim=True) / n.clamp(min=1)).clamp(min=1e-300)  # [N,T] mean 1 over role tokens
    return torch.where(role, w, torch.ones_like(w))  # [N,T]


def apply_token_weights(adv: Tensor, w: Tensor, mask: Tensor) -> Tensor:
    """The spec's interface: adv [B,G] (or [B,G,T]), w, mask [B,G,T] -> adv_tok [B,G,T] = A·w on the mask, 0 off it."""
    adv = adv[..., None] if adv.dim() == 2 else adv  # [B,G,1] or [B,G,T]
    return torch.where(mask.bool(), adv * w, torch.zeros((), dtype=w.dtype))  # [B,G,T]


@register("weight", "srpo")
@dataclass
class SRPO:
    """Positive token weights from self-distilled contrasts: perception by context dependency, reasoning by perception
    consistency (SRPO, Jiang & Zou 2026)."""

    kappa: float = 1.0
    clip: float = 3.0
    role_norm: bool = False
    eps: float = 1e-6
    perception_tags: list = field(default_factory=lambda: ["<perception>", "</perception>"])
    reasoning_tags: list = field(default_factory=lambda: ["<reasoning>", "</reasoning>"])
    _token_text: Any = field(default=None, init=False, repr=False)
    _stats: dict = field(default_factory=dict, init=False, repr=False)

    needs = (Need("logp"), CORRUPT, ABLATE)
    scope = "loss"  # w > 0 on every loss token

    def __post_init__(self) -> None:
        if not self.kappa > 0 or not self.clip > 0 or not self.eps > 0:
            raise ConfigError(f"weight srpo: kappa={self.kappa}, clip={self.clip} and eps={self.eps} must be > 0")
        check_tags(self.perception_tags, "weight srpo: perception_tags", need_open=True)
        check_tags(self.reasoning_tags, "weight srpo: reasoning_tags", need_open=True)

    def use_vocabulary(self, token_text: list[str]) -> None:
        self._token_text = list(token_text)

    def _role_masks(self, actions: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """The spec's interface: actions, mask [N,T] -> (perc_mask, reas_mask) [N,T] bool."""
        if self._token_text is None:
            raise ValueError(
                "weight srpo has no vocabulary: it needs a text policy (the trainer calls use_vocabulary at build)"
            )
        seg = segment_ids(actions, mask, self._token_text, [self.perception_tags, self.reasoning_tags])  # [N,T]
        return seg == 1, seg == 2

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        missing = [
            k
            for k in ("logp", CORRUPT.key, ABLATE.key)
            if (rollout.logp_old if k == "logp" else rollout.extras.get(k)) is None
        ]
        if missing:
            raise ValueError(
                f"weight srpo needs {missing}: declared needs, filled by the trainer before the weight stage"
            )
        B, G, T = rollout.shape
        mask = rollout.row_mask.bool()  # [B,G,T]
        # [N,T] over the sequence (a prefix)
        perc, reas = self._role_masks(rollout.actions.reshape(B * G, T), rollout.mask.reshape(B * G, T))
        perc, reas = perc & mask.reshape(B * G, T), reas & mask.reshape(B * G, T)  # [N,T] loss tokens of valid rows
        logp = rollout.logp_old.reshape(B * G, T).double()  # [N,T]
        d = logp - rollout.extras[CORRUPT.key].reshape(B * G, T).double()  # [N,T]
        c = logp - rollout.extras[ABLATE.key].reshape(B * G, T).double()  # [N,T]
        # [B,G,T]
        w = srpo_token_weights(d, c, perc, reas, self.kappa, self.clip, self.role_norm, self.eps).reshape(B, G, T)
        weight = torch.where(mask, w, torch.zeros_like(w)).float()  # [B,G,T]
        p_ok, r_ok = (perc & torch.isfinite(d)).reshape(B, G, T), (reas & torch.isfinite(c)).reshape(B, G, T)  # [B,G,T]
        n = max(int(mask.sum()), 1)
        self._stats = {
            "srpo/perc_frac": float(p_ok.sum()) / n,
            "srpo/reas_frac": float(r_ok.sum()) / n,
            "srpo/w_perc": float(weight[p_ok].mean()) if p_ok.any() else 1.0,
            "srpo/w_reas": float(weight[r_ok].mean()) if r_ok.any() else 1.0,
            "srpo/d_mean": float(d.reshape(B, G, T)[p_ok].mean()) if p_ok.any() else 0.0,
            "srpo/c_mean": float(c.reshape(B, G, T)[r_ok].mean()) if r_ok.any() else 0.0,
        }
        return weight  # [B,G,T]

    def step_stats(self) -> dict[str, float]:
        """The last batch's role shares, mean weights and contrasts (whole batch: no reduction over ranks)."""
        return dict(self._stats)
