"""``flow2d``: the 2-D flow toy's task — a label as the prompt, the ``flow_region`` reward (land in
the label's mixture region). Rows come from ``modalities/flow_toy.mixture_rows``; the train and
held-out splits use different seeds (the labels are all there is to a prompt).

``flow2d_bimodal`` (CM-GRPO's toy, spec 19 [INFERRED]): the train rows are demonstrations
(``modalities/flow_toy.bimodal_rows``: label k's ``target`` points are a 50/50 mixture of the
centres μ_k and μ_{k+1}), so a flow fitted on them (the ``sft`` phase) lands about half its samples
in each mode; the reward ``flow_region`` pays μ_k only."""

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


def _bimodal(split: str, n: int, seed: int) -> list[dict]:
    from groupwise.modalities.flow_toy import bimodal_rows

    size = n or (1024 if split == "train" else 64)
    return bimodal_rows(size, seed=seed if split == "train" else seed + 10_007)


register_task(
    Task(
        "flow2d_bimodal",
        "2-D flow toy with bimodal demonstrations: label k's targets lie at μ_k or μ_(k+1), the reward pays μ_k "
        "(CM-GRPO's toy, spec 19)",
        _bimodal,
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
