"""Order-permutation groups: each group is one question asked under G orders of its input elements.

"Towards Order Fairness: Mitigating LLMs Order Sensitivity through Dual Group Advantage
Optimization", Wang, Mo, Li, Chen, Chu, Tan, Li, 2026. https://arxiv.org/abs/2605.11974 — authors'
code github.com/Hyalinesky/DGAO (``train.py``: a group = one question's ``prompt_variants``, one
completion per variant; ``eval.py``: Consistency and Overconfidence Rates). Any advantage can use
these groups (GRPO per permutation is the paper's baseline); DGAO's own is ``advantages/dgao.py``.

**Change vs GRPO**: GRPO samples G completions of one prompt. Here row ``o`` of a group is sampled
(and trained and scored) under its own context — the question with its input elements (documents,
demonstrations, facts) in the o-th of G different orders — so a group compares a question's
answers across orders.

**Math** (per drawn dataset row ``i`` with ``elements`` e_1..e_n and a ``template``)::

    perms_i   = num_orders distinct permutations of 1..n, drawn from (seed, step, i)   (all n! first
                when n! < num_orders, then repeated)
    prompt_io = template with e_{perm_io(1)} sep … sep e_{perm_io(n)} in its "{elements}" slot
    rows      = ctx.rollout([Request(i, n=rows_per_order, offset=o·rows_per_order, prompt=prompt_io)])
    group i   = its num_orders · rows_per_order rows, each under its own prompt_io (Rollout.ctx)

Metrics (``a_io`` = normalised answer = completion.lower().strip(), ``gold_i`` the answer column)::

    consistency    = mean_i  max_a #{o : a_io = a} / O
    overconfidence = mean_i  (max_a #{o : a_io = a} / O  if the most common a ≠ gold_i  else 0)

**Defaults**

- ``num_orders = 0`` → ``rollout.group_size`` [CODE] ``num_orders = 8``; ``rows_per_order = 1``
  [CODE] one completion per variant. A group has ``num_orders · rows_per_order`` rows (two
  operands have two orders: the recipe asks 2 orders × 4 rows).
- ``include_original = False`` [INFERRED] the released data ships fixed variants; here every
  order is drawn, the shown one included only when asked.
- ``elements_column = "elements"``, ``template_column = "template"``, ``sep = " "`` [INFERRED]
  (``papers/31_dgao/addition_orders.py`` carries the columns; its recipe sets ``sep = "+"``).
- ``greedy_probe = False`` [INFERRED] a measurement, not the paper's training: when on, every
  (question, order) is also answered greedily (not trained on) and its metrics logged.

**Notes**

1. The groups follow the sampler's ``keep``; there are no refill rounds.
2. Permutations depend only on (seed, step, dataset row), not on the rank or batch, so a resumed
   run draws the same orders.
3. ``step_stats``: ``dgao/accuracy``, ``dgao/consistency``, ``dgao/overconfidence`` over the sampled
   rows (a row is right when its total reward ≥ ``solved_at``), and ``dgao/greedy_*`` from the probe.
4. A row without the columns, or with a template lacking ``{elements}``, is an error naming them.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rollout.context import RolloutContext
from groupwise.types import Request, Rollout

SLOT = "{elements}"


def render(template: str, elements: Sequence[str], sep: str = " ") -> str:
    """The prompt with the elements, in the given order, joined by ``sep`` in the template's slot."""
    return template.replace(SLOT, sep.join(elements))


def order_permutations(
    n: int, num_orders: int, rng: random.Random, include_original: bool = False
) -> list[tuple[int, ...]]:
    """``num_orders`` permutations of range(n), distinct while n! allows (then all of them, repeated)."""
    ident = tuple(range(n))
    if math.factorial(n) <= num_orders + include_original:
        pool = list(itertools.permutations(range(n)))
        rng.shuffle(pool)
        if include_original:
            pool.remove(ident)
            pool.insert(0, ident)
        return [pool[o % len(pool)] for o in range(num_orders)]
    seen, out = ({ident}, [ident]) if include_original else (set(), [])
    while len(out) < num_orders:
        perm = tuple(rng.sample(range(n), n))
        if perm not in seen:
            seen.add(perm)
            out.append(perm)
    return out


def make_order_variants(
    elements: Sequence[str], template: str, num_orders: int, seed: Any, include_original: bool = False, sep: str = " "
) -> list[str]:
    """The spec's interface: ``num_orders`` prompts of one question, its elements in different orders."""
    perms = order_permutations(len(elements), num_orders, random.Random(seed), include_original)
    return [render(template, [elements[i] for i in perm], sep) for perm in perms]


def normalize(answer: str) -> str:
    return str(answer).lower().strip()


def _most_common(answers: Sequence[str]) -> tuple[str, int]:
    """The most frequent answer (the first seen among ties, as Counter.most_common) and its count."""
    return Counter(answers).most_common(1)[0]


def consistency_rate(answers: Sequence[Sequence[str]]) -> float:
    """mean over questions of (count of the most common normalised answer / #orders)."""
    groups = [[normalize(a) for a in q] for q in answers if q]
    return sum(_most_common(q)[1] / len(q) for q in groups) / len(groups) if groups else float("nan")


def overconfidence_rate(answers: Sequence[Sequence[str]], gold: Sequence[str]) -> float:
    """mean over questions of (most-common share if the most common answer is wrong, else 0)."""
    scores = []
    for q, g in zip(answers, gold, strict=True):
        if q:
            top, count = _most_common([normalize(a) for a in q])
            scores.append(count / len(q) if top != normalize(g) else 0.0)
    return sum(scores) / len(scores) if scores else float("nan")


@register("rollout", "dgao")
@dataclass
class DGAOOrders:
    """Each group = one question under G orders of its input elements, one row per order (DGAO, Wang et al. 2026)."""

    num_orders: int = 0  # 0: rollout.group_size
    rows_per_order: int = 1
    include_original: bool = False
    elements_column: str = "elements"
    template_column: str = "template"
    sep: str = " "
    answer_column: str = "answer"
    solved_at: float = 1.0
    greedy_probe: bool = False
    _stats: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_orders < 0 or self.rows_per_order < 1:
            raise ConfigError(
                f"rollout dgao: num_orders={self.num_orders} must be >= 0 (0 = "
                f"rollout.group_size) and rows_per_order={self.rows_per_order} >= 1"
            )

    @property
    def request_options(self) -> tuple[str, ...]:
        return ("greedy",) if self.greedy_probe else ()

    def _variants(self, ctx: RolloutContext, key: int, num_orders: int) -> list[str]:
        meta = ctx.meta(key)
        elements, template = meta.get(self.elements_column), meta.get(self.template_column)
        if not isinstance(elements, (list, tuple)) or not isinstance(template, str) or SLOT not in template:
            raise ConfigError(
                f"rollout dgao needs rows with a list column {self.elements_column!r} "
                f"and a text column {self.template_column!r} "
                f'holding {SLOT!r}; row {key} has {sorted(meta)} (e.g. data.task="addition_orders")'
            )
        info = ctx.info(0)
        return make_order_variants(
            [str(e) for e in elements],
            template,
            num_orders,
            f"dgao:{info.seed}:{info.step}:{key}",
            self.include_original,
            self.sep,
        )

    def __call__(self, ctx: RolloutContext) -> Rollout:
        O, n = self.num_orders or ctx.group_size, self.rows_per_order
        ids = ctx.draw(ctx.batch_size)
        variants = [self._variants(ctx, key, O) for key in ids]
        encoded = [[ctx.policy.encode(text) for text in vs] for vs in variants]
        batch = ctx.rollout([Request(key, n, o * n, encoded[b][o]) for b, key in enumerate(ids) for o in range(O)])
        # [B, O·n]
        grouped = batch.regroup([[(b * O + o, j) for o in range(O) for j in range(n)] for b in range(len(ids))])
        self._stats = self._metrics(grouped, "dgao/")
        if self.greedy_probe:
            probe = ctx.rollout(
                [
                    Request(key, 1, O * n + o, encoded[b][o], {"greedy": True})
                    for b, key in enumerate(ids)
                    for o in range(O)
                ]
            )
            self._stats.update(
                self._metrics(
                    probe.regroup([[(b * O + o, 0) for o in range(O)] for b in range(len(ids))]), "dgao/greedy_"
                )
            )
        keep = ctx.keep(grouped)  # [B] bool
        return grouped if bool(keep.all()) else grouped.select(keep.nonzero().flatten())

    def _metrics(self, batch: Rollout, prefix: str) -> dict[str, float]:
        valid = batch.group_valid.tolist()
        answers = [[batch.completions[b][g] for g, ok in enumerate(row) if ok] for b, row in enumerate(valid)]
        gold = [str(m.get(self.answer_column, "")) for m in batch.meta]
        right = (batch.rewards >= self.solved_at) & batch.group_valid  # [B,G]
        return {
            f"{prefix}accuracy": float(right.sum()) / max(1, int(batch.group_valid.sum())),
            f"{prefix}consistency": consistency_rate(answers),
            f"{prefix}overconfidence": overconfidence_rate(answers, gold),
        }

    def step_stats(self) -> dict[str, float]:
        return dict(self._stats)
