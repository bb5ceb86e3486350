"""An updater around another updater (``inner``): what the LoRA placement mask and the gradient-norm
profiler share. The wrapper passes ``bind``, ``step``, the state and the build-time contracts
(``use_parameter_names``, ``artifacts`` / ``use_artifact``) on to ``inner``; a subclass changes
what ``inner`` is bound to or what its closure does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from groupwise.errors import ConfigError
from groupwise.registry import build_spec


def build_inner(spec: Any, who: str) -> Any:
    """The wrapped updater from its config value (a name or a table)."""
    inner = build_spec("update", spec)
    for method in ("bind", "step", "state_dict", "load_state_dict"):
        if not hasattr(inner, method):
            raise ConfigError(f"update {who}: inner={spec!r} is not an updater (no {method}())")
    return inner


class Wrapped:
    """Forwards the updater contract to ``self.inner_updater`` (built in the subclass's ``__post_init__``)."""

    inner_updater: Any

    @property
    def skipped(self) -> int:
        return getattr(self.inner_updater, "skipped", 0)

    @property
    def artifacts(self) -> tuple[str, ...]:
        return tuple(getattr(self.inner_updater, "artifacts", ()))

    def use_artifact(self, name: str, value: Any) -> None:
        self.inner_updater.use_artifact(name, value)

    def use_parameter_names(self, names: list[str]) -> None:
        self.names = list(names)
        if hasattr(self.inner_updater, "use_parameter_names"):
            self.inner_updater.use_parameter_names(names)

    def bind(self, params: list[torch.nn.Parameter], total_steps: int) -> None:
        self.params = list(params)
        self.inner_updater.bind(params, total_steps)

    def step(self, closure: Callable[[], torch.Tensor]) -> dict[str, float]:
        return self.inner_updater.step(closure)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner_updater.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner_updater.load_state_dict(state["inner"])
