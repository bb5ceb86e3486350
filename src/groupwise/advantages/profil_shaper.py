"""ProFIL as an advantage shaper: zero the advantage of rollouts the frozen probe flags as theater.

"Drop the Act: Probe-Filtered RL for Faithful Chain-of-Thought Reasoning", Swapnil Parekh, 2026.
https://arxiv.org/abs/2605.11467 — spec 34. Only the abstract was available; no code.

**Change vs GRPO**: after the estimator, ``A_i := 0`` for a rollout whose probe score exceeds τ.
The probe (artifact ``probe`` of the offline phase ``profil_probe``) reads the hidden states of
the **frozen reference** — the policy as RL began, i.e. the base the probe was trained on — on
the rollout's own tokens, so the policy cannot move the probe's inputs by learning ("resists
obfuscation").

**Math** (per rollout i; steps from its completion tokens, ``H`` = ref hidden(layer) [T,d])::

    step_ids = segment_steps(token texts, sep)          (the artifact's sep and vocabulary texts)
    p_k      = AttnProbe(H_k)                           (one per step)
    S_i      = mean_k 1[p_k > threshold] | max_k p_k | mean_k p_k        (mode)
    A_i      = 0 if S_i > tau (only where A_i > 0 when only_positive), else A_i

**Defaults**

- the probe on frozen-base states, filtering of the GRPO advantage [ABSTRACT].
- ``mode = "mean_flag"``, ``threshold = 0.5``, ``tau = 0.5``, ``only_positive = False`` [INFERRED]
  (spec 34).
- ``layer = 1`` [INFERRED] the spec's analogue; must equal the artifact's.

**Notes**

1. ``layer`` is a field because the need ``hidden(layer)`` of model ``ref`` is declared at build
   time, before the phase has run; ``use_artifact`` refuses a probe trained on another layer.
   ``Need(model="ref")`` makes the trainer keep a frozen copy (reset after an sft phase).
2. Rows with ``group_valid`` False or a non-finite reward get exactly 0 (and are not scored);
   a row without steps scores 0 and is never filtered. Token advantages [B,G,T] are filtered per
   row. Non-finite advantages count as 0.
3. ``step_stats`` logs ``profil/flagged`` (share of valid rows filtered) and ``profil/score``
   (mean S over valid rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from groupwise.advantages.profil import SCORE_MODES, AttnProbe, profil_filter, rollout_score, segment_steps
from groupwise.errors import ConfigError
from groupwise.masked import finite_or_zero
from groupwise.registry import register
from groupwise.types import Need, Rollout, StepInfo


def rollout_step_ids(actions: Tensor, mask: Tensor, token_text: list[str], sep: str) -> Tensor:
    """[N,T] int64 step ids of each row's completion tokens (−1 outside the mask and outside steps)."""
    N, T = actions.shape
    counts, ids = mask.sum(-1).tolist(), actions.tolist()
    rows = []
    for r in range(N):
        texts = [token_text[t] if 0 <= t < len(token_text) else "" for t in ids[r][: counts[r]]]
        rows.append(segment_steps(texts, sep=sep, pad_to=T))  # [T]
    return torch.stack(rows) if rows else torch.full((0, T), -1, dtype=torch.long)  # [N,T]


@register("advantage", "profil")
@dataclass
class ProFIL:
    """Zero the advantage of rollouts whose frozen-base probe score exceeds tau (ProFIL, Parekh 2026)."""

    tau: float = 0.5
    mode: str = "mean_flag"
    threshold: float = 0.5
    only_positive: bool = False
    layer: int = 1

    shaper = True  # reshapes an estimator's advantages (advantage.shapers)
    artifacts = ("probe",)
    _probe: Any = field(default=None, init=False, repr=False)
    _stats: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in SCORE_MODES:
            raise ConfigError(f"advantage profil: mode={self.mode!r}; allowed: {', '.join(SCORE_MODES)}")
        if self.layer < 0:
            raise ConfigError(f"advantage profil: layer={self.layer} must be >= 0")

    @property
    def needs(self) -> tuple[Need, ...]:
        return (Need(f"hidden({self.layer})", model="ref"),)

    def use_artifact(self, name: str, value: dict) -> None:
        if value.get("layer") != self.layer:
            raise ConfigError(
                f"advantage profil: layer={self.layer}, but the artifact {name!r} holds a probe trained "
                f"on layer {value.get('layer')}; set advantage.shapers.profil.layer={value.get('layer')} "
                f"(or the phase's layer to {self.layer})"
            )
        probe = AttnProbe(int(value["d_model"]), int(value["n_heads"]), int(value["d_head"]))
        probe.load_state_dict(value["state"])
        self._probe, self._sep, self._token_text = (
            probe.eval().requires_grad_(False),
            value["sep"],
            list(value["token_text"]),
        )

    def _scores(self, rollout: Rollout) -> Tensor:
        """S [B,G] float32: each rollout's probe score."""
        if self._probe is None:
            raise ValueError(
                "advantage profil has no probe: configure the offline phase "
                'profil_probe (phases = [..., {name = "profil_probe"}])'
            )
        key = Need(f"hidden({self.layer})", model="ref").key
        if key not in rollout.extras:
            raise ValueError(
                f"advantage profil needs rollout.extras[{key!r}] (declared "
                f"in its needs); extras present: {sorted(rollout.extras)}"
            )
        B, G, T = rollout.shape
        hidden = rollout.extras[key].reshape(B * G, T, -1)  # [N,T,d]
        ids = rollout_step_ids(
            rollout.actions.reshape(B * G, T), rollout.mask.reshape(B * G, T), self._token_text, self._sep
        )  # [N,T]
        with torch.no_grad():
            p = self._probe.probe_scores(hidden, ids)  # [N,K]
        return rollout_score(p, self.mode, self.threshold).reshape(B, G)  # [B,G]

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        if rollout.advantages is None:
            raise ValueError(
                "profil is a shaper: configure an advantage estimator before it (rollout.advantages is None)"
            )
        B, G, _ = rollout.shape
        adv = finite_or_zero(rollout.advantages.float())  # [B,G] or [B,G,T]
        valid = rollout.group_valid.bool()  # [B,G]
        if rollout.rewards is not None:
            valid = valid & torch.isfinite(rollout.rewards)  # [B,G]
        S = torch.where(valid, self._scores(rollout), torch.zeros(()))  # [B,G]
        out = profil_filter(adv.reshape(B * G, *adv.shape[2:]), S.reshape(B * G), self.tau, self.only_positive).reshape(
            adv.shape
        )  # [B,G] / [B,G,T]
        out = torch.where(valid if adv.dim() == 2 else valid[..., None], out, torch.zeros(()))  # excluded rows: 0
        n, flagged = int(valid.sum()), (S > self.tau) & valid  # [B,G]
        self._stats = {
            "profil/flagged": float(flagged.sum()) / n if n else 0.0,
            "profil/score": float(S[valid].mean()) if n else 0.0,
        }
        return out  # [B,G] or [B,G,T]

    def step_stats(self) -> dict[str, float]:
        return dict(self._stats)
