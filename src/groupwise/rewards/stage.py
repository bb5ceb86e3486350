"""The reward stage: decode completions, run every scorer, apply the weights once.

Two kinds of scorer share one list (``rewards = [...]`` in the config), in order:

- **text scorers** (TRL's signature ``f(prompts, completions, **columns)``, one value per row) run on
  each rank's own rows, right after generation (:meth:`RewardStage.score_local`), where they are
  cheap to parallelise (the code sandbox, the math verifier);
- **rollout scorers** (``score_rollout(rollout, info) -> [B,G]``, e.g. ``kl_penalty``) run on the
  step's whole batch (:meth:`RewardStage.finish`) after the no-grad needs they declare.

Each contributes one column of ``rollout.reward_parts`` [B,G,K] (unweighted, NaN = no verdict), and
:func:`groupwise.rewards.score.combine` turns them into ``rollout.rewards`` in one place, so every
consumer (dynamic sampling's ``keep``, the estimator, the logged ``reward_mean``) sees the same total.
The weights travel as the group-level extra ``reward_weights`` [B,K] for estimators that combine the
parts themselves (normalise each reward, then sum).
"""

from __future__ import annotations

from typing import Any

import torch

from groupwise.registry import build_spec
from groupwise.rewards.score import RewardAborted, unique_labels, combine, reward_label, score_parts
from groupwise.types import Need, Rollout, StepInfo


class RewardStage:
    def __init__(self, specs: list, policy: Any, decode: Any, max_new_tokens: int):
        self.scorers = [build_spec("reward", spec) for spec in specs]
        self.text = [s for s in self.scorers if not hasattr(s, "score_rollout")]
        self.tensor = [s for s in self.scorers if hasattr(s, "score_rollout")]
        self.policy, self.decode, self.max_new_tokens = policy, decode, max_new_tokens  # decode(rollout) -> [B][G] texts
        self.counts: dict[str, int] = {}

    @property
    def labels(self) -> list[str]:
        """One name per column of ``reward_parts`` (text scorers, then rollout scorers), repeats told apart."""
        return unique_labels([reward_label(s) for s in self.text + self.tensor])

    @property
    def needs(self) -> list[Need]:
        return [n for s in self.scorers for n in getattr(s, "needs", ())]

    # ------------------------------------------------------------------ dataset columns
    def columns(self, meta: list[dict], repeat: int, lengths: list[int], truncated: list[bool]) -> dict[str, Any]:
        """Dataset columns repeated per completion, plus ``completion_lengths``, ``truncated``, ``max_new_tokens``."""
        columns = {key: [m.get(key) for m in meta for _ in range(repeat)] for key in meta[0] if key != "prompt"} if meta else {}
        columns.update(completion_lengths=lengths, truncated=truncated, max_new_tokens=self.max_new_tokens)
        return columns

    # ------------------------------------------------------------------ scoring
    def score_local(self, rollout: Rollout) -> None:
        """Decode this rank's rows and run the text scorers: ``completions``, ``reward_parts``."""
        B, G, T = rollout.shape
        lengths = rollout.mask.sum(-1)  # [B,G]
        rollout.completions = self.decode(rollout)  # [B][G]
        flat = [text for group in rollout.completions for text in group]
        failed = torch.zeros(B * G, dtype=torch.bool)  # [B*G]
        parts = torch.zeros(B * G, 0, dtype=torch.float64)  # [B*G,0]
        self.counts = {}
        if self.text:
            prompts = [m["prompt"] for m in rollout.meta for _ in range(G)]
            columns = self.columns(rollout.meta, G, lengths.flatten().tolist(), rollout.truncated.flatten().tolist())
            rows = rollout.group_valid.flatten().nonzero().flatten()  # [R] padding rows of ragged groups are not scored
            if len(rows) < B * G:
                keep = rows.tolist()
                prompts, flat = [prompts[i] for i in keep], [flat[i] for i in keep]
                columns = {k: ([v[i] for i in keep] if isinstance(v, list) else v) for k, v in columns.items()}
            scored, scored_failed, self.counts = score_parts(self.text, prompts, flat, columns, on_error=self.policy.on_error, timeout_s=self.policy.timeout_s or None)
            parts = torch.full((B * G, scored.shape[1]), float("nan"), dtype=torch.float64).index_copy_(0, rows, scored)  # [B*G,K]
            failed = failed.index_copy_(0, rows, scored_failed)  # [B*G]
            errors = sum(v for k, v in self.counts.items() if k.endswith("/error"))
            if errors > self.policy.max_error_rate * max(1, len(rows)):
                raise RuntimeError(f"reward functions failed on {errors} of {len(rows)} samples this step (reward.max_error_rate={self.policy.max_error_rate}): {self.counts}")
        rollout.reward_parts = parts.view(B, G, -1)  # [B,G,K_text] float64 until finish
        rollout.set_extra("reward_failed", failed.view(B, G), "row")

    def finish(self, batch: Rollout, info: StepInfo) -> None:
        """On the whole batch: the rollout scorers, then the weighted total (the one place weights apply)."""
        columns = [batch.reward_parts.double()]  # [B,G,K_text]
        for scorer in self.tensor:
            try:
                values = scorer.score_rollout(batch, info)  # [B,G]
            except (SystemExit, KeyboardInterrupt) as err:  # as for text scorers: never a silent exit
                raise RewardAborted.of(reward_label(scorer), err) from err
            columns.append(values.double()[..., None])  # [B,G,1]
        parts = torch.cat(columns, dim=-1)  # [B,G,K]
        weights = [float(getattr(s, "weight", 1.0)) for s in self.text + self.tensor]
        total, excluded = combine(parts, weights, batch.extras.pop("reward_failed"), self.policy.missing)  # [B,G]
        batch.extra_levels.pop("reward_failed", None)
        batch.rewards = total  # [B,G] float32, NaN where excluded
        batch.reward_parts = parts.float()  # [B,G,K] in the order text scorers, rollout scorers
        batch.set_extra("reward_weights", torch.tensor(weights, dtype=torch.float32).expand(parts.shape[0], -1).clone(), "group")  # [B,K]
        self.excluded = int((excluded & batch.group_valid).sum())  # real rows only: padding of ragged groups is not a lost sample
        batch.group_valid = batch.group_valid & torch.isfinite(total)  # [B,G]
