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

What text scorers log through TRL's hooks (``rewards/_hooks.py``): ``log_extra`` columns land per
row in ``rollout.info[b][g]["extra"][column]`` (``info`` is filled with one dict per row whenever
there are text scorers, so it concatenates and gathers like any list field); ``log_metric``
values are summed and counted over the step's scoring calls (refill rounds, a greedy baseline
too) and :meth:`RewardStage.pop_metrics` averages them over ranks as ``reward_metric/<name>``,
the prefix keeping them apart from the trainer's own keys.
"""

from __future__ import annotations

from typing import Any

import torch

from groupwise import dist
from groupwise.registry import build_spec
from groupwise.rewards._hooks import RewardLog, TrainerState, accepts
from groupwise.rewards.score import RewardAborted, combine, reward_label, score_parts, unique_labels
from groupwise.types import Need, Rollout, StepInfo


class RewardStage:
    def __init__(self, specs: list, policy: Any, decode: Any, max_new_tokens: int):
        self.scorers = [build_spec("reward", spec) for spec in specs]
        self.text = [s for s in self.scorers if not hasattr(s, "score_rollout")]
        self.tensor = [s for s in self.scorers if hasattr(s, "score_rollout")]
        self.policy, self.decode, self.max_new_tokens = (
            policy,
            decode,
            max_new_tokens,
        )  # decode(rollout) -> [B][G] texts
        self.counts: dict[str, int] = {}
        self.metrics: dict[str, list[float]] = {}  # log_metric name -> [sum, count] since the last pop_metrics

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
        columns = (
            {key: [m.get(key) for m in meta for _ in range(repeat)] for key in meta[0] if key != "prompt"}
            if meta
            else {}
        )
        columns.update(completion_lengths=lengths, truncated=truncated, max_new_tokens=self.max_new_tokens)
        return columns

    # ------------------------------------------------------------------ scoring
    def score_local(self, rollout: Rollout, info: StepInfo | None = None) -> None:
        """Decode this rank's rows and run the text scorers: ``completions``, ``reward_parts``. With
        ``info``, scorers that take it get ``trainer_state`` (``global_step = info.step``)."""
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
            ids = None
            # TRL's completion_ids: only built when a scorer takes it
            if any(accepts(s, "completion_ids") for s in self.text):
                ids = [rollout.actions[i // G, i % G][rollout.mask[i // G, i % G]].tolist() for i in rows.tolist()]
            log = RewardLog()
            scored, scored_failed, self.counts = score_parts(
                self.text,
                prompts,
                flat,
                columns,
                on_error=self.policy.on_error,
                timeout_s=self.policy.timeout_s or None,
                completion_ids=ids,
                trainer_state=TrainerState(info.step) if info is not None else None,
                log=log,
            )
            self._keep_log(rollout, rows.tolist(), log)
            # [B*G,K]
            parts = torch.full((B * G, scored.shape[1]), float("nan"), dtype=torch.float64).index_copy_(0, rows, scored)
            failed = failed.index_copy_(0, rows, scored_failed)  # [B*G]
            errors = sum(v for k, v in self.counts.items() if k.endswith("/error"))
            if errors > self.policy.max_error_rate * max(1, len(rows)):
                raise RuntimeError(
                    f"reward functions failed on {errors} of {len(rows)} samples this step "
                    f"(reward.max_error_rate={self.policy.max_error_rate}): {self.counts}"
                )
        rollout.reward_parts = parts.view(B, G, -1)  # [B,G,K_text] float64 until finish
        rollout.set_extra("reward_failed", failed.view(B, G), "row")

    def _keep_log(self, rollout: Rollout, rows: list[int], log: RewardLog) -> None:
        """``log_extra`` values into each scored row's ``info[b][g]["extra"]``; ``log_metric`` into the step's sums."""
        B, G, _ = rollout.shape
        if not rollout.info:
            rollout.info = [[{} for _ in range(G)] for _ in range(B)]
        for column, values in log.extra.items():
            for i, value in zip(rows, values):
                b, g = divmod(i, G)
                if rollout.info[b][g] is None:
                    rollout.info[b][g] = {}
                rollout.info[b][g].setdefault("extra", {})[column] = value
        for name, values in log.metrics.items():
            total = self.metrics.setdefault(name, [0.0, 0.0])
            total[0] += sum(values)
            total[1] += len(values)

    def pop_metrics(self) -> dict[str, float]:
        """``reward_metric/<name>``: the mean of every ``log_metric`` value since the last call, over
        all ranks (sum and count all-reduced; call it on every rank). Resets the sums."""
        if not self.text:  # the same on every rank: no text scorer, nothing logged, no collective
            return {}
        # every rank reduces the same names in the same order
        names = sorted(set(dist.all_gather_objects(list(self.metrics))))
        if not names:
            return {}
        # [M,2] sum, count
        local = torch.tensor([self.metrics.get(n, [0.0, 0.0]) for n in names], dtype=torch.float64).reshape(-1, 2)
        total = dist.all_reduce_sum(local)  # [M,2]
        self.metrics = {}
        return {
            f"reward_metric/{n}": float(total[m, 0] / total[m, 1]) if total[m, 1] else float("nan")
            for m, n in enumerate(names)
        }

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
        batch.set_extra(
            "reward_weights", torch.tensor(weights, dtype=torch.float32).expand(parts.shape[0], -1).clone(), "group"
        )  # [B,K]
        # real rows only: padding of ragged groups is not a lost sample
        self.excluded = int((excluded & batch.group_valid).sum())
        batch.group_valid = batch.group_valid & torch.isfinite(total)  # [B,G]
