"""Mutual RL: two policies with their own tokenizers sample the same prompts and share experience.

"Experience Sharing in Mutual Reinforcement Learning for Heterogeneous Language Models", Xiaoze Liu,
Dhananjay Ram, Yuting Zhang, Zhaoyang Zhang, Wei Xia, Stefano Soatto, arXiv 2605.07244; read through
the author blog (https://xz-liu.github.io/blog/mutual-rl.html). No code; the paper body was not read.
Spec: ``shared/specs/52-mutual-rl.md``.

**Change vs GRPO**: a second policy, the peer (an actor: ``roles.<peer>.samples = true``), samples G
rows of every prompt the receiver (the trained policy) samples; each trains on its own batch. What
crosses between them is ``share``: nothing (``"none"``), the baseline (``"xgrpo"``), the peer's
verified successes where the receiver failed (``"sgt"``) or all the peer's rows (``"prp"``).

**Math** (prompt b; the receiver's rows A_b, the peer's P_b; ``ok = valid & reward ≥ success``)::

    ids = ctx.draw(B);  A = ctx.rollout(ids, G);  P = ctx.rollout(ids, G, actor=peer)
    sgt:   rescued_b = first k_rescue rows of ok(P_b)   if no ok(A_b) and some ok(P_b)
    prp:   rescued_b = every valid row of P_b
    A_b  ← A_b ∪ retokenize(text(rescued_b), receiver)   re-scored by the receiver's rewards,
           flag injected, behav_seq_logp = Σ_t logp_sampler of the peer's own tokens
    xgrpo: μ_b, σ_b = mean, population std of the valid rewards of A_b ∪ P_b   (both batches)
    else:  μ_b, σ_b = the same over each batch's own (augmented) group
    group extras pooled_mean = μ_b, pooled_std = σ_b         (read by the estimator ``xgrpo``)

Returns ``{"policy": A, peer: P}``.

**Defaults** [INFERRED] (spec 52, design §6; the blog names the probes, not their forms): the
pooled baseline over all rows of both actors; SGT's gate (no receiver success, ≥ 1 peer success),
``k_rescue = 1``, ``success = 1.0``, no IS on rescue rows (on-policy ``ppo_clip`` gives A·∇log π(y⁺));
PRP's sequence-level truncated IS with C = 2 is the weight ``peer_is``.

**Notes**

1. Injected rows carry ``logp_sampler`` NaN (no sampler log-probs of the receiver's tokens exist;
   ``sampler_is`` reads NaN as ρ = 1) and 0 in the row extra ``behav_seq_logp`` on the receiver's
   own rows. Under ``share != "xgrpo"`` the estimator ``xgrpo`` equals ``grpo`` with the population
   std over the (augmented) group.
2. Logged (``step_stats``): ``mutual/rescued_groups`` (share of prompts rescued under sgt),
   ``mutual/injected_rows``, ``mutual/thl_residual`` (the share of the peer's tokens of its rows
   without a 1:1 span in the receiver's tokenization, ``tokens.text_residual``; under every
   ``share``), ``mutual/peer_reward``.
3. ``check`` refuses ``share = "prp"`` without the weight ``peer_is`` and ``"xgrpo"`` without an
   estimator that reads the pooled baseline. MWRA (the blog's compute scheduler) is not built.
4. One round: both actors sample the same draw of prompts once; a sampler that drops groups
   (``sampling.name = "dynamic"``) is not asked (``ctx.keep``), so every group trains.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from groupwise import tokens
from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rollout.context import RolloutContext
from groupwise.types import INJECTED, Request, Rollout

SHARES = ("none", "xgrpo", "prp", "sgt")


def pooled_stats(*batches: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] mean and population std of the valid rewards of group b of every batch (the same prompts)."""
    r = torch.cat([batch.rewards for batch in batches], dim=1).double()  # [B,ΣG]
    valid = torch.cat([batch.group_valid for batch in batches], dim=1) & torch.isfinite(r)  # [B,ΣG]
    n = valid.sum(1).clamp(min=1).double()  # [B]
    r = torch.where(valid, r, torch.zeros((), dtype=r.dtype))
    mean = r.sum(1) / n  # [B]
    var = (torch.where(valid, r - mean[:, None], torch.zeros((), dtype=r.dtype)) ** 2).sum(1) / n  # [B]
    return mean.float(), var.sqrt().float()


def sequence_logp(batch: Rollout) -> torch.Tensor:
    """[B,G] the sampling log-prob of each row's tokens (NaN when the engine reported none)."""
    if batch.logp_sampler is None:
        return torch.full(batch.shape[:2], float("nan"))
    return (torch.nan_to_num(batch.logp_sampler.float()) * batch.mask).sum(-1)  # [B,G]


def rescue_rows(receiver: Rollout, peer: Rollout, success: float, k: int) -> dict[int, list[int]]:
    """SGT's gate: {group b: up to ``k`` peer rows} for groups where the receiver has no valid row with
    reward ≥ ``success`` and the peer has at least one (its first ones, in row order)."""
    ok_r = receiver.group_valid & (receiver.rewards >= success)  # [B,G_a]
    ok_p = peer.group_valid & (peer.rewards >= success)  # [B,G_b]
    out = {}
    for b in range(receiver.shape[0]):
        if receiver.group_valid[b].any() and not ok_r[b].any() and ok_p[b].any():
            out[b] = ok_p[b].nonzero().flatten().tolist()[:k]
    return out


def token_rows(receiver: Rollout, groups: list[int], ids: list[list[list[int]]]) -> Rollout:
    """Rows of token ids ``ids[k]`` (each a list of rows) under the receiver's prompts of ``groups[k]``."""
    B2, G2 = len(groups), max(len(rows) for rows in ids)
    T = max(1, max(len(row) for rows in ids for row in rows))
    actions = torch.zeros(B2, G2, T, dtype=torch.long)  # [B2,G2,T]
    mask = torch.zeros(B2, G2, T, dtype=torch.bool)  # [B2,G2,T]
    valid = torch.zeros(B2, G2, dtype=torch.bool)  # [B2,G2]
    for k, rows in enumerate(ids):
        for g, row in enumerate(rows):
            actions[k, g, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[k, g, : len(row)] = True
            valid[k, g] = True
    return Rollout(
        prompt_ids=[receiver.prompt_ids[b] for b in groups],
        actions=actions,
        mask=mask,
        group_valid=valid,
        truncated=torch.zeros(B2, G2, dtype=torch.bool),
        prompt_index=receiver.prompt_index[groups],
        meta=[receiver.meta[b] for b in groups] if receiver.meta else [],
    )


@register("rollout", "mutual")
@dataclass
class Mutual:
    """The receiver and a peer actor sample the same prompts; ``share`` says what crosses (module docstring)."""

    share: str = "none"  # "none" | "xgrpo" | "prp" | "sgt"
    peer: str = "peer"  # the actor (roles.<peer>.samples = true) that shares with the policy
    k_rescue: int = 1  # sgt: at most this many peer successes join a receiver group [INFERRED]
    success: float = 1.0  # a row whose reward is at least this is a verified success (sgt's gate)

    collects = ("pooled_mean", "pooled_std", "behav_seq_logp")

    def __post_init__(self) -> None:
        if self.share not in SHARES:
            raise ConfigError(f"rollout mutual: share={self.share!r}; one of {', '.join(SHARES)}")
        if self.k_rescue < 1:
            raise ConfigError(f"rollout mutual: k_rescue={self.k_rescue} must be >= 1")
        self._stats: dict[str, float] = {}

    @property
    def samples_with(self) -> tuple[str, ...]:
        return (self.peer,)

    def check(self, components: list) -> None:
        """At build: ``share = "prp"`` needs the weight ``peer_is`` (peer rows would otherwise count as the
        receiver's own samples), ``"xgrpo"`` an estimator that reads the pooled baseline."""
        names = {getattr(c, "registry_name", "") for c in components}
        if self.share == "prp" and "peer_is" not in names:
            raise ConfigError(
                "rollout mutual: share=\"prp\" joins the peer's rows to the receiver's groups; add the weight "
                'objective.weights=[{name="peer_is", C=2.0}] (their sequence-level importance weight)'
            )
        if self.share == "xgrpo" and not any("pooled_mean" in getattr(c, "rollout_extras", ()) for c in components):
            raise ConfigError(
                'rollout mutual: share="xgrpo" shares a pooled baseline that only an estimator reading it uses; '
                'set advantage.estimator="xgrpo"'
            )

    def __call__(self, ctx: RolloutContext) -> dict[str, Rollout]:
        ids = ctx.draw(ctx.batch_size)
        requests = [Request(key=i, n=ctx.group_size) for i in ids]
        own = ctx.rollout(requests)
        peer = ctx.rollout(requests, actor=self.peer)
        receiver_policy, peer_policy = ctx.policy_of("policy"), ctx.policy_of(self.peer)
        texts = [t for b in range(peer.shape[0]) for g, t in enumerate(peer.completions[b]) if peer.group_valid[b, g]]
        self._stats = {
            "mutual/thl_residual": tokens.text_residual(peer_policy.tokenizer, receiver_policy.tokenizer, texts),
            "mutual/peer_reward": float(peer.rewards[peer.group_valid].float().mean()) if texts else float("nan"),
        }
        own.set_extra("behav_seq_logp", torch.zeros(own.shape[:2]), "row")  # [B,G]
        chosen: dict[int, list[int]] = {}
        if self.share == "sgt":
            chosen = rescue_rows(own, peer, self.success, self.k_rescue)
        elif self.share == "prp":
            chosen = {b: peer.group_valid[b].nonzero().flatten().tolist() for b in range(peer.shape[0])}
            chosen = {b: rows for b, rows in chosen.items() if rows}
        self._stats["mutual/rescued_groups"] = len(chosen) / max(1, len(ids)) if self.share == "sgt" else 0.0
        self._stats["mutual/injected_rows"] = float(sum(len(rows) for rows in chosen.values()))
        own.set_flag(INJECTED, torch.zeros(own.shape[:2], dtype=torch.bool))
        if chosen:
            own = self._inject(ctx, own, peer, chosen)
        # xgrpo: both actors' rows; otherwise each group's own (the receiver's augmented by injected rows)
        pooled = pooled_stats(own, peer) if self.share == "xgrpo" else None  # [B], [B]
        for batch in (own, peer):
            mean, std = pooled if pooled is not None else pooled_stats(batch)  # [B], [B]
            batch.set_extra("pooled_mean", mean, "group")
            batch.set_extra("pooled_std", std, "group")
        return {"policy": own, self.peer: peer}

    def _inject(self, ctx: RolloutContext, own: Rollout, peer: Rollout, chosen: dict[int, list[int]]) -> Rollout:
        """The chosen peer rows, retokenised into the receiver's vocabulary, scored by the receiver's
        rewards and joined to their groups (flag ``injected``, extra ``behav_seq_logp``)."""
        groups = sorted(chosen)
        receiver = ctx.policy_of("policy")
        ids = [tokens.retokenize([peer.completions[b][g] for g in chosen[b]], receiver) for b in groups]
        more = token_rows(own, groups, ids)
        if own.logp_sampler is not None:  # no sampler log-probs of these tokens exist (sampler_is reads NaN as ρ = 1)
            more.logp_sampler = torch.full(more.shape, float("nan"))  # [B2,G2,T]
        ctx.score(more)
        behaviour = sequence_logp(peer)  # [B,G_b]
        seq = torch.zeros(more.shape[:2])  # [B2,G2]
        for k, b in enumerate(groups):
            seq[k, : len(chosen[b])] = behaviour[b, chosen[b]]
        more.set_extra("behav_seq_logp", seq, "row")
        more.set_flag(INJECTED, more.group_valid.clone())
        return own.join_rows(more, groups)

    def step_stats(self) -> dict[str, float]:
        return dict(self._stats)
