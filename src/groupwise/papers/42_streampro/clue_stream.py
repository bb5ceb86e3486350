"""Clue stream: the text analogue of proactive streaming video (StreamPro, spec 42) and its
multi-grained (turn-level + trajectory-level) reward.

Citation: "StreamPro: From Reactive Perception to Proactive Decision-Making in Streaming Video",
Ao Li et al., 2026, https://arxiv.org/abs/2605.16381 (spec 42; abstract only, full paper not read).

The env is ``streampro`` (``groupwise explain streampro``), its task ``clue_stream``; the paper's
stage-1 loss is the ``sft`` phase's ``loss = "cb_stream"`` (``phases/cb_stream.py``), the recipe
``streampro`` runs both stages.

A stream hides a label ``y`` in 0..9. Turn ``t`` (0-indexed) shows one observation character:
``"?"`` while the label is not yet determinable (``t < t_open``), then the digit ``y`` from
``t_open`` on. At each turn the policy either stays silent (``"."``) or answers (one digit); an
answer ends the episode, and so does the last turn ``T − 1``. Information arrives turn by turn and
the model must answer at the right time: the streaming-video decision (silence ≫ response) in a
form the embedded tiny model can play (``rollout.name = "episodes"``, ``separator = ""``: the
transcript of a stream shown at turn 2 reads ``"?.?.3"``, one token an action).

**Change vs GRPO**: the reward. Instead of one outcome, an episode is scored with turn-level
rewards (silence while undeterminable, a penalty for a false answer) and a trajectory-level reward
(correctness with a timing bonus, a penalty for never answering), mixed with weight ``alpha``; GRPO
normalises it over the group as usual (advantage ``grpo``).

**Math** (``streampro_reward`` / ``episode_reward``; events ``e_t`` of the turns played, ``"sil"``,
a digit, or ``"invalid"``)::

    r_t    = +c_sil   if e_t == "sil" and t < t_open
           = −c_fa    if e_t is a digit != y                     (a false alarm)
           = 0        otherwise (silence after t_open, the right digit, an invalid action)
    R_traj = 1[correct] · (1 + lambda_time · (T − t_resp) / T) − c_miss · 1[never answered]
    R      = alpha · mean_t r_t + (1 − alpha) · R_traj              (the episode's return)

The env pays ``R`` at the episode's last step (0 before), so ``env_return`` (the sum) is ``R``.

**Defaults**

- ``c_sil = 0.05, c_fa = 0.5, lambda_time = 0.5, c_miss = 0.5, alpha = 0.3`` [INFERRED] spec 42's
  concrete form; the abstract only says "turn-level and trajectory-level rewards" jointly
  optimising correctness and timing. ``lambda_time = 0, alpha = 0`` is the correctness-only reward.
- ``t_resp`` is the 0-indexed turn of the answer [INFERRED] (the spec's hand number: T = 10,
  t_resp = 4 → R_traj = 1.3).
- task ``clue_stream``: ``T = TURNS = 24`` turns, ``t_open`` in ``OPEN = 10..23`` [INFERRED] the
  oracle trajectories then hold ≈ 16.5 silent decisions per answer (the spec asks ≈ 20:1 within the
  embedded model's 128-position context).

**Notes**

1. A digit other than ``y`` ends the episode as a false alarm (``−c_fa`` at that turn, no
   ``R_traj`` credit); an action that is neither ``"."`` nor a digit (empty, EOS, ``"?"``) is an
   invalid turn: reward 0, the stream goes on (it is not silence, so it earns no ``c_sil``).
2. Running out of turns without answering costs ``c_miss`` (the trajectory term); a stream whose
   label was determinable only at the last turn still gets ``T − t_resp = 1`` of timing credit.
3. Rows (task ``clue_stream``): one row per *decision position* of an oracle trajectory (silent
   until ``t_open``, then answer): ``prompt`` = the transcript up to turn ``t``, ``answer`` = the
   oracle action (``"."`` or the digit), ``decision`` = 0 (silence) / 1 (respond), plus the
   stream's ``label``, ``t_open``, ``turns``. ``train``: every decision position of the train
   streams (the SFT data; the env plays each row's stream from turn 0, whatever its ``prompt``).
   ``test``: only the respond positions of held-out streams (``(y, t_open)`` pairs never trained
   on), so the trainer's held-out accuracy is **respond accuracy**: the share of determinable-at-
   last positions where the greedy policy answers the right digit (respond recall × correctness).
4. ``action_value(row, action)`` = 1 when the action is the row's oracle action, else 0 (the
   single-turn score of ``env_return`` used by held-out evaluation).
5. ``outcome()`` (the env runner's optional episode facts) gives ``answered``, ``correct``,
   ``response_turn`` and ``delay`` (turns after ``t_open`` of a correct answer): the ``episodes``
   strategy logs their means as ``env/answered`` … ``env/delay``.
6. The seed of ``reset`` is unused: a stream is fixed by its row (the contract allows random envs).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.tasks import Task, register_task

SILENT, HIDDEN = ".", "?"
TURNS = 24
OPEN = (10, 23)
TEST_STREAMS = 40
_SPLIT_SEED = 4242

Event = str | int  # "sil", "invalid", or the answered digit


def parse_action(action: str) -> Event:
    """``"."`` → ``"sil"``; one digit → that digit (an answer); anything else → ``"invalid"``."""
    text = action.strip() if isinstance(action, str) else ""
    if text == SILENT:
        return "sil"
    return int(text) if len(text) == 1 and text.isdigit() else "invalid"


@dataclass
class RewardConfig:
    """The multi-grained reward's weights (see the module's **Defaults**; all [INFERRED])."""

    c_sil: float = 0.05
    c_fa: float = 0.5
    lambda_time: float = 0.5
    c_miss: float = 0.5
    alpha: float = 0.3

    def __post_init__(self) -> None:
        for name in ("c_sil", "c_fa", "lambda_time", "c_miss"):
            if getattr(self, name) < 0:
                raise ConfigError(
                    f"streampro reward: {name}={getattr(self, name)} must be "
                    ">= 0 (it is a bonus or penalty size; 0 turns it off)"
                )
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(
                f"streampro reward: alpha={self.alpha} must be in [0, 1] (the turn-level share; 0 = trajectory only)"
            )


def episode_reward(events: Sequence[Event], y_true: int, t_open: int, T: int, cfg: RewardConfig) -> float:
    """``R = alpha · mean_t r_t + (1 − alpha) · R_traj`` of one episode's events (module **Math**)."""
    if T < 1:
        raise ValueError(f"streampro reward: T={T} must be >= 1")
    turn, t_resp, correct = [], None, False
    for t, e in enumerate(events):
        if e == "sil":
            turn.append(cfg.c_sil if t < t_open else 0.0)
        elif isinstance(e, int):
            turn.append(0.0 if e == y_true else -cfg.c_fa)
            t_resp, correct = t, e == y_true
            break  # an answer ends the episode
        else:
            turn.append(0.0)
    traj = (1.0 + cfg.lambda_time * (T - t_resp) / T) if correct else 0.0
    traj -= cfg.c_miss if t_resp is None else 0.0
    mean_turn = sum(turn) / len(turn) if turn else 0.0
    return cfg.alpha * mean_turn + (1.0 - cfg.alpha) * traj


def streampro_reward(
    turn_events: Sequence[Sequence[Sequence[Event]]],
    y_true: Sequence[int],
    t_open: Sequence[int],
    T: int,
    cfg: RewardConfig,
) -> torch.Tensor:
    """``rewards`` [B,G]: ``episode_reward`` of every episode ``turn_events[b][g]`` of stream ``b``
    (label ``y_true[b]``, opening turn ``t_open[b]``); a ragged group's missing episodes are NaN."""
    B, G = len(turn_events), max((len(g) for g in turn_events), default=0)
    out = torch.full((B, G), float("nan"), dtype=torch.float64)  # [B,G]
    for b, group in enumerate(turn_events):
        for g, events in enumerate(group):
            out[b, g] = episode_reward(events, int(y_true[b]), int(t_open[b]), T, cfg)
    return out


def observation(y: int, t_open: int, t: int) -> str:
    return str(y) if t >= t_open else HIDDEN


@register("env", "streampro")
@dataclass
class ClueStream:
    """Streaming clues: stay silent (".") until the label is shown, then answer it; multi-grained StreamPro reward."""

    c_sil: float = 0.05
    c_fa: float = 0.5
    lambda_time: float = 0.5
    c_miss: float = 0.5
    alpha: float = 0.3
    y: int = field(default=0, init=False)
    t_open: int = field(default=0, init=False)
    turns: int = field(default=TURNS, init=False)
    events: list = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.cfg = RewardConfig(self.c_sil, self.c_fa, self.lambda_time, self.c_miss, self.alpha)

    def reset(self, row: dict, seed: int) -> str:
        self.y, self.t_open, self.turns, self.events = int(row["label"]), int(row["t_open"]), int(row["turns"]), []
        if not 0 <= self.t_open < self.turns:
            raise ConfigError(
                f"env streampro: a row needs 0 <= t_open < turns, got t_open={self.t_open}, turns={self.turns}"
            )
        return observation(self.y, self.t_open, 0)

    def step(self, action: str) -> tuple[str, float, bool]:
        event = parse_action(action)
        self.events.append(event)
        t = len(self.events)  # the next turn
        done = isinstance(event, int) or t >= self.turns
        reward = episode_reward(self.events, self.y, self.t_open, self.turns, self.cfg) if done else 0.0
        return observation(self.y, self.t_open, min(t, self.turns - 1)), reward, done

    def outcome(self) -> dict[str, float]:
        """The episode's decision statistics (logged as ``env/<key>`` step stats by the env strategies):
        ``answered`` and ``correct`` (0/1), ``response_turn`` (0-indexed, NaN when never answered) and
        ``delay`` = response turn − t_open of a correct answer (NaN otherwise)."""
        t = next((i for i, e in enumerate(self.events) if isinstance(e, int)), None)
        correct = t is not None and self.events[t] == self.y
        return {
            "answered": float(t is not None),
            "correct": float(correct),
            "response_turn": float("nan") if t is None else float(t),
            "delay": float(t - self.t_open) if correct else float("nan"),
        }

    def action_value(self, row: dict, action: str) -> float:
        """1 when ``action`` is the row's oracle action (silence before ``t_open``, the label after), else 0."""
        return 1.0 if parse_action(action) == parse_action(str(row["answer"])) else 0.0


def decision_rows(y: int, t_open: int, turns: int = TURNS, respond_only: bool = False) -> list[dict]:
    """The oracle trajectory's decision positions of stream ``(y, t_open)`` as rows (module Note 3)."""
    rows, prefix = [], ""
    for t in range(t_open + 1):
        prefix += observation(y, t_open, t)
        answer = str(y) if t == t_open else SILENT
        if not respond_only or t == t_open:
            rows.append(
                {
                    "prompt": prefix,
                    "answer": answer,
                    "decision": int(t == t_open),
                    "env": "streampro",
                    "label": y,
                    "t_open": t_open,
                    "turns": turns,
                }
            )
        prefix += answer
    return rows


def _streams() -> list[tuple[int, int]]:
    pairs = [(y, o) for y in range(10) for o in range(OPEN[0], OPEN[1] + 1)]
    random.Random(_SPLIT_SEED).shuffle(pairs)
    return pairs


def rows(split: str, n: int, seed: int = 0) -> list[dict]:
    """``split`` rows (module Note 3); ``n > 0`` train rows are a ``seed``-shuffled sample,
    ``n <= 0`` the whole split."""
    streams = _streams()
    if split == "test":
        out = [r for y, o in streams[:TEST_STREAMS] for r in decision_rows(y, o, respond_only=True)]
    elif split == "train":
        out = [r for y, o in streams[TEST_STREAMS:] for r in decision_rows(y, o)]
        if n > 0:
            random.Random(seed).shuffle(out)
    else:
        raise ValueError(f"clue_stream has splits 'train' and 'test', not {split!r}")
    return out[:n] if n > 0 else out


register_task(
    Task(
        "clue_stream",
        "streaming multi-turn: stay silent ('.') while the clue is '?', answer the digit once shown "
        "(StreamPro analogue); rows are decision positions; reward env_return",
        rows,
        reward="env_return",
    )
)
