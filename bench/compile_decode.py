"""Does a compiled decode step pay? ``torch.compile`` of the functional decode step against eager.

    python bench/compile_decode.py [tiny|small|medium] [rows] [tokens]

Prefills one fixed prompt of 10 tokens (ids 3..12), repeats it over ``rows`` (default 8), then times
``tokens - 1`` decode steps (default 16, a bench cell's L16) four times, eager and then through
``torch.compile(DecodeState.step, dynamic=True)`` (the cache length grows every step, so a static
compile would recompile each step). Prints the compile cost (the first compiled pass) and the
median step of the last pass of each, and how many rollouts the saving needs to pay the compile back.
Not part of ``make bench``: groupwise runs the eager step (docs/performance.md says why).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT = 10


def _pass(state, step, rows: int, tokens: int) -> list[float]:
    """Seconds of each decode step of one prefill + ``tokens - 1`` steps."""
    import torch

    prompt = torch.arange(3, 3 + PROMPT)[None]  # [1,W]
    state.prefill(prompt, torch.arange(PROMPT)[None], torch.ones(1, PROMPT, dtype=torch.bool), rows, PROMPT + tokens)
    token = torch.zeros(rows, dtype=torch.long)  # [R]
    seconds = []
    for t in range(tokens - 1):
        start = time.perf_counter()
        step(token, torch.full((rows,), PROMPT + t), PROMPT + t)
        seconds.append(time.perf_counter() - start)
    return seconds


def main(argv: list[str]) -> int:
    import torch
    from build_models import build
    from transformers import AutoModelForCausalLM

    from groupwise.policy.functional import DecodeState

    preset = argv[0] if argv else "tiny"
    rows = int(argv[1]) if len(argv) > 1 else 8
    tokens = int(argv[2]) if len(argv) > 2 else 16
    model = AutoModelForCausalLM.from_pretrained(str(build(preset)), dtype=torch.float32).eval()
    eager = DecodeState(model)
    for _ in range(4):
        eager_s = statistics.median(_pass(eager, eager.step, rows, tokens))
    compiled = DecodeState(model)
    step = torch.compile(compiled.step, dynamic=True)
    start = time.perf_counter()
    _pass(compiled, step, rows, tokens)
    first = time.perf_counter() - start
    for _ in range(3):
        compiled_s = statistics.median(_pass(compiled, step, rows, tokens))
    saved = (eager_s - compiled_s) * (tokens - 1)  # per rollout
    payback = f"{first / saved:,.0f} rollouts" if saved > 0 else "never (the compiled step is not faster)"
    print(
        f"{preset}, {rows} rows, {tokens - 1} decode steps, {torch.get_num_threads()} thread(s): eager "
        f"step {eager_s * 1e3:.3f} ms, compiled {compiled_s * 1e3:.3f} ms ({eager_s / compiled_s:.2f}x); "
        f"first compiled pass {first:.1f} s; the compile pays back after {payback}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
