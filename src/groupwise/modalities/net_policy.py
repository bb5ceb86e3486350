"""What the small non-text policy kinds share (flow, gaussian, subset, mdlm): one torch module ``net``
trained in place, a frozen snapshot of it as the reference, and a run's state as a dict.

A kind subclasses :class:`NetPolicy` and sets ``policy_file`` (the file ``save`` writes and
``policy/kinds.py`` loads from ``model.path``); ``extra_tensors`` names tensors trained beside
``net`` (the Gaussian policy's ``log_sigma``), ``shared_attributes`` ones a snapshot shares instead
of copying (the masked-diffusion LM's tokenizer). Each instance has ``net``, ``config`` (its
constructor's arguments, checked on load), ``reference`` (``None`` until a need asks for it) and
``trainable``.

The reference is ``snapshot()``: a deep copy with every parameter frozen and the net in eval mode,
built when a need first asks for the ``ref`` role (``scoring_models``) and rebuilt after an ``sft``
phase (``rebase_reference``: the fitted policy is what RL starts from, and what a KL term holds it to).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from groupwise.types import Rollout


class NetPolicy:
    """The shared state and reference handling of a policy that is one ``net`` (module docstring)."""

    policy_file: ClassVar[str]
    extra_tensors: ClassVar[tuple[str, ...]] = ()
    shared_attributes: ClassVar[tuple[str, ...]] = ()

    net: nn.Module
    config: dict
    reference: Any
    trainable: bool

    def scoring_models(self, with_reference: bool) -> dict[str, Any]:
        """The policies needs are read from, by role: this one and (built on request) a frozen snapshot."""
        if with_reference and self.reference is None:
            self.reference = self.snapshot()
        models: dict[str, Any] = {"policy": lambda: contextlib.nullcontext(self)}
        if self.reference is not None:
            models["ref"] = lambda: contextlib.nullcontext(self.reference)
        return models

    def score(self, handle: Any, rollout: Rollout, quantities: Sequence[str]) -> dict[str, Tensor]:
        return handle.forward(rollout, quantities)

    def rebase_reference(self) -> None:
        """After an sft phase (a demonstration fit) the frozen reference is the fitted policy RL starts from."""
        if self.reference is not None:
            self.reference = self.snapshot()

    def _extras(self) -> list[Tensor]:
        return [getattr(self, name) for name in self.extra_tensors]

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in [*self.net.parameters(), *self._extras()] if p.requires_grad]

    def snapshot(self) -> Any:
        """A frozen deep copy (no reference of its own; ``shared_attributes`` shared, not copied)."""
        kept = {name: getattr(self, name) for name in ("reference", *self.shared_attributes)}
        for name in kept:
            setattr(self, name, None)
        twin = copy.deepcopy(self)
        for name, value in kept.items():
            setattr(self, name, value)
            if name != "reference":
                setattr(twin, name, value)
        for p in [*twin.net.parameters(), *twin._extras()]:
            p.requires_grad_(False)
        twin.trainable = False
        twin.net.eval()
        return twin

    def state_dict(self) -> dict:
        state = {"config": dict(self.config), "net": {k: v.clone() for k, v in self.net.state_dict().items()}}
        state.update({name: t.detach().clone() for name, t in zip(self.extra_tensors, self._extras())})
        if self.reference is not None:
            state["reference"] = {k: v.clone() for k, v in self.reference.net.state_dict().items()}
            state.update(
                {
                    f"reference_{name}": t.detach().clone()
                    for name, t in zip(self.extra_tensors, self.reference._extras())
                }
            )
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("config") != self.config:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state was saved from {state.get('config')}, "
                f"this policy is {self.config}"
            )
        self.net.load_state_dict(state["net"])
        with torch.no_grad():
            for name, t in zip(self.extra_tensors, self._extras()):
                t.copy_(state[name])
        if self.reference is not None and "reference" in state:
            self.reference.net.load_state_dict(state["reference"])
            with torch.no_grad():
                for name, t in zip(self.extra_tensors, self.reference._extras()):
                    t.copy_(state[f"reference_{name}"])

    def save(self, folder: Any) -> None:
        """``policy_file`` (config + weights) in ``folder``: the kind's constructor with ``config``, then
        ``load_state_dict``, rebuilds it (``policy/kinds.py``, ``model.path``)."""
        Path(folder).mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), Path(folder) / self.policy_file)

    def train(self) -> None:
        self.net.train()

    def eval(self) -> None:
        self.net.eval()
