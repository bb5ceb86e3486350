"""Phase ``lac_align``: LAC's stage 1, prior-guided variational alignment of the latent planner and the
flow generator (spec 10 "Stage 1"; design note §3 "10 LAC").

"LAC: Latent Action Control with Latent-Flow GRPO", arXiv 2605.16961,
https://arxiv.org/abs/2605.16961 (abstract only: every choice below is [INFERRED]).

**Change vs GRPO**: a warm start before RL (kind ``sft``). A phase-owned posterior q(a | priors)
sees training-only priors (the row's ``priors`` column: in ``flow_binding`` the true mode coordinates
[μ_i, μ_j] of the row's pair, 4 numbers) and
proposes the K latent actions; the generator learns to draw the demonstration given a ~ q, and the
planner π_φ(a | y) (which sees only the label) is pulled toward q.

**Math** (row: label y, priors c, demonstration x_0 [D]; σ = the planner's ``plan_sigma``, shared by q)::

    q(a_k | c) = N(m_k(c), σ² I)                                      m = MLP(c) reshaped [K,d]
    a = m + σ ε                                                        (reparameterised)
    L = mean_{n,d} (v_θ(x_s, s, y, plan_condition(a)) − (ε' − x_0))²   flow matching, s ~ U(0,1)
      + kl_coef · mean_n Σ_k KL(N(m_k, σ²) ‖ N(μ_φ,k(y, a_<k), σ²))     closed form (``modalities/gauss.gauss_kl``)

Halting (the paper's BCE on a stop head) is off: K is fixed in the toy.

**Defaults** (all [INFERRED]): ``steps = 400``, ``batch_size = 64``, Adam ``lr = 5e-3``,
``kl_coef = 1``, ``posterior_hidden = 32``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from groupwise.errors import ConfigError
from groupwise.modalities.flow import flow_matching_pair
from groupwise.modalities.gauss import gauss_kl
from groupwise.modalities.planner import PlannerPolicy
from groupwise.registry import register


class Posterior(nn.Module):
    """m [N,K,d]: the posterior's means of the latent actions given the priors [N,P]."""

    def __init__(self, n_priors: int, n_plan: int, plan_dim: int, hidden: int):
        super().__init__()
        self.n_plan, self.plan_dim = n_plan, plan_dim
        self.body = nn.Sequential(nn.Linear(n_priors, hidden), nn.SiLU(), nn.Linear(hidden, n_plan * plan_dim))

    def forward(self, priors: Tensor) -> Tensor:
        return self.body(priors).view(-1, self.n_plan, self.plan_dim)  # [N,K,d]


@register("phase", "lac_align")
@dataclass
class LacAlign:
    """LAC stage 1: fit the generator given posterior latents and pull the planner toward the posterior."""

    kind = "sft"
    steps: int = 400  # [INFERRED] the toy
    batch_size: int = 64  # [INFERRED]
    lr: float = 5e-3  # [INFERRED] Adam on the planner, the generator and the posterior
    kl_coef: float = 1.0  # [INFERRED] weight of KL(q ‖ π_φ)
    posterior_hidden: int = 32  # [INFERRED]

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.lr <= 0 or self.kl_coef < 0 or self.posterior_hidden < 1:
            raise ConfigError(
                f"phase lac_align: need steps, batch_size, posterior_hidden >= 1, lr > 0, kl_coef >= 0; got "
                f"{self.steps}, {self.batch_size}, {self.posterior_hidden}, {self.lr}, {self.kl_coef}"
            )

    def _loss(
        self, policy: PlannerPolicy, posterior: Posterior, rows: list[dict], gen: torch.Generator
    ) -> tuple[Tensor, Tensor]:
        """(flow-matching loss, mean KL) of one batch of demonstration rows (module docstring)."""
        labels = torch.tensor([int(r["prompt"]) for r in rows])  # [N]
        priors = torch.tensor([r["priors"] for r in rows], dtype=torch.float64)  # [N,P] training-only
        x0 = torch.tensor([r["target"] for r in rows], dtype=torch.float64)  # [N,D]
        m = posterior(priors)  # [N,K,d]
        eps = torch.randn(m.shape, generator=gen, dtype=torch.float64)  # [N,K,d]
        plan = m + policy.plan_sigma * eps  # [N,K,d]
        kl = gauss_kl(m, policy.plan_sigma, policy.planner(labels, plan), policy.plan_sigma).sum(-1).mean()
        sigma = torch.rand(len(rows), generator=gen, dtype=torch.float64)  # [N]
        noise = torch.randn(x0.shape, generator=gen, dtype=torch.float64)  # [N,D]
        x_sigma, velocity = flow_matching_pair(x0, noise, sigma)  # [N,D], [N,D]
        fm = ((policy._velocity(x_sigma, sigma, labels, plan) - velocity) ** 2).mean()
        return fm, kl

    def __call__(self, ctx) -> dict:
        policy = ctx.policy
        if not isinstance(policy, PlannerPolicy) or policy.dim != 4 or policy.planner_kind != "latent":
            raise ConfigError(
                'phase lac_align trains a latent planner policy with dim = 4 (model.policy = "planner", '
                f'model.params.planner = "latent", dim = 4); this one is {type(policy).__name__}'
                + (f" ({policy.planner_kind!r}, dim {policy.dim})" if isinstance(policy, PlannerPolicy) else "")
            )
        rows = [r for r in ctx.train_rows if "priors" in r and "target" in r]
        if not rows:
            raise ConfigError("phase lac_align needs demonstration rows with `priors` and `target` (task flow_binding)")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.seed)
            posterior = Posterior(
                len(rows[0]["priors"]), policy.n_plan, policy.plan_dim, self.posterior_hidden
            ).double()
        params = [*policy.parameters(), *posterior.parameters()]
        opt = torch.optim.Adam(params, lr=self.lr)
        gen = torch.Generator().manual_seed(ctx.seed)
        policy.train()
        fm = kl = torch.zeros(())
        for _ in range(self.steps):
            pick = torch.randint(len(rows), (self.batch_size,), generator=gen).tolist()
            fm, kl = self._loss(policy, posterior, [rows[i] for i in pick], gen)
            opt.zero_grad()
            (fm + self.kl_coef * kl).backward()
            opt.step()
        policy.eval()
        summary = {"steps": self.steps, "fm_loss": float(fm.detach()), "kl": float(kl.detach())}
        ctx.say(
            f"phase 'lac_align': {self.steps} steps, flow matching {summary['fm_loss']:.4f}, KL {summary['kl']:.4f}"
        )
        return {"summary": summary}
