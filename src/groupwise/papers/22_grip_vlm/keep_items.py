"""Keep-items: context-item pruning for a frozen, hand-coded reader — the small analogue of GRIP-VLM's
visual-token pruning (spec 22, arXiv 2605.13375; the toy is the spec's "small-scale analogue").

A row holds N = 16 context items and a query. Each item carries a key (one of 16, a permutation per
row); the query asks for one key (``single``) or two keys jointly (``pair``). The policy (kind
``subset``) keeps k = ceil(ρ·N) items. The frozen reader answers correctly iff every key the query
asks for is among the kept items, so a pair query is answered only when both of its items are kept:
each alone is worth nothing. That is the combinatorial case the paper says RL fixes and a
single-item saliency teacher cannot see.

- Task ``keep_items``: train rows with ρ ∈ {0.125, 0.25} (k = 2, 4), half single and half pair
  queries; the test split adds the unseen budget ρ = 0.1875 (k = 3: ρ = 0.2 of the design would give
  ceil(3.2) = 4 picks, the 0.25 budget's k). Columns: ``prompt`` (the subset encoding), ``teacher_scores``
  (the leave-one-in saliency), ``query_kind``, ``budget`` and ``cell`` = ``KIND@BUDGET`` (for ``eval.by``).
- Task ``keep_items_pairs``: the same train rows, held out on the pair queries alone (192 rows), so a
  run's held-out accuracy (``final_accuracy``) is the pair-query accuracy the claim reads.
- Reward ``keep_items``: the reader, 1.0 when the kept items hold every asked key, else 0.0. It reads the
  items and the query from the row's own encoded prompt and the kept set from the row extra ``keep``.
- The warm-up teacher, ``leave_one_in``: t_j = the reader's reward when item j alone is kept. It is 1 on
  a single query's item and 0 everywhere for a pair query (a flat ListNet target: the spec's point).

**Change vs GRPO**: none in the loop; a task, its frozen reader and the warm-up teacher.

**Math** (key one-hots e_c, c ∈ 0..15; d = 17: 16 key slots and a pair flag)::

    v_j = [e_{key_j} ; 0]       q_single(a) = [e_a ; 0]       q_pair(a, b) = [e_a + e_b ; 1]
    reader(keep, q) = 1 if {c : q_c = 1, c < 16} ⊆ {key_j : j kept} else 0
    t_j = reader({j}, q)        (leave-one-in saliency)

**Defaults** (all [INFERRED]: the toy is the spec's suggestion, the numbers ours)

- N = 16 items, 16 keys, budgets {0.125, 0.25} (train) and 0.1875 (held out), half pair queries,
  2000 train and 384 test rows (128 per budget).

**Notes**

1. Chance for a pair query under a uniform keep-set of k items: C(14, k−2)/C(16, k) = 1/120 (k = 2),
   1/40 (k = 3), 1/20 (k = 4); a single query: k/16.
2. Rows are generated from one ``random.Random`` stream per split (seed 0 for test, the run seed for
   train), so the held-out rows are the same for every run.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.tasks import Task, register_task
from groupwise.types import Rollout, StepInfo

N_ITEMS = 16
N_KEYS = 16
D = N_KEYS + 1  # 16 key slots and the pair flag
TRAIN_BUDGETS = (0.125, 0.25)
TEST_BUDGETS = (0.125, 0.1875, 0.25)
TRAIN_SIZE, TEST_PER_BUDGET = 2000, 128


def _onehot(keys: list[int]) -> list[float]:
    out = [0.0] * N_KEYS
    for c in keys:
        out[c] = 1.0
    return out


def make_row(rng: random.Random, rho: float, kind: str) -> dict:
    """One row: a key permutation over the items, a query of ``kind`` (single | pair), budget ``rho``."""
    keys = list(range(N_KEYS))
    rng.shuffle(keys)  # item j has key keys[j]
    asked = rng.sample(range(N_KEYS), 1 if kind == "single" else 2)
    items = [v for c in keys[:N_ITEMS] for v in [*_onehot([c]), 0.0]]  # [N*D]
    query = [*_onehot(asked), 1.0 if kind == "pair" else 0.0]  # [D]
    prompt = [float(N_ITEMS), float(D), rho, *items, *query]
    return {
        "prompt": prompt,
        "teacher_scores": leave_one_in(prompt),
        "query_kind": kind,
        "budget": rho,
        "cell": f"{kind}@{rho}",
    }


def _parse(prompt: list) -> tuple[Tensor, Tensor]:
    """Items' keys as one-hots [N,16] and the asked keys [16] (0/1) from an encoded prompt."""
    n, d = int(prompt[0]), int(prompt[1])
    if d != D:
        raise ValueError(f"keep_items: a prompt of this task has d = {D} numbers per item, got d = {d}")
    x = torch.tensor(prompt[3:], dtype=torch.float32)
    return x[: n * d].view(n, d)[:, :N_KEYS], x[n * d : n * d + N_KEYS]  # [N,16], [16]


def read(prompt: list, keep: Tensor) -> Tensor:
    """The frozen reader: [...] 1.0 where the kept items (``keep`` [..., N] 0/1) hold every asked key."""
    items, asked = _parse(prompt)  # [N,16], [16]
    present = (keep.float() @ items).clamp(max=1.0)  # [...,16] keys among the kept items
    return ((present * asked).sum(-1) >= asked.sum() - 0.5).float()  # [...]


def leave_one_in(prompt: list) -> list[float]:
    """t_j = the reader's reward with item j alone kept (the warm-up teacher)."""
    n = int(prompt[0])
    return read(prompt, torch.eye(n)).tolist()  # [N]


def rows(split: str, n: int = 0, seed: int = 0, kinds: tuple[str, ...] = ("single", "pair")) -> list[dict]:
    """Train rows (budgets 0.125 / 0.25, ``seed``'s stream) or the fixed test rows (three budgets) whose
    query kind is in ``kinds``."""
    if split == "test":
        rng = random.Random(0)
        out = [make_row(rng, rho, kind) for rho in TEST_BUDGETS for kind in ("single", "pair") * (TEST_PER_BUDGET // 2)]
        random.Random(1).shuffle(out)  # the first eval.size rows mix budgets and kinds
        out = [r for r in out if r["query_kind"] in kinds]
    elif split == "train":
        rng = random.Random(1000 + seed)
        out = [make_row(rng, rng.choice(TRAIN_BUDGETS), rng.choice(("single", "pair"))) for _ in range(TRAIN_SIZE)]
    else:
        raise ValueError(f"keep_items has splits 'train' and 'test', not {split!r}")
    return out[:n] if n > 0 else out


def chance(k: int, kind: str) -> float:
    """A uniform keep-set's success probability (Note 1)."""
    return k / N_ITEMS if kind == "single" else math.comb(N_ITEMS - 2, k - 2) / math.comb(N_ITEMS, k)


@register("reward", "keep_items")
@dataclass
class KeepItemsReader:
    """1.0 when the kept items hold every key the query asks for, else 0.0 (the frozen reader of spec 22's toy)."""

    weight: float = 1.0

    needs = ()
    reads_extras = ("keep",)  # the subset policy's kept items

    def score_rollout(self, rollout: Rollout, info: StepInfo) -> Tensor:
        if "keep" not in rollout.extras:
            raise ValueError("reward keep_items reads the row extra `keep` of a subset policy (model.policy='subset')")
        contexts = rollout.row_contexts()
        keep = rollout.extras["keep"]  # [B,G,N]
        reward = torch.stack(
            [torch.stack([read(c, keep[b, g]) for g, c in enumerate(row)]) for b, row in enumerate(contexts)]
        )  # [B,G]
        return torch.where(rollout.group_valid.bool(), reward, torch.zeros(()))  # [B,G]


register_task(Task("keep_items", "keep the items a frozen reader needs (spec 22's toy)", rows, "keep_items"))
register_task(
    Task(
        "keep_items_pairs",
        "keep_items held out on its pair queries alone",
        lambda split, n=0, seed=0: rows(split, n, seed, ("pair",) if split == "test" else ("single", "pair")),
        "keep_items",
    )
)
