"""Failure-cause-aware rollout governance: a group compares only execution-comparable rollouts (spec 50).

"Signal Reshaping for GRPO in Weak-Feedback Agentic Code Repair", arXiv 2605.07276,
https://arxiv.org/abs/2605.07276 (spec: specs/50; abstract only, no code).

**Change vs GRPO** (trajectory-level ``episodes``): every episode's termination cause is classified;
a rollout that ended because the environment failed (sandbox/tool crash, a timeout the policy did
not cause) says nothing about the policy, so it leaves its group (``group_valid`` False: it enters
no group statistic and gets advantage 0) instead of counting as a failure with a negative
advantage. Optionally the row is played again; a group left with fewer than ``min_valid`` valid
rollouts leaves the batch.

**Math** (episode e of row b; facts from the env's ``outcome()``, ``cut`` from the runner)::

    cause(e)  = facts["cause"]  if it is one of {policy_fail, env_fail, success}
              = "truncated"     if the runner cut it (max_turns, context, gate)
              = "policy_fail"   otherwise (the env ended it without a verdict)
    repeat up to max_resample times: replay the env_fail episodes of each group (fresh indices)
    valid_mask[b, e] = cause(e) != env_fail                   (govern = True)
    group_keep[b]    = Σ_e valid_mask[b, e] >= min_valid
    A = estimator over valid rows only (grpo's statistics skip invalid rows: grpo_advantage_masked)

**Defaults** — every form is the spec's reconstruction ([ABSTRACT]: "failure-cause-aware rollout
governance reshapes within-group comparability").

- ``govern = True`` [INFERRED]; ``False`` classifies and logs only (the ungoverned baseline).
- ``max_resample = 0`` [INFERRED] spec 50 "optionally resample up to max_resample": off by default.
- ``min_valid = 2`` [INFERRED] spec 50: drop groups with < 2 valid rollouts.
- Rollout: as ``episodes`` (``max_turns = 16``, ``separator = " "``, the row's env).

**Notes**

1. ``govern_group(rewards, causes)`` is the pure rule, ``grpo_advantage_masked`` GRPO's statistic
   over the valid rows (``masked.group_normalize``); the strategy applies the rule to the batch.
2. The governance runs on the whole batch every rank assembled identically (the env runner gathers
   every action), so ranks agree on what is dropped.
3. A resampled episode replaces the failed one in its slot; one still failing after
   ``max_resample`` replays is dropped. Replays cost env steps (``episodes/env_steps`` counts them).
4. ``step_stats()``: ``govern/cause_<name>`` (share of the step's played episodes, the replaced
   ones included, per cause), ``govern/dropped_rows``, ``govern/dropped_groups``,
   ``govern/resampled``, ``govern/steps_to_solve`` (mean actions of the successful episodes, NaN if
   none). After the advantages (``prepare``): ``govern/spurious_neg_frac`` (of the valid-or-not rows
   with a negative advantage, the share that ended in ``env_fail``: 0 under governance),
   ``govern/mid_groups`` (groups where no valid, not env-failed rollout passed and some but not
   all of them compiled) and
   ``govern/mid_signal_frac`` (of those, the share with a non-zero advantage somewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.masked import group_normalize, to_float32
from groupwise.registry import register
from groupwise.rollout.env import Played, play, score_returns
from groupwise.rollout.episodes import Episodes, transcripts
from groupwise.types import Rollout, StepInfo

CAUSES = ("policy_fail", "env_fail", "truncated", "success")


def cause_of(ep) -> str:
    """The termination cause of a played episode (see the module docstring)."""
    cause = ep.facts.get("cause", "") if isinstance(ep.facts, dict) else ""
    if cause in ("policy_fail", "env_fail", "success"):
        return cause
    return "truncated" if ep.cut else "policy_fail"


def govern_group(rewards: Tensor, causes: list[list[str]], min_valid: int = 2) -> tuple[Tensor, Tensor]:
    """(valid_mask [B,G] bool, group_keep [B] bool): env_fail rows out, groups with < min_valid valid rows out."""
    B, G = rewards.shape
    fail = torch.tensor([[c == "env_fail" for c in row] for row in causes], dtype=torch.bool).view(B, G)  # [B,G]
    valid = ~fail & torch.isfinite(rewards)  # [B,G]
    return valid, valid.sum(-1) >= min_valid  # [B,G], [B]


def grpo_advantage_masked(rewards: Tensor, valid_mask: Tensor, ddof: int = 0, eps: float = 0.0) -> Tensor:
    """adv [B,G] float32: GRPO's (r − mean) / std over the valid rows of each
    group (population std by default), 0 elsewhere."""
    valid = valid_mask.bool() & torch.isfinite(rewards)  # [B,G]
    adv = group_normalize(rewards.double().nan_to_num(0.0), valid, "group", ddof, eps)  # [B,G]
    return to_float32(torch.where(valid, adv, torch.zeros((), dtype=adv.dtype)))  # [B,G]


def _merge(first: Played, again: Played, replace: dict[tuple[int, int], object]) -> Played:
    """``first`` with the episodes of ``replace`` ((group, slot) -> episode of ``again``) swapped in."""
    shift = len(first.turns.group_valid)
    for ep in (ep for g in again.episodes for ep in g):
        ep.rows = [r + shift for r in ep.rows]
    episodes = [list(g) for g in first.episodes]
    for (b, e), ep in replace.items():
        episodes[b][e] = ep
    return Played(episodes, Rollout.concat([first.turns, again.turns]), first.gated)


@register("rollout", "governed_episodes")
@dataclass
class GovernedEpisodes(Episodes):
    """Trajectory-level episodes whose env-failed rollouts leave their group (failure-cause-aware governance, spec
    50)."""

    govern: bool = True
    max_resample: int = 0
    min_valid: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (isinstance(self.max_resample, int) and self.max_resample >= 0):
            raise ConfigError(f"rollout governed_episodes: max_resample must be an int >= 0, got {self.max_resample!r}")
        if not (isinstance(self.min_valid, int) and self.min_valid >= 1):
            raise ConfigError(
                "rollout governed_episodes: min_valid must be an int >= 1 (2: "
                f"a group needs two rollouts to compare), got {self.min_valid!r}"
            )

    def __call__(self, ctx) -> Rollout:
        n, kw = (
            ctx.group_size,
            dict(history=True, separator=self.separator, max_context=self.max_context, who=self._who),
        )
        keys = ctx.draw(ctx.batch_size)
        played = play(ctx, keys, n, self.max_turns, self.env, self.env_params, on_step=self.on_step, **kw)
        all_causes = [cause_of(ep) for g in played.episodes for ep in g]
        resampled = 0
        for r in range(self.max_resample if self.govern else 0):
            failed = [
                (b, e) for b, g in enumerate(played.episodes) for e, ep in enumerate(g) if cause_of(ep) == "env_fail"
            ]
            if not failed:
                break
            groups = sorted({b for b, _ in failed})
            need = max(sum(1 for b2, _ in failed if b2 == b) for b in groups)
            again = play(
                ctx,
                [keys[b] for b in groups],
                need,
                self.max_turns,
                self.env,
                self.env_params,
                index_base=n * (r + 1),
                **kw,
            )
            slots = {b: iter(again.episodes[i]) for i, b in enumerate(groups)}
            replace = {(b, e): next(slots[b]) for b, e in failed}
            all_causes += [cause_of(ep) for g in again.episodes for ep in g]
            resampled += len(replace)
            played = _merge(played, again, replace)
        batch, outcome = transcripts(played, self.separator, self.turn_facts)
        score_returns(ctx, batch, outcome, self._who)
        causes = [[cause_of(ep) for ep in g] for g in played.episodes]
        keep = ctx.keep(batch) & ~torch.tensor(played.gated, dtype=torch.bool)  # [B]
        dropped_rows = dropped_groups = 0
        if self.govern:
            valid, group_keep = govern_group(batch.rewards, causes, self.min_valid)  # [B,G], [B]
            dropped_rows = int((batch.group_valid & ~valid).sum())
            batch.group_valid = batch.group_valid & valid  # [B,G]
            dropped_groups = int((keep & ~group_keep).sum())
            keep = keep & group_keep
        solved = [len(ep.actions) for g in played.episodes for ep in g if cause_of(ep) == "success"]
        self._stats = {
            "episodes/env_steps": float(played.actions),
            "episodes/action_tokens": float(played.turns.mask.sum()),
            "episodes/gated_frac": sum(played.gated) / max(1, len(played.gated)),
            **{f"govern/cause_{c}": all_causes.count(c) / max(1, len(all_causes)) for c in CAUSES},
            "govern/dropped_rows": float(dropped_rows),
            "govern/dropped_groups": float(dropped_groups),
            "govern/resampled": float(resampled),
            "govern/steps_to_solve": sum(solved) / len(solved) if solved else float("nan"),
        }
        return batch if bool(keep.all()) else batch.select(keep.nonzero().flatten())

    def prepare(self, batch: Rollout, info: StepInfo) -> None:
        """After the advantages: how many negative advantages are spurious (env_fail), and whether the
        compile-only groups carry a signal (whole batch, identical on every rank)."""
        if batch.advantages is None or not batch.info:
            return
        adv = batch.advantages.float()  # [B,G] or [B,G,T]
        row_adv = adv if adv.dim() == 2 else (adv * batch.row_mask).sum(-1)  # [B,G]
        B, G = row_adv.shape
        fail = torch.tensor(
            [
                [isinstance(x, dict) and (x.get("env") or {}).get("cause") == "env_fail" for x in row[:G]]
                for row in batch.info
            ],
            dtype=torch.bool,
        ).view(B, G)  # [B,G]
        facts = [[(x.get("env") or {}) if isinstance(x, dict) else {} for x in row[:G]] for row in batch.info]
        neg = row_adv < 0  # [B,G]
        real = [
            [f for g, f in enumerate(facts[b]) if f and f.get("cause") != "env_fail" and bool(batch.group_valid[b, g])]
            for b in range(B)
        ]
        mid = [
            b
            for b in range(B)
            if real[b]
            and not any(f.get("semantic") for f in real[b])
            and 0 < sum(bool(f.get("compiled")) for f in real[b]) < len(real[b])
        ]
        self._stats.update(
            {
                "govern/spurious_neg_frac": float((neg & fail).sum()) / max(1, int(neg.sum())),
                "govern/mid_groups": float(len(mid)),
                "govern/mid_signal_frac": sum(bool((row_adv[b] != 0).any()) for b in mid) / len(mid)
                if mid
                else float("nan"),
            }
        )
