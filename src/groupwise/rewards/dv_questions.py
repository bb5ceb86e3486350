"""DVReward's template decomposers: what a completion is about (a *domain*), the atomic yes/no
questions each requested attribute asks about it, and the programmatic truth of each (a margin).

Spec 27 (AlphaGRPO): an LLM decomposes each prompt offline into semantic questions (one per
requested attribute) and generic quality questions; the judge answers them about the generated
image. Here a domain stands in for that LLM: a table of question templates per attribute key, so
``dv_reward`` asks the same kind of question about any modality — the judge only ever sees
``(question text, margin)`` pairs, never the sample itself.

Domains (``DOMAINS``):

- ``"number"``: the text toy ``number_attrs``; the completion is an integer ("52").
- ``"point2d"``: the flow toy ``flow_attrs``; the completion is a 2-D sample as the flow policy
  writes it (``"x,y"``), the spec's "image": attributes are the half-planes of a quadrant
  (``right``/``left``, ``upper``/``lower`` — a quadrant is two atomic questions) and a radius band
  (``near`` r < 1, ``mid`` 1 < r < 2, ``far`` r > 2), quality questions "a finite point?" and
  "inside the canvas [−3, 3]²?".

**Math** (margins, > 0 exactly when the answer is yes; the programmatic judge answers
``P(yes) = sigmoid(k · margin)``)::

    number:   even/odd ±1,  gt50 (n − 50.5)/5,  lt50 (49.5 − n)/5,  ends5 ±1,  div3 ±1;
              quality: whole number +1,  two digits ±1
    point2d:  right x,  left −x,  upper y,  lower −y,                     r = ‖(x, y)‖
              near 1 − r,  mid min(r − 1, 2 − r),  far r − 2;
              quality: finite point +1,  canvas 3 − max(|x|, |y|)
    a completion the domain cannot parse: margin −1 for every question

**Defaults** (all [INFERRED]: the paper's decomposer is an LLM over free-form prompts)

- the question templates and margins above; the margin scale is the toy's geometry (a unit of
  distance, or 5 for the number's magnitude).

**Notes**

1. ``{n}`` in a template is the completion as written (stripped), so an LM judge reads the sample.
2. An unknown attribute key is a ``RewardError`` naming the domain and its keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from groupwise.rewards._common import RewardError

Margin = Callable[[Any], float]

# attribute key -> (prompt label, question, margin(n) > 0 when true)
ATTRIBUTES: dict[str, tuple[str, str, Margin]] = {
    "even": ("even", "Is {n} even?", lambda n: 1.0 if n % 2 == 0 else -1.0),
    "odd": ("odd", "Is {n} odd?", lambda n: 1.0 if n % 2 == 1 else -1.0),
    "gt50": (">50", "Is {n} greater than 50?", lambda n: (n - 50.5) / 5.0),
    "lt50": ("<50", "Is {n} less than 50?", lambda n: (49.5 - n) / 5.0),
    "ends5": ("ends5", "Does {n} end in 5?", lambda n: 1.0 if n % 10 == 5 else -1.0),
    "div3": ("div3", "Is {n} divisible by 3?", lambda n: 1.0 if n % 3 == 0 else -1.0),
}
# generic quality questions (every prompt): the completion is a bare number, and a two-digit one
QUALITY: dict[str, tuple[str, Margin]] = {
    "number": ("Is {n} a whole number?", lambda n: 1.0),
    "two_digits": ("Is {n} a two-digit number?", lambda n: 1.0 if 10 <= n <= 99 else -1.0),
}


def _radius(p: tuple[float, float]) -> float:
    return math.hypot(p[0], p[1])


POINT_ATTRIBUTES: dict[str, tuple[str, str, Margin]] = {
    "right": ("right", "Is the point ({n}) right of the vertical axis?", lambda p: p[0]),
    "left": ("left", "Is the point ({n}) left of the vertical axis?", lambda p: -p[0]),
    "upper": ("upper", "Is the point ({n}) above the horizontal axis?", lambda p: p[1]),
    "lower": ("lower", "Is the point ({n}) below the horizontal axis?", lambda p: -p[1]),
    "near": ("near", "Is the point ({n}) within distance 1 of the centre?", lambda p: 1.0 - _radius(p)),
    "mid": (
        "mid",
        "Is the point ({n}) between distance 1 and 2 from the centre?",
        lambda p: min(_radius(p) - 1.0, 2.0 - _radius(p)),
    ),
    "far": ("far", "Is the point ({n}) farther than 2 from the centre?", lambda p: _radius(p) - 2.0),
}
CANVAS = 3.0
POINT_QUALITY: dict[str, tuple[str, Margin]] = {
    "point": ("Is ({n}) a finite 2-D point?", lambda p: 1.0),
    "canvas": ("Is the point ({n}) inside the canvas?", lambda p: CANVAS - max(abs(p[0]), abs(p[1]))),
}


def as_int(text: str) -> int | None:
    t = text.strip()
    return int(t) if t.isdigit() else None


def as_point(text: str) -> tuple[float, float] | None:
    """``"x,y"`` (the flow policy's decoded sample) as two finite floats, else None."""
    parts = text.strip().split(",")
    if len(parts) != 2:
        return None
    try:
        x, y = float(parts[0]), float(parts[1])
    except ValueError:
        return None
    return (x, y) if math.isfinite(x) and math.isfinite(y) else None


@dataclass(frozen=True)
class Domain:
    """What completions are about: a parser (text -> subject, None when it is none) and the question tables."""

    name: str
    parse: Callable[[str], Any]
    attributes: Mapping[str, tuple[str, str, Margin]]
    quality: Mapping[str, tuple[str, Margin]]

    def keys(self, value: Any) -> list[str]:
        """The attribute keys of a row (``"even,gt50"`` or a list), each checked against the domain's table."""
        keys = [k.strip() for k in value.split(",") if k.strip()] if isinstance(value, str) else [str(k) for k in value]
        bad = [k for k in keys if k not in self.attributes]
        if bad:
            raise RewardError(
                f"reward 'dv_reward': unknown attribute {bad} for domain "
                f"{self.name!r}; known: {', '.join(self.attributes)}"
            )
        return keys

    def decompose(
        self, completion: str, keys: Sequence[str]
    ) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
        """([(semantic question, margin)], [(quality question, margin)]) about ``completion``;
        margins −1 when it does not parse."""
        keys = self.keys(keys)
        subject = self.parse(completion)
        shown = completion.strip()
        sem = [
            (
                self.attributes[k][1].format(n=shown),
                float(self.attributes[k][2](subject)) if subject is not None else -1.0,
            )
            for k in keys
        ]
        qual = [
            (q.format(n=shown), float(m(subject)) if subject is not None else -1.0) for q, m in self.quality.values()
        ]
        return sem, qual


DOMAINS: dict[str, Domain] = {
    "number": Domain("number", as_int, ATTRIBUTES, QUALITY),
    "point2d": Domain("point2d", as_point, POINT_ATTRIBUTES, POINT_QUALITY),
}
