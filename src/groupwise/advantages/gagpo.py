"""GAGPO: per-turn GAE advantages over a grouped, non-parametric state value (multi-turn episodes).

GAGPO (Generalized Advantage Grouped Policy Optimization), Zhu, Yu, Yang, Liu, Hu, Chen, Zhang (SYSU
and Meituan), 2026. arXiv 2605.13217, https://arxiv.org/abs/2605.13217 (specs/23; the full text was
not available: the method's structure comes from third-party summaries, every exact form below is
the spec's reconstruction, [INFERRED]). No code was found.

**Change vs GRPO**: GRPO gives every token of an episode its trajectory's group-normalised return,
so a good first move in a failed episode is blamed. GAGPO gives each turn t of episode i its own
advantage: a TD/GAE estimate whose value function is the mean return of every visit of the same
environment state in the group (no value head), normalised over all turns of the group.

**Math** (one group = the G episodes of a task; turn t of episode i acted on state s_{i,t} with
reward r_{i,t}; a state is its observation text, the segment extra ``env/state_id``; the rewards are
``env/step_reward``, both written by ``rollout.name = "episodes"`` with ``turn_facts = true``)::

    G_{i,t} = Σ_{k≥t} γ^{k−t} r_{i,k}                                   return-to-go
    V(s)    = mean{ G_{j,u} : s_{j,u} = s }   over the group;  V(after the last turn) = 0
    δ_{i,t} = r_{i,t} + γ V(s_{i,t+1}) − V(s_{i,t})
    Â_{i,t} = Σ_{l≥0} (γλ)^l δ_{i,t+l}                                  (backward recursion)
    A_{i,t} = (Â_{i,t} − mean) / (std + eps)       norm = "center_scale"
            = Â_{i,t} / (std + eps)                norm = "scale_only"
              mean, std (population) over every turn (i, t) of the group
    adv[i, τ] = A_{i, seg(τ)} on each loss token τ of turn seg(τ) (``segment_id``), 0 elsewhere  # [B,G,T]

λ = 1 gives Â = G − V(s) (Monte Carlo minus the state's grouped baseline); λ = 0 the one-step TD.

**Defaults** (all [INFERRED], the spec's reconstruction)

- ``gamma = 0.95`` GiGPO's default discount; ``lam = 0.95``.
- ``norm = "center_scale"`` over all turns of the group (the spec's step 5), population std (the
  spec's worked example: std 1/3), ``eps = 1e-6``.

**Notes**

1. A turn is a segment with a finite ``env/step_reward`` in a valid row with a finite reward; NaN
   entries (past an episode's turns) and invalid rows take part in no statistic and get 0.
2. The value after an episode's last turn is 0 whether the episode ended (``done``) or was cut
   (max_turns, context): the return it got is all it gets, as the env runner scores it [INFERRED].
3. A group whose turns all have the same Â (every state visited with one return, e.g. all episodes
   failed identically) gets exactly 0 in both norms: it carries no contrast.
4. Whole-batch quantities only within each group: computed once per step on the whole batch (the
   trainer's ``estimator(batch)``), so micro-batching and ranks cannot change it.
5. Reads the segment extras through ``rollout_extras``: a run whose strategy does not collect them
   fails at build, naming the fix (``rollout.params.turn_facts = true`` on ``episodes``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.masked import to_float32
from groupwise.registry import register
from groupwise.rollout.episodes import STATE_ID, STEP_REWARD
from groupwise.types import Rollout, StepInfo

NORMS = ("center_scale", "scale_only")


def gagpo_gae(state_ids: Tensor, step_rewards: Tensor, valid: Tensor, gamma: float, lam: float) -> Tensor:
    """[B,G,S] float64 Â_{i,t} (module Math, before normalisation) for ``state_ids`` and ``step_rewards``
    [B,G,S] and ``valid`` [B,G,S] bool (the turns); 0 off ``valid``."""
    r = torch.where(valid, step_rewards.double(), torch.zeros((), dtype=torch.float64))  # [B,G,S]
    B, G, S = r.shape
    ret = torch.zeros_like(r)  # [B,G,S] return-to-go
    acc = torch.zeros(B, G, dtype=torch.float64)  # [B,G]
    for t in reversed(range(S)):
        acc = torch.where(valid[..., t], r[..., t] + gamma * acc, torch.zeros((), dtype=torch.float64))
        ret[..., t] = acc
    value = torch.zeros_like(r)  # [B,G,S] V(s_{i,t})
    for b in range(B):
        on = valid[b]  # [G,S]
        if not on.any():
            continue
        _, which = torch.unique(state_ids[b][on].long(), return_inverse=True)  # [n] dense state of each turn
        total = torch.zeros(int(which.max()) + 1, dtype=torch.float64).index_add_(0, which, ret[b][on])  # [n_s]
        count = torch.zeros_like(total).index_add_(0, which, torch.ones_like(ret[b][on]))  # [n_s]
        value[b][on] = (total / count)[which]
    nxt_on = torch.cat([valid[..., 1:], torch.zeros(B, G, 1, dtype=torch.bool)], dim=-1)  # [B,G,S] a next turn
    nxt_value = torch.cat([value[..., 1:], torch.zeros(B, G, 1, dtype=torch.float64)], dim=-1)  # [B,G,S]
    nxt_value = torch.where(nxt_on, nxt_value, torch.zeros((), dtype=torch.float64))  # [B,G,S] 0 after the last
    delta = torch.where(valid, r + gamma * nxt_value - value, torch.zeros((), dtype=torch.float64))  # [B,G,S]
    gae = torch.zeros_like(r)  # [B,G,S]
    acc = torch.zeros(B, G, dtype=torch.float64)  # [B,G]
    for t in reversed(range(S)):
        acc = torch.where(valid[..., t], delta[..., t] + gamma * lam * acc, torch.zeros((), dtype=torch.float64))
        gae[..., t] = acc
    return gae


def gagpo_turn_advantages(
    state_ids: Tensor, step_rewards: Tensor, valid: Tensor, gamma: float, lam: float, norm: str, eps: float
) -> Tensor:
    """[B,G,S] float64 normalised per-turn advantages A_{i,t} (module Math); 0 off ``valid``."""
    gae = gagpo_gae(state_ids, step_rewards, valid, gamma, lam)  # [B,G,S]
    n = valid.sum((1, 2), keepdim=True).clamp(min=1).double()  # [B,1,1]
    mean = gae.sum((1, 2), keepdim=True) / n  # [B,1,1] (gae is 0 off valid)
    centred = torch.where(valid, gae - mean, torch.zeros((), dtype=torch.float64))  # [B,G,S]
    std = (centred.square().sum((1, 2), keepdim=True) / n).sqrt()  # [B,1,1] population std
    top = gae - mean if norm == "center_scale" else gae  # [B,G,S]
    adv = top / (std + eps)  # [B,G,S]
    constant = (centred.abs() <= 1e-12 * (1.0 + mean.abs())).logical_or(~valid).all(-1).all(-1)  # [B] Note 3
    keep = valid & ~constant[:, None, None]  # [B,G,S]
    return torch.where(keep, adv, torch.zeros((), dtype=torch.float64))  # [B,G,S]


def turn_to_tokens(turn_adv: Tensor, segment_id: Tensor, mask: Tensor) -> Tensor:
    """[B,G,T] each token's turn's advantage (``turn_adv`` [B,G,S], ``segment_id`` [B,G,T], −1: no turn);
    0 off ``mask`` [B,G,T], on tokens of no turn and on turns past S."""
    S = turn_adv.shape[-1]
    on = mask & (segment_id >= 0) & (segment_id < S)  # [B,G,T]
    picked = turn_adv.gather(-1, segment_id.clamp(0, max(S - 1, 0)))  # [B,G,T]
    return torch.where(on, picked, torch.zeros((), dtype=turn_adv.dtype))  # [B,G,T]


@register("advantage", "gagpo")
@dataclass
class GAGPOAdvantage:
    """Per-turn GAE over a grouped state-value proxy, normalised per group (GAGPO, Zhu et al. 2026)."""

    group_relative = True  # the value proxy and the normalisation are group statistics
    rollout_extras = (STEP_REWARD, STATE_ID)  # written by rollout episodes with turn_facts=true (Note 5)

    gamma: float = 0.95
    lam: float = 0.95
    norm: str = "center_scale"  # "center_scale" | "scale_only"
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ConfigError(f"advantage gagpo: gamma and lam must lie in [0, 1], got {self.gamma}, {self.lam}")
        if self.norm not in NORMS:
            raise ConfigError(f"advantage gagpo: norm must be one of {NORMS}, got {self.norm!r}")
        if self.eps < 0:
            raise ConfigError(f"advantage gagpo: eps must be >= 0, got {self.eps}")

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        missing = [k for k in self.rollout_extras if k not in rollout.extras]
        if missing or rollout.segment_id is None:
            raise ConfigError(
                f"advantage gagpo needs the per-turn extras {list(self.rollout_extras)} and segment_id "
                f"(missing {missing or ['segment_id']}): use rollout.name='episodes' with "
                "rollout.params.turn_facts=true"
            )
        rewards = rollout.extras[STEP_REWARD]  # [B,G,S]
        row = rollout.group_valid & (torch.isfinite(rollout.rewards) if rollout.rewards is not None else True)  # [B,G]
        valid = torch.isfinite(rewards) & row[..., None]  # [B,G,S] the turns of rows with a verdict
        turn_adv = gagpo_turn_advantages(
            rollout.extras[STATE_ID], rewards, valid, self.gamma, self.lam, self.norm, self.eps
        )  # [B,G,S]
        return to_float32(turn_to_tokens(turn_adv, rollout.segment_id, rollout.row_mask))  # [B,G,T]
