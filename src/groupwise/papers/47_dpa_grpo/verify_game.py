"""The generator–verifier game of DPA-GRPO (spec 47) in the embedded model's own language, and its tasks.

Citation: "Interactive Critique-Revision Training for Reliable Structured LLM Generation", Fei Xu Yu,
Zuyuan Zhang, Mahdi Imani, Nathaniel D. Bastian, Tian Lan, arXiv 2605.08327 (spec 47; abstract only,
full paper not read, no code). Design: ``shared/design/nontext.md`` §3 "47 DPA-GRPO" and §6.

The game's formats and decisions are the rollout strategy's (``rollout/dpa_game.py``); this module
holds the toy's tasks.

**Tasks**

- ``verify_game``: the RL rows, ``{"prompt": "a+b=", "answer": "a+b"}``, the arithmetic task's pairs
  and split (its held-out rows are arithmetic's), reward ``exact`` for the trainer's own held-out
  evaluation (first-move greedy accuracy); the game's rewards come from the strategy ``dpa_game``.
- ``verify_game_sft``: the warm start's rows, all three formats in equal shares, built from the
  train pairs only [INFERRED] the toy's warm start: generator rows answer the total; verifier rows
  show y0 right (half) or off by ±1, ±2 or ±10, and answer ``"."`` or ``"!"`` + the total;
  challenged rows show a wrong y0 with the true total as evidence (answer ``"r"`` + total) or a
  right y0 with a wrong evidence (answer ``"k"``). Labels are right; the warm start stays partial
  because the model's arithmetic is (the phase's step count bounds it).
"""

from __future__ import annotations

import random

from groupwise.rollout.dpa_game import CHALLENGE, KEEP, REVISE, SILENT, challenge_context, verifier_context
from groupwise.tasks import Task, register_task
from groupwise.tasks.arithmetic import TEST_SIZE, _problems

OFFSETS = (-10, -2, -1, 1, 2, 10)  # how a wrong y0 is off in the warm start's rows [INFERRED] toy


def rows(split: str, n: int, seed: int = 0) -> list[dict]:
    """The arithmetic task's rows of ``split`` (the same pairs and split), as game prompts."""
    pairs = _problems()
    pool = pairs[:TEST_SIZE] if split == "test" else pairs[TEST_SIZE:]
    if split not in ("train", "test"):
        raise ValueError(f"verify_game has splits 'train' and 'test', not {split!r}")
    if split == "train" and n > 0:
        pool = list(pool)
        random.Random(seed).shuffle(pool)
    pool = pool[:n] if n > 0 else pool
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pool]


def _wrong(total: int, rng: random.Random) -> int:
    value = total + rng.choice(OFFSETS)
    return value if value >= 0 else total + 1


def sft_rows(split: str, n: int, seed: int = 0) -> list[dict]:
    """The warm start's rows (module docstring): row ``i`` is of format ``i % 3``, from the train pairs only."""
    if split == "test":
        return []  # the warm start is never evaluated on held-out pairs
    rng = random.Random(f"verify_game_sft:{seed}")
    out = []
    for i, row in enumerate(rows("train", n, seed)):
        prompt, total = row["prompt"], int(row["answer"])
        kind = i % 3
        if kind == 0:
            out.append({"prompt": prompt, "answer": str(total), "format": "generator"})
            continue
        right = rng.random() < 0.5
        y0 = total if right else _wrong(total, rng)
        if kind == 1:
            answer = SILENT if right else f"{CHALLENGE}{total}"
            out.append({"prompt": verifier_context(prompt, str(y0)), "answer": answer, "format": "verifier"})
        else:
            evidence = _wrong(total, rng) if right else total
            answer = KEEP if right else f"{REVISE}{total}"
            out.append(
                {"prompt": challenge_context(prompt, str(y0), str(evidence)), "answer": answer, "format": "challenged"}
            )
    return out


register_task(
    Task("verify_game", "DPA-GRPO's game prompts 'a+b=' (arithmetic's pairs and split)", rows, reward="exact")
)
register_task(
    Task("verify_game_sft", "DPA-GRPO's warm start: generator, verifier and challenged rows (train pairs)", sft_rows)
)
