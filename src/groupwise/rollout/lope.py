"""LoPE: when every rollout of a prompt fails, sample it again under Lorem-Ipsum-prefixed prompts and
swap the successes into its group, trained under the original prompt.

"Nonsense Helps: Prompt Space Perturbation Broadens Reasoning Exploration", Langlin Huang, Chengsong
Huang, Jinyuan Li, Donghong Cai, Yuyi Yang, Jiaxin Huang, 2026. https://arxiv.org/abs/2605.05566 —
spec 61. Code read: https://github.com/shrango/LoPE (EasyR1-based: the fallback / regroup stage of
``verl/trainer/ray_trainer.py``, the prompt construction of ``verl/utils/dataset.py``, the defaults
of ``verl/trainer/config.py``).

**Change vs GRPO**: a GRPO group whose G rollouts all fail has zero advantage everywhere. Here each
such prompt is sampled again: ``num_perturbation`` perturbed prompts (a random run of Lorem words
before the question), ``n_per`` rollouts each (G' = ``num_perturbation · n_per``). Correct
resamples replace failed rows of the group (at least one original failure is kept), and are trained
as if sampled under the **original** prompt; each carries the row flag ``injected`` and its
perturbed prompt as its behaviour context (``Rollout.behav_ctx``), so that the objective term
``lope`` gives it the shaped, unclipped ratio ρ/(ρ+γ) against that context, and every rescued
group carries the rewards of those of its G + G' samples that are not its rows (a group extra) for the advantage
estimator ``lope`` (mean/std over the full G + G' reward vector). The strategy works with any
estimator and objective; without those two components the swapped rows are ordinary GRPO rows.

**Math** (``B = rollout.prompts_per_step``, ``G = rollout.group_size``, ``P = num_perturbation``)::

    first  = ctx.rollout([Request(i, n=G) for i in ids])                        scored
    fail_b = group b has a valid row and none with reward > correct_above       (prompt_all_wrong)
    δ_bj   = lorem_words(n_min, n_max, Random(sample_seed(seed, step, i_b, LOREM_STREAM + j)))
    x'_bj  = lorem_prompt(x_b, δ_bj, tail, separator)                           j < P
    res    = ctx.rollout([Request(i_b, n=n_per, offset=G + j·n_per, prompt=encode(x'_bj))])   scored vs b's answer
    C_b    = [k : resample k = j·n_per + r of b is valid with reward > correct_above]
    slots, chosen = lope_regroup(first.rewards[b], C_b, Random(sample_seed(seed, step, i_b, REGROUP_STREAM)))
    row (b, slots[m]) := resample chosen[m];  injected[b, slots[m]] = True;  trained under x_b, behav_ctx = x'_bj
    lope_extra_rewards[b] = rewards of the replaced originals ++ rewards of the resamples not chosen   [G'], NaN-padded
                            (so group b's rows ∪ its extra rewards = its G first rewards ∪ its G' resample rewards)

``lope_regroup`` (the code's rule, with n = the group's valid rows):
``|C| >= n`` → ``chosen = rng.sample(C, n − 1)`` (keep one original failure); else ``chosen = C``;
``slots`` = the first ``len(chosen)`` valid slots.

**Defaults**

- ``num_perturbation = 6``, ``n_per = 4`` [CODE] ``data.num_perturbation``,
  ``data.rollout_n_per_perturbation`` (G' = 24 for the paper's G = 8).
- ``n_min = 100``, ``n_max = 300`` [CODE] ``lorem.get_word(count=(100, 300))``: the word count is
  uniform in [n_min, n_max]; each word is drawn uniformly, with replacement, from the vocabulary
  [INFERRED] (python-lorem's sampler was not read).
- ``vocabulary = ""`` [INFERRED] the shipped ``rollout/data/lorem_words.txt``: 200 Latin and lorem-ipsum
  words written for this library (the paper uses python-lorem's list); a path to a file of words
  (one a line, ``#`` comments) replaces it.
- ``tail = TAIL`` ("Please reason step by step, and put your final answer within \\boxed{}.") and
  ``separator = "\\n"`` [CODE] the perturbed system message is ``lorem + "\\n" + tail``.
- ``correct_above = 0.0`` [CODE] a row is correct when its score is > 0 (``prompt_all_wrong = not any(r > 0)``).
- ``resample_temperature = None`` [CODE] optional ``resample_temperature``, off: the rollout temperature.
- ``fit = "truncate"`` [INFERRED] a perturbed prompt that does not fit the model's context with
  ``rollout.max_new_tokens`` keeps the longest run of its Lorem words that fits (``"error"``: fail,
  naming the row); the paper's 2048-token prompts always hold 300 words.

**Notes**

1. Regroup: the code replaces the *first* k slots and picks the resamples at random when at least G
   are correct; the spec's "randomly chosen original slots" is the same thing in distribution,
   since every original row of a failing group is a failure.
2. Old log-probs, as ``fbos``'s EPA groups: a swapped row is trained under the original prompt
   (``Rollout.under_prompts``), so the trainer's ``logp_old`` is re-scored under it; its perturbed
   prompt stays in ``behav_ctx``, and ``logp_sampler`` keeps the sampler's log-probs under it,
   π_old(o | δ ⊕ x), the behaviour probability of the paper's ratio, which the objective term
   ``lope`` reads for ``injected`` rows (or re-scores: its ``behaviour = "view"``).
3. Prompts: a text prompt becomes ``separator.join([lorem, tail, prompt])`` (empty parts left
   out); a chat prompt gets the system message ``lorem + separator + tail`` (an existing system
   message's content takes the tail's place). ``n_min = n_max = 0`` with ``tail = ""`` resamples
   the original prompt: the paper's naive-resampling control. ``data.system_prompt`` is not added.
4. Randomness: the words of perturbation j of row i depend only on (seed, step, i, j), the choice
   of resamples only on (seed, step, i); every rank computes the same batch.
5. A resample whose reward was excluded (NaN) is never chosen and leaves its extra entry NaN. The
   flag and the extra are set every step (``injected`` all False and the extra all NaN when no
   group failed), so batches always carry the same fields.
6. ``step_stats``: ``lope/all_wrong_frac`` (share of prompts resampled), ``lope/rescued_frac`` (share
   with at least one swapped row), ``lope/resample_acc`` (share of correct resamples; NaN when
   none was drawn). The sampler's ``keep`` runs once on the regrouped batch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rollout.context import RolloutContext
from groupwise.seeds import sample_seed
from groupwise.types import INJECTED, Request, Rollout

TAIL = "Please reason step by step, and put your final answer within \\boxed{}."
WORDS_FILE = Path(__file__).with_name("data") / "lorem_words.txt"
LOREM_STREAM = 1 << 43  # seeds of the Lorem words, apart from the sample indices of the rows
REGROUP_STREAM = 1 << 44  # seed of the random choice of resamples
EXTRA = "lope_extra_rewards"  # group extra [B,G'] float32: the rewards joining the group's statistics


@cache
def load_words(path: str = "") -> tuple[str, ...]:
    """The vocabulary: the shipped list, or the words of ``path`` (one a line, ``#`` starts a comment)."""
    source = Path(path) if path else WORDS_FILE
    if not source.is_file():
        raise ConfigError(
            f"rollout lope: vocabulary file {str(source)!r} does not exist; "
            'give a file of words, one a line (or "" for the shipped list)'
        )
    words = tuple(w.strip() for w in source.read_text().splitlines() if w.strip() and not w.strip().startswith("#"))
    if not words:
        raise ConfigError(f"rollout lope: vocabulary file {str(source)!r} holds no words")
    return words


def lorem_words(n_min: int, n_max: int, rng: random.Random, words: Sequence[str] | None = None) -> list[str]:
    """A uniform count in [n_min, n_max] of words drawn uniformly (with replacement) from ``words``."""
    words = words or load_words()
    return [rng.choice(words) for _ in range(rng.randint(n_min, n_max))]


def lorem_prompt(prompt: Any, words: Sequence[str], tail: str = TAIL, separator: str = "\n") -> Any:
    """The perturbed prompt: Lorem words (and the tail) before a text prompt, or as a chat prompt's system message."""
    lorem = " ".join(words)
    if isinstance(prompt, list):
        rest = prompt
        if prompt and prompt[0].get("role") == "system":
            tail, rest = prompt[0]["content"], prompt[1:]
        system = separator.join(p for p in (lorem, tail) if p)
        return [{"role": "system", "content": system}, *rest] if system else list(rest)
    return separator.join(p for p in (lorem, tail, prompt) if p)


def make_lorem_prompt(
    prompt: Any,
    rng: random.Random,
    n_min: int = 100,
    n_max: int = 300,
    tail: str = TAIL,
    separator: str = "\n",
    words: Sequence[str] | None = None,
) -> Any:
    """``lorem_prompt`` with freshly drawn words (spec 61's interface)."""
    return lorem_prompt(prompt, lorem_words(n_min, n_max, rng, words), tail, separator)


def lope_regroup(
    base_rewards: Sequence[float], correct: Sequence[int], rng: random.Random
) -> tuple[list[int], list[int]]:
    """(slots, chosen): which of the group's slots take which correct resamples (see the module Math).
    ``base_rewards`` [G] marks the valid slots (finite); ``correct`` lists the correct resamples."""
    slots = [g for g, r in enumerate(base_rewards) if math.isfinite(float(r))]
    n = len(slots)
    if n == 0 or not correct:
        return [], []
    chosen = rng.sample(list(correct), n - 1) if len(correct) >= n else list(correct)
    return slots[: len(chosen)], chosen


@register("rollout", "lope")
@dataclass
class LoPE:
    """All-wrong prompts are resampled under Lorem-prefixed prompts; correct resamples join the group under the original
    prompt (LoPE)."""

    num_perturbation: int = 6
    n_per: int = 4
    n_min: int = 100
    n_max: int = 300
    vocabulary: str = ""
    tail: str = TAIL
    separator: str = "\n"
    correct_above: float = 0.0
    resample_temperature: float | None = None
    fit: str = "truncate"

    collects = (EXTRA,)

    def __post_init__(self) -> None:
        if self.num_perturbation < 1 or self.n_per < 1:
            raise ConfigError(
                f"rollout lope: num_perturbation={self.num_perturbation} and n_per={self.n_per} must be >= 1"
            )
        if not 0 <= self.n_min <= self.n_max:
            raise ConfigError(f"rollout lope: need 0 <= n_min <= n_max, got n_min={self.n_min}, n_max={self.n_max}")
        if self.fit not in ("truncate", "error"):
            raise ConfigError(f"rollout lope: fit={self.fit!r} must be 'truncate' or 'error'")
        if self.resample_temperature is not None and not self.resample_temperature > 0:
            raise ConfigError(
                f"rollout lope: resample_temperature={self.resample_temperature} "
                "must be > 0 (or None: the rollout temperature)"
            )
        self.words = load_words(self.vocabulary)
        self._stats: dict[str, float] = {}

    @property
    def request_options(self) -> tuple[str, ...]:
        return ("temperature",) if self.resample_temperature is not None else ()

    def __call__(self, ctx: RolloutContext) -> Rollout:
        B, G, P = ctx.batch_size, ctx.group_size, self.num_perturbation
        info = ctx.info(0)
        ids = ctx.draw(B)
        first = ctx.rollout([Request(key=i, n=G) for i in ids])
        valid = first.group_valid & torch.isfinite(first.rewards)  # [B,G]
        failing = [
            b
            for b in range(len(ids))
            if bool(valid[b].any()) and not bool((valid[b] & (first.rewards[b] > self.correct_above)).any())
        ]
        sampling = None if self.resample_temperature is None else {"temperature": self.resample_temperature}
        requests = [
            Request(
                key=ids[b],
                n=self.n_per,
                offset=G + j * self.n_per,
                prompt=self._perturbed(ctx, first.meta[b]["prompt"], ids[b], j, info),
                sampling=sampling,
            )
            for b in failing
            for j in range(P)
        ]
        injected = torch.zeros(len(ids), G, dtype=torch.bool)  # [B,G]
        extra = torch.full((len(ids), P * self.n_per), float("nan"))  # [B,G']
        batch, rescued, resample_acc = first, 0, float("nan")
        if requests:
            res = ctx.rollout(requests)  # [F·P, n_per, T]
            res_ok = res.group_valid & torch.isfinite(res.rewards)  # [F·P, n_per]
            hits = res_ok & (res.rewards > self.correct_above)  # [F·P, n_per]
            resample_acc = float(hits.sum() / res_ok.sum().clamp(min=1)) if bool(res_ok.any()) else float("nan")
            both = Rollout.concat([first, res])  # groups 0..B−1 first, then the resample requests
            rows = [[(b, g) for g in range(G)] for b in range(len(ids))]
            for f, b in enumerate(failing):
                # resample k = j·n_per + r
                flat = [(len(ids) + f * P + j, r) for j in range(P) for r in range(self.n_per)]
                scores = res.rewards[f * P : (f + 1) * P].reshape(-1)  # [G']
                correct = [k for k, (q, r) in enumerate(flat) if bool(hits[q - len(ids), r])]
                rng = random.Random(sample_seed(info.seed, info.step, ids[b], REGROUP_STREAM))
                base = torch.where(valid[b], first.rewards[b], torch.full((), float("nan"))).tolist()  # [G]
                slots, chosen = lope_regroup(base, correct, rng)
                for s, k in zip(slots, chosen):
                    rows[b][s] = flat[k]
                    injected[b, s] = True
                taken = set(chosen)
                pool = [float(first.rewards[b, s]) for s in slots] + [
                    float(scores[k]) for k in range(len(flat)) if k not in taken
                ]
                extra[b, : len(pool)] = torch.tensor(pool)
                rescued += bool(slots)
            batch = both.regroup(rows)
            batch.ctx = batch.row_contexts()  # the prompt each row was sampled under
            batch.prompt_ids, batch.prompt_index, batch.meta = (
                list(first.prompt_ids),
                first.prompt_index.clone(),
                list(first.meta),
            )
            batch.extras.update({k: v for k, v in first.extras.items() if first.extra_levels[k] == "group"})
            # every row trained and scored under its original prompt, sampled under behav_ctx (note 2)
            batch = batch.under_prompts()
        batch.set_flag(INJECTED, injected)
        batch.set_extra(EXTRA, extra, "group")
        self._stats = {
            "lope/all_wrong_frac": len(failing) / max(1, len(ids)),
            "lope/rescued_frac": rescued / max(1, len(ids)),
            "lope/resample_acc": resample_acc,
        }
        keep = ctx.keep(batch)  # [B] bool
        return batch if bool(keep.all()) else batch.select(keep.nonzero().flatten())

    def _perturbed(self, ctx: RolloutContext, prompt: Any, key: int, j: int, info: Any) -> list[int]:
        """Token ids of perturbation ``j`` of row ``key``: its drawn words, cut to fit the context (``fit``)."""
        words = lorem_words(
            self.n_min, self.n_max, random.Random(sample_seed(info.seed, info.step, key, LOREM_STREAM + j)), self.words
        )
        encode = ctx.policy.encode
        limit = getattr(ctx.policy, "context", None)
        budget = ctx.sampling["max_new_tokens"]
        ids = encode(lorem_prompt(prompt, words, self.tail, self.separator))
        if self.fit == "error" or not limit or len(ids) + budget <= limit:
            return ids  # the context's own check names a prompt that is too long
        lo, hi = 0, len(words)  # the longest prefix of the words that fits: fits(lo), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (
                (mid, hi)
                if len(encode(lorem_prompt(prompt, words[:mid], self.tail, self.separator))) + budget <= limit
                else (lo, mid)
            )
        return encode(lorem_prompt(prompt, words[:lo], self.tail, self.separator))

    def step_stats(self) -> dict[str, float]:
        return dict(self._stats)
