"""E²PO (text and flow forms): each prompt's group is sampled under the original prompt and K−1
learned perturbations of its token embeddings; the update is on the original prompt.

"E²PO: Embedding-perturbed Exploration Preference Optimization" (learned prompt-embedding
perturbations for exploration in flow models), arXiv 2605.15803 (ICML 2026),
https://arxiv.org/abs/2605.15803 — spec 15 (from a public paper note with the equations; no code).
The paper trains flow (text-to-image) models. Two forms share this strategy and the phase: the
paper's own on the flow toy (``modalities/flow.py`` with ``condition = "embedding"``: a prompt is
one 8-d token embedding read through a frozen random MLP "text encoder", the spec's CPU
implementation; recipe ``e2po_flow``), and the spec's text transfer (perturb the prompt embeddings
of an LM while sampling, train on the clean prompt; recipe ``e2po``).

**Change vs GRPO**: the G rows of a prompt's group are split over K conditions: ``G/K`` rows under
the original prompt and ``G/K`` under each of K−1 perturbations ``δ_k`` of its content-token
embeddings, learned once before RL by the offline phase ``e2po_perturbations``
(``phases/e2po_perturb.py``) to be diverse among themselves and anchored to the prompt's meaning.
The perturbation is a generation hook (``groupwise.hooks.EmbedDelta``): the engine adds it while
sampling only. Every row is stored with the original prompt, so old log-probs, needs and the loss
are computed on the original condition (the paper's "reference-anchored batching"); the group's
advantages are normalised over all G rows, whatever their condition.

**Math** (``B = rollout.prompts_per_step``, ``G = rollout.group_size``, ``K = conditions`` of the
artifact, ``m = G / K``)::

    Phase I (offline, the policy frozen; learn_prompt_perturbations)
    Ẽ_k[𝓘_j] = E[𝓘_j] + δ_k[j]           𝓘 = the prompt's content tokens (no special tokens), k = 1..K−1
    e_k = f(Ẽ_k),  e_anc = f(E)            f = the policy's final hidden state (``pool``)
    L_div = mean_{k≠k'} cos(e_k, e_k')     (0 when K−1 < 2)
    L_anc = Σ_k max(0, |cos(e_k, e_anc) − μ| − ε)
    L_emb = λ_div · L_div + L_anc          Adam on δ, ``steps`` steps

    Phase II (this strategy)
    cond(g) = g // m                       rows g of condition 0 are the original prompt
    hook    = EmbedDelta(positions = 𝓘, delta[g] = δ_{cond(g)} (0 for cond 0), rho)
    batch   = ctx.rollout([Request(i, n=G, hook=hook_i)])        every row stored under the ORIGINAL prompt
    A       = the estimator over the whole group of G rows
    update on the original prompt (logp_old, logp: clean forward); logp_sampler = π_old(o | Ẽ_cond)

    Flow form (the policy applies the hook per denoising step, σ: 1 → 0)
    C^orig = f(E),  C^opt_k = f(E + δ_k)                f = the policy's frozen prompt encoder
    C_k(σ) = γ(σ) C^opt_k + (1 − γ(σ)) C^orig,  γ(σ) = clip((σ − (1 − ρ))/ρ, 0, 1)   (γ = 1 with rho unset)
    v_θ(x, σ, C_cond(g)(σ)) samples row g;  the update's log-probs use v_θ(x, σ, C^orig)

``noise_aware_gamma`` / ``mix_condition`` are that schedule, defined with the ``embed_delta`` hook
(``hooks.py``) since every engine that applies the hook's ``rho`` uses them (the flow policy, at
every step); the text engine has no noise levels and refuses a ``rho``.

**Defaults**

- ``artifact = "e2po_perturbations"`` [INFERRED] the offline phase's default name.
- conditions, λ_div, μ, ε, σ_init: the phase's fields (``phases/e2po_perturb.py``); the paper's
  (G, K) configurations are (4, 12), (2, 4), (8, 3) with G rows per condition [PAPER]; here
  ``rollout.group_size`` is the whole group (G·K in the paper's notation).
- ``assign = "blocks"`` [INFERRED] condition c takes rows c·m .. c·m + m − 1 (``"round_robin"``:
  row g takes condition g mod K); the spec gives the counts, not the order.
- ``rho = None`` (no schedule: the perturbation on at every step) [INFERRED]. The text form must
  leave it unset: the spec gives no text schedule, and an LM reads the prompt (its KV cache) at
  every generated token, so the perturbation is on for the whole completion. The flow form sets
  it (recipe ``e2po_flow``: ``rho = 0.4`` [INFERRED] the spec's unit-test value; the note gives
  none); unset there it is the paper's "static perturbation" ablation.

**Notes**

1. ``G`` must be a multiple of the artifact's ``conditions``, and every drawn train row must have
   learned perturbations (the phase covers the run's train rows): otherwise an error names the fix.
2. Behaviour log-probs: the trainer's ``logp_old`` is the original condition under the old weights
   (the spec's GRPO adaptation: "use old_logp computed under C^orig"); the engine's
   ``logp_sampler`` keeps π_old(o | perturbed), for objectives that want the true importance ratio
   (``trust_region`` with ``anchor = "sampler"``).
3. Row extra ``e2po_condition`` [B,G] int64 (0 = original); ``step_stats``:
   ``e2po/reward_orig`` and ``e2po/reward_perturbed`` (mean finite rewards of the two kinds of rows)
   and ``e2po/group_std`` (mean within-group reward std, the signal E²PO keeps alive).
4. A hooked call prefills each row separately (``policy/engine.py``): generation costs more than
   the shared-prefix rollout of ``sample``. Refill rounds (dynamic sampling) work as in ``sample``.
5. The flow form: a flow policy applies the hook only with ``condition = "embedding"`` (it then
   lists ``embed_delta`` in its ``hooks``); the label form applies none and the build refuses this
   strategy on it (``hooks.check_hooks``). Rows whose δ is zero (condition 0) read C^orig exactly
   at every step: they are bit-identical to unhooked sampling. On the flow toy a mode-collapsed
   velocity field contracts late steps, so a perturbation that is on only at high noise can be
   erased by the steps under C^orig (measured: ``docs/claims.md``, 15-e2po-flow).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from groupwise.components import ReadsArtifact
from groupwise.errors import ConfigError
from groupwise.hooks import EmbedDelta
from groupwise.registry import register
from groupwise.rollout.context import RolloutContext
from groupwise.rollout.sample import refill_rounds
from groupwise.types import Rollout

CONDITION = "e2po_condition"  # row extra [B,G] int64: 0 = the original prompt, k = perturbation k


# --------------------------------------------------------------------------- the paper's maths
def eps_insensitive(x: Tensor, eps: float) -> Tensor:
    """|x|_ε = max(0, |x| − ε)."""
    return (x.abs() - eps).clamp(min=0.0)


def diversity_loss(e: Tensor) -> Tensor:
    """L_div [...] = mean over k ≠ k' of cos(e_k, e_k') for ``e`` [...,K,d]; 0 when K < 2."""
    K = e.shape[-2]
    if K < 2:
        return e.new_zeros(e.shape[:-2])
    unit = F.normalize(e, dim=-1)  # [...,K,d]
    cos = unit @ unit.transpose(-1, -2)  # [...,K,K]
    off = ~torch.eye(K, dtype=torch.bool, device=e.device)  # [K,K]
    return (cos * off).sum(dim=(-1, -2)) / (K * (K - 1))  # [...]


def anchor_loss(e: Tensor, e_anc: Tensor, mu: float, eps: float) -> Tensor:
    """L_anc [...] = Σ_k |cos(e_k, e_anc) − μ|_ε for ``e`` [...,K,d], ``e_anc`` [...,d]."""
    cos = F.cosine_similarity(e, e_anc.unsqueeze(-2), dim=-1)  # [...,K]
    return eps_insensitive(cos - mu, eps).sum(dim=-1)  # [...]


def embedding_loss(e: Tensor, e_anc: Tensor, lam_div: float, mu: float, eps: float) -> Tensor:
    """L_emb [...] = λ_div · L_div + L_anc."""
    return lam_div * diversity_loss(e) + anchor_loss(e, e_anc, mu, eps)


def learn_prompt_perturbations(
    token_emb: Tensor,
    real: Tensor,
    content: Tensor,
    encoder: Callable[[Tensor, Tensor], Tensor],
    K: int,
    steps: int,
    lam_div: float,
    mu: float,
    eps: float,
    sigma_init: float,
    lr: float,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Phase I for N prompts at once: ``delta`` [N,K,L,d] and the final losses.

    ``token_emb`` [N,S,d] the prompts' (left-padded) token embeddings, ``real`` [N,S] bool their
    tokens, ``content`` [N,L] the content-token columns (−1: padding), ``encoder(emb [M,S,d], real
    [M,S]) -> [M,d']`` the frozen encoder f. Each prompt's δ is optimised on its own loss (the
    losses are summed over prompts and Adam is elementwise, so batching changes nothing);
    ``sigma_init`` and ``lr`` are absolute (the phase scales them to the embeddings)."""
    N, S, d = token_emb.shape
    L = content.shape[1]
    keep = (content >= 0).to(token_emb.dtype)[:, None, :, None]  # [N,1,L,1]
    columns = content.clamp(min=0)[:, None, :, None].expand(N, K, L, d)  # [N,K,L,d]
    noise = torch.randn(N, K, L, d, generator=generator, dtype=token_emb.dtype)  # [N,K,L,d]
    delta = (noise * sigma_init * keep).requires_grad_(True)  # [N,K,L,d]
    real_k = real.repeat_interleave(K, dim=0)  # [N·K,S]
    with torch.no_grad():
        e_anc = encoder(token_emb, real)  # [N,d']
    opt = torch.optim.Adam([delta], lr=lr)

    def losses() -> tuple[Tensor, Tensor, Tensor]:
        add = torch.zeros(N, K, S, d, dtype=token_emb.dtype).scatter_add(2, columns, delta * keep)  # [N,K,S,d]
        e = encoder((token_emb[:, None] + add).reshape(N * K, S, d), real_k).view(N, K, -1)  # [N,K,d']
        return (
            embedding_loss(e, e_anc, lam_div, mu, eps),
            diversity_loss(e),
            F.cosine_similarity(e, e_anc[:, None], dim=-1),
        )  # [N],[N],[N,K]

    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = losses()[0].sum()
        loss.backward()
        opt.step()
    with torch.no_grad():
        loss, div, cos = losses()
    return (delta.detach() * keep), {"loss": loss, "div": div, "cos_anchor": cos}


# --------------------------------------------------------------------------- the rollout strategy
@register("rollout", "e2po")
@dataclass
class E2PO(ReadsArtifact):
    """Each group under the original prompt and K−1 learned prompt-embedding perturbations; trained on the original
    (E²PO)."""

    artifact: str = "e2po_perturbations"
    assign: str = "blocks"
    rho: float | None = None

    hooks = ("embed_delta",)
    collects = (CONDITION,)
    phase_hint = "the offline phase e2po_perturbations"

    def __post_init__(self) -> None:
        if self.assign not in ("blocks", "round_robin"):
            raise ConfigError(f"rollout e2po: assign={self.assign!r} must be 'blocks' or 'round_robin'")
        if self.rho is not None and not 0 < self.rho <= 1:
            raise ConfigError(
                f"rollout e2po: rho={self.rho} must be in (0, 1] (the share of the noise range, from σ = "
                "1 down, where the perturbation is on); leave it unset for no schedule (the text form)"
            )
        self._table: dict[int, int] = {}
        self._stats: dict[str, float] = {}

    def use_artifact(self, name: str, value: dict[str, Any]) -> None:
        super().use_artifact(name, value)
        self._table = {int(k): j for j, k in enumerate(value["keys"].tolist())}

    def _conditions_of(self, G: int) -> Tensor:
        """[G] int64: each row's condition (0 = the original prompt)."""
        K = int(self.artifact_value()["conditions"])
        if G % K:
            raise ConfigError(
                f"rollout e2po: rollout.group_size={G} is not a multiple of the artifact's conditions={K}; "
                f"set group_size to a multiple of {K} (or the phase's conditions to a divisor of {G})"
            )
        g = torch.arange(G)
        return g // (G // K) if self.assign == "blocks" else g % K  # [G]

    def _hook(self, key: int, G: int) -> EmbedDelta:
        """The embedding perturbation of each of the G rows of train row ``key``."""
        value = self.artifact_value()
        if key not in self._table:
            raise ConfigError(
                f"rollout e2po: train row {key} has no learned perturbations in {self.artifact!r}; the phase covers "
                f"{len(self._table)} rows: set the phase's rows = 0 (all train rows) or data.train_size to at most that"
            )
        j = self._table[key]
        positions = value["positions"][j]  # [L] (−1: padding)
        real = positions >= 0  # [L]
        deltas = value["delta"][j][:, real]  # [K−1,P,d]
        cond = self._conditions_of(G)  # [G]
        table = torch.cat([torch.zeros_like(deltas[:1]), deltas])  # [K,P,d] condition 0: no perturbation
        return EmbedDelta(positions=positions[real], delta=table[cond], rho=self.rho)  # [P], [G,P,d]

    def __call__(self, ctx: RolloutContext) -> Rollout:
        batch = refill_rounds(ctx, self._hook)
        B, G = batch.shape[0], ctx.group_size
        cond = self._conditions_of(G).expand(B, G).clone()  # [B,G]
        batch.set_extra(CONDITION, cond, "row")
        ok = batch.group_valid & torch.isfinite(batch.rewards)  # [B,G]
        r = torch.nan_to_num(batch.rewards)  # [B,G]
        orig, pert = ok & (cond == 0), ok & (cond > 0)  # [B,G]
        std = [float(r[b][ok[b]].std(unbiased=False)) for b in range(B) if int(ok[b].sum()) > 1]
        self._stats = {
            "e2po/reward_orig": float(r[orig].mean()) if orig.any() else float("nan"),
            "e2po/reward_perturbed": float(r[pert].mean()) if pert.any() else float("nan"),
            "e2po/group_std": sum(std) / len(std) if std else float("nan"),
        }
        return batch

    def step_stats(self) -> dict[str, float]:
        return dict(self._stats)
