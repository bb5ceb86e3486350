"""The planner kind (K4 of the non-text design ``../shared/design/nontext.md``): a planner draws K
actions, then the flow generator draws a sample conditioned on them; one rollout row holds both, so
one advantage trains both (Latent-Flow GRPO; AlphaGRPO's unified think + image model).

"LAC: Latent Action Control with Latent-Flow GRPO", arXiv 2605.16961,
https://arxiv.org/abs/2605.16961 — spec 10 (status ABSTRACT: only the abstract was read, so every
mechanical choice of the latent planner is [INFERRED]: K, d, the role embeddings, the injection map, σ).
"AlphaGRPO: GRPO over a unified AR+diffusion model with decompositional verifiable reward",
https://arxiv.org/abs/2605.12495 — spec 27's small analogue: the think-LM planner.

**Change vs GRPO**: a row's "tokens" are ``n_plan`` plan positions (``0..K−1``) followed by the flow
policy's trained SDE steps (positions ``K..``, ``modalities/flow.py``). The token extra ``part``
[B,G,T] (0 at plan positions, 1 at generator steps, 0 on padding) lets a loss treat the two parts
apart. The planners (``modalities/planner_heads.py``):

- ``planner = "latent"``: K Gaussian latent actions of ``plan_dim`` numbers (row extra ``plan``
  [B,G,K,d]; the actions at the plan positions are 0);
- ``planner = "think_lm"``: K think tokens of ``THINK_VOCAB`` from a tiny causal LM (the actions at
  the plan positions, and the row extra ``think_ids`` [B,G,K]).

**Math** (row with label ``y``; ``R[k]`` the role embedding, ``P[k]`` the position embedding)::

    latent:    h_k = silu(W2 silu(E_label[y] + R[k] + W_a Σ_{s<k} a_s));  μ_k = W_μ h_k
               a_k ~ N(μ_k, σ² I)   (greedy: a_k = μ_k);       plan_condition(a) = W_c concat(a_1..a_K)
    think_lm:  h_k = silu(W2 silu(E_label[y] + Σ_{s<k} E_tok[z_s] + P[k]));  z_k ~ softmax(W_out h_k)
               (greedy: the argmax);                            plan_condition(z) = Σ_k E_think[z_k]
    generator: v_θ(x, σ, c, plan_condition(plan))                                              [N,D]
               c = y ("label"), bag[y] ("bag": an order-free label, e.g. the unordered pair) or none
    logp[b,g,k] = the planner's log-prob (Gaussian Σ_d, or the categorical's)   k < K
                = Flow-GRPO SDE step log-prob      t ≥ K   (modalities/flow.py)

**Defaults** (all [INFERRED])

- ``planner = "latent"``, ``n_plan = 2``, ``plan_dim = 4``, ``plan_sigma = 0.5``, ``plan_hidden = 32``
  (``plan_dim`` and ``plan_sigma`` are the latent planner's only: ``think_lm`` refuses them).
- ``generator_sees = "none"``: the plan is the only path from the prompt to the sample;
  ``"bag"`` needs ``bag`` (one generator label per prompt label, ``bag[y]``).
- The generator's sizes and SDE modes as ``FlowPolicy`` (``dim`` included: D = 4 for two 2-D points).

**Notes**

1. Seeds: row ``j`` of a request draws its plan from ``torch.Generator(sample_seed(seed, step, key,
   offset + j) + 1)``, a stream apart from the flow's (``FlowPolicy`` Note 1).
2. Each latent is rounded to float32 as soon as it is drawn (it is stored so), and later latents are
   planned from the rounded ones, so ``forward`` recomputes the sampler's log-probs exactly (Note 3
   of ``modalities/flow.py``).
3. ``model.policy = "unified"`` is this kind with ``planner = "think_lm"`` under its old parameter
   names, checkpoint file and extras (``modalities/unified.py``): its recipes and claims run as before.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from groupwise.modalities.flow import FlowPolicy
from groupwise.modalities.flow_sde import row_labels
from groupwise.modalities.planner_heads import LatentPlanner, ThinkPlanner
from groupwise.seeds import sample_seed
from groupwise.types import Request, Rollout, StepInfo

PLANNERS = ("latent", "think_lm")
GENERATOR_SEES = ("label", "bag", "none")
FILE = "planner_policy.pt"


class PlannerPolicy(FlowPolicy):
    """A planner's K actions (Gaussian latents or think tokens), then a flow sample conditioned on them (K4)."""

    policy_file = FILE
    part_extra = "part"  # the token extra naming each position's part (0 plan, 1 generator)

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
        plan_dim: int | None = None,
        plan_sigma: float | None = None,
        plan_hidden: int = 32,
    ):
        if planner not in PLANNERS:
            raise ValueError(f"PlannerPolicy: planner must be one of {PLANNERS}, got {planner!r}")
        if planner == "think_lm" and (plan_dim, plan_sigma) != (None, None):
            raise ValueError(
                'PlannerPolicy: planner = "think_lm" (the think LM of model.policy = "unified") draws n_plan tokens; '
                f"plan_dim and plan_sigma are the latent planner's: leave them out (got {plan_dim}, {plan_sigma})"
            )
        plan_dim = 4 if plan_dim is None else plan_dim
        plan_sigma = 0.5 if plan_sigma is None else plan_sigma
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
        self.config.update(planner=planner, generator_sees=generator_sees, n_plan=n_plan)
        if planner == "latent":
            self.config.update(plan_dim=plan_dim, plan_sigma=plan_sigma)
        self.config["plan_hidden"] = plan_hidden
        if bag_list is not None:
            self.config["bag"] = bag_list
        self.planner_kind, self.generator_sees, self.n_plan = planner, generator_sees, n_plan
        self.plan_dim, self.plan_sigma = plan_dim, plan_sigma
        self.bag = torch.tensor(bag_list) if bag_list is not None else None  # [n_labels] generator label per label
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed + 1)
            self.planner: LatentPlanner | ThinkPlanner = (
                LatentPlanner(n_labels, n_plan, plan_dim, plan_hidden, hidden, plan_sigma)
                if planner == "latent"
                else ThinkPlanner(n_labels, n_plan, plan_hidden, hidden)
            ).double()
        self.modality = "planner"
        self.row_extras = self.row_extras | {self.planner.row_extra}  # the flow's, the plan
        self.token_extras = self.token_extras | {self.part_extra}  # the flow's (0 at plan positions), the part
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

    def plan_condition(self, plan: Tensor) -> Tensor:
        """[N,H] the generator's view of a whole plan [N,K,...] (the planner's; module docstring)."""
        return self.planner.plan_condition(plan)

    def _velocity(self, x: Tensor, sigma: Tensor, label: Tensor, cond: Tensor | None) -> Tensor:
        if cond is None:
            raise ValueError("PlannerPolicy: the generator needs the plan as its condition (cond [N,K,...]), got None")
        return self.net(x, sigma, self.generator_label(label), self.plan_condition(cond))  # [N,D]

    def _stored_condition(self, rollout: Rollout, sel: Tensor) -> Tensor:
        plan = self.planner.condition_of(rollout.extras[self.planner.row_extra])  # [B,G,K,...]
        return plan[:, :, None].expand(*sel.shape, *plan.shape[2:])[sel]  # [M,K,...]

    # ------------------------------------------------------------------ sampling
    def plan_logp(self, labels: Tensor, plan: Tensor) -> Tensor:
        """The planner's log-probs [N,K] of a plan [N,K,...] (float64)."""
        return self.planner.log_probs(labels, plan)

    def _plan(self, requests: Sequence[Request], info: StepInfo, G: int, greedy: bool) -> tuple[Tensor, Tensor]:
        """A plan [B,G,K,...] and its log-probs [B,G,K] (Note 1: row j's own stream, +1)."""
        B = len(requests)
        labels = torch.tensor([self.encode(r.prompt)[0] for r in requests]).repeat_interleave(G)  # [B*G]
        gens = None
        if not greedy:
            gens = [
                torch.Generator().manual_seed(sample_seed(info.seed, info.step, r.key, getattr(r, "offset", 0) + j) + 1)
                for r in requests
                for j in range(G)
            ]
        plan, logp = self.planner.draw(labels, gens, self.n_plan)  # [N,K,...], [N,K]
        return plan.view(B, G, *plan.shape[1:]), logp.view(B, G, -1)

    @torch.no_grad()
    def generate(self, requests: Sequence[Request], sampling: dict, info: StepInfo) -> Rollout:
        if not requests or any(r.n < 1 for r in requests):
            raise ValueError(f"{type(self).__name__}.generate needs at least one request, each with n >= 1")
        G, K = max(r.n for r in requests), self.n_plan
        valid = torch.arange(G)[None, :] < torch.tensor([r.n for r in requests])[:, None]  # [B,G]
        plan, plan_logp = self._plan(requests, info, G, bool(sampling.get("greedy")))  # [B,G,K,...], [B,G,K]
        plan = self.planner.blank(plan, valid)  # [B,G,K,...] zeros on padding rows
        flow = self._generate_flow(requests, sampling, info, plan)  # [B,G,T_flow] trained steps
        B, _, T_flow = flow.shape
        assert flow.logp_sampler is not None  # the flow sampler always writes it

        def before(v: Tensor) -> Tensor:  # [B,G,T_flow,...] -> [B,G,K+T_flow,...], zeros at the plan positions
            return torch.cat([torch.zeros(B, G, K, *v.shape[3:], dtype=v.dtype), v], dim=2)

        out = copy.copy(flow)
        out.actions = torch.cat([self.planner.plan_actions(plan, flow.actions.dtype), flow.actions], dim=2)  # [B,G,T]
        out.mask = torch.cat([valid[..., None].expand(B, G, K), flow.mask], dim=2)  # [B,G,T]
        out.logp_sampler = torch.cat([plan_logp.float() * valid[..., None], flow.logp_sampler], dim=2)  # [B,G,T]
        out.extras, out.extra_levels = {}, {}
        for key, value in flow.extras.items():
            out.set_extra(key, before(value) if flow.extra_levels[key] == "token" else value, flow.extra_levels[key])
        part = torch.cat([torch.zeros(B, G, K), torch.ones(B, G, T_flow)], dim=2) * out.mask  # [B,G,T]
        out.set_extra(self.part_extra, part, "token")
        out.set_extra(self.planner.row_extra, self.planner.stored_extra(plan), "row")  # [B,G,K,...]
        return out

    def think_text(self, rollout: Rollout) -> list[list[str]]:
        """[B][G] each row's think tokens as text ("RIGHT UP NEAR"); the think-LM planner only."""
        if not isinstance(self.planner, ThinkPlanner):
            raise ValueError(f'think_text reads a think-LM plan (planner = "think_lm"); this is {self.planner_kind!r}')
        return self.planner.text(rollout.extras["think_ids"])

    # ------------------------------------------------------------------ scoring and training
    def forward(self, rollout: Rollout, quantities: Sequence[str] = ("logp",)) -> dict[str, Tensor]:
        """``{"logp": [B,G,T]}``: the plan's log-probs under the planner, then the flow steps'
        (``FlowPolicy.forward`` on the generator positions); ``"entropy"``: the planner's, then the flow's."""
        unknown = [q for q in quantities if q not in self.quantities]
        if unknown:
            raise ValueError(f"{type(self).__name__}.forward computes {sorted(self.quantities)}, not {unknown}")
        K = self.n_plan
        plan = self.planner.stored_plan(rollout, K)  # [B,G,K,...]
        flow_view = copy.copy(rollout)
        flow_view.actions, flow_view.mask = rollout.actions[:, :, K:], rollout.mask[:, :, K:]
        flow_view.extras = {
            k: (v[:, :, K:] if rollout.extra_levels.get(k) == "token" else v) for k, v in rollout.extras.items()
        }
        flow_out = super().forward(flow_view, quantities)
        B, G, _ = rollout.shape
        labels = row_labels(rollout).view(B * G)  # [B*G] each row's own label (its context's)
        plan = plan.reshape(B * G, *plan.shape[2:])  # [N,K,...]
        plan_mask = rollout.mask[:, :, :K].bool()  # [B,G,K]

        def at_plan(v: Tensor) -> Tensor:  # [N,K] -> [B,G,K], 0 off the mask
            return torch.where(plan_mask, v.view(B, G, K), torch.zeros((), dtype=v.dtype)).float()

        out = {"logp": torch.cat([at_plan(self.plan_logp(labels, plan)), flow_out["logp"]], dim=2)}  # [B,G,T]
        if "entropy" in quantities:
            out["entropy"] = torch.cat([at_plan(self.planner.entropy(labels, plan)), flow_out["entropy"]], dim=2)
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
        key = self.planner.state_key
        state[key] = {k: v.clone() for k, v in self.planner.state_dict().items()}
        if isinstance(self.reference, PlannerPolicy):
            state[f"reference_{key}"] = {k: v.clone() for k, v in self.reference.planner.state_dict().items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        key = self.planner.state_key
        self.planner.load_state_dict(state[key])
        if isinstance(self.reference, PlannerPolicy) and f"reference_{key}" in state:
            self.reference.planner.load_state_dict(state[f"reference_{key}"])

    def train(self) -> None:
        super().train()
        self.planner.train()

    def eval(self) -> None:
        super().eval()
        self.planner.eval()
