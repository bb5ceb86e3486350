"""The bf16 rows of the matrix (issue 17): the same cells with the matrix products in bfloat16 —
groupwise with ``model.matmul=bfloat16`` (float32 master weights, float32 log-probs and loss),
TRL with ``bf16=True`` (its bf16 autocast) — and their GEMM floor timed in bfloat16.

They are run only where a GEMM probe (``groupwise.policy.precision``: the cells' largest model's
MLP shape, float32 vs bfloat16 at the workers' thread count) measures bfloat16 at least 1.3x
faster: a CPU without bfloat16 matrix units emulates it, measures it slower, and the table says why
the rows are absent instead. Decided by measurement, never by the CPU's name.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from common import Cell, select

# A few cells per model size, sized to keep `make bench` in budget (~2 min for both frameworks):
# the overhead-bound small step, the compute-bound 64x8 and long-completion cells.
BF16_CELLS = "tiny-4x8-L16,tiny-64x8-L16,small-4x8-L128,small-64x8-L16,medium-4x8-L128"


def probe(configs: dict[str, dict[str, Any]], threads: int) -> dict[str, Any]:
    """The decision for this machine: ``{"on", "reason", "fp32_gflops", "bf16_gflops", "shape", "threads"}``."""
    import torch

    from groupwise.policy import precision

    widest = max(configs.values(), key=lambda c: c["hidden_size"])
    rows, inner, outer = precision.PROBE_ROWS, widest["hidden_size"], widest["intermediate_size"]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fp32, bf16 = precision.probe(rows, inner, outer, rounds=3)
    finally:
        torch.set_num_threads(previous)
    on, reason = precision.decide(fp32, bf16)
    return {
        "on": on,
        "reason": reason,
        "fp32_gflops": fp32,
        "bf16_gflops": bf16,
        "shape": [rows, inner, outer],
        "threads": threads,
    }


def bf16_cells(cells: list[Cell], patterns: str = BF16_CELLS) -> list[Cell]:
    """The float32 cells named by ``patterns`` (``none``: no row), as their bfloat16 twins (names end ``-bf16``)."""
    if patterns.strip() == "none":
        return []
    return [replace(c, matmul="bfloat16") for c in select([c for c in cells if c.matmul == "float32"], patterns)]


def absent_note(decision: dict[str, Any] | None) -> str:
    """The line under the results table when no bf16 row was run."""
    if decision is None:
        return "_bf16 rows absent: not requested (`--bf16-cells none`, or none of the chosen cells is a bf16 cell)._"
    if decision["on"]:
        return ""
    slower = decision["bf16_gflops"] < decision["fp32_gflops"]
    what = "slower than fp32" if slower else "less than 1.3× faster than fp32"
    return f"_bf16 rows absent: this CPU's bf16 GEMM is {what} ({decision['reason']})._"


def present_note(decision: dict[str, Any]) -> str:
    """The line under the results table when bf16 rows were run."""
    return (
        "_Rows ending `-bf16`: the same cell with bfloat16 matrix products (groupwise `model.matmul=bfloat16` "
        "over float32 master weights; TRL `bf16=True`), GEMM floor and FLOP efficiency in bfloat16 — "
        f"{decision['reason']}, GEMM {decision['shape'][0]}×{decision['shape'][1]}×{decision['shape'][2]} at "
        f"{decision['threads']} thread(s)._"
    )
