"""Small LoRA helpers shared by the placement mask (spec 29) and the rank allocation (spec 49):
where a PEFT parameter sits (layer, module kind, A or B), the largest-remainder rounding, and
counting adapter parameters."""

from __future__ import annotations

import re
from typing import Any

import torch

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")
_LORA = re.compile(r"\.lora_([AB])\.")


def layer_of(name: str) -> int | None:
    """The decoder layer index in a parameter or module name
    (``...layers.3.self_attn...`` → 3; GPT-2's ``h.3``), else None."""
    found = _LAYER.search(name)
    return int(found.group(1)) if found else None


def lora_side(name: str) -> str | None:
    """``"A"`` or ``"B"`` for a PEFT LoRA weight (``...q_proj.lora_B.default.weight``), else None."""
    found = _LORA.search(name)
    return found.group(1) if found else None


def module_kind(name: str) -> str:
    """The adapted module's own name (``q_proj``, ``down_proj``, ``c_attn``) of a PEFT LoRA weight."""
    head = _LORA.split(name, maxsplit=1)[0]
    return head.rsplit(".", 1)[-1]


def largest_remainder(raw: torch.Tensor, total: int) -> torch.Tensor:
    """Integers ``floor(raw)`` plus one for the ``total − Σ floor(raw)`` entries with the largest
    fractional parts (ties: the lower index first), so the result sums to ``total`` exactly.
    ``raw`` [L] must be >= 0 and sum to ``total`` (up to rounding)."""
    raw = raw.double()  # [L]
    base = torch.floor(raw + 1e-9)  # [L] 3.0000000000000004 and 2.9999999999999996 both floor to 3
    left = int(total - int(base.sum()))
    if left < 0 or left > raw.numel():
        raise ValueError(f"largest_remainder: the values sum to {float(raw.sum())}, not to the total {total}")
    frac = (raw - base).clamp(min=0.0)  # [L]
    order = torch.sort(-frac, stable=True).indices  # descending fractional part, lower index first on ties
    out = base.long()
    out[order[:left]] += 1
    return out  # [L]


def lora_param_count(model: Any) -> int:
    """Number of LoRA adapter entries (A and B) in a PEFT model."""
    return sum(p.numel() for n, p in model.named_parameters() if lora_side(n) is not None)


def assert_lora_param_count(model: Any, expected: int) -> None:
    """Raise unless the model's LoRA adapters hold exactly ``expected`` entries (a ``rank_pattern``
    key that matched nothing leaves its modules at the default rank: this catches it)."""
    got = lora_param_count(model)
    if got != expected:
        raise ValueError(
            f"the LoRA adapters hold {got} parameters, expected {expected}: a rank_pattern key matched no module "
            f"(keys are regexes on full module names), or a target module is missing"
        )
