"""``flow_attrs``: the 2-D flow toy with attribute prompts — a label names a quadrant and a radius
band, and a sample must land there (spec 27's "image" analogue for DVReward).

Label ``k`` (12 labels) asks for quadrant ``QUADRANTS[k // 3]`` (two half-planes, e.g. ``right`` and
``upper``) and band ``BANDS[k % 3]`` (``near`` r < 1, ``mid`` 1 < r < 2, ``far`` r > 2). Rows:
``{"prompt": k, "attrs": "right,upper,near"}``, labels uniform (seeded; the held-out split another
seed, as ``flow2d``). The flow policy needs ``model.params.n_labels = 12``. The default reward (and
so the held-out accuracy, on the deterministic ODE sample) is ``dv_reward`` with the ``point2d``
domain, its programmatic judge and ``method = "holistic"``: 1 exactly when the sample satisfies every
atomic question (both half-planes, the band, a finite point inside the canvas).
"""

from __future__ import annotations

import torch

from groupwise.tasks import Task, register_task

QUADRANTS = (("right", "upper"), ("left", "upper"), ("left", "lower"), ("right", "lower"))
BANDS = ("near", "mid", "far")
N_LABELS = len(QUADRANTS) * len(BANDS)


def label_attrs(label: int) -> str:
    """The comma-separated attribute keys label ``label`` asks for."""
    return ",".join((*QUADRANTS[label // len(BANDS)], BANDS[label % len(BANDS)]))


def _rows(split: str, n: int, seed: int) -> list[dict]:
    size = n or (256 if split == "train" else 64)
    labels = torch.randint(
        N_LABELS, (size,), generator=torch.Generator().manual_seed(seed if split == "train" else seed + 10_007)
    )  # [n]
    return [{"prompt": int(k), "attrs": label_attrs(int(k))} for k in labels]


register_task(
    Task(
        "flow_attrs",
        "2-D flow toy: a label asks for a quadrant and a radius band; dv_reward (point2d, holistic)",
        _rows,
        reward={"name": "dv_reward", "domain": "point2d", "method": "holistic"},
    )
)
