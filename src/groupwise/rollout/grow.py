"""GROW: split multi-turn trajectories into local (state, action) samples and group them per task.

"GROW: GRPO with state-action grouping for multi-turn open-world VLM agents", arXiv 2605.20246
(v2), https://arxiv.org/abs/2605.20246 — spec 04. Only the abstract was available; no code.

**Change vs GRPO**: GRPO's sample is a completion of one prompt. GROW plays K trajectories per
task and decomposes each into its per-turn samples, each conditioned on its *local* state only
(no earlier turns): a group is every sample of a task across its K trajectories (ragged), each row
with its own context (``Rollout.ctx``). The advantage is then the configured estimator on these
rows (``grpo`` gives the spec's ``(g − mean_group g) / (std_group g + eps)``); the loss is unchanged.

**Math** (``K = rollout.group_size`` episodes per task, ``B = rollout.prompts_per_step`` tasks)::

    ξ_k = [(s_1, a_1, r_1), …, (s_Tk, a_Tk, r_Tk)]      played by rollout/env.py (local contexts)
    g_{k,t} = R_k = Σ_t' r_{k,t'}                        step_return = "outcome"
            | Σ_{t' >= t} γ^(t'−t) r_{k,t'}              step_return = "rtg"
    group(τ) = {(context = encode(s_{k,t}), action = a_{k,t}, reward = g_{k,t}) : k < K, t < T_k}
    rewards [B, max_τ |group(τ)|], group_valid False on the padding

**Defaults**

- ``step_return = "outcome"`` [INFERRED] spec 04: outcome credit shared by every step of a trajectory.
- ``gamma = 1.0`` [INFERRED] spec 04's ``grow_advantages(..., gamma=1.0)``; used by ``"rtg"`` only.
- ``max_turns = 16`` [INFERRED] a cut that covers the built-in games (reach_long: 10 moves).
- ``max_samples = None`` [INFERRED] no cap; an integer keeps a seeded subset of that many samples per
  task (the per-group cut), the same whatever else is in the batch.
- ``env = None`` [INFERRED] the env named by each row's ``env`` column; ``env_params = {}`` its defaults.
- grouping by task over all steps [INFERRED] spec 04's default; grouping by (task, step bucket) or
  by state cluster is not implemented.

**Notes**

1. The spec's unit test: g = [1, 1, 1, 0, 0] gives A = [0.8165 ×3, −1.2247 ×2] with ``grpo``
   at ``std = "population"``, ``eps = 1e-6`` (recipe ``grow``); the library default (unbiased std,
   eps = 1e-4) gives 0.7303 / −1.0954 instead (tests/test_grow.py).
2. Rewards come from the env, not from text scorers: ``env_return`` gets each row's g, other text
   rewards are a build error, rollout scorers and reward weights apply as usual (``rollout/env.py``).
3. A row's tokens are its action only; with one token per action a sample costs its local context
   plus one token, O(step length) instead of O(trajectory length).
4. The sampler's ``keep`` runs once on the grouped batch (no refill rounds).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rollout.env import Played, check_env_rewards, check_envs, heldout_returns, play, score_returns
from groupwise.seeds import sample_seed
from groupwise.types import Rollout

CUT_STREAM = 1 << 41  # the seed stream of the max_samples subset


def step_returns(rewards: list[float], mode: str = "outcome", gamma: float = 1.0) -> list[float]:
    """g_t of every step of one trajectory: the outcome Σ r (every step alike) or the discounted return-to-go."""
    if mode == "outcome":
        return [float(sum(rewards))] * len(rewards)
    if mode != "rtg":
        raise ConfigError(f"rollout grow: step_return must be 'outcome' or 'rtg', got {mode!r}")
    out, acc = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = rewards[t] + gamma * acc
        out[t] = acc
    return out


def decompose(
    played: Played,
    step_return: str = "outcome",
    gamma: float = 1.0,
    max_samples: int | None = None,
    seed: int = 0,
    step: int = 0,
) -> tuple[Rollout, torch.Tensor]:
    """(batch [B, max samples, T], g [B, max samples]): group b holds every (episode, turn) sample of task b
    in play order, each row under the context it was generated under; padding rows invalid, g = 0."""
    rows, values, info = [], [], []
    for group in played.episodes:
        samples = [(ep, t, g) for ep in group for t, g in enumerate(step_returns(ep.rewards, step_return, gamma))]
        if not samples:
            raise ConfigError("rollout grow: a task played no step (max_turns >= 1 is needed)")
        if max_samples is not None and len(samples) > max_samples:
            rng = random.Random(sample_seed(seed, step, group[0].key, CUT_STREAM))
            samples = [samples[i] for i in sorted(rng.sample(range(len(samples)), max_samples))]
        rows.append([(ep.rows[t], 0) for ep, t, _ in samples])
        values.append([g for _, _, g in samples])
        info.append([{"episode": ep.index, "turn": t, "return": ep.ret} for ep, t, _ in samples])
    batch = played.turns.regroup(rows)
    B, G, _ = batch.shape
    g = torch.zeros(B, G, dtype=torch.float64)  # [B,G]
    for b, v in enumerate(values):
        g[b, : len(v)] = torch.tensor(v, dtype=torch.float64)
    batch.info = [row + [None] * (G - len(row)) for row in info]
    batch.ctx = batch.row_contexts()  # every row keeps its own local context, whatever the group's prompt
    # each task's first observation
    batch.prompt_ids = [next(list(ep.contexts[0]) for ep in group if ep.contexts) for group in played.episodes]
    return batch, g


@register("rollout", "grow")
@dataclass
class GROW:
    """K episodes per task, decomposed into local (state, action) samples grouped per task (GROW, arXiv 2605.20246)."""

    step_return: str = "outcome"
    gamma: float = 1.0
    max_turns: int = 16
    max_samples: int | None = None
    env: str | None = None
    env_params: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        step_returns([], self.step_return)  # a bad mode fails at build
        if (
            not 0.0 <= self.gamma <= 1.0
            or self.max_turns < 1
            or (self.max_samples is not None and self.max_samples < 1)
        ):
            raise ConfigError(
                f"rollout grow: need 0 <= gamma <= 1, max_turns >= 1, max_samples >= 1 or None; "
                f"got gamma={self.gamma}, max_turns={self.max_turns}, max_samples={self.max_samples}"
            )

    def check(self, components: list) -> None:
        check_env_rewards(components, "grow")

    def use_rows(self, rows: list[dict]) -> None:
        check_envs(self.env, self.env_params, rows, "grow")  # a bad env name fails at build

    def play_heldout(
        self, policy: Any, rows: list[dict], sampling: dict, info: Any, n: int, greedy: bool
    ) -> list[list[float]]:
        """``n`` closed-loop episodes of each held-out row, each action under its local state as in
        training: their returns [row][episode]."""
        return heldout_returns(
            policy,
            rows,
            sampling,
            info,
            n,
            self.max_turns,
            greedy=greedy,
            env=self.env,
            env_params=self.env_params,
            who="grow",
        )

    def __call__(self, ctx) -> Rollout:
        info = ctx.info(0)
        played = play(
            ctx, ctx.draw(ctx.batch_size), ctx.group_size, self.max_turns, self.env, self.env_params, who="grow"
        )
        batch, g = decompose(played, self.step_return, self.gamma, self.max_samples, info.seed, info.step)
        score_returns(ctx, batch, g, "grow")
        keep = ctx.keep(batch)  # [B] bool
        return batch if bool(keep.all()) else batch.select(keep.nonzero().flatten())
