"""``flow2d``: the 2-D flow toy's task — a label as the prompt, the ``flow_region`` reward (land in
the label's mixture region). Rows come from ``modalities/flow_toy.mixture_rows``; the train and
held-out splits use different seeds (the labels are all there is to a prompt)."""

from __future__ import annotations

from groupwise.tasks import Task, register_task


def _rows(split: str, n: int, seed: int) -> list[dict]:
    from groupwise.modalities.flow_toy import mixture_rows

    size = n or (256 if split == "train" else 64)
    return mixture_rows(size, seed=seed if split == "train" else seed + 10_007)


register_task(
    Task(
        "flow2d",
        "2-D flow toy: samples must land in the region of their label's mixture centre",
        _rows,
        reward="flow_region",
    )
)
register_task(
    Task(
        "flow2d_trap",
        "2-D flow toy with a trap: an easy near region worth 0.5, a far one worth 1 on the opposite side "
        "(E²PO's behavioural test, spec 15)",
        _rows,
        reward="flow_trap",
    )
)
