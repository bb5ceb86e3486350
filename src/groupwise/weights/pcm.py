"""PCM: train on a budget of chunks per trajectory, sampled by phase keep probabilities from
success–failure divergence.

"Probabilistic Chunk Masking: outcome-divergence-guided gradient budgets for VLA GRPO" (PCM),
arXiv 2605.16154, https://arxiv.org/abs/2605.16154 (Algorithm 1; Eq. 5/8 reconstructed in spec 13).
No reference code was available. Spec 13-pcm.md.

**Change vs GRPO**: only ``budget`` chunks of each completion receive loss. Chunks are drawn
without replacement (Plackett–Luce, Gumbel-top-k) with weights ``p[phase]``; a phase's keep
probability grows with how differently successful and failed rollouts act in it (refreshed online
every ``refresh`` steps, floored at ``p_min``). No 1/p importance reweighting (deliberately biased).
Text analogue [INFERRED]: a chunk is ``chunk_size`` tokens (or a ';'/newline segment,
``delimiter_ids``); a chunk's phase is its position bucket; a chunk's "action" is the one-hot of its
(position-in-chunk, token) pairs, so ``C_c`` compares token histograms of successes and failures.

**Math** (per step, whole batch; ``success = reward ≥ success_threshold``; see the functions)::

    C_c,b  = ‖mean{a(i,k): i∈b succ, φ(i,k)=c} − mean{a(i,k): i∈b fail, φ(i,k)=c}‖₂   (groups with both)
    C_c    = mean_b C_c,b                        NaN when no group has both in phase c (buffer unchanged)
    every `refresh` steps (and at the first):  C̄_c = mean(buffer_c);  ρ = C̄/ΣC̄;  ρ̃ = ρ/max ρ;  p = max(p_min, ρ̃)
    keep_i = top-min(budget, N_i) chunks of  log p[φ(i,k)] + Gumbel(i,k)
    w[i,t] = 1 on kept chunks' loss tokens (reweight: 1/p[φ]), 0 elsewhere          # [B,G,T]

**Defaults**

- ``budget = 12`` [PAPER] B chunks per trajectory (of 64); ``refresh = 5`` [PAPER] T_rc;
  ``p_min = 0.1`` [PAPER]; ``num_phases = 5`` [PAPER] K phases.
- ``chunk_size = 8`` [PAPER] L = 8 actions a chunk; as tokens [INFERRED]. ``delimiter_ids = []``
  [INFERRED] token ids that end a chunk (';', newline) instead of fixed sizes.
- ``phase_by = "index"`` [INFERRED] phase = min(k, num_phases−1); ``"relative"``: floor(k·K/N_i).
  The paper's phases come from a gripper-command labeller (manipulation only; not implemented).
- ``success_threshold = 0.5`` [INFERRED] binary rewards (the paper's r_i ∈ {0,1}).
- ``reweight = False`` [PAPER] no importance weights; ``True`` = 1/p [INFERRED] option.
- ``scope = "token"`` [PAPER] the loss is normalised by the kept chunks (1/Σ|K_i|).

**Notes**

1. The text divergence is :func:`phase_divergence` on one-hot chunk actions, computed sparsely per
   group and averaged over the groups with a success and a failure (a group's prompt fixes the
   answer, so successes and failures are compared within groups) [INFERRED]. This is *not* the
   paper's per-batch pooling, not even for one task: pooling takes one norm of the difference of the
   batch's success and failure means, so an action that is right for one prompt and wrong for
   another cancels, and groups weigh by their chunk counts. Two groups of one chunk per row, group 1
   success e_A / failure e_B, group 2 success e_B / failure e_A: per group ‖e_A − e_B‖ = √2 each,
   mean 1.414; pooled ‖(e_A + e_B)/2 − (e_A + e_B)/2‖ = 0 (tests/test_pcm.py).
2. The chunk noise is a hash of (seed, step, prompt id, the row's tokens, chunk index): the same on
   every rank, after a resume, and for a row wherever it sits in its group (identical rows draw
   identical chunks).
3. The refresh counts steps since the last one (the paper's |B_c| = T_rc); an empty buffer keeps
   its phase's previous C̄; a phase never scored keeps p = 1 (p starts at 1: random masking).
4. ``step_stats``: ``pcm/kept_token_frac`` (loss tokens with nonzero weight / loss tokens),
   ``pcm/kept_chunk_frac``, ``pcm/p<c>``, ``pcm/C<c>`` (this batch, where defined).
5. The text forward is causal: a dropped chunk is still computed (later tokens attend to it), so
   zero-weight tokens cost forward and backward time here; only their loss and head gradient vanish.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.seeds import noise_at, sample_seed
from groupwise.types import Rollout, StepInfo


def keep_probabilities(cbar: Tensor, p_min: float) -> Tensor:
    """p [K] = max(p_min, ρ/max ρ), ρ = C̄/ΣC̄ over the finite C̄; NaN C̄ → p 1; all-zero → p 1."""
    ok = torch.isfinite(cbar)  # [K]
    p = torch.ones_like(cbar, dtype=torch.float64)  # [K]
    total = cbar[ok].double().sum()
    if not ok.any() or total <= 0:
        return p
    rho = cbar[ok].double() / total  # [K'] share normalisation
    p[ok] = (rho / rho.max()).clamp(min=p_min)  # [K'] max normalisation, floor
    return p


def phase_divergence(actions: Tensor, phase: Tensor, success: Tensor, valid: Tensor, num_phases: int) -> Tensor:
    """C [num_phases] = ‖μ⁺_c − μ⁻_c‖₂ of chunk actions [N,K,A];
    NaN where phase c lacks a success or a failure chunk."""
    C = torch.full((num_phases,), float("nan"), dtype=torch.float64)  # [P]
    a = actions.double().flatten(2)  # [N,K,A]
    for c in range(num_phases):
        sel = valid & (phase == c)  # [N,K]
        pos, neg = sel & success[:, None], sel & ~success[:, None]  # [N,K]
        if pos.any() and neg.any():
            C[c] = torch.linalg.vector_norm(a[pos].mean(0) - a[neg].mean(0))
    return C


def token_phase_divergence(
    tokens: Tensor, chunk: Tensor, offset: Tensor, phase: Tensor, success: Tensor, ok: Tensor, num_phases: int
) -> Tensor:
    """:func:`phase_divergence` of one group with a chunk's action = one-hot of its (offset, token) pairs, sparse.

    tokens/chunk/offset/phase/ok [G,T] (ok: the tokens that count), success [G] → C [num_phases]."""
    C = torch.full((num_phases,), float("nan"), dtype=torch.float64)  # [P]
    G, T = tokens.shape
    row = torch.arange(G)[:, None].expand(G, T)  # [G,T]
    for c in range(num_phases):
        sel = ok & (phase == c)  # [G,T]
        pos, neg = sel & success[:, None], sel & ~success[:, None]  # [G,T]
        if not (pos.any() and neg.any()):
            continue
        keys, slot = torch.unique(torch.stack([offset[sel], tokens[sel]]), dim=1, return_inverse=True)  # [2,U], [n]
        n_pos = torch.unique(row[pos] * T + chunk[pos]).numel()  # success chunks in phase c
        n_neg = torch.unique(row[neg] * T + chunk[neg]).numel()
        up, down = torch.tensor(1.0 / n_pos, dtype=torch.float64), torch.tensor(-1.0 / n_neg, dtype=torch.float64)
        signed = torch.where(success[:, None].expand(G, T)[sel], up, down)  # [n] ±1/(chunks of its side)
        C[c] = torch.linalg.vector_norm(torch.zeros(keys.shape[1], dtype=torch.float64).index_add_(0, slot, signed))
    return C


def token_chunks(actions: Tensor, mask: Tensor, chunk_size: int, delimiter_ids: list[int]) -> tuple[Tensor, Tensor]:
    """(chunk index, offset in chunk) [N,T] long, −1 outside ``mask``: fixed ``chunk_size`` tokens, or
    segments ending with (and including) a delimiter token when ``delimiter_ids`` is given."""
    N, T = actions.shape
    t = torch.arange(T).expand(N, T)  # [N,T]
    if delimiter_ids:
        ends = torch.isin(actions, torch.tensor(delimiter_ids)) & mask  # [N,T]
        chunk = ends.long().cumsum(-1) - ends.long()  # [N,T] delimiters before t
        begins = torch.ones_like(ends)  # [N,T]
        begins[:, 1:] = ends[:, :-1]
        offset = t - torch.where(begins, t, torch.zeros_like(t)).cummax(-1).values  # [N,T]
    else:
        chunk, offset = t // chunk_size, t % chunk_size  # [N,T]
    return torch.where(mask, chunk, -1), torch.where(mask, offset, -1)


def sample_chunks(weights: Tensor, budget: int, valid: Tensor, rng: torch.Generator | Tensor | None = None) -> Tensor:
    """keep [N,K] bool: min(budget, N_i) valid chunks per row, Plackett–Luce without replacement
    (Gumbel-top-k). ``rng``: a generator or uniforms [N,K] in (0,1). Zero weights come last."""
    u = rng if isinstance(rng, Tensor) else torch.rand(weights.shape, generator=rng, dtype=torch.float64)  # [N,K]
    gumbel = -torch.log(-torch.log(u.double()))  # [N,K]
    w = weights.double()  # [N,K]
    score = torch.where(w > 0, torch.log(w.clamp(min=1e-300)), torch.full_like(w, -1e6)) + gumbel  # [N,K]
    score = torch.where(valid, score, torch.full_like(score, -math.inf))  # [N,K]
    rank = torch.argsort(torch.argsort(score, dim=-1, descending=True, stable=True), dim=-1)  # [N,K] 0 = best
    n_keep = valid.sum(-1, keepdim=True).clamp(max=budget)  # [N,1]
    return valid & (rank < n_keep)  # [N,K]


@register("weight", "pcm")
@dataclass
class PCM:
    """Loss on a budget of chunks per completion, drawn by divergence-derived phase keep probabilities (PCM, 2026)."""

    budget: int = 12
    chunk_size: int = 8
    delimiter_ids: list = field(default_factory=list)
    num_phases: int = 5
    phase_by: str = "index"
    refresh: int = 5
    p_min: float = 0.1
    success_threshold: float = 0.5
    reweight: bool = False
    scope: str = "token"

    needs = ()

    def __post_init__(self) -> None:
        if (
            self.budget < 1
            or self.chunk_size < 1
            or self.num_phases < 1
            or self.refresh < 1
            or not 0 <= self.p_min <= 1
        ):
            raise ValueError(f"pcm: need budget, chunk_size, num_phases, refresh >= 1 and 0 <= p_min <= 1; got {self}")
        if self.phase_by not in ("index", "relative") or self.scope not in ("token", "loss"):
            raise ValueError(
                "pcm: phase_by must be 'index' or 'relative' and scope "
                f"'token' or 'loss'; got {self.phase_by!r}, {self.scope!r}"
            )
        self._buffers: list[list[float]] = [[] for _ in range(self.num_phases)]
        self._cbar = [float("nan")] * self.num_phases
        self._p = [1.0] * self.num_phases
        self._since, self._started, self._last_step = 0, False, None
        self._stats: dict[str, float] = {}
        self._last_C = torch.full((self.num_phases,), float("nan"), dtype=torch.float64)  # [P]

    def _update(self, C: Tensor, step: int | None = None) -> Tensor:
        """Append this batch's C [K] (NaN: skipped) and refresh p every ``refresh`` steps; returns p [K]."""
        if step is not None and step == self._last_step:
            return torch.tensor(self._p, dtype=torch.float64)  # called twice in one step: no second append
        self._last_step = step
        for c, value in enumerate(C.tolist()):
            if math.isfinite(value):
                self._buffers[c].append(value)
        self._since += 1
        if (not self._started and any(self._buffers)) or self._since >= self.refresh:
            self._cbar = [sum(b) / len(b) if b else old for b, old in zip(self._buffers, self._cbar)]
            self._p = keep_probabilities(torch.tensor(self._cbar, dtype=torch.float64), self.p_min).tolist()
            self._buffers, self._since, self._started = [[] for _ in range(self.num_phases)], 0, True
        return torch.tensor(self._p, dtype=torch.float64)  # [K]

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        B, G, T = rollout.shape
        N, loss = B * G, rollout.row_mask.reshape(B * G, T)  # [N,T] loss tokens of valid rows
        tokens = rollout.actions.reshape(N, T)  # [N,T]
        seq = (rollout.mask & rollout.group_valid[..., None]).reshape(N, T)  # [N,T] the sequence of valid rows
        chunk, offset = token_chunks(tokens, seq, self.chunk_size, list(self.delimiter_ids))  # [N,T], [N,T]
        K = T  # at most one chunk per token
        has = torch.zeros(N, K, dtype=torch.bool).index_put_(
            (torch.arange(N)[:, None].expand(N, T)[loss], chunk[loss]), torch.tensor(True)
        )  # [N,K] chunks with a loss token
        n_chunks = (chunk.max(-1).values + 1).clamp(min=1)  # [N]
        k = torch.arange(K).expand(N, K)  # [N,K]
        phase = (
            k.clamp(max=self.num_phases - 1) if self.phase_by == "index" else (k * self.num_phases) // n_chunks[:, None]
        ).clamp(max=self.num_phases - 1)  # [N,K]
        tok_phase = torch.where(chunk >= 0, phase.gather(1, chunk.clamp(min=0)), -1)  # [N,T]
        p = self._update(self._divergence(rollout, tokens, chunk, offset, tok_phase, loss), info.step)  # [P]
        weights = p[phase]  # [N,K]
        seeds = torch.tensor(
            [
                sample_seed(info.seed, info.step, int(rollout.prompt_index[i // G]), h)
                for i, h in enumerate(_row_hashes(tokens, seq))
            ],
            dtype=torch.long,
        )  # [N]
        keep = sample_chunks(weights, self.budget, has, noise_at(seeds, 13, torch.arange(K)))  # [N,K]
        value = (1.0 / weights if self.reweight else torch.ones_like(weights)) * keep  # [N,K]
        w = torch.where(loss, value.gather(1, chunk.clamp(min=0)), 0.0).float()  # [N,T]
        self._record(w, loss, keep, has, p, self._last_C)
        return w.reshape(B, G, T)  # [B,G,T]

    def _divergence(
        self, rollout: Rollout, tokens: Tensor, chunk: Tensor, offset: Tensor, tok_phase: Tensor, loss: Tensor
    ) -> Tensor:
        """C [P]: the mean over groups with a success and a failure of their per-group phase divergence."""
        B, G, T = rollout.shape
        r = rollout.rewards if rollout.rewards is not None else torch.full((B, G), float("nan"))  # [B,G]
        scored = rollout.group_valid & torch.isfinite(r)  # [B,G]
        success = r >= self.success_threshold  # [B,G]
        per_group = []
        for b in range(B):
            rows = scored[b]  # [G]
            if not ((success[b] & rows).any() and (~success[b] & rows).any()):
                continue
            sl = slice(b * G, (b + 1) * G)
            per_group.append(
                token_phase_divergence(
                    tokens[sl],
                    chunk[sl],
                    offset[sl],
                    tok_phase[sl],
                    success[b],
                    loss[sl] & rows[:, None],
                    self.num_phases,
                )
            )
        C = (
            torch.stack(per_group).nanmean(0)
            if per_group
            else torch.full((self.num_phases,), float("nan"), dtype=torch.float64)
        )  # [P]
        self._last_C = C
        return C

    def _record(self, w: Tensor, loss: Tensor, keep: Tensor, has: Tensor, p: Tensor, C: Tensor) -> None:
        stats = {
            "pcm/kept_token_frac": float((w[loss] != 0).float().sum() / max(int(loss.sum()), 1)),
            "pcm/kept_chunk_frac": float(keep.sum() / max(int(has.sum()), 1)),
        }
        stats.update({f"pcm/p{c}": float(v) for c, v in enumerate(p.tolist())})
        stats.update({f"pcm/C{c}": float(v) for c, v in enumerate(C.tolist()) if math.isfinite(v)})
        self._stats = stats

    def step_stats(self) -> dict[str, float]:
        return dict(self._stats)

    def state_dict(self) -> dict[str, Any]:
        return {
            "buffers": [list(b) for b in self._buffers],
            "cbar": list(self._cbar),
            "p": list(self._p),
            "since": self._since,
            "started": self._started,
            "last_step": self._last_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["p"]) != self.num_phases:
            raise ValueError(f"pcm: state has {len(state['p'])} phases, num_phases={self.num_phases}")
        self._buffers, self._cbar, self._p = [list(b) for b in state["buffers"]], list(state["cbar"]), list(state["p"])
        self._since, self._started, self._last_step = int(state["since"]), bool(state["started"]), state["last_step"]


def _row_hashes(tokens: Tensor, seq: Tensor) -> list[int]:
    """A 63-bit content hash per row of its sequence tokens (int64 arithmetic wraps), permutation-safe noise keys."""
    h = torch.zeros(tokens.shape[0], dtype=torch.long)  # [N]
    for t in range(tokens.shape[1]):
        h = h * 1_000_003 + torch.where(seq[:, t], tokens[:, t] + 1, 0)  # [N]
    return [v & ((1 << 63) - 1) for v in h.tolist()]
