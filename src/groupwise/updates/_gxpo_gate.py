"""GXPO's z-score shutoff gate (``updates/gxpo.py`` documents it): a rolling window of the
extrapolation statistic, the trajectory-aware z-score, patience and the fallback modes."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from groupwise.errors import ConfigError


class GXPOGate:
    """Rolling z-score shutoff: ``update(H, step) -> (z, tripped)``, ``enabled(step)``."""

    MODES, FALLBACKS = ("trajectory_aware", "legacy_g0"), ("permanent", "temporary")

    def __init__(
        self,
        tau: float = 3.0,
        window: int = 30,
        patience: int = 3,
        mode: str = "trajectory_aware",
        fallback_mode: str = "permanent",
        warmup: int = 50,
        fallback_window: int = 10,
        ddof: int = 0,
    ) -> None:
        if mode not in self.MODES or fallback_mode not in self.FALLBACKS:
            raise ConfigError(
                f"gxpo: gate_mode must be one of {self.MODES} and fallback_mode "
                f"one of {self.FALLBACKS}, got {mode!r}, {fallback_mode!r}"
            )
        if window < 2 or patience < 1 or fallback_window < 1 or ddof not in (0, 1):
            raise ConfigError(
                "gxpo: need window >= 2, patience >= 1, fallback_window >= 1, gate_ddof "
                f"in (0, 1); got {window}, {patience}, {fallback_window}, {ddof}"
            )
        self.tau, self.window, self.patience, self.mode, self.ddof = tau, window, patience, mode, ddof
        self.fallback_mode, self.fallback_window, self.warmup = fallback_mode, fallback_window, warmup
        self.history: deque[float] = deque(maxlen=window)
        self.streak, self.off_from = 0, None  # consecutive z >= tau; first disabled step (None: armed)

    def statistic(self, g0_norm: float, corrective_norm: float) -> float:
        return float(g0_norm if self.mode == "legacy_g0" else corrective_norm)

    def enabled(self, step: int) -> bool:
        if self.off_from is None or step < self.off_from:
            return True
        return self.fallback_mode == "temporary" and step >= self.off_from + self.fallback_window

    def update(self, H: float, step: int) -> tuple[float, bool]:
        self.off_from = None if self.off_from is not None and self.enabled(step) else self.off_from  # re-armed
        z = 0.0
        if len(self.history) == self.window:  # baseline = the previous `window` values only
            past = torch.tensor(list(self.history), dtype=torch.float64)  # [W]
            z = float((H - past.mean()) / (past.std(correction=self.ddof) + 1e-9))
        self.history.append(float(H))
        self.streak = self.streak + 1 if step >= self.warmup and z >= self.tau else 0
        if self.streak < self.patience:
            return z, False
        self.off_from, self.streak = step + 1, 0
        return z, True

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "streak": self.streak, "off_from": self.off_from}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque(state["history"], maxlen=self.window)
        self.streak, self.off_from = state["streak"], state["off_from"]
