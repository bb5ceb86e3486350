"""A subset policy: a per-item scorer whose action is an ordered choice of k distinct items, sampled
as a Plackett–Luce ranking by Gumbel-top-k (K3 of the non-text design ``../shared/design/nontext.md``).

Its first paper is 22 (GRIP-VLM, arXiv 2605.13375, spec 22: a budget-aware visual-token pruning
scorer trained with GRPO after a supervised warm-up). The sampler is the Gumbel-top-k trick (Kool,
van Hoof, Welling 2019, "Stochastic Beams and Where to Find Them", https://arxiv.org/abs/1903.06059:
the top k of s_j/T + Gumbel noise is an exact Plackett–Luce sample without replacement); the warm-up
loss is ListNet (Cao et al. 2007, "Learning to Rank: From Pairwise Approach to Listwise Approach").
Nothing here is specific to a task.

**Change vs GRPO**: none to the algorithm; a row is k picks (T = k), each with its Plackett–Luce
step log-prob, so the row's sequence log-prob is the log-prob of the whole ordered selection.

**Math** (items v [N,d], query q [d], budget ρ, k = ceil(ρ·N), temperature T)::

    s_j     = MLP([v_j ; q ; ρ ; log ρ])                     (the budget features: emb(ρ) folded into layer 1)
    z       = s / T
    sample  = the k largest of z_j + g_j, g_j ~ Gumbel(0, 1), in decreasing order     greedy: top-k of z
    logp_m  = z_{a_m} − logsumexp_{j ∉ {a_1..a_{m−1}}} z_j   (pick m = 1..k, on the T axis)
    Σ_m logp_m = log π(a_1..a_k)                               (the Plackett–Luce probability of the order)
    warm-up = −Σ_j softmax(t / τ)_j · log softmax(s)_j          (ListNet against teacher scores t)

**Defaults** (all [INFERRED]: spec 22 names the scorer's inputs, not its form)

- ``hidden = 64``, ``layers = 3``, ``temperature = 1.0``, ``teacher_temperature = 0.1`` (a 0/1 saliency
  teacher becomes a near one-hot target), ``init_seed = 0``.

**Notes**

1. The encoded prompt is ``[n_items, d, ρ, *items (n_items·d), *query (d)]`` as floats (M2 of the
   design: a control policy's encoding is not token ids). Rows of a batch may have different
   ``n_items`` and budgets: scores are padded with −inf past a row's items, picks past its k masked.
2. Seeds: row j of a request draws its Gumbel noise from ``torch.Generator(sample_seed(seed, step,
   key, offset + j))``: a request's samples do not depend on the rest of the batch.
3. Contract: ``actions`` [B,G,T] are the picked item indices (T = the largest k of the batch),
   ``mask`` the picks of each row's budget, ``logp_sampler`` [B,G,T] the per-pick log-probs; the
   row extra ``keep`` [B,G,N] (1 = kept, N = the largest n_items) is what a reader reward reads.
4. The scorer runs in float64 on float32-rounded inputs, in ``generate`` and ``forward`` alike, on
   the same [rows·items] layout, so ``forward`` recomputes the sampling log-probs exactly.
5. ``forward`` computes ``logp`` and ``entropy`` (of each pick's distribution over the remaining items).
6. ``save`` writes ``subset_policy.pt`` (config + weights); ``model.path`` loads it
   (``policy/kinds.build_policy``): the warm-up scorer is then a warm start or a frozen reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from groupwise.modalities.gaussian import MeanMLP
from groupwise.modalities.net_policy import NetPolicy
from groupwise.seeds import sample_seed
from groupwise.types import Request, Rollout, StepInfo

QUANTITIES = frozenset({"logp", "entropy"})
FILE = "subset_policy.pt"


def budget_k(n_items: int, rho: float) -> int:
    """k = ceil(ρ·N), at least 1 and at most N (spec 22). ρ·N is rounded to 6 digits first (ρ is stored
    in float32), so a budget of exactly m/N is m picks despite float error (float32(1/3)·6 = 2.0000001)."""
    return min(n_items, max(1, math.ceil(round(rho * n_items, 6))))


def pl_logprob(z: Tensor, order: Tensor, picks: Tensor | None = None) -> Tensor:
    """[M,k] per-pick Plackett–Luce log-probs of ``order`` [M,k] (item indices) under scores ``z`` [M,N]
    (−inf = not an item). Picks where ``picks`` [M,k] is False get 0 and remove nothing."""
    M, k = order.shape
    picks = torch.ones(M, k, dtype=torch.bool) if picks is None else picks
    taken = torch.zeros_like(z, dtype=torch.bool)  # [M,N] items already picked
    out = torch.zeros(M, k, dtype=z.dtype)
    for m in range(k):
        left = z.masked_fill(taken, -math.inf)  # [M,N]
        step = left.gather(1, order[:, m : m + 1])[:, 0] - torch.logsumexp(left, dim=1)  # [M]
        out[:, m] = torch.where(picks[:, m], step, torch.zeros((), dtype=z.dtype))
        taken = taken | (nn.functional.one_hot(order[:, m], z.shape[1]).bool() & picks[:, m : m + 1])
    return out  # [M,k]


def pl_entropy(z: Tensor, order: Tensor, picks: Tensor) -> Tensor:
    """[M,k] entropy of each pick's distribution over the items still left (0 where not a pick)."""
    M, k = order.shape
    taken = torch.zeros_like(z, dtype=torch.bool)  # [M,N]
    out = torch.zeros(M, k, dtype=z.dtype)
    for m in range(k):
        logq = torch.log_softmax(z.masked_fill(taken, -math.inf), dim=1)  # [M,N]
        h = -(logq.exp() * torch.nan_to_num(logq, neginf=0.0)).sum(1)  # [M]
        out[:, m] = torch.where(picks[:, m], h, torch.zeros((), dtype=z.dtype))
        taken = taken | (nn.functional.one_hot(order[:, m], z.shape[1]).bool() & picks[:, m : m + 1])
    return out  # [M,k]


class SubsetPolicy(NetPolicy):
    """A budget-aware item scorer; the action is k items chosen as a Plackett–Luce ranking (K3)."""

    policy_file = FILE  # what save writes and model.path loads (policy/kinds.py)

    def __init__(
        self,
        d: int = 17,
        hidden: int = 64,
        layers: int = 3,
        temperature: float = 1.0,
        teacher_temperature: float = 0.1,
        init_seed: int = 0,
    ):
        if min(d, hidden) < 1 or layers < 1 or not temperature > 0 or not teacher_temperature > 0:
            raise ValueError(
                f"SubsetPolicy: need d, hidden >= 1, layers >= 1, temperature > 0, teacher_temperature > 0; "
                f"got {d}, {hidden}, {layers}, {temperature}, {teacher_temperature}"
            )
        self.config = {"d": d, "hidden": hidden, "layers": layers}
        self.d, self.temperature, self.teacher_temperature = d, temperature, teacher_temperature
        with torch.random.fork_rng(devices=[]):  # seeded init that leaves the global stream alone
            torch.manual_seed(init_seed)
            self.net = MeanMLP(2 * d + 2, 1, hidden, layers).double()  # [v_j; q; ρ; log ρ] -> s_j
        self.trainable = True
        self.modality = "subset"
        self.row_extras, self.token_extras = frozenset({"keep"}), frozenset()  # what generate writes
        self.request_options = frozenset({"greedy"})  # greedy = the top k of the scores
        self.quantities = QUANTITIES
        self.reference: SubsetPolicy | None = None
        self.context = None  # items, query and budget are the whole prompt

    # ------------------------------------------------------------------ encoding
    def encode(self, prompt: Any) -> list[float]:
        """A dataset prompt ``[n_items, d, ρ, *items, *query]`` (Note 1) as a list of floats, checked."""
        try:
            flat = [float(v) for v in prompt]
        except (TypeError, ValueError):
            flat = []
        n = int(flat[0]) if flat and flat[0] >= 1 and flat[0] == int(flat[0]) else 0
        ok = n >= 1 and len(flat) == 3 + (n + 1) * self.d and flat[1] == self.d and 0 < flat[2] <= 1
        if not ok or not all(math.isfinite(v) for v in flat):
            raise ValueError(
                f"SubsetPolicy: a prompt must be [n_items, d={self.d}, budget in (0,1], n_items*d item numbers, "
                f"d query numbers]; got {str(prompt)[:120]!r}"
            )
        return flat

    def decode(self, rollout: Rollout) -> list[list[str]]:
        """[B][G] the kept item indices in pick order, ``"3 0 7"`` ("" for padding rows)."""
        picks, mask, valid = rollout.actions.tolist(), rollout.mask.tolist(), rollout.group_valid.tolist()
        return [
            [" ".join(str(a) for a, m in zip(p, ms) if m) if ok else "" for p, ms, ok in zip(row, mrow, oks)]
            for row, mrow, oks in zip(picks, mask, valid)
        ]

    def check_fits(self, ids: list, max_new_tokens: int, where: str) -> None:
        """Nothing to check: k picks per row, no token budget."""

    def _scores(self, contexts: Sequence[list]) -> tuple[Tensor, Tensor]:
        """z = s/T [M,N] in float64 (−inf past a row's items) and k [M] for encoded prompts (Notes 1, 4)."""
        M, d = len(contexts), self.d
        sizes = [int(c[0]) for c in contexts]
        N = max(sizes)
        feats = torch.zeros(M, N, 2 * d + 2, dtype=torch.float64)  # [M,N,2d+2]
        for i, c in enumerate(contexts):
            x = torch.tensor(c, dtype=torch.float32).double()  # rounded as stored
            n, rho = sizes[i], x[2]
            feats[i, :n, :d] = x[3 : 3 + n * d].view(n, d)
            feats[i, :n, d : 2 * d] = x[3 + n * d :]
            feats[i, :n, 2 * d] = rho
            feats[i, :n, 2 * d + 1] = torch.log(rho)
        s = self.net(feats.view(M * N, -1)).view(M, N)  # [M,N]
        items = torch.arange(N)[None, :] < torch.tensor(sizes)[:, None]  # [M,N]
        z = (s / self.temperature).masked_fill(~items, -math.inf)  # [M,N]
        k = torch.tensor([budget_k(n, float(torch.tensor(c[2], dtype=torch.float32))) for n, c in zip(sizes, contexts)])
        return z, k

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def generate(self, requests: Sequence[Request], sampling: dict, info: StepInfo) -> Rollout:
        if not requests or any(r.n < 1 for r in requests):
            raise ValueError("SubsetPolicy.generate needs at least one request, each with n >= 1")
        prompts = [self.encode(r.prompt) for r in requests]
        B, G = len(requests), max(r.n for r in requests)
        valid = torch.arange(G)[None, :] < torch.tensor([r.n for r in requests])[:, None]  # [B,G]
        z, k = self._scores([p for p in prompts for _ in range(G)])  # [B*G,N], [B*G]
        N, T = z.shape[1], int(k.max())
        noise = torch.zeros(B * G, N, dtype=torch.float64)  # [B*G,N] Gumbel(0,1) draws
        if not sampling.get("greedy"):
            for b, req in enumerate(requests):
                for j in range(req.n):
                    g = torch.Generator().manual_seed(sample_seed(info.seed, info.step, req.key, req.offset + j))
                    u = torch.rand(N, generator=g, dtype=torch.float64).clamp_min(1e-300)  # [N]
                    noise[b * G + j] = -torch.log(-torch.log(u))
        order = torch.topk(z + noise, T, dim=1).indices  # [B*G,T] decreasing perturbed score
        picks = (torch.arange(T)[None, :] < k[:, None]) & valid.reshape(-1, 1)  # [B*G,T]
        order = torch.where(picks, order, torch.zeros((), dtype=torch.long))
        logp = pl_logprob(z, order, picks)  # [B*G,T]
        # scatter_add: the index 0 that fills a row's unused picks adds 0 instead of overwriting a kept item 0
        keep = torch.zeros(B * G, N).scatter_add(1, order, picks.float())  # [B*G,N]
        out = Rollout(
            prompt_ids=[list(p) for p in prompts],
            actions=order.view(B, G, T),  # [B,G,T] item indices
            mask=picks.view(B, G, T),
            group_valid=valid,
            truncated=torch.zeros(B, G, dtype=torch.bool),
            prompt_index=torch.tensor([r.key for r in requests], dtype=torch.long),
            meta=[{"prompt": list(p)} for p in prompts],
            logp_sampler=logp.float().view(B, G, T),  # [B,G,T]
        )
        out.set_extra("keep", keep.view(B, G, N), "row")  # [B,G,N]
        out.completions = self.decode(out)
        return out

    # ------------------------------------------------------------------ scoring and training
    def forward(self, rollout: Rollout, quantities: Sequence[str] = ("logp",)) -> dict[str, Tensor]:
        """``logp`` [B,G,T] of each stored pick under the current scorer; ``entropy`` [B,G,T] of each pick's
        distribution; both from each row's own context (its items, query and budget)."""
        unknown = [q for q in quantities if q not in QUANTITIES]
        if unknown:
            raise ValueError(f"SubsetPolicy.forward computes {sorted(QUANTITIES)}, not {unknown}")
        B, G, T = rollout.shape
        contexts = [c for row in rollout.row_contexts() for c in row]  # B*G
        z, _ = self._scores(contexts)  # [B*G,N]
        order, picks = rollout.actions.reshape(B * G, T), rollout.mask.bool().reshape(B * G, T)
        out = {"logp": pl_logprob(z, order, picks).view(B, G, T).float()}  # [B,G,T]
        if "entropy" in quantities:
            out["entropy"] = pl_entropy(z, order, picks).view(B, G, T).float()  # [B,G,T]
        return out

    # ------------------------------------------------------------------ demonstrations (M1)
    def encode_target(self, row: dict) -> Tensor:
        """A warm-up row's ``teacher_scores`` (one number per item) as a float64 tensor [N]."""
        if "teacher_scores" not in row:
            raise ValueError(
                "SubsetPolicy.encode_target: a warm-up row needs a `teacher_scores` column (one number per item); "
                f"got the columns {sorted(row)}"
            )
        n = int(self.encode(row["prompt"])[0])
        target = torch.as_tensor(row["teacher_scores"], dtype=torch.float64)  # [N]
        if target.shape != (n,) or not bool(torch.isfinite(target).all()):
            raise ValueError(
                f"SubsetPolicy.encode_target: `teacher_scores` must be {n} finite numbers (one per item), "
                f"got {row['teacher_scores']!r}"
            )
        return target

    def supervised_loss(self, prompts: Sequence[list], targets: Sequence[Tensor], gen: torch.Generator) -> Tensor:
        """ListNet −Σ_j softmax(t/τ)_j · log softmax(s)_j, the mean over rows (``gen`` unused: nothing drawn)."""
        if len(prompts) != len(targets) or not prompts:
            raise ValueError(
                "SubsetPolicy.supervised_loss: need as many prompts as targets (>= 1), "
                f"got {len(prompts)} and {len(targets)}"
            )
        z, _ = self._scores([self.encode(p) for p in prompts])  # [M,N]
        t = torch.full_like(z, -math.inf)  # [M,N]
        for i, target in enumerate(targets):
            t[i, : len(target)] = torch.as_tensor(target, dtype=torch.float64) / self.teacher_temperature
        logq = torch.log_softmax(z * self.temperature, dim=1)  # [M,N] log softmax(s)
        return -(torch.softmax(t, dim=1) * torch.nan_to_num(logq, neginf=0.0)).sum(1).mean()
