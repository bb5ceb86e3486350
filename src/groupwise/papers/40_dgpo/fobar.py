"""Forward and reverse (FOBAR-style) addition: ``"37+45="`` -> ``"82"`` and ``"X+45=82;X="`` -> ``"37"``.

The data of DGPO (specs/40): every two-number addition problem of the ``arithmetic`` task also
gives a *backward* question — one number of the forward question is masked, the forward answer is
given as known, and the masked number is asked for (FOBAR, "Forward-Backward Reasoning in Large
Language Models for Mathematical Verification", Weisen Jiang et al., 2023,
https://arxiv.org/abs/2308.07758; spec 40's data construction).

- :func:`make_reverse_question` is the builder on any question text: it masks the ``which``-th
  number with ``X`` and writes the known answer with ``template``. The default template is FOBAR's
  wording ("If we know the answer to the above question is 7, what is the value of unknown variable
  X?"); the tasks use the compact ``"{question}{answer};X="`` that fits the embedded model.
- Task ``fobar``: train rows in problem pairs (forward, reverse) of the ``arithmetic`` train split,
  columns ``{"prompt", "answer", "problem", "direction"}`` (``problem`` the problem's id in the
  arithmetic permutation, ``direction`` "forward" | "reverse"); the pairs are shuffled by ``seed``,
  a pair's two rows stay adjacent.
- Task ``fobar_forward``: the same problems, forward rows only (the forward-only baseline). Both
  tasks hold out the same test split: the ``arithmetic`` test problems, both directions, in pairs
  (``eval.by = "direction"`` reports the accuracy of each direction).
- Reward ``fobar``: its own verifier. It solves the question from the prompt text (forward: a + b;
  reverse: the known sum minus the other operand) and compares the completion, never reading the
  ``answer`` column, so a wrong builder and a wrong answer column cannot agree silently.

**Change vs GRPO**: none in the loop; a data construction and its rule-based reward.

**Math**::

    forward  q = "{a}+{b}="            answer a + b
    reverse  q = "X+{b}={a+b};X="       answer a      (problems with an even id mask the first operand)
             q = "{a}+X={a+b};X="       answer b      (odd ids mask the second)
    reward   1.0 if completion.strip() == str(solve(prompt)) else 0.0

**Defaults** (all [INFERRED]: the spec gives the construction, not a format)

- Masked operand: alternating by problem id, so both backward forms are trained and held out.
- ``template = "{question}{answer};X="`` for the tasks, FOBAR's sentence for the builder's default.

**Notes**

1. ``make_reverse_question`` raises when ``which`` is out of range (the error says how many numbers
   the question has); numbers are maximal digit runs.
2. The verifier raises on a prompt it cannot read (a prompt outside the two formats): use it only
   with these tasks.
3. ``data.train_size = n`` takes the first ``n`` rows, so an odd ``n`` cuts the last pair; rollout
   ``directions`` pairs what is there and samples a lone row alone.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from groupwise.registry import register
from groupwise.tasks import Task, register_task
from groupwise.tasks.arithmetic import TEST_SIZE, _problems

FOBAR_TEMPLATE = (
    "{question} If we know the answer to the above question is {answer}, what is the value of unknown variable X?"
)
COMPACT_TEMPLATE = "{question}{answer};X="
DIRECTIONS = ("forward", "reverse")
_NUMBER = re.compile(r"\d+")
_FORWARD = re.compile(r"^(\d+)\+(\d+)=$")
_REVERSE = re.compile(r"^(\d+|X)\+(\d+|X)=(\d+);X=$")


def make_reverse_question(q: str, a: str | int, which: int = 0, template: str = FOBAR_TEMPLATE) -> tuple[str, str]:
    """(q_rev, a_rev): ``q`` with its ``which``-th number masked as ``X`` and the answer ``a`` given
    through ``template`` (``{question}``, ``{answer}``); ``a_rev`` is the masked number."""
    numbers = list(_NUMBER.finditer(q))
    if not -len(numbers) <= which < len(numbers):
        raise ValueError(f"make_reverse_question: which={which} but the question has {len(numbers)} numbers: {q!r}")
    hit = numbers[which]
    masked = q[: hit.start()] + "X" + q[hit.end() :]
    return template.format(question=masked, answer=a), hit.group()


def pair_rows(problem: int, x: int, y: int) -> list[dict]:
    """The forward and the reverse row of one addition problem (its id ``problem``)."""
    forward = {"prompt": f"{x}+{y}=", "answer": str(x + y), "problem": problem, "direction": "forward"}
    q_rev, a_rev = make_reverse_question(forward["prompt"], forward["answer"], problem % 2, COMPACT_TEMPLATE)
    return [forward, {"prompt": q_rev, "answer": a_rev, "problem": problem, "direction": "reverse"}]


@lru_cache(maxsize=1)
def _pairs() -> tuple[tuple[int, int, int], ...]:
    return tuple((k, x, y) for k, (x, y) in enumerate(_problems()))


def rows(split: str, n: int = 0, seed: int = 0, directions: tuple[str, ...] = DIRECTIONS) -> list[dict]:
    """``n`` rows of ``split`` (``n <= 0``: all). Train keeps ``directions`` of each problem, pairs
    shuffled by ``seed``; test is always both directions of the arithmetic test problems, in order."""
    problems = _pairs()
    if split == "test":
        pool, directions = list(problems[:TEST_SIZE]), DIRECTIONS
    elif split == "train":
        pool = list(problems[TEST_SIZE:])
        random.Random(seed).shuffle(pool)
    else:
        raise ValueError(f"fobar has splits 'train' and 'test', not {split!r}")
    out = [r for k, x, y in pool for r in pair_rows(k, x, y) if r["direction"] in directions]
    return out[:n] if n > 0 else out


def solve(prompt: str) -> int:
    """The answer of a ``fobar`` question, from its text alone."""
    if m := _FORWARD.match(prompt):
        return int(m.group(1)) + int(m.group(2))
    if (m := _REVERSE.match(prompt)) and (m.group(1) == "X") != (m.group(2) == "X"):
        known = m.group(2) if m.group(1) == "X" else m.group(1)
        return int(m.group(3)) - int(known)
    raise ValueError(
        f"reward 'fobar' cannot read the question {prompt!r}: it verifies "
        "'a+b=' and 'X+b=s;X=' / 'a+X=s;X=' (tasks fobar, fobar_forward)"
    )


@register("reward", "fobar")
@dataclass
class FobarVerifier:
    """1.0 if the completion (stripped) is the answer solved from the prompt itself, else 0.0."""

    weight: float = 1.0

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns) -> list[float | None]:
        return [1.0 if text.strip() == str(solve(prompt)) else 0.0 for prompt, text in zip(prompts, completions)]


register_task(
    Task(
        "fobar",
        "addition 'a+b=' and its reverse 'X+b=s;X=' in problem pairs (FOBAR-style), verifier reward",
        rows,
        reward="fobar",
    )
)
register_task(
    Task(
        "fobar_forward",
        "the fobar problems, forward rows only in train (held out: both directions)",
        lambda split, n, seed: rows(split, n, seed, ("forward",)),
        reward="fobar",
    )
)
