"""The two planners of the planner kind (``modalities/planner.py``, K4 of ``../shared/design/nontext.md``):
what each draws at the K plan positions of a row, its log-probs, and ``plan_condition``, the generator's
view of a whole plan.

- :class:`LatentPlanner` (``planner = "latent"``; paper 10 LAC, arXiv 2605.16961, spec 10, all
  [INFERRED]): K Gaussian latent actions of ``plan_dim`` numbers, each planned from the label, a
  role embedding and the sum of the actions before it; stored as the row extra ``plan`` [B,G,K,d].
- :class:`ThinkPlanner` (``planner = "think_lm"``; paper 27 AlphaGRPO's toy, arXiv 2605.12495,
  spec 27): K think tokens of ``THINK_VOCAB`` from a tiny causal LM (:class:`ThinkLM`); stored as
  the actions at the plan positions and as the row extra ``think_ids`` [B,G,K].

Both take the draws of row i from ``gens[i]`` (None: greedy, the mean or the argmax) and give
log-probs in float64 of exactly what they store, so the policy's ``forward`` recomputes the
sampler's log-probs (Note 3 of ``modalities/flow.py``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from groupwise.modalities.gauss import gauss_logp
from groupwise.types import Rollout

THINK_VOCAB = ("RIGHT", "LEFT", "UP", "DOWN", "NEAR", "MID", "FAR")


class LatentPlanner(nn.Module):
    """μ [N,K,d] of each latent action given the label and the actions before it (causal); the
    plan's Gaussian log-probs; ``plan_condition`` = W_c concat(a_1..a_K)."""

    state_key = "planner"  # the checkpoint keys: state["planner"], state["reference_planner"]
    row_extra = "plan"

    def __init__(self, n_labels: int, n_plan: int, plan_dim: int, hidden: int, flow_hidden: int, sigma: float):
        super().__init__()
        self.sigma = sigma
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

    def log_probs(self, labels: Tensor, plan: Tensor) -> Tensor:
        """Σ_d log N(a_k; μ_k, σ²) [N,K] of a plan [N,K,d] (float64)."""
        N, K, d = plan.shape
        mean = self(labels, plan)  # [N,K,d]
        return gauss_logp(plan.reshape(N * K, d), mean.reshape(N * K, d), self.sigma, "sum").view(N, K)

    def entropy(self, labels: Tensor, plan: Tensor) -> Tensor:
        """Per dimension, ½ log(2πe) + log σ [N,K] (the Gaussian's, whatever the mean)."""
        return torch.full(plan.shape[:2], 0.5 * math.log(2 * math.pi * math.e) + math.log(self.sigma))  # [N,K]

    def draw(self, labels: Tensor, gens: list[torch.Generator] | None, K: int) -> tuple[Tensor, Tensor]:
        """A plan [N,K,d] (float64 of float32 values: each latent is rounded as it is stored, and later
        ones are planned from the rounded ones) and its log-probs [N,K], one action at a time."""
        eps = torch.zeros(len(labels), K, self.mean.out_features, dtype=torch.float64)  # [N,K,d]
        for i, g in enumerate(gens or []):
            eps[i] = torch.randn(*eps.shape[1:], generator=g, dtype=torch.float64)
        plan = torch.zeros_like(eps)  # [N,K,d]
        for k in range(K):
            mean = self(labels, plan)[:, k]  # [N,d] position k sees actions < k only
            plan[:, k] = (mean + self.sigma * eps[:, k]).float().double()
        return plan, self.log_probs(labels, plan)

    @staticmethod
    def blank(plan: Tensor, valid: Tensor) -> Tensor:
        return plan * valid[..., None, None]  # [B,G,K,d] zeros on padding rows

    @staticmethod
    def plan_actions(plan: Tensor, dtype: torch.dtype) -> Tensor:
        return torch.zeros(*plan.shape[:3], dtype=dtype)  # [B,G,K] the latents live in the row extra

    @staticmethod
    def stored_extra(plan: Tensor) -> Tensor:
        return plan.float()  # [B,G,K,d]

    def stored_plan(self, rollout: Rollout, K: int) -> Tensor:
        if "plan" not in rollout.extras:
            raise ValueError("PlannerPolicy.forward needs the row extra 'plan', written by PlannerPolicy.generate")
        return rollout.extras["plan"].double()  # [B,G,K,d]

    @staticmethod
    def condition_of(extra: Tensor) -> Tensor:
        return extra.double()  # [B,G,K,d]


class ThinkLM(nn.Module):
    """logits [N,n,V] of each think position given the label and the tokens before it (causal)."""

    def __init__(self, n_labels: int, vocab: int, n_think: int, hidden: int = 32):
        super().__init__()
        self.label = nn.Embedding(n_labels, hidden)
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(n_think, hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, label: Tensor, think: Tensor) -> Tensor:
        e = self.tok(think)  # [N,n,H]
        before = e.cumsum(1) - e  # [N,n,H] Σ of the tokens before each position
        # [N,n,H]
        h = nn.functional.silu(self.label(label)[:, None, :] + before + self.pos.weight[None, : think.shape[1]])
        return self.out(nn.functional.silu(self.mid(h)))  # [N,n,V]


class ThinkPlanner(nn.Module):
    """The think LM ``lm`` and the generator's view of its tokens, ``plan_condition`` = Σ_t E_think[z_t]."""

    state_key = "think"  # the checkpoint keys as the unified policy wrote them: state["think"]["lm.*", "emb.*"]
    row_extra = "think_ids"

    def __init__(self, n_labels: int, n_think: int, hidden: int, flow_hidden: int):
        super().__init__()
        self.lm = ThinkLM(n_labels, len(THINK_VOCAB), n_think, hidden)
        self.emb = nn.Embedding(len(THINK_VOCAB), flow_hidden)  # E_think: the plan as the flow's condition

    def plan_condition(self, think: Tensor) -> Tensor:
        return self.emb(think).sum(1)  # [N,H_flow] Σ_t E_think[z_t]

    def log_probs(self, labels: Tensor, think: Tensor) -> Tensor:
        logq = torch.log_softmax(self.lm(labels, think), -1)  # [N,n,V]
        return logq.gather(-1, think[..., None])[..., 0]  # [N,n]

    def entropy(self, labels: Tensor, think: Tensor) -> Tensor:
        logq = torch.log_softmax(self.lm(labels, think), -1)  # [N,n,V]
        return -(logq.exp() * logq).sum(-1)  # [N,n]

    def draw(self, labels: Tensor, gens: list[torch.Generator] | None, K: int) -> tuple[Tensor, Tensor]:
        """Think tokens [N,K] and their log-probs [N,K] (float32 as stored), one token at a time."""
        think = torch.zeros(len(labels), K, dtype=torch.long)  # [N,K]
        for t in range(K):
            logq = torch.log_softmax(self.lm(labels, think)[:, t], -1)  # [N,V] position t sees tokens < t only
            if gens is None:
                think[:, t] = logq.argmax(-1)
            else:
                think[:, t] = torch.cat([torch.multinomial(logq[i].exp(), 1, generator=g) for i, g in enumerate(gens)])
        return think, self.log_probs(labels, think).float()

    @staticmethod
    def blank(think: Tensor, valid: Tensor) -> Tensor:
        return torch.where(valid[..., None], think, torch.zeros((), dtype=think.dtype))  # [B,G,K]

    @staticmethod
    def plan_actions(think: Tensor, dtype: torch.dtype) -> Tensor:
        return think  # [B,G,K] the tokens are the actions

    @staticmethod
    def stored_extra(think: Tensor) -> Tensor:
        return think  # [B,G,K] int64

    @staticmethod
    def stored_plan(rollout: Rollout, K: int) -> Tensor:
        return rollout.actions[:, :, :K]  # [B,G,K]

    @staticmethod
    def condition_of(extra: Tensor) -> Tensor:
        return extra.long()  # [B,G,K]

    @staticmethod
    def text(think: Tensor) -> list[list[str]]:
        """[B][G] each row's think tokens as text ("RIGHT UP NEAR") of ids [B,G,K]."""
        return [[" ".join(THINK_VOCAB[int(t)] for t in row) for row in group] for group in think.tolist()]
