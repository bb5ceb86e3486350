"""A toy "unified model" (spec 27's small analogue of AlphaGRPO's AR + diffusion model): a tiny
causal LM writes a few think tokens, then the 2-D flow model draws a sample conditioned on them; one
rollout row holds both, so one advantage trains both (the joint text + image loss).

"AlphaGRPO: GRPO over a unified AR+diffusion model with decompositional verifiable reward",
Huang, Wu, Yang, Liu, Zhao (ICML 2026), https://arxiv.org/abs/2605.12495 — spec 27 ("Small-scale
analogue": think tokens from a small vocabulary, then a conditional 2-D flow model; the loss's text
part GRPO-SURR, its image part Flow-GRPO per denoising step, the same advantage for both).

**Change vs GRPO**: a row's "tokens" are ``n_think`` discrete think tokens (positions ``0..n−1``,
log-prob of a categorical) followed by the flow policy's trained SDE steps (positions ``n..``,
Gaussian log-prob, ``modalities/flow.py``). The token extra ``image_token`` [B,G,T] (1 at flow
positions) lets a loss treat the two parts apart (``alphagrpo_joint``); ``think_ids`` [B,G,n] (row
extra) is the plan the flow was conditioned on.

**Math** (row with label ``y``; ``e``, ``p_t``, ``w`` embeddings; ``z_t`` the think tokens)::

    think LM:  h_t = silu(W2 silu(E_label[y] + Σ_{s<t} E_tok[z_s] + P[t]));  z_t ~ softmax(W_out h_t)
    flow:      v_θ(x, σ, y, z) = VelocityMLP(x, σ, y if flow_sees_label else none, extra = Σ_t E_think[z_t])
    logp[b,g,t] = log softmax(W_out h_t)[z_t]        t < n
                = Flow-GRPO SDE step log-prob        t ≥ n   (modalities/flow.py)

**Defaults** (all [INFERRED]: the spec's toy)

- ``n_think = 3``, vocabulary ``THINK_VOCAB`` (RIGHT LEFT UP DOWN NEAR MID FAR): one token can name
  each attribute of a ``flow_attrs`` prompt.
- ``flow_sees_label = false``: the flow sees the think tokens only, so the plan is what carries the
  prompt to the image (with ``true`` the think tokens are optional for the flow).
- ``think_hidden = 32``; the flow's sizes and SDE modes as ``FlowPolicy``.

**Notes**

1. Seeds: row ``j`` of a request draws its think tokens from ``torch.Generator(sample_seed(seed,
   step, key, offset + j) + 1)``, a stream apart from the flow's (``FlowPolicy`` Note 1); ``greedy``
   samples (evaluation) take the argmax token and the ODE.
2. ``decode`` is the flow sample ``"x,y"`` (what the rewards judge); ``think_text(rollout)`` gives
   the plans as text.
3. Both nets run in float64 (``FlowPolicy`` Note 3) so the recomputed log-probs equal the sampler's.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from groupwise.modalities.flow import FlowPolicy
from groupwise.modalities.flow_sde import row_labels
from groupwise.seeds import sample_seed
from groupwise.types import Request, Rollout, StepInfo

_NO_DEMONSTRATIONS = (
    "the unified policy has no demonstration fit (its flow is conditioned on think tokens a target row does not give); "
    'fit a model.policy = "flow" instead'
)
THINK_VOCAB = ("RIGHT", "LEFT", "UP", "DOWN", "NEAR", "MID", "FAR")


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


class UnifiedPolicy(FlowPolicy):
    """Think tokens from a tiny causal LM, then a flow sample conditioned on them;
    one row, one advantage (AlphaGRPO toy)."""

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
        n_think: int = 3,
        think_hidden: int = 32,
        flow_sees_label: bool = False,
    ):
        super().__init__(n_labels, hidden, layers, steps, sde, sde_window, shift, init_seed)
        if n_think < 1 or think_hidden < 1:
            raise ValueError(f"UnifiedPolicy: need n_think >= 1 and think_hidden >= 1; got {n_think}, {think_hidden}")
        self.config.update(n_think=n_think, think_hidden=think_hidden, flow_sees_label=flow_sees_label)
        self.n_think, self.flow_sees_label, self.vocab = n_think, flow_sees_label, len(THINK_VOCAB)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed + 1)
            self.think_lm = ThinkLM(n_labels, self.vocab, n_think, think_hidden).double()
            self.think_emb = nn.Embedding(self.vocab, hidden).double()  # E_think: the plan as the flow's condition
        self.modality = "unified"
        self.quantities = frozenset({"logp", "entropy"})  # the think tokens have no Gaussian step

    @property
    def T(self) -> int:
        return self.n_think + self._steps_trained(self.sde)

    def encode_target(self, row: dict) -> Tensor:
        """Not defined: a demonstration would need the think tokens' plan too (the planner kind K4 of
        the non-text design brings one); the flow policy's own fit does not apply."""
        raise ValueError(_NO_DEMONSTRATIONS)

    def supervised_loss(self, prompts: Sequence[list[int]], targets: Sequence[Tensor], gen: torch.Generator) -> Tensor:
        """Not defined (see :meth:`encode_target`)."""
        raise ValueError(_NO_DEMONSTRATIONS)

    # ------------------------------------------------------------------ the flow's condition
    def _velocity(self, x: Tensor, sigma: Tensor, label: Tensor, cond: Tensor | None) -> Tensor:
        extra = self.think_emb(cond).sum(1)  # [N,H] Σ_t E_think[z_t]
        return self.net(x, sigma, label if self.flow_sees_label else None, extra)  # [N,2]

    def _stored_condition(self, rollout: Rollout, sel: Tensor) -> Tensor:
        think = rollout.extras["think_ids"].long()  # [B,G,n]
        return think[:, :, None, :].expand(*sel.shape, think.shape[-1])[sel]  # [M,n]

    # ------------------------------------------------------------------ sampling
    def _think(self, requests: Sequence[Request], info: StepInfo, G: int, greedy: bool) -> tuple[Tensor, Tensor]:
        """Think tokens [B,G,n] (0 on padding rows) and their sampling log-probs [B,G,n], one token at a time."""
        B, n = len(requests), self.n_think
        labels = torch.tensor([self.encode(r.prompt)[0] for r in requests]).repeat_interleave(G)  # [B*G]
        gens = [
            torch.Generator().manual_seed(sample_seed(info.seed, info.step, r.key, getattr(r, "offset", 0) + j) + 1)
            for r in requests
            for j in range(G)
        ]
        think = torch.zeros(B * G, n, dtype=torch.long)  # [N,n]
        for t in range(n):
            logq = torch.log_softmax(self.think_lm(labels, think)[:, t], -1)  # [N,V] position t sees tokens < t only
            if greedy:
                think[:, t] = logq.argmax(-1)
            else:
                think[:, t] = torch.cat([torch.multinomial(logq[i].exp(), 1, generator=g) for i, g in enumerate(gens)])
        logq = torch.log_softmax(self.think_lm(labels, think), -1)  # [N,n,V]
        logp = logq.gather(-1, think[..., None])[..., 0]  # [N,n]
        return think.view(B, G, n), logp.view(B, G, n).float()

    @torch.no_grad()
    def generate(self, requests: Sequence[Request], sampling: dict, info: StepInfo) -> Rollout:
        if not requests or any(r.n < 1 for r in requests):
            raise ValueError("UnifiedPolicy.generate needs at least one request, each with n >= 1")
        G = max(r.n for r in requests)
        valid = torch.arange(G)[None, :] < torch.tensor([r.n for r in requests])[:, None]  # [B,G]
        think, think_logp = self._think(requests, info, G, bool(sampling.get("greedy")))  # [B,G,n], [B,G,n]
        think = torch.where(valid[..., None], think, torch.zeros((), dtype=think.dtype))  # [B,G,n]
        flow = self._generate_flow(requests, sampling, info, think)  # [B,G,T_flow] trained steps
        n = self.n_think
        B, _, T_flow = flow.shape

        def before(v: Tensor) -> Tensor:  # [B,G,T_flow,...] -> [B,G,n+T_flow,...], zeros at the think positions
            return torch.cat([torch.zeros(B, G, n, *v.shape[3:], dtype=v.dtype), v], dim=2)

        out = copy.copy(flow)
        out.actions = torch.cat([think, flow.actions], dim=2)  # [B,G,T]
        out.mask = torch.cat([valid[..., None].expand(B, G, n), flow.mask], dim=2)  # [B,G,T]
        out.logp_sampler = torch.cat([think_logp * valid[..., None], flow.logp_sampler], dim=2)  # [B,G,T]
        out.extras, out.extra_levels = {}, {}
        for key, value in flow.extras.items():
            out.set_extra(key, before(value) if flow.extra_levels[key] == "token" else value, flow.extra_levels[key])
        image = torch.cat([torch.zeros(B, G, n), torch.ones(B, G, T_flow)], dim=2) * out.mask  # [B,G,T]
        out.set_extra("image_token", image, "token")
        out.set_extra("think_ids", think, "row")
        return out

    def think_text(self, rollout: Rollout) -> list[list[str]]:
        """[B][G] each row's think tokens as text ("RIGHT UP NEAR")."""
        return [
            [" ".join(THINK_VOCAB[int(t)] for t in row) for row in group]
            for group in rollout.extras["think_ids"].tolist()
        ]

    # ------------------------------------------------------------------ scoring and training
    def forward(self, rollout: Rollout, quantities: Sequence[str] = ("logp",)) -> dict[str, Tensor]:
        """``{"logp": [B,G,T]}``: the think tokens' log-probs under the think LM, then the flow steps'
        (``FlowPolicy.forward`` on the flow positions); ``"entropy"``: the categorical's, then the flow's."""
        unknown = [q for q in quantities if q not in self.quantities]
        if unknown:
            raise ValueError(f"UnifiedPolicy.forward computes {sorted(self.quantities)}, not {unknown}")
        n = self.n_think
        flow_view = copy.copy(rollout)
        flow_view.actions, flow_view.mask = rollout.actions[:, :, n:], rollout.mask[:, :, n:]
        flow_view.extras = {
            k: (v[:, :, n:] if rollout.extra_levels.get(k) == "token" else v) for k, v in rollout.extras.items()
        }
        flow_out = super().forward(flow_view, quantities)
        B, G, _ = rollout.shape
        labels = row_labels(rollout).view(B * G)  # [B*G] each row's own label (its context's)
        think = rollout.actions[:, :, :n].reshape(B * G, n)  # [N,n]
        logq = torch.log_softmax(self.think_lm(labels, think), -1).view(B, G, n, -1)  # [B,G,n,V]
        text_mask = rollout.mask[:, :, :n]  # [B,G,n]
        logp = torch.where(
            text_mask, logq.gather(-1, rollout.actions[:, :, :n, None])[..., 0], torch.zeros((), dtype=logq.dtype)
        )  # [B,G,n]
        out = {"logp": torch.cat([logp.float(), flow_out["logp"]], dim=2)}  # [B,G,T]
        if "entropy" in quantities:
            ent = torch.where(text_mask, -(logq.exp() * logq).sum(-1), torch.zeros((), dtype=logq.dtype))  # [B,G,n]
            out["entropy"] = torch.cat([ent.float(), flow_out["entropy"]], dim=2)  # [B,G,T]
        return out

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in (self.net, self.think_lm, self.think_emb) for p in m.parameters() if p.requires_grad]

    def snapshot(self) -> UnifiedPolicy:
        twin = super().snapshot()
        for p in [*twin.think_lm.parameters(), *twin.think_emb.parameters()]:
            p.requires_grad_(False)
        twin.think_lm.eval()
        return twin

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["think"] = {
            f"{name}.{k}": v.clone()
            for name, m in (("lm", self.think_lm), ("emb", self.think_emb))
            for k, v in m.state_dict().items()
        }
        if self.reference is not None:
            state["reference_think"] = {
                f"{name}.{k}": v.clone()
                for name, m in (("lm", self.reference.think_lm), ("emb", self.reference.think_emb))
                for k, v in m.state_dict().items()
            }
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        for key, twin in (("think", self), ("reference_think", self.reference)):
            if twin is None or key not in state:
                continue
            for name, m in (("lm", twin.think_lm), ("emb", twin.think_emb)):
                m.load_state_dict({k[len(name) + 1 :]: v for k, v in state[key].items() if k.startswith(name + ".")})

    def train(self) -> None:
        super().train()
        self.think_lm.train()

    def eval(self) -> None:
        super().eval()
        self.think_lm.eval()
