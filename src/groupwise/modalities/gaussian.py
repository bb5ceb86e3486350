"""A Gaussian policy over continuous actions: observation → N(μ_θ(s), σ²·I), the first
non-generative policy kind (issue 37, K1 of the non-text design ``../shared/design/nontext.md``).

Its first paper is 37 (Newton's Lantern, spec 37: a power-flow warm start μ_θ(s) refined by RL, the
supervised fit f0 as the reference); the kind itself is standard practice (a diagonal Gaussian
policy head, e.g. PPO's continuous-control policy, Schulman et al. 2017,
https://arxiv.org/abs/1707.06347). Nothing here is specific to a task.

**Change vs GRPO**: none to the algorithm; a row is one continuous action (T = 1), not tokens.

**Math** (observation s [C], action a [D])::

    μ_θ(s) = MLP(s)  (C → hidden → … → D, silu)            σ = ``sigma`` (fixed) or exp(log σ) (learned)
    a      = μ_θ(s) + σ·ε,  ε ~ N(0, I)                        greedy: a = μ_θ(s)
    logp   = Σ_d [ −(a − μ)²/(2σ²) − log σ − ½ log 2π ]        (``gauss_logp``, sum over D)
    demonstration loss = mean_{n,d} (μ_θ(s_n) − a*_n)²         (the sft phase: the warm start f0)

**Defaults** (all [INFERRED]: spec 37's toy, ``nontext.md`` §3 37)

- ``hidden = 64``, ``layers = 3`` (C → 64 → 64 → D), ``sigma = 0.05``, ``learn_sigma = false``.
- ``obs_dim = 2``, ``dim = 2``, ``init_seed = 0``.

**Notes**

1. Seeds: row j of a request draws ε from ``torch.Generator(sample_seed(seed, step, key, offset + j))``:
   a request's samples do not depend on the rest of the batch.
2. Contract: the action is the token extra ``action`` [B,G,1,D] and the row extra ``x_final``
   [B,G,D] (what a reward reads, as for the flow toy); ``logp_sampler`` [B,G,1] its log-prob. The
   encoded prompt is the observation, a list of ``obs_dim`` floats (``Rollout.prompt_ids``), and
   ``forward`` reads each row's own context (``Rollout.row_contexts``).
3. The net runs in float64 and the action is stored in float32, rounded before it is scored (as
   the flow toy's Note 3), so ``forward`` recomputes the sampling log-prob exactly.
4. ``forward`` computes ``logp``, ``entropy`` (per dimension: ½ log(2πe) + log σ, the mean over D)
   and ``step_mean`` (μ_θ(s) [B,G,1,D], with grad when asked with grad: an anchor to a frozen f0
   reads the reference's).
5. ``save`` writes ``gaussian_policy.pt`` (config + weights); ``model.path`` loads it
   (``policy/kinds.build_policy``), so a fitted policy is a warm start, a frozen role or a teacher.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from groupwise.modalities.gauss import gauss_logp
from groupwise.modalities.net_policy import NetPolicy
from groupwise.seeds import sample_seed
from groupwise.types import Request, Rollout, StepInfo

QUANTITIES = frozenset({"logp", "entropy", "step_mean"})
FILE = "gaussian_policy.pt"


class MeanMLP(nn.Module):
    """μ_θ(s): observations [N,C] -> action means [N,D] (silu MLP)."""

    def __init__(self, obs_dim: int, dim: int, hidden: int, layers: int):
        super().__init__()
        sizes = [obs_dim] + [hidden] * (layers - 1) + [dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, obs: Tensor) -> Tensor:
        h = obs
        for i, layer in enumerate(self.layers):
            h = layer(h)  # [N,H] or [N,D]
            if i < len(self.layers) - 1:
                h = nn.functional.silu(h)
        return h  # [N,D]


class GaussianPolicy(NetPolicy):
    """Observation → N(μ_θ(s), σ²I): one continuous action per row (K1)."""

    policy_file = FILE  # what save writes and model.path loads (policy/kinds.py)
    extra_tensors = ("log_sigma",)  # trained beside net: the state and the snapshot carry it

    def __init__(
        self,
        obs_dim: int = 2,
        dim: int = 2,
        hidden: int = 64,
        layers: int = 3,
        sigma: float = 0.05,
        learn_sigma: bool = False,
        init_seed: int = 0,
    ):
        if min(obs_dim, dim, hidden) < 1 or layers < 1 or not sigma > 0:
            raise ValueError(
                f"GaussianPolicy: need obs_dim, dim, hidden >= 1, layers >= 1, sigma > 0; "
                f"got {obs_dim}, {dim}, {hidden}, {layers}, {sigma}"
            )
        self.config = {"obs_dim": obs_dim, "dim": dim, "hidden": hidden, "layers": layers, "learn_sigma": learn_sigma}
        self.obs_dim, self.dim = obs_dim, dim
        with torch.random.fork_rng(devices=[]):  # seeded init that leaves the global stream alone
            torch.manual_seed(init_seed)
            self.net = MeanMLP(obs_dim, dim, hidden, layers).double()
        # log σ: a parameter when learned, else a fixed buffer-like tensor
        self.log_sigma = nn.Parameter(torch.tensor(math.log(sigma), dtype=torch.float64), requires_grad=learn_sigma)
        self.trainable = True
        self.modality = "gaussian"
        self.row_extras, self.token_extras = frozenset({"x_final"}), frozenset({"action"})  # what generate writes
        self.request_options = frozenset({"greedy"})  # greedy = the mean action
        self.quantities = QUANTITIES
        self.reference: GaussianPolicy | None = None
        self.context = None  # an observation is the whole prompt

    # ------------------------------------------------------------------ encoding
    def encode(self, prompt: Any) -> list[float]:
        """A dataset prompt (an observation of ``obs_dim`` numbers) as a list of floats."""
        try:
            obs = [float(v) for v in prompt]
        except (TypeError, ValueError):
            obs = []
        if len(obs) != self.obs_dim or not all(math.isfinite(v) for v in obs):
            raise ValueError(
                f"GaussianPolicy: a prompt must be an observation of {self.obs_dim} numbers, got {prompt!r}"
            )
        return obs

    def decode(self, rollout: Rollout) -> list[list[str]]:
        """[B][G] the actions as ``"a1,a2,…"`` ("" for padding rows)."""
        finals, valid = rollout.extras["x_final"].tolist(), rollout.group_valid.tolist()
        return [
            [",".join(f"{v:.4f}" for v in a) if ok else "" for a, ok in zip(row, oks)]
            for row, oks in zip(finals, valid)
        ]

    def check_fits(self, ids: list, max_new_tokens: int, where: str) -> None:
        """Nothing to check: one action per row, no token budget."""

    @property
    def sigma(self) -> Tensor:
        return self.log_sigma.exp()

    def _obs(self, contexts: Sequence[list]) -> Tensor:
        """[N,C] float64 observations, rounded to float32 first (as they are stored: Note 3)."""
        return torch.tensor([list(c) for c in contexts], dtype=torch.float32).double()  # [N,C]

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def generate(self, requests: Sequence[Request], sampling: dict, info: StepInfo) -> Rollout:
        if not requests or any(r.n < 1 for r in requests):
            raise ValueError("GaussianPolicy.generate needs at least one request, each with n >= 1")
        prompts = [self.encode(r.prompt) for r in requests]
        B, G, D = len(requests), max(r.n for r in requests), self.dim
        valid = torch.arange(G)[None, :] < torch.tensor([r.n for r in requests])[:, None]  # [B,G]
        eps = torch.zeros(B, G, D, dtype=torch.float64)  # [B,G,D]
        if not sampling.get("greedy"):
            for b, req in enumerate(requests):
                for j in range(req.n):
                    g = torch.Generator().manual_seed(sample_seed(info.seed, info.step, req.key, req.offset + j))
                    eps[b, j] = torch.randn(D, generator=g, dtype=torch.float64)
        mean = self.net(self._obs(prompts))[:, None, :]  # [B,1,D]
        action = (mean + self.sigma * eps).float()  # [B,G,D] stored in float32
        logp = gauss_logp(action.double().view(B * G, D), mean.expand(B, G, D).reshape(B * G, D), self.sigma, "sum")
        mask = valid[..., None].clone()  # [B,G,1]
        action = torch.where(valid[..., None], action, torch.zeros(()))  # [B,G,D]
        out = Rollout(
            prompt_ids=[list(p) for p in prompts],
            actions=torch.zeros(B, G, 1, dtype=torch.long),  # [B,G,1] the continuous action lives in the extras
            mask=mask,
            group_valid=valid,
            truncated=torch.zeros(B, G, dtype=torch.bool),
            prompt_index=torch.tensor([r.key for r in requests], dtype=torch.long),
            meta=[{"prompt": list(p)} for p in prompts],
            logp_sampler=logp.float().view(B, G, 1) * mask,  # [B,G,1]
        )
        out.set_extra("action", action[:, :, None, :], "token")  # [B,G,1,D]
        out.set_extra("x_final", action, "row")  # [B,G,D]
        out.completions = self.decode(out)
        return out

    # ------------------------------------------------------------------ scoring and training
    def forward(self, rollout: Rollout, quantities: Sequence[str] = ("logp",)) -> dict[str, Tensor]:
        """``logp`` [B,G,1] of each stored action under the current μ_θ and σ; ``entropy`` [B,G,1]
        (per dimension); ``step_mean`` [B,G,1,D] = μ_θ(s) of each row's own observation."""
        unknown = [q for q in quantities if q not in QUANTITIES]
        if unknown:
            raise ValueError(f"GaussianPolicy.forward computes {sorted(QUANTITIES)}, not {unknown}")
        if "action" not in rollout.extras:
            raise ValueError(
                "GaussianPolicy.forward needs the token extra 'action', written by GaussianPolicy.generate"
            )
        B, G, T = rollout.shape
        contexts = [c if c else [0.0] * self.obs_dim for row in rollout.row_contexts() for c in row]  # B*G
        mean = self.net(self._obs(contexts)).view(B, G, 1, self.dim)  # [B,G,1,D]
        action = rollout.extras["action"].double()  # [B,G,1,D]
        logp = gauss_logp(action.view(-1, self.dim), mean.view(-1, self.dim), self.sigma, "sum").view(B, G, 1)
        sel = rollout.mask.bool()  # [B,G,1]
        out = {"logp": torch.where(sel, logp, torch.zeros((), dtype=logp.dtype)).float()}  # [B,G,1]
        if "entropy" in quantities:
            entropy = 0.5 * math.log(2 * math.pi * math.e) + self.log_sigma  # per dimension
            out["entropy"] = torch.where(sel, entropy.float(), torch.zeros(()))  # [B,G,1]
        if "step_mean" in quantities:
            out["step_mean"] = (mean * sel[..., None]).float()  # [B,G,1,D]
        return out

    # ------------------------------------------------------------------ demonstrations (M1)
    def encode_target(self, row: dict) -> Tensor:
        """A demonstration row's ``target`` action (``dim`` numbers) as a float64 tensor [D]."""
        if "target" not in row:
            raise ValueError(
                f"GaussianPolicy.encode_target: a demonstration row needs a `target` column ({self.dim} numbers); "
                f"got the columns {sorted(row)}"
            )
        target = torch.as_tensor(row["target"], dtype=torch.float64)  # [D]
        if target.shape != (self.dim,) or not bool(torch.isfinite(target).all()):
            raise ValueError(
                f"GaussianPolicy.encode_target: `target` must be {self.dim} finite numbers, got {row['target']!r}"
            )
        return target

    def supervised_loss(self, prompts: Sequence[list], targets: Sequence[Tensor], gen: torch.Generator) -> Tensor:
        """The MSE of μ_θ(s) on the demonstrated actions, mean over rows and dimensions (``gen`` unused:
        the fit draws nothing)."""
        if len(prompts) != len(targets) or not prompts:
            raise ValueError(
                "GaussianPolicy.supervised_loss: need as many prompts as targets (>= 1), "
                f"got {len(prompts)} and {len(targets)}"
            )
        mean = self.net(self._obs([self.encode(p) for p in prompts]))  # [N,D]
        return ((mean - torch.stack([torch.as_tensor(t, dtype=torch.float64) for t in targets])) ** 2).mean()
