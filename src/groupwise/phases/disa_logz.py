"""DISA's offline phase: estimate log Z(x) of every training prompt by importance sampling and freeze it.

"DISA: Decoupled Importance-Sampled Anchoring" (offline, frozen partition function for
distribution-matching RL), 2026, https://arxiv.org/abs/2605.17295 — spec 09. Only the abstract and
a third-party summary ("Proposal Model → Offline Importance Sampling Estimator → Prompt-Conditioned
Regressor → Frozen Partition Function") were available; the estimator is the spec's reconstruction.

**Change vs GRPO**: none by itself. It runs before the RL steps, on the policy as RL begins (the
reference of the ``disa`` objective, ``losses/disa.py``), and produces the artifact ``logz`` that
the objective reads as its frozen anchor.

**Procedure** (per distinct training prompt x; maths in ``losses/disa.py``)::

    y_j ~ q(.|x), j = 1..samples       q = the policy at `temperature` (proposal = ""), or a frozen role
    r_j                                the run's rewards (ctx.score), NaN rows excluded
    r_hat_j                            the run's advantage estimator on the M rows (or `estimator`)
    lref_bar_j, lq_bar_j               length-averaged log-probs under the reference and under q
    logZ[x] = estimate_logZ(r_hat, lref_bar, lq_bar, beta),  ESS[x] = is_ess(log_w)
    regressor (optional)               LogZRegressor on hidden(layer) at the prompt's last position

**Defaults**

- q = the reference at ``temperature = 1.2`` [INFERRED] the spec's CPU "weak proposal";
  ``proposal = "NAME"`` uses the frozen role ``roles.NAME`` at the same temperature ("strong
  proposal"). q's log-probs are exact: sampling uses top_p = 1, top_k = 0.
- ``beta = 15`` [INFERRED] the spec's start at FlowRL's β (15 in FlowRL's code [CODE]); must equal the objective's.
- ``samples = 8`` [INFERRED] the spec's M = 8–16.
- r̂ normalised within the M proposals by the run's estimator [INFERRED] ("same normaliser as
  training"); ``estimator = {...}`` names another.
- ``dedupe = True`` [INFERRED]: rows with the same prompt share one estimate (their reward must
  depend on the prompt only); ``prompts = 0`` estimates every distinct prompt, else a seeded subset.
- ``regressor = False`` [INFERRED]; ``layer = 1``, ``hidden = 64``, ``steps = 300``, ``lr = 1e-2``,
  ``val_fraction = 0.25`` (held-out prompts for R²) [INFERRED].
- ``max_new_tokens = 0``: the run's ``rollout.max_new_tokens`` [INFERRED] (proposals as long as rollouts).

**Notes**

1. Sampling draws its noise from step −3 (RL's steps are 0, 1, …), key = the prompt's first row.
2. A prompt whose proposals all lack a reward has NaN in the table (the objective then needs the
   regressor); ``ess`` is 0 there.
3. Summary (``summary.json`` under the phase's name): prompts, rows covered, proposals, their mean
   reward, logZ mean / min / max, ESS mean and min (of M), the regressor's train / held-out R².
4. With q = the reference at temperature 1, log_w = β r̂ exactly and logZ = log mean_j exp(β r̂_j).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from groupwise.errors import ConfigError
from groupwise.losses.disa import LogZRegressor, estimate_logZ, is_ess, r_squared
from groupwise.masked import masked_mean
from groupwise.phases import PhaseContext
from groupwise.policy.forward import tempered_logp
from groupwise.registry import build_spec, register
from groupwise.types import Request, StepInfo


@register("phase", "disa_logz")
@dataclass
class DisaLogZ:
    """DISA's frozen anchor: an importance-sampled log Z(x) per training prompt (and optionally a regressor)."""

    kind = "offline"
    artifact: str = "logz"
    beta: float = 15.0
    samples: int = 8
    prompts: int = 0
    proposal: str = ""
    temperature: float = 1.2
    max_new_tokens: int = 0
    estimator: Any = None
    dedupe: bool = True
    batch_prompts: int = 64
    regressor: bool = False
    layer: int = 1
    hidden: int = 64
    steps: int = 300
    lr: float = 1e-2
    val_fraction: float = 0.25

    def __post_init__(self) -> None:
        for key in ("samples", "batch_prompts", "hidden", "steps"):
            if getattr(self, key) < 1:
                raise ConfigError(f"phase disa_logz: {key}={getattr(self, key)} must be >= 1")
        if (
            self.prompts < 0
            or self.max_new_tokens < 0
            or self.layer < 0
            or not self.temperature > 0
            or not self.beta >= 0
        ):
            raise ConfigError(
                f"phase disa_logz: need prompts >= 0 (got {self.prompts}; 0 = all), "
                f"max_new_tokens >= 0 (got {self.max_new_tokens}), layer >= 0 (got {self.layer}), "
                f"temperature > 0 (got {self.temperature}), beta >= 0 (got {self.beta})"
            )
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"phase disa_logz: val_fraction={self.val_fraction} must be in [0, 1)")

    def __call__(self, ctx: PhaseContext) -> dict:
        t0, policy = time.perf_counter(), ctx.policy
        if ctx.score is None or (self.estimator is None and ctx.advantage is None):
            raise ConfigError(
                "phase disa_logz needs the run's reward (and its advantage "
                "estimator, or `estimator`): run it through the trainer"
            )
        if self.proposal and self.proposal not in ctx.models:
            raise ConfigError(
                f"phase disa_logz: proposal={self.proposal!r} is not a frozen "
                f"role (frozen roles: {sorted(ctx.models) or 'none'}); "
                f"add roles.{self.proposal} = {{frozen = true, model = "
                '{path = "..."}} or leave proposal empty (the policy)'
            )
        q = ctx.models[self.proposal] if self.proposal else policy
        estimator = build_spec("advantage", self.estimator) if self.estimator is not None else None
        units = self._units(ctx)  # [(prompt ids, [rows])]
        max_new = self.max_new_tokens or ctx.max_new_tokens
        if max_new < 1:
            raise ConfigError(
                "phase disa_logz: max_new_tokens = 0 and the run gives no generation budget; set max_new_tokens"
            )
        info = StepInfo(step=-3, seed=ctx.seed, max_new_tokens=max_new, phase=self.artifact)
        sampling = {"temperature": self.temperature, "top_p": 1.0, "top_k": 0, "max_new_tokens": max_new}
        N = len(ctx.train_rows)
        table, ess_table = torch.full((N,), float("nan")), torch.zeros(N)  # [N]
        logZ_all, ess_all, emb_all, reward_sum, scored = [], [], [], 0.0, 0
        policy.eval()
        for start in range(0, len(units), self.batch_prompts):
            chunk = units[start : start + self.batch_prompts]
            with torch.no_grad():
                roll = q.generate(
                    [Request(key=rows[0], n=self.samples, prompt=ids) for ids, rows in chunk], sampling, info
                )
                roll.meta = [ctx.train_rows[rows[0]] for _, rows in chunk]
                ctx.score(roll, info)
                valid = roll.group_valid & torch.isfinite(roll.rewards)  # [P,M]
                adv = (estimator or ctx.advantage)(roll, info).float()  # [P,M] or [P,M,T]
                r_hat = masked_mean(adv, roll.mask, dim=-1) if adv.dim() == 3 else adv  # [P,M]
                lref, lq, emb = self._logps(policy, q, roll)  # [P,M], [P,M], [P,H] or None
            logZ = estimate_logZ(r_hat, lref, lq, self.beta, valid)  # [P]
            ess = is_ess(self.beta * r_hat + lref - lq, valid)  # [P]
            for p, (_, rows) in enumerate(chunk):
                table[rows], ess_table[rows] = logZ[p], ess[p]
            logZ_all.append(logZ), ess_all.append(ess)
            if emb is not None:
                emb_all.append(emb)
            reward_sum, scored = reward_sum + float(roll.rewards[valid].sum()), scored + int(valid.sum())
        logZ, ess = torch.cat(logZ_all), torch.cat(ess_all)  # [U]
        known = torch.isfinite(logZ)  # [U]
        summary = {
            "prompts": len(units),
            "rows": int(torch.isfinite(table).sum()),
            "proposals": len(units) * self.samples,
            "scored": scored,
            "reward_mean": reward_sum / max(scored, 1),
            "logz_mean": float(logZ[known].mean()) if known.any() else float("nan"),
            "logz_min": float(logZ[known].min()) if known.any() else float("nan"),
            "logz_max": float(logZ[known].max()) if known.any() else float("nan"),
            "ess_mean": float(ess.mean()),
            "ess_min": float(ess.min()),
            "samples": self.samples,
        }
        regressor = self._fit(torch.cat(emb_all)[known], logZ[known], ctx.seed, summary) if self.regressor else None
        summary["seconds"] = round(time.perf_counter() - t0, 1)
        ctx.say(
            f"phase {self.artifact!r}: log Z of {len(units)} prompts ({summary['rows']} rows) from "
            f"{self.samples} proposals each (proposal {self.proposal or 'policy'} at T={self.temperature}); "
            f"mean {summary['logz_mean']:.3f}, ESS mean {summary['ess_mean']:.2f} of {self.samples}"
            + (f", regressor held-out R² {summary['r2_val']:.3f}" if regressor else "")
        )
        return {
            "table": table,
            "ess": ess_table,
            "beta": self.beta,
            "samples": self.samples,
            "temperature": self.temperature,
            "proposal": self.proposal or "policy",
            "regressor": regressor,
            "summary": summary,
        }

    def _units(self, ctx: PhaseContext) -> list[tuple[list[int], list[int]]]:
        """The prompts to estimate: (prompt ids, the train rows sharing them), in row order;
        a seeded subset when `prompts` > 0."""
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        units = []
        for i in range(len(ctx.train_rows)):
            ids = list(ctx.prompt("train", ctx.train_rows, i))
            if self.dedupe:
                rows = by_prompt.setdefault(tuple(ids), [])
                if not rows:
                    units.append((ids, rows))
                rows.append(i)
            else:
                units.append((ids, [i]))
        if self.prompts and self.prompts < len(units):
            keep = sorted(
                torch.randperm(len(units), generator=torch.Generator().manual_seed(ctx.seed))[: self.prompts].tolist()
            )
            units = [units[k] for k in keep]
        return units

    def _logps(self, policy: Any, q: Any, roll: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(ℓ̄_ref [P,M], ℓ̄_q [P,M], prompt embedding [P,H] or None) of the proposals."""
        mask = roll.mask & roll.group_valid[..., None]  # [P,M,T]
        own_q = q is policy
        wanted = (
            ["logp"]
            + (["last_hidden"] if own_q and self.temperature != 1.0 else [])
            + ([f"hidden({self.layer})"] if self.regressor else [])
        )
        out = policy.forward(roll, wanted)
        lref = masked_mean(out["logp"], mask, dim=-1)  # [P,M]
        if own_q and self.temperature == 1.0:
            lq = lref  # [P,M] q is the reference itself
        else:
            # [P,M,T,H]
            hidden = out["last_hidden"] if own_q else q.forward(roll, ["logp", "last_hidden"])["last_hidden"]
            # [P,M]
            lq = masked_mean(tempered_logp(q.module, hidden, roll.actions, mask, self.temperature), mask, dim=-1)
        # [P,H] the state after the prompt
        emb = out[f"hidden({self.layer})"][:, 0, 0].float() if self.regressor else None
        return lref, lq, emb

    def _fit(self, emb: torch.Tensor, logZ: torch.Tensor, seed: int, summary: dict) -> dict:
        """Fit the regressor on the estimated prompts less a seeded held-out share; R² into the summary."""
        order = torch.randperm(len(logZ), generator=torch.Generator().manual_seed(seed + 1))  # [U']
        n_val = round(self.val_fraction * len(logZ))
        val, train = order[:n_val], order[n_val:]
        if len(train) < 2:
            raise RuntimeError(
                f"phase disa_logz: {len(train)} prompts with an estimate to fit the regressor on; need >= 2"
            )
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            reg = LogZRegressor(emb.shape[-1], self.hidden)
        summary["regressor_mse"] = reg.fit(emb[train], logZ[train], self.steps, self.lr, seed)
        with torch.no_grad():
            summary["r2_train"] = r_squared(reg(emb[train]), logZ[train])
            summary["r2_val"] = r_squared(reg(emb[val]), logZ[val]) if len(val) else float("nan")
        return {"state": reg.state_dict(), "embed_dim": emb.shape[-1], "hidden": self.hidden, "layer": self.layer}
