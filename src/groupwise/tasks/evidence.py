"""Evidence QA: read two facts from a short passage, quote them, add them, answer.

The text analogue of SRPO's perception-then-reasoning responses (specs/51): the passage is the
"image", quoting the facts is perception, the sum is reasoning. A passage gives the four letters
``a b c d`` a digit each, in a shuffled order; the question asks for the sum of two of them::

    prompt:    c=5 a=3 d=1 b=7\\na+d?
    reference: <p>a=3 d=1</p><r>3+1</r><a>4</a>

The reference (what an ``sft`` phase teaches, column ``answer``) quotes the asked facts in the
question's order inside ``<p>…</p>``, writes the sum inside ``<r>…</r>`` and the result inside
``<a>…</a>``. Rows: ``{"prompt", "answer", "value", "passage", "question", "shortcut"}`` —
``value`` is the gold result (``"4"``), ``passage`` the passage as it appears in the prompt (the
``corrupt_context`` view swaps it for another row's), ``shortcut`` marks the rows whose two asked
facts hold their letter's usual value (below). The default reward is ``exact`` on the text inside
``<a>…</a>`` against ``value``.

**Change vs GRPO**: none; a verifiable task.

**Defaults** (all [INFERRED], sized for the embedded model's 128-token context: ~19 prompt tokens,
a 33-token reference)

- Letters ``abcd``, every one in every passage (so another row's passage states the asked facts
  too, with other values); values ``1..9``; the question is an ordered pair of distinct letters.
- Short tags ``<p> <r> <a>`` (the spec's ``<perception>`` ``<reasoning>`` ``<answer>`` cost 59
  tokens of the 128).
- Shortcut (the spec's "distractor questions answerable from a prior"): with probability
  ``PRIOR_RATE = 0.3`` a row's two asked facts take their letter's usual value (``USUAL``: a=1 b=2
  c=3 d=4), so a model that ignores the passage can still answer those rows; corrupting the
  passage (``eval.views = ["corrupt_context"]``) separates reading from guessing.
- ``TEST_SIZE = 300`` and ``TRAIN_SIZE = 8000`` rows.

**Notes**

1. Problems are drawn from fixed seeds; a train row whose prompt equals a test prompt is skipped,
   so the splits are disjoint whatever ``n`` and ``seed`` a caller asks for.
2. Every passage has the same length (15 characters), as the spec's "random passage of equal
   length" asks of the corruption.
3. ``evidence_hinted`` (a warm-start task for RubricEM's reflection strategy, spec 39,
   ``rollout/rubricem_reflect.py``): the same rows, where with probability ``HINT_RATE = 0.5`` the
   prompt starts with a hint line ``"hint:{h}\n"`` (the strategy's default context), ``h`` a random
   slice (``1..HINT_CHARS = 16`` characters) of another row's reference answer; the answer is
   unchanged. [INFERRED] it lets a short sft warm start see hinted prompts, so that a prompt carrying a
   reflection is not out of distribution for the policy (the hints carry nothing: the policy learns
   to read past them, RL has to make them useful).
"""

from __future__ import annotations

import random
from functools import lru_cache

from groupwise.tasks import Task, register_task

LETTERS = "abcd"
USUAL = {"a": 1, "b": 2, "c": 3, "d": 4}
PRIOR_RATE = 0.3
TEST_SIZE = 300
TRAIN_SIZE = 8000
PERCEPTION, REASONING, ANSWER = ("<p>", "</p>"), ("<r>", "</r>"), ("<a>", "</a>")
REWARD = {"name": "exact", "column": "value", "start": ANSWER[0], "stop": ANSWER[1]}
_SPLIT_SEED = 5151


def format_row(values: dict[str, int], order: str, x: str, y: str, shortcut: bool = False) -> dict:
    """One row: ``values`` per letter, shown in ``order``; the question ``x+y``."""
    passage = " ".join(f"{k}={values[k]}" for k in order)
    total = values[x] + values[y]
    answer = (
        f"{PERCEPTION[0]}{x}={values[x]} "
        f"{y}={values[y]}{PERCEPTION[1]}{REASONING[0]}{values[x]}+{values[y]}{REASONING[1]}{ANSWER[0]}{total}{ANSWER[1]}"
    )
    return {
        "prompt": f"{passage}\n{x}+{y}?",
        "answer": answer,
        "value": str(total),
        "passage": passage,
        "question": f"{x}+{y}",
        "shortcut": shortcut,
    }


def make_problem(rng: random.Random) -> dict:
    """One row (module docstring) drawn from ``rng``."""
    values = {k: rng.randint(1, 9) for k in LETTERS}
    order = "".join(rng.sample(LETTERS, len(LETTERS)))
    x, y = rng.sample(LETTERS, 2)
    shortcut = rng.random() < PRIOR_RATE
    if shortcut:
        values[x], values[y] = USUAL[x], USUAL[y]
    return format_row(values, order, x, y, shortcut)


@lru_cache(maxsize=1)
def _splits() -> tuple[tuple[dict, ...], tuple[dict, ...]]:
    rng = random.Random(_SPLIT_SEED)
    test, seen = [], set()
    while len(test) < TEST_SIZE:
        row = make_problem(rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            test.append(row)
    rng, train = random.Random(_SPLIT_SEED + 1), []
    while len(train) < TRAIN_SIZE:
        row = make_problem(rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            train.append(row)
    return tuple(test), tuple(train)


def rows(split: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` rows of ``split`` ('train' or 'test'); ``n <= 0`` means the whole split."""
    test, train = _splits()
    if split == "test":
        pool = list(test)
    elif split == "train":
        pool = list(train)
        if n > 0:
            random.Random(seed).shuffle(pool)
    else:
        raise ValueError(f"evidence has splits 'train' and 'test', not {split!r}")
    return [dict(r) for r in (pool[:n] if n > 0 else pool)]


register_task(
    Task(
        "evidence",
        "quote two facts of a passage, add them: 'c=5 a=3 d=1 b=7\\na+d?' -> '<p>a=3 d=1</p><r>3+1</r><a>4</a>'",
        rows,
        reward=REWARD,
    )
)


HINT_RATE, HINT_CHARS = 0.5, 16


def hinted_rows(split: str, n: int, seed: int = 0) -> list[dict]:
    """``rows`` with a random hint line in front of about half the prompts (Notes 3)."""
    out = rows(split, n, seed)
    rng = random.Random(seed * 7919 + (1 if split == "train" else 2))
    for row in out:
        if rng.random() < HINT_RATE:
            other = out[rng.randrange(len(out))]["answer"]
            start = rng.randrange(len(other))
            row["prompt"] = f"hint:{other[start : start + rng.randint(1, HINT_CHARS)]}\n{row['prompt']}"
    return out


register_task(
    Task(
        "evidence_hinted",
        "evidence with a random hint line before half the prompts (a warm start for rollout rubricem_reflect)",
        hinted_rows,
        reward=REWARD,
    )
)
