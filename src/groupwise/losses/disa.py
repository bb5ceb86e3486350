"""DISA: the trajectory-balance (FlowRL) loss anchored on an offline, importance-sampled, frozen log Z(x).

"DISA: Decoupled Importance-Sampled Anchoring" (offline, frozen partition function for
distribution-matching RL), 2026, https://arxiv.org/abs/2605.17295 — spec 09 (authors not in the
spec; the abstract and a third-party summary only). The residual is FlowRL's: "FlowRL: Matching
Reward Distributions for LLM Reasoning", Xuekai Zhu et al., 2025, https://arxiv.org/abs/2509.15207
(its README and the verl ``recipe/flowrl`` objective, as the spec transcribes them).

**Change vs GRPO**

- The clipped surrogate is replaced by a squared trajectory-balance residual per row: the policy is
  pulled toward π_ref·exp(β r̂)/Z(x) (distribution matching) instead of up the advantage.
- log Z(x) is not learned online (FlowRL's head): the offline phase ``disa_logz``
  (``phases/disa_logz.py``) estimates it by importance sampling and freezes it (artifact ``logz``:
  a table by prompt id, optionally a prompt-conditioned regressor). No gradient reaches it.

**Math** (per row; ``mask`` = its completion tokens; means over ``mask``)::

    lp_bar  = mean_t logp,  old_bar = mean_t logp_old,  ref_bar = mean_t logp_ref          # [b,G]
    lp_bar  = clamp(lp_bar, old_bar + log(1 − eps_low), old_bar + log(1 + eps_high))   (clamp_logp)
    r_hat   = the row's advantage (configured estimator; token-level: mean over mask)     # [b,G]
    w       = sg[clip(exp(Σ_t (logp − logp_old)), 1 − eps_low, 1 + eps_high)]             # [b,G]
    delta   = logZ[x] + lp_bar − beta·r_hat − ref_bar        logZ frozen (artifact)        # [b,G]
    loss    = w · delta²                                     per row; the objective averages rows

Offline (``estimate_logZ``, proposals y_j ~ q, j = 1..M, r̂ normalised within the M)::

    log_w_j = beta·r_hat_j + lref_bar_j − lq_bar_j;   logZ = logsumexp_j(log_w_j) − log M
    ESS     = (Σ_j w_j)² / Σ_j w_j²

**Defaults**

- ``beta = 15`` [INFERRED] the spec starts DISA at FlowRL's β for binary math rewards (15 in
  FlowRL's code [CODE]); the paper studies its sensitivity [ABSTRACT] but its value is not known.
- ``eps_low = 0.2`` [CODE] FlowRL's ε; ``eps_high = 0.28`` [CODE] FlowRL recipes' clip-high.
- ``clamp_logp = True`` [CODE] FlowRL clamps lp_bar to the log-ratio bounds (spec).
- r̂ = the group-normalised reward [CODE] (FlowRL's residual), i.e. the GRPO advantage
  (``advantage.estimator = "grpo"``); reading it from the configured estimator, so that any
  estimator composes (``sign``: ±1), is [INFERRED].
- ``use_regressor = False`` [INFERRED]: prompts outside the table are an error; ``True`` predicts
  their logZ from the frozen reference's ``hidden(embed_layer)`` at the prompt's last position
  (``embed_layer = 1`` [INFERRED]), as the phase fitted it.

**Notes**

1. Rows without a loss token, or with a non-finite advantage, get exactly 0 (and no gradient).
2. ``w`` is detached; with ``clamp_logp`` a row whose lp_bar is outside its bounds has gradient 0
   (``torch.clamp``); bounds are closed (on a bound the gradient still flows).
3. dL/dlp_bar = 2·w·delta; dL/dlogZ does not exist (a constant). Not REINFORCE on-policy
   (``on_policy_reinforce = False``): on-policy the gradient is 2·delta·∇lp_bar.
4. ``beta`` must equal the artifact's (log Z was estimated for that β): ``use_artifact`` refuses
   another. Rows are values [b,G]; use ``agg = "seq_mean_token_mean"`` for the spec's mean over rows.
5. Statistics (row means): ``disa/delta`` (E[δ], the calibration diagnostic), ``disa/logz``,
   ``disa/w``, ``disa/clamp_low``, ``disa/clamp_high`` (rows whose lp_bar was clamped).
6. Token weights: none (``token_weights = "none"``; objective.py): the residual is one value per
   whole sequence and no source weighs its tokens, so a token weight is refused at build.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.losses._common import check_clip, required, row_advantages, term_mask
from groupwise.masked import masked_input, masked_logsumexp, masked_mean
from groupwise.registry import register
from groupwise.types import Need, Rollout, StepInfo


def estimate_logZ(r_hat: Tensor, lref_bar: Tensor, lq_bar: Tensor, beta: float, valid: Tensor | None = None) -> Tensor:
    """[...] self-normalised IS estimate log mean_j exp(β r̂_j + ℓ̄_ref_j − ℓ̄_q_j) over the last axis
    (M proposals; ``valid`` [..., M] marks the ones that count); NaN where none is valid."""
    log_w = beta * r_hat.double() + lref_bar.double() - lq_bar.double()  # [...,M]
    valid = torch.isfinite(log_w) if valid is None else valid.bool() & torch.isfinite(log_w)  # [...,M]
    n = valid.sum(-1)  # [...]
    lse = masked_logsumexp(log_w, valid, dim=-1).squeeze(-1)  # [...]
    return torch.where(
        n > 0, lse - n.clamp(min=1).double().log(), torch.full((), float("nan"), dtype=torch.float64)
    ).float()  # [...]


def is_ess(log_w: Tensor, valid: Tensor) -> Tensor:
    """[...] effective sample size (Σw)²/Σw² of the weights exp(log_w) over the last axis (0 if none valid)."""
    log_w = log_w.double()  # [...,M]
    ess = (2 * masked_logsumexp(log_w, valid, -1) - masked_logsumexp(2 * log_w, valid, -1)).exp().squeeze(-1)  # [...]
    return torch.where(valid.any(-1), ess, torch.zeros((), dtype=ess.dtype)).float()  # [...]


def tb_residual(logZ: Tensor, lp_bar: Tensor, ref_bar: Tensor, r_hat: Tensor, beta: float) -> Tensor:
    """[B,G] δ = logZ + ℓ̄_θ − β r̂ − ℓ̄_ref (``logZ`` [B] or [B,G], detached: the anchor is frozen)."""
    logZ = logZ.detach()
    return (logZ[:, None] if logZ.dim() == 1 else logZ) + lp_bar - beta * r_hat - ref_bar  # [B,G]


def tb_loss(
    logZ: Tensor, lp_bar: Tensor, ref_bar: Tensor, r_hat: Tensor, w: Tensor, beta: float, valid: Tensor | None = None
) -> Tensor:
    """[] mean over (valid) rows of w·δ², ``w`` detached."""
    values = w.detach() * tb_residual(logZ, lp_bar, ref_bar, r_hat, beta) ** 2  # [B,G]
    valid = torch.ones_like(values, dtype=torch.bool) if valid is None else valid.bool()
    return masked_mean(torch.where(valid, values, torch.zeros(())), valid)  # []


class LogZRegressor(torch.nn.Module):
    """g_ψ(emb) -> log Z: an MLP with two hidden layers (inputs and target standardised by the fit set)."""

    def __init__(self, embed_dim: int, hidden: int = 64):
        super().__init__()
        self.embed_dim, self.hidden = embed_dim, hidden
        self.net = torch.nn.Sequential(
            torch.nn.Linear(embed_dim, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, 1),
        )
        for name, size in (("x_mean", embed_dim), ("x_std", embed_dim), ("y_mean", 1), ("y_std", 1)):
            self.register_buffer(name, torch.zeros(size) if "mean" in name else torch.ones(size))

    def forward(self, emb: Tensor) -> Tensor:
        z = (emb.float() - self.x_mean) / self.x_std  # [N,D]
        return self.net(z).squeeze(-1) * self.y_std + self.y_mean  # [N]

    def fit(self, emb: Tensor, logZ: Tensor, steps: int = 300, lr: float = 1e-2, seed: int = 0) -> float:
        """Full-batch Adam on the MSE, then frozen (eval, no grad); returns the final MSE."""
        emb, logZ = emb.float(), logZ.float()  # [P,D], [P]
        self.x_mean.copy_(emb.mean(0)), self.x_std.copy_(emb.std(0, unbiased=False).clamp(min=1e-6))
        self.y_mean.fill_(float(logZ.mean())), self.y_std.fill_(max(float(logZ.std(unbiased=False)), 1e-6))
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    layer.reset_parameters()
        optimiser = torch.optim.Adam(self.net.parameters(), lr=lr)
        for _ in range(steps):
            optimiser.zero_grad()
            loss = torch.nn.functional.mse_loss(self(emb), logZ)
            loss.backward()
            optimiser.step()
        self.eval().requires_grad_(False)
        return float(torch.nn.functional.mse_loss(self(emb), logZ))


def r_squared(pred: Tensor, target: Tensor) -> float:
    """1 − SS_res/SS_tot (NaN with fewer than two targets or constant ones)."""
    ss_tot = float(((target - target.mean()) ** 2).sum())
    return 1.0 - float(((pred - target) ** 2).sum()) / ss_tot if len(target) > 1 and ss_tot > 0 else float("nan")


@register("objective", "disa")
@dataclass
class DISA:
    """Trajectory-balance residual w·(logZ + ℓ̄_θ − β r̂ − ℓ̄_ref)² with an offline, frozen logZ (DISA, 2026; FlowRL,
    Zhu et al. 2025)."""

    beta: float = 15.0
    eps_low: float = 0.2
    eps_high: float = 0.28
    clamp_logp: bool = True
    use_regressor: bool = False
    embed_layer: int = 1
    coef: float = 1.0
    agg: str | None = None

    artifacts = ("logz",)
    on_policy_reinforce = False  # Note 3
    token_weights = "none"  # Note 6
    token_weights_reason = "a trajectory-balance residual of whole sequences' log-probs, with no weighted form"
    _table: Any = field(default=None, init=False, repr=False)
    _regressor: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_clip("disa", self.eps_low, self.eps_high)
        if not (math.isfinite(self.beta) and self.beta >= 0.0):
            raise ConfigError(f"objective disa: beta={self.beta} must be a finite number >= 0 (FlowRL: 15)")
        if self.embed_layer < 0:
            raise ConfigError(f"objective disa: embed_layer={self.embed_layer} must be >= 0")

    @property
    def needs(self) -> tuple[Need, ...]:
        return (Need("logp", model="ref"),) + (
            (Need(f"hidden({self.embed_layer})", model="ref"),) if self.use_regressor else ()
        )

    def use_artifact(self, name: str, value: dict) -> None:
        if abs(float(value["beta"]) - self.beta) > 1e-9:
            raise ConfigError(
                f"objective disa: beta={self.beta}, but the artifact {name!r} "
                f"estimated log Z for beta={value['beta']}; set the phase's beta "
                f"to {self.beta} (or objective.terms.disa.beta={value['beta']})"
            )
        self._table = torch.as_tensor(value["table"], dtype=torch.float32)  # [N] NaN where not estimated
        reg = value.get("regressor")
        if self.use_regressor:
            if not reg or reg.get("layer") != self.embed_layer:
                raise ConfigError(
                    "objective disa: use_regressor with "
                    f"embed_layer={self.embed_layer}, but the artifact {name!r} holds "
                    f"{'no regressor' if not reg else 'one fitted on layer ' + str(reg.get('layer'))}; "
                    f"set the phase's regressor = true, layer = {self.embed_layer}"
                )
            self._regressor = LogZRegressor(int(reg["embed_dim"]), int(reg["hidden"]))
            self._regressor.load_state_dict(reg["state"])
            self._regressor.eval().requires_grad_(False)

    def _anchor(self, mb: Rollout) -> Tensor:
        """[b,G] frozen log Z of each row's prompt: the table, else (use_regressor) the regressor."""
        if self._table is None:
            raise ValueError(
                "objective disa has no log Z table: configure the offline "
                'phase disa_logz (phases = [{name = "disa_logz"}])'
            )
        B, G, _ = mb.shape
        idx = mb.prompt_index.long()  # [b]
        inside = (idx >= 0) & (idx < len(self._table))  # [b]
        logZ = torch.where(
            inside, self._table[idx.clamp(0, max(len(self._table) - 1, 0))], torch.full((), float("nan"))
        )  # [b]
        logZ = logZ[:, None].expand(B, G)  # [b,G]
        missing = ~torch.isfinite(logZ)  # [b,G]
        if bool(missing.any()):
            if self._regressor is None:
                raise ValueError(
                    f"objective disa: prompt ids {sorted(set(idx[missing.any(-1)].tolist()))[:8]} "
                    "have no log Z in the table; estimate them (phase disa_logz prompts = 0: every "
                    "prompt) or set regressor = true on the phase and use_regressor = true here"
                )
            # [b,G,H] the state after the prompt
            emb = mb.extras[Need(f"hidden({self.embed_layer})", model="ref").key][:, :, 0]
            with torch.no_grad():
                logZ = torch.where(missing, self._regressor(emb.reshape(B * G, -1)).reshape(B, G), logZ)  # [b,G]
        return logZ  # [b,G]

    def _parts(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        mask = term_mask(mb)  # [b,G,T]
        rows = mask.any(-1)  # [b,G]
        logp = masked_input(out["logp"], mask)  # [b,G,T]
        logp_old = masked_input(required(mb, "logp_old", "disa"), mask)  # [b,G,T]
        lp_bar = masked_mean(logp, mask, dim=-1)  # [b,G]
        old_bar = masked_mean(logp_old, mask, dim=-1)  # [b,G]
        ref_bar = masked_mean(masked_input(required(mb, "logp_ref", "disa"), mask), mask, dim=-1)  # [b,G]
        low, high = old_bar + math.log(1.0 - self.eps_low), old_bar + math.log(1.0 + self.eps_high)  # [b,G]
        if self.clamp_logp:
            lp_bar = torch.clamp(lp_bar, low, high)  # [b,G]
        r_hat = row_advantages(mb, mask, "disa")  # [b,G]
        rows = rows & torch.isfinite(r_hat)  # [b,G]
        r_hat = torch.where(rows, r_hat, torch.zeros(()))  # [b,G]
        w = (logp - logp_old).sum(-1).exp().clamp(1.0 - self.eps_low, 1.0 + self.eps_high).detach()  # [b,G]
        logZ = torch.where(rows, self._anchor(mb), torch.zeros(()))  # [b,G]
        delta = tb_residual(logZ, lp_bar, ref_bar, r_hat, self.beta)  # [b,G]
        delta = torch.where(rows, delta, torch.zeros(()))  # [b,G]
        raw = masked_mean(logp, mask, dim=-1).detach()  # [b,G] before the clamp
        return {
            "delta": delta,
            "w": w,
            "logZ": logZ,
            "rows": rows,
            "clamp_low": (raw < low) & rows,
            "clamp_high": (raw > high) & rows,
        }

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        p = self._parts(mb, out)
        return torch.where(p["rows"], p["w"] * p["delta"] ** 2, torch.zeros(()))  # [b,G]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        p = self._parts(mb, out)
        return {
            "disa/delta": p["delta"].detach(),
            "disa/logz": p["logZ"],
            "disa/w": p["w"],
            "disa/clamp_low": p["clamp_low"].float(),
            "disa/clamp_high": p["clamp_high"].float(),
        }  # [b,G] each
