"""Trajectory-level GRPO for multi-turn environments: one row per episode, the whole transcript.

The baseline GROW is compared with (spec 04, comparison (a): "trajectory-level GRPO with full
history in context"); the standard way multi-turn agents are trained with GRPO (one trajectory =
one sample, environment tokens masked out of the loss), as multi-turn RL frameworks do (e.g.
slime's ``MultiTurnLossMaskGenerator``, ``slime/utils/mask_utils.py``: loss on assistant tokens only).

**Change vs GRPO**: the G completions of a prompt are G episodes: each row's tokens are the
policy's actions AND the environment's observations between them, generated turn by turn with the
whole transcript as context; ``loss_mask`` is False on the environment tokens (holes), so only the
actions are trained. Reward = the episode's outcome; the advantage is the configured estimator.

**Math** (episode e of task τ, played by ``rollout/env.py`` in history mode)::

    prompt  = encode(o_0)
    row     = a_0 ‖ encode(sep + o_1) ‖ a_1 ‖ … ‖ a_last        (mask: a prefix, as always)
    loss_mask = 1 on the tokens of every a_t, 0 on every encode(sep + o_t)
    reward  = R_e = Σ_t r_t

**Defaults**

- ``max_turns = 16`` [INFERRED] as ``grow``'s, so both strategies play the same episodes' length.
- ``separator = " "`` [INFERRED] one space between an action and the next observation.
- ``max_context = None`` [INFERRED] the model's own context (128 positions for the embedded
  model); a smaller value emulates a shorter window (the spec's truncating-context test).
- ``env = None`` [INFERRED] the row's ``env`` column; ``env_params = {}`` the env's defaults.

**Notes**

1. Truncation rule: a turn is played only if its context (prompt + transcript so far) plus
   ``rollout.max_new_tokens`` fits ``min(model context, max_context)``; otherwise the episode stops
   there (``truncated`` True, ``info["cut"] = "context"``) with the rewards it has (0 in the reach
   game). The row then fits the model: prompt + row tokens ≤ the limit.
2. A row's ``T`` is the transcript's length, so it can exceed ``rollout.max_new_tokens``
   (``StepInfo.max_new_tokens``, Dr.GRPO's constant normaliser, still reads the config value).
3. Transcripts are plain text (``policy.encode`` of each observation): chat-format transcripts
   (a template per turn) are not implemented.
4. ``logp_sampler`` is the sampler's log-prob at action tokens and 0 at environment tokens (holes).
5. Turns are segments: ``Rollout.segment_id`` [B,n,T] gives each action token its turn ``t`` and
   every environment token (and padding) −1; an ``outcome()`` fact that is a list of numbers is a
   per-turn value (entry t = turn t), stored as the segment extra ``env/<key>`` [B,n,S] (NaN past
   an episode's list; S = the longest list), e.g. ``env/step_scores``, which the per-step token
   weights read (``weights/process_score.py``); ``info[b][g]["env"]`` holds every fact as well.
6. ``turn_facts = True`` (M5, first consumer: the ``gagpo`` estimator) adds two segment extras for
   per-turn credit: ``env/step_reward`` [B,n,S] = r_t (``Episode.rewards``) and ``env/state_id``
   [B,n,S] = the observation text turn t acted on (o_t), as a dense index over the batch's distinct
   texts in order of first appearance (state identity = observation text, as GiGPO's anchor
   states). An index, not a hash: segment extras are float32, exact only below 2^24. Both are NaN
   past an episode's turns. The strategy then ``collects`` them (``rollout_extras`` checks at build).
7. ``step_stats``: ``episodes/env_steps`` (actions played this step, every episode: the generation
   cost), ``episodes/action_tokens`` (their tokens) and ``episodes/gated_frac`` (share of groups a
   group hook cut, 0 here; ``selective_rollout`` sets the hook). Gated groups leave the batch.
   An env with ``outcome()`` adds ``env/<key>``: the means of its numeric facts (``rollout/env.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rollout.env import Played, check_env_rewards, check_envs, heldout_returns, play, score_returns
from groupwise.types import Rollout

TURN_FACT = "env/"  # segment extras [B,n,S]: an outcome() fact with one number per turn


def turn_facts(episodes: list[list[Any]]) -> dict[str, torch.Tensor]:
    """Each ``outcome()`` fact that is a list of numbers in some episode, as [B,n,S] float32: entry
    (b, e, t) = the value at turn t of episode e of group b, NaN where the episode's list is shorter
    (or the fact is not a list there); S = the longest list."""

    def numbers(v: Any) -> bool:
        return isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v)

    B, n = len(episodes), max((len(g) for g in episodes), default=0)
    keys = sorted({k for g in episodes for ep in g for k, v in ep.facts.items() if numbers(v)})
    out = {}
    for key in keys:
        S = max(len(ep.facts[key]) for g in episodes for ep in g if numbers(ep.facts.get(key)))
        values = torch.full((B, n, S), float("nan"))  # [B,n,S]
        for b, g in enumerate(episodes):
            for e, ep in enumerate(g):
                if numbers(ep.facts.get(key)) and ep.facts[key]:
                    values[b, e, : len(ep.facts[key])] = torch.tensor([float(x) for x in ep.facts[key]])
        out[key] = values
    return out


STEP_REWARD, STATE_ID = TURN_FACT + "step_reward", TURN_FACT + "state_id"  # the segment extras of turn_facts=True


def state_facts(episodes: list[list[Any]]) -> dict[str, torch.Tensor]:
    """Per-turn reward and state id (Note 6) as [B,n,S] float32 segment extras, NaN past an episode's turns."""
    B, n = len(episodes), max((len(g) for g in episodes), default=0)
    S = max(1, max((len(ep.rewards) for g in episodes for ep in g), default=0))
    reward = torch.full((B, n, S), float("nan"))  # [B,n,S]
    state = torch.full((B, n, S), float("nan"))  # [B,n,S]
    index: dict[str, int] = {}  # observation text -> dense id, in order of first appearance
    for b, g in enumerate(episodes):
        for e, ep in enumerate(g):
            for t, r in enumerate(ep.rewards):
                reward[b, e, t] = float(r)
                state[b, e, t] = float(index.setdefault(ep.observations[t], len(index)))
    return {STEP_REWARD: reward, STATE_ID: state}


def transcripts(played: Played, separator: str = " ", with_state: bool = False) -> tuple[Rollout, torch.Tensor]:
    """(batch [B, n, T], outcome [B, n]): one row per episode, its actions and the env tokens between them
    (``with_state``: with the per-turn extras of Note 6)."""
    B, n = len(played.episodes), max(len(g) for g in played.episodes)
    logp_of = played.turns.logp_sampler  # [R,1,T'] the sampler's log-probs of every action
    rows = []
    for group in played.episodes:
        for ep in group:
            tokens, own, logp, step = [], [], [], []
            for t, action in enumerate(ep.actions):
                tokens += action
                own += [True] * len(action)
                step += [t] * len(action)
                logp += logp_of[ep.rows[t], 0, : len(action)].tolist() if logp_of is not None else [0.0] * len(action)
                if t < len(ep.actions) - 1:  # the observation the next action saw; none after the last
                    tokens += ep.env_tokens[t]
                    own += [False] * len(ep.env_tokens[t])
                    logp += [0.0] * len(ep.env_tokens[t])
                    step += [-1] * len(ep.env_tokens[t])
            rows.append((tokens, own, logp, step))
    T = max(1, max(len(r[0]) for r in rows))
    actions = torch.zeros(B, n, T, dtype=torch.long)  # [B,n,T]
    mask = torch.zeros(B, n, T, dtype=torch.bool)  # [B,n,T]
    loss_mask = torch.zeros(B, n, T, dtype=torch.bool)  # [B,n,T]
    logp = torch.zeros(B, n, T)  # [B,n,T]
    # [B,n,T] the action (turn) each token belongs to; -1: env token or padding
    segment_id = torch.full((B, n, T), -1, dtype=torch.long)
    for i, (tok, own, lp, st) in enumerate(rows):
        b, e = divmod(i, n)
        actions[b, e, : len(tok)], mask[b, e, : len(tok)] = torch.tensor(tok, dtype=torch.long), True
        loss_mask[b, e, : len(tok)], logp[b, e, : len(tok)] = torch.tensor(own), torch.tensor(lp)
        segment_id[b, e, : len(tok)] = torch.tensor(st, dtype=torch.long)
    firsts = [[ep.contexts[0] if ep.contexts else [] for ep in g] for g in played.episodes]
    prompts = [list(next((c for c in f if c), [])) for f in firsts]
    meta = played.turns.meta
    first_row = {ep.key: ep.rows[0] for g in played.episodes for ep in g if ep.rows}
    batch = Rollout(
        prompt_ids=prompts,
        actions=actions,
        mask=mask,
        group_valid=mask.any(-1),  # [B,n] an episode cut before its first action has nothing to train
        truncated=torch.tensor([[ep.cut == "context" for ep in g] for g in played.episodes]),  # [B,n]
        prompt_index=torch.tensor([g[0].key for g in played.episodes], dtype=torch.long),  # [B]
        meta=[meta[first_row[g[0].key]] if g[0].key in first_row else {} for g in played.episodes],
        completions=[
            [
                "".join(
                    a + (separator + ep.observations[t + 1] if t < len(ep.texts) - 1 else "")
                    for t, a in enumerate(ep.texts)
                )
                for ep in g
            ]
            for g in played.episodes
        ],
        info=[
            [{"actions": list(ep.texts), "return": ep.ret, "cut": ep.cut, "env": dict(ep.facts)} for ep in g]
            for g in played.episodes
        ],
        ctx=firsts
        if any(f != p for fs, p in zip(firsts, prompts) for f in fs)
        else [],  # a random reset: each row its own prompt
        loss_mask=loss_mask,
        logp_sampler=logp,
        segment_id=segment_id,
    )
    for key, values in turn_facts(played.episodes).items():
        batch.set_extra(TURN_FACT + key, values, "segment")
    if with_state:
        for key, values in state_facts(played.episodes).items():
            batch.set_extra(key, values, "segment")
    outcome = torch.tensor([[ep.ret for ep in g] for g in played.episodes], dtype=torch.float64)  # [B,n]
    return batch, outcome


@register("rollout", "episodes")
@dataclass
class Episodes:
    """One row per episode: the whole multi-turn transcript, environment tokens masked out of the loss (trajectory-level
    GRPO)."""

    max_turns: int = 16
    separator: str = " "
    max_context: int | None = None
    env: str | None = None
    env_params: dict = field(default_factory=dict)
    turn_facts: bool = False  # per-turn segment extras env/step_reward and env/state_id (Note 6): gagpo reads them

    def __post_init__(self) -> None:
        if self.max_turns < 1 or (self.max_context is not None and self.max_context < 2):
            raise ConfigError(
                "rollout episodes: need max_turns >= 1 and max_context >= 2 or None, "
                f"got max_turns={self.max_turns}, max_context={self.max_context}"
            )

    on_step = None  # a group hook for rollout/env.py's play (``selective_rollout`` defines its gate here); None: none

    @property
    def collects(self) -> tuple[str, ...]:
        """The extras other components may read (``rollout_extras``): the turn facts when they are on."""
        return (STEP_REWARD, STATE_ID) if self.turn_facts else ()

    def check(self, components: list) -> None:
        check_env_rewards(components, self._who)
        if not self.turn_facts:  # a reader of the turn facts: name the switch (the generic check cannot)
            for c in components:
                read = sorted({STEP_REWARD, STATE_ID} & set(getattr(c, "rollout_extras", ())))
                if read:
                    raise ConfigError(
                        f"{getattr(c, 'stage', '')} component {getattr(c, 'registry_name', type(c).__name__)!r} "
                        f"reads the per-turn facts {read}, which rollout {self._who!r} writes only with "
                        "rollout.params.turn_facts=true: set it"
                    )

    def use_rows(self, rows: list[dict]) -> None:
        check_envs(self.env, self.env_params, rows, self._who)  # a bad env name fails at build

    def play_heldout(
        self, policy: Any, rows: list[dict], sampling: dict, info: Any, n: int, greedy: bool
    ) -> list[list[float]]:
        """``n`` closed-loop episodes of each held-out row, as training plays them (the whole transcript
        as the context; no group hook): their returns [row][episode]."""
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
            history=True,
            separator=self.separator,
            max_context=self.max_context,
            who=self._who,
        )

    @property
    def _who(self) -> str:
        return getattr(self, "registry_name", "episodes")

    def __call__(self, ctx) -> Rollout:
        played = play(
            ctx,
            ctx.draw(ctx.batch_size),
            ctx.group_size,
            self.max_turns,
            self.env,
            self.env_params,
            history=True,
            separator=self.separator,
            max_context=self.max_context,
            who=self._who,
            on_step=self.on_step,
        )
        batch, outcome = transcripts(played, self.separator, self.turn_facts)
        score_returns(ctx, batch, outcome, self._who)
        self._stats = {
            "episodes/env_steps": float(played.actions),
            "episodes/action_tokens": float(played.turns.mask.sum()),
            "episodes/gated_frac": sum(played.gated) / max(1, len(played.gated)),
            **played.fact_means(),
        }
        # [B] bool: a gated group leaves the batch
        keep = ctx.keep(batch) & ~torch.tensor(played.gated, dtype=torch.bool)
        return batch if bool(keep.all()) else batch.select(keep.nonzero().flatten())

    def step_stats(self) -> dict[str, float]:
        return dict(getattr(self, "_stats", {}))
