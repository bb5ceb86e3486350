"""The planner kind (K4 of the non-text design ``../shared/design/nontext.md``): a planner emits K
continuous latent actions, then the flow generator draws a sample conditioned on them; one rollout
row holds both, so one advantage trains both (Latent-Flow GRPO).

"LAC: Latent Action Control with Latent-Flow GRPO", arXiv 2605.16961,
https://arxiv.org/abs/2605.16961 — spec 10 (status ABSTRACT: only the abstract was read, so every
mechanical choice below is [INFERRED]: K, d, the role embeddings, the injection map, σ).

**Change vs GRPO**: a row's "tokens" are ``n_plan`` Gaussian latent actions (positions ``0..K−1``)
followed by the flow policy's trained SDE steps (positions ``K..``, ``modalities/flow.py``). The
token extra ``part`` [B,G,T] (0 at plan positions, 1 at generator steps, 0 on padding) lets a loss
treat the two parts apart; the row extra ``plan`` [B,G,K,d] holds the latent actions.

**Math** (row with label ``y``; ``a_k`` ∈ R^d the latent actions; ``R[k]`` the role embedding)::

    planner:   h_k = silu(W2 silu(E_label[y] + R[k] + W_a Σ_{s<k} a_s));  μ_k = W_μ h_k
               a_k ~ N(μ_k, σ² I)                                           greedy: a_k = μ_k
    generator: v_θ(x, σ, c, plan_condition(a)),  plan_condition(a) = W_c concat(a_1..a_K)   [N,H]
               c = y ("label"), bag[y] ("bag": an order-free label, e.g. the unordered pair) or none
    logp[b,g,k] = Σ_d log N(a_k,d; μ_k,d, σ²)    k < K
                = Flow-GRPO SDE step log-prob      t ≥ K   (modalities/flow.py)

**Defaults** (all [INFERRED])

- ``planner = "latent"``, ``n_plan = 2``, ``plan_dim = 4``, ``plan_sigma = 0.5``, ``plan_hidden = 32``.
- ``generator_sees = "none"``: the plan is the only path from the prompt to the sample;
  ``"bag"`` needs ``bag`` (one generator label per prompt label, ``bag[y]``).
- The generator's sizes and SDE modes as ``FlowPolicy`` (``dim`` included: D = 4 for two 2-D points).

**Notes**

1. Seeds: row ``j`` of a request draws its latents from ``torch.Generator(sample_seed(seed, step,
   key, offset + j) + 1)``, a stream apart from the flow's (``FlowPolicy`` Note 1; as ``unified``).
2. Each latent is rounded to float32 as soon as it is drawn (it is stored so), and later latents are
   planned from the rounded ones, so ``forward`` recomputes the sampler's log-probs exactly (Note 3
   of ``modalities/flow.py``).
3. ``planner = "think_lm"`` (today's ``unified`` kind: think tokens from a tiny causal LM) is not yet
   absorbed here: ``model.policy = "unified"`` stays the way to train it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from groupwise.modalities.flow import FlowPolicy
from groupwise.modalities.flow_sde import row_labels
from groupwise.modalities.gauss import gauss_logp
from groupwise.seeds import sample_seed
from groupwise.types import Request, Rollout, StepInfo

PLANNERS = ("latent",)
GENERATOR_SEES = ("label", "bag", "none")
FILE = "planner_policy.pt"


class LatentPlanner(nn.Module):
    """μ [N,K,d] of each latent action given the label and the actions before it (causal), and the
    generator's condition ``plan_condition`` of a whole plan."""

    def __init__(self, n_labels: int, n_plan: int, plan_dim: int, hidden: int, flow_hidden: int):
        super().__init__()
        self.label = nn.Embedding(n_labels, hidden)
        self.role = nn.Embedding(n_plan, hidden)
        self.prev = nn.Linear(plan_dim, hidden, bias=False)
        self.mid = nn.Linear(hidden, hidden)
        self.mean = nn.Linear(hidden, plan_dim)
        self.inject = nn.Linear(n_plan * plan_dim, flow_hidden, bias=False)  # W_c: the plan into the generator

    def forward(self, label: Tensor, plan: Tensor) -> Tensor:
        before = plan.cumsum(1) - plan  # [N,K,d] Σ of the actions before each position
        h = self.label(label)[:, None, :] + self.role.weight[None, : plan.shape[1]] + self.prev(before)  # [N,K,H]
        return self.mean(nn.functional.silu(self.mid(nn.functional.silu(h))))  # [N,K,d]

    def plan_condition(self, plan: Tensor) -> Tensor:
        return self.inject(plan.flatten(1))  # [N,H_flow] W_c concat(a_1..a_K)


class PlannerPolicy(FlowPolicy):
    """Latent actions from a Gaussian planner, then a flow sample conditioned on them (K4)."""

    policy_file = FILE

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
        dim: int = 2,
        planner: str = "latent",
        generator_sees: str = "none",
        bag: list[int] | None = None,
        n_plan: int = 2,
        plan_dim: int = 4,
        plan_sigma: float = 0.5,
        plan_hidden: int = 32,
    ):
        if planner not in PLANNERS:
            hint = ' (the think-LM planner is model.policy = "unified" for now)' if planner == "think_lm" else ""
            raise ValueError(f"PlannerPolicy: planner must be one of {PLANNERS}, got {planner!r}{hint}")
        if generator_sees not in GENERATOR_SEES:
            raise ValueError(f"PlannerPolicy: generator_sees must be one of {GENERATOR_SEES}, got {generator_sees!r}")
        bag_list = [int(v) for v in bag] if bag is not None else None
        if (generator_sees == "bag") != (bag_list is not None) or (
            bag_list is not None and (len(bag_list) != n_labels or not all(0 <= v < n_labels for v in bag_list))
        ):
            raise ValueError(
                f'PlannerPolicy: generator_sees = "bag" needs bag = one generator label in 0..{n_labels - 1} per '
                f"prompt label ({n_labels} of them), and only then; got generator_sees={generator_sees!r}, bag={bag}"
            )
        if min(n_plan, plan_dim, plan_hidden) < 1 or not plan_sigma > 0:
            raise ValueError(
                f"PlannerPolicy: need n_plan, plan_dim, plan_hidden >= 1 and plan_sigma > 0; "
                f"got {n_plan}, {plan_dim}, {plan_hidden}, {plan_sigma}"
            )
        super().__init__(n_labels, hidden, layers, steps, sde, sde_window, shift, init_seed, dim=dim)
        self.config.update(
            planner=planner,
            generator_sees=generator_sees,
            n_plan=n_plan,
            plan_dim=plan_dim,
            plan_sigma=plan_sigma,
            plan_hidden=plan_hidden,
        )
        if bag_list is not None:
            self.config["bag"] = bag_list
        self.generator_sees, self.n_plan, self.plan_dim, self.plan_sigma = generator_sees, n_plan, plan_dim, plan_sigma
        self.bag = torch.tensor(bag_list) if bag_list is not None else None  # [n_labels] generator label per label
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed + 1)
            self.planner = LatentPlanner(n_labels, n_plan, plan_dim, plan_hidden, hidden).double()
        self.modality = "planner"
        self.quantities = frozenset({"logp", "entropy"})

    @property
    def T(self) -> int:
        return self.n_plan + self._steps_trained(self.sde)

    def encode_target(self, row: dict) -> Tensor:
        """Not defined: a demonstration would need the plan too (paper 10's phase ``lac_align`` fits it)."""
        raise ValueError("the planner policy has no plain demonstration fit; its stage 1 is a paper's own phase")

    def supervised_loss(self, prompts: Sequence[list[int]], targets: Sequence[Tensor], gen: torch.Generator) -> Tensor:
        """Not defined (see :meth:`encode_target`)."""
        raise ValueError("the planner policy has no plain demonstration fit; its stage 1 is a paper's own phase")

    # ------------------------------------------------------------------ the generator's condition
    def generator_label(self, label: Tensor) -> Tensor | None:
        """What the generator sees of the prompt label [N]: the label, its bag label, or nothing."""
        if self.generator_sees == "none":
            return None
        return label if self.bag is None else self.bag[label]  # [N]

    def _velocity(self, x: Tensor, sigma: Tensor, label: Tensor, cond: Tensor | None) -> Tensor:
        if cond is None:
            raise ValueError("PlannerPolicy: the generator needs the plan as its condition (cond [N,K,d]), got None")
        extra = self.planner.plan_condition(cond)  # [N,H]
        return self.net(x, sigma, self.generator_label(label), extra)  # [N,D]

    def _stored_condition(self, rollout: Rollout, sel: Tensor) -> Tensor:
        plan = rollout.extras["plan"].double()  # [B,G,K,d]
        return plan[:, :, None].expand(*sel.shape, *plan.shape[-2:])[sel]  # [M,K,d]

    # ------------------------------------------------------------------ sampling
    def plan_logp(self, labels: Tensor, plan: Tensor) -> Tensor:
        """Σ_d log N(a_k; μ_k, σ²) [N,K] of a plan [N,K,d] (float64)."""
        N, K, d = plan.shape
        mean = self.planner(labels, plan)  # [N,K,d]
        return gauss_logp(plan.reshape(N * K, d), mean.reshape(N * K, d), self.plan_sigma, "sum").view(N, K)

    def _plan(self, requests: Sequence[Request], info: StepInfo, G: int, greedy: bool) -> tuple[Tensor, Tensor]:
        """Latent actions [B,G,K,d] (float64 of float32 values) and their log-probs [B,G,K], one action at a time."""
        B, K, d = len(requests), self.n_plan, self.plan_dim
        labels = torch.tensor([self.encode(r.prompt)[0] for r in requests]).repeat_interleave(G)  # [B*G]
        eps = torch.zeros(B * G, K, d, dtype=torch.float64)  # [N,K,d]
        if not greedy:
            for i, (r, j) in enumerate((r, j) for r in requests for j in range(G)):
                g = torch.Generator().manual_seed(
                    sample_seed(info.seed, info.step, r.key, getattr(r, "offset", 0) + j) + 1
                )
                eps[i] = torch.randn(K, d, generator=g, dtype=torch.float64)
        plan = torch.zeros(B * G, K, d, dtype=torch.float64)  # [N,K,d]
        for k in range(K):
            mean = self.planner(labels, plan)[:, k]  # [N,d] position k sees actions < k only
            plan[:, k] = (mean + self.plan_sigma * eps[:, k]).float().double()  # Note 2: rounded as stored
        return plan.view(B, G, K, d), self.plan_logp(labels, plan).view(B, G, K)

    @torch.no_grad()
    def generate(self, requests: Sequence[Request], sampling: dict, info: StepInfo) -> Rollout:
        if not requests or any(r.n < 1 for r in requests):
            raise ValueError("PlannerPolicy.generate needs at least one request, each with n >= 1")
        G, K = max(r.n for r in requests), self.n_plan
        valid = torch.arange(G)[None, :] < torch.tensor([r.n for r in requests])[:, None]  # [B,G]
        plan, plan_logp = self._plan(requests, info, G, bool(sampling.get("greedy")))  # [B,G,K,d], [B,G,K]
        plan = plan * valid[..., None, None]  # [B,G,K,d] zeros on padding rows
        flow = self._generate_flow(requests, sampling, info, plan)  # [B,G,T_flow] trained steps
        B, _, T_flow = flow.shape
        assert flow.logp_sampler is not None  # the flow sampler always writes it

        def before(v: Tensor) -> Tensor:  # [B,G,T_flow,...] -> [B,G,K+T_flow,...], zeros at the plan positions
            return torch.cat([torch.zeros(B, G, K, *v.shape[3:], dtype=v.dtype), v], dim=2)

        out = copy.copy(flow)
        out.actions = before(flow.actions)  # [B,G,T] the latents live in the row extra `plan`
        out.mask = torch.cat([valid[..., None].expand(B, G, K), flow.mask], dim=2)  # [B,G,T]
        out.logp_sampler = torch.cat([plan_logp.float() * valid[..., None], flow.logp_sampler], dim=2)  # [B,G,T]
        out.extras, out.extra_levels = {}, {}
        for key, value in flow.extras.items():
            out.set_extra(key, before(value) if flow.extra_levels[key] == "token" else value, flow.extra_levels[key])
        out.set_extra("part", torch.cat([torch.zeros(B, G, K), torch.ones(B, G, T_flow)], dim=2) * out.mask, "token")
        out.set_extra("plan", plan.float(), "row")  # [B,G,K,d]
        return out

    # ------------------------------------------------------------------ scoring and training
    def forward(self, rollout: Rollout, quantities: Sequence[str] = ("logp",)) -> dict[str, Tensor]:
        """``{"logp": [B,G,T]}``: the latents' Gaussian log-probs under the planner, then the flow steps'
        (``FlowPolicy.forward`` on the generator positions); ``"entropy"``: per dimension, then the flow's."""
        unknown = [q for q in quantities if q not in self.quantities]
        if unknown:
            raise ValueError(f"PlannerPolicy.forward computes {sorted(self.quantities)}, not {unknown}")
        if "plan" not in rollout.extras:
            raise ValueError("PlannerPolicy.forward needs the row extra 'plan', written by PlannerPolicy.generate")
        K = self.n_plan
        flow_view = copy.copy(rollout)
        flow_view.actions, flow_view.mask = rollout.actions[:, :, K:], rollout.mask[:, :, K:]
        flow_view.extras = {
            k: (v[:, :, K:] if rollout.extra_levels.get(k) == "token" else v) for k, v in rollout.extras.items()
        }
        flow_out = super().forward(flow_view, quantities)
        B, G, _ = rollout.shape
        labels = row_labels(rollout).view(B * G)  # [B*G]
        plan = rollout.extras["plan"].double().view(B * G, K, self.plan_dim)  # [N,K,d]
        plan_mask = rollout.mask[:, :, :K].bool()  # [B,G,K]
        logp = torch.where(plan_mask, self.plan_logp(labels, plan).view(B, G, K), torch.zeros((), dtype=plan.dtype))
        out = {"logp": torch.cat([logp.float(), flow_out["logp"]], dim=2)}  # [B,G,T]
        if "entropy" in quantities:
            ent = plan_mask * (0.5 * math.log(2 * math.pi * math.e) + math.log(self.plan_sigma))  # [B,G,K]
            out["entropy"] = torch.cat([ent.float(), flow_out["entropy"]], dim=2)  # [B,G,T]
        return out

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in (self.net, self.planner) for p in m.parameters() if p.requires_grad]

    def snapshot(self) -> PlannerPolicy:
        twin = super().snapshot()
        for p in twin.planner.parameters():
            p.requires_grad_(False)
        twin.planner.eval()
        return twin

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["planner"] = {k: v.clone() for k, v in self.planner.state_dict().items()}
        if isinstance(self.reference, PlannerPolicy):
            state["reference_planner"] = {k: v.clone() for k, v in self.reference.planner.state_dict().items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.planner.load_state_dict(state["planner"])
        if isinstance(self.reference, PlannerPolicy) and "reference_planner" in state:
            self.reference.planner.load_state_dict(state["reference_planner"])

    def train(self) -> None:
        super().train()
        self.planner.train()

    def eval(self) -> None:
        super().eval()
        self.planner.eval()
