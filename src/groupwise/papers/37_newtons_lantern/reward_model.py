"""Newton's Lantern's learned reward: a model of the Newton–Raphson update count, fitted before RL on
perturbations of the warm start f0, and the reward −R_φ(s, x) it gives.

"Newton's Lantern", arXiv 2605.11102 (spec 37, "Reward-model data" [ABSTRACT]: "reward model trained
to predict iteration counts from error perturbations"). The fit's form is not in the abstract.

**Change vs GRPO**: the reward is a learned model of a solver's cost, not the solver: an offline
phase fits it on the policy as it is after the sft phase (f0), the reward reads the artifact.

**Math** (rows: the run's train snapshots s; f0(s) = the policy's greedy action)::

    x      = f0(s) + σ_p·ε,  ε ~ N(0, I),  σ_p ∈ ``scales``            (``per_scale`` draws each)
    n(s,x) = NR updates to the high-voltage root, n_max when NR fails  (``powerflow.iterations``)
    R_φ    = MLP([s, x] standardised) → 1;  min_φ mean Huber_δ(R_φ(s, x) − n(s, x))   (Adam)
    reward learned_reward = −R_φ(s, x_final)

**Defaults** (all [INFERRED]: the abstract gives no numbers)

- ``scales = [0.02, 0.05, 0.1, 0.2]`` (several scales, as the abstract says), ``per_scale = 2``,
  ``rows = 2048`` train snapshots: 16 384 labelled starts.
- ``hidden = 128`` (an MLP 4 → 128 → 128 → 1, silu), ``steps = 1500``, ``batch_size = 256``,
  ``lr = 3e-3``, ``huber_delta = 1.0``; ``n_max = 20``, ``tol = 1e-8`` as the true count.

**Notes**

1. The draws come from a ``torch.Generator`` seeded by the run's seed, so every rank (and a rerun)
   fits the same model; the artifact holds the net's config, weights and input standardisation.
2. The phase reports the fit (``summary.json`` under the phase's name): the share of capped labels,
   and on 1024 fresh perturbations the mean absolute error and the Spearman correlation of R_φ with
   the true count.
3. Only the training reward reads it: held-out evaluation keeps the true count (``nr_iterations``),
   which is what the claim measures.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from groupwise.registry import register
from groupwise.types import Request, Rollout, StepInfo

powerflow = importlib.import_module("groupwise.papers.37_newtons_lantern.powerflow")


class CountModel(nn.Module):
    """R_φ(s, x): [N,2] snapshots and [N,2] warm starts -> [N] predicted NR update counts."""

    def __init__(self, hidden: int, shift: Tensor | None = None, scale: Tensor | None = None):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(4, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1)
        )
        self.register_buffer("shift", torch.zeros(4) if shift is None else shift.float())
        self.register_buffer("scale", torch.ones(4) if scale is None else scale.float())

    def forward(self, s: Tensor, x: Tensor) -> Tensor:
        z = (torch.cat([s, x], -1).float() - self.shift) / self.scale  # [N,4]
        return self.net(z).squeeze(-1)  # [N]


def _ranks(v: Tensor) -> Tensor:
    return v.argsort().argsort().double()  # [N] (ties broken by position: fine for a report)


def spearman(a: Tensor, b: Tensor) -> float:
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


@register("phase", "nr_reward_model")
@dataclass
class NRRewardModel:
    """Fit R_φ(s, x) ≈ NR update count on perturbations of the policy's warm starts (Newton's Lantern, spec 37)."""

    kind = "offline"
    artifact: str = "reward_model"
    scales: list = field(default_factory=lambda: [0.02, 0.05, 0.1, 0.2])
    per_scale: int = 2
    rows: int = 2048
    hidden: int = 128
    steps: int = 1500
    batch_size: int = 256
    lr: float = 3e-3
    huber_delta: float = 1.0
    n_max: int = powerflow.N_MAX
    tol: float = powerflow.TOL

    def __post_init__(self) -> None:
        if not self.scales or min(self.scales) <= 0 or min(self.per_scale, self.rows, self.steps, self.hidden) < 1:
            raise ValueError(
                f"phase nr_reward_model: need scales > 0 (got {self.scales}) and per_scale, rows, steps, hidden >= 1"
            )

    def _starts(self, policy: Any, obs: list[list[float]], gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        """(s [M,2], x [M,2], labels [M]) for every perturbation of the policy's greedy warm starts."""
        info = StepInfo(step=-2, seed=0, max_new_tokens=0, phase=self.artifact)
        greedy = policy.generate([Request(key=i, n=1, prompt=o) for i, o in enumerate(obs)], {"greedy": True}, info)
        base = greedy.extras["x_final"][:, 0].double()  # [N,2]
        s = torch.tensor(obs, dtype=torch.float64)  # [N,2]
        reps = [sigma for sigma in self.scales for _ in range(self.per_scale)]
        x = torch.cat([base + sigma * torch.randn(base.shape, generator=gen, dtype=torch.float64) for sigma in reps])
        s = s.repeat(len(reps), 1)  # [M,2]
        labels, _ = powerflow.iterations(x, s, self.n_max, self.tol)  # [M]
        return s, x, labels

    def __call__(self, ctx: Any) -> dict:
        gen = torch.Generator().manual_seed(int(ctx.seed) * 7919 + 37)
        obs = [list(ctx.prompt("train", ctx.train_rows, i)) for i in range(min(self.rows, len(ctx.train_rows)))]
        with torch.no_grad():
            s, x, labels = self._starts(ctx.policy, obs, gen)
            inputs = torch.cat([s, x], -1)  # [M,4]
            shift, scale = inputs.mean(0), inputs.std(0).clamp_min(1e-6)  # [4]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(ctx.seed))
            model = CountModel(self.hidden, shift, scale)
        opt = torch.optim.Adam(model.parameters(), lr=self.lr)
        loss = torch.zeros(())
        for _ in range(self.steps):
            idx = torch.randint(len(labels), (self.batch_size,), generator=gen)  # [b]
            loss = nn.functional.huber_loss(model(s[idx], x[idx]), labels[idx].float(), delta=self.huber_delta)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            s_new, x_new, truth = self._starts(ctx.policy, obs[:1024], gen)  # fresh perturbations (Note 2)
            pred = model(s_new, x_new).double()  # [M']
        report = {
            "labels": len(labels),
            "capped_share": float((labels >= self.n_max).double().mean()),
            "huber_last": float(loss.detach()),
            "heldout_mae": float((pred - truth).abs().mean()),
            "heldout_spearman": spearman(pred, truth),
        }
        ctx.say(f"phase {self.artifact!r}: {report}")
        return {
            "hidden": self.hidden,
            "state": {k: v.clone() for k, v in model.state_dict().items()},
            "summary": report,
        }


@register("reward", "learned_reward")
@dataclass
class LearnedNRReward:
    """−R_φ(s, x): the learned NR update count of the warm start (phase nr_reward_model; Newton's Lantern)."""

    artifact: str = "reward_model"
    weight: float = 1.0

    needs = ()
    reads_extras = ("x_final",)  # the warm start (the gaussian policy's action)

    def __post_init__(self) -> None:
        self.model: CountModel | None = None

    @property
    def artifacts(self) -> tuple[str, ...]:
        return (self.artifact,)

    def use_artifact(self, name: str, value: dict) -> None:
        model = CountModel(int(value["hidden"]))
        model.load_state_dict(value["state"])
        self.model = model.eval()

    def score_rollout(self, rollout: Rollout, info: StepInfo) -> Tensor:
        if self.model is None:
            raise ValueError(
                f"reward learned_reward: no reward model; add the offline phase nr_reward_model "
                f"(artifact {self.artifact!r}) to `phases`, after the sft phase"
            )
        x = rollout.extras["x_final"]  # [B,G,2]
        B, G, _ = x.shape
        obs = [c if c else [0.0, 0.0] for row in rollout.row_contexts() for c in row]  # B*G
        with torch.no_grad():
            pred = self.model(torch.tensor(obs, dtype=torch.float64), x.reshape(-1, 2).double()).view(B, G)  # [B,G]
        return torch.where(rollout.group_valid.bool(), -pred, torch.zeros(()))  # [B,G]
