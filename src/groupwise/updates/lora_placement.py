"""LoRA parameter placement: train only k chosen entries of LoRA's B (A frozen), chosen from probe gradients.

"Not How Many, But Which: Parameter Placement in Low-Rank Adaptation", Sehanobish, Lovering, 2026,
https://arxiv.org/abs/2605.12207 — spec 29. Only the abstract was available; no code.

**Change vs GRPO**: the loss is GRPO's; only what trains changes. An offline phase
(``lora_placement_probe``, ``phases/lora_placement_probe.py``) records S probe gradients of the GRPO
loss with respect to every LoRA-B entry, scores the entries and keeps the global top k; this
updater then trains exactly those k entries with any updater (``inner``) — every other weight
(LoRA-A, the unchosen B entries, anything else trainable) stays at its initial value.

**Math** (``g^{(s)}`` = ∂L_GRPO/∂B of probe s, per entry; ``S`` probes)::

    net              score = | Σ_s g^{(s)} |                       (default: large AND sign-consistent)
    sign_consistency score = | Σ_s g^{(s)} | / Σ_s |g^{(s)}|        ∈ [0, 1]  (0 where Σ|g| = 0)
    magnitude        score = Σ_s |g^{(s)}|                          (the control: blind to sign)
    random           score ~ U(0, 1), seeded                        (the placement baseline)
    M                = top-k entries by score (global; or a per-module quota, see Notes)

    training: v = B[M] is the only trainable tensor (the inner updater's parameters, its state
    sized k); each closure writes v into B[M], zeroes every gradient, runs the backward and hands
    the inner updater g_v = ∂L/∂B[M]; after the step v is written back. Entries outside M are
    never written: they stay exactly at their initial value, weight decay included.

    diagnostics of the stacked probe gradients G [S, P]:
    eff_rank = exp(H(σ / Σσ))     σ = singular values of G, H = entropy (Roy & Vetterli 2007)
    mean_cos = mean_s cos(G[s], G[s+1])                           (0 for a zero row)

**Defaults**

- ``inner = "adamw"`` [INFERRED] any updater; AdamW's state is kept for the k entries only
  [INFERRED] (the spec's "AdamW state only for those entries"; the abstract, all that was read,
  does not say).
- ``artifact = "placement"`` [INFERRED] the name the probe phase writes by default.
- the scores and the top-k rule (phase) [INFERRED] from the abstract ("only elements with
  consistently signed gradients retain the learning signal"): spec 29's ``net`` score.

**Notes**

1. Before the artifact arrives (``use_artifact``, before the first RL step) the inner updater is
   not bound: a ``step`` then is an error naming the missing phase.
2. The artifact holds one bool mask per LoRA-B parameter name; a name this policy does not train,
   or a mask of another shape, is a ``ConfigError``; so is a placement of no entry at all.
3. The logged ``grad_norm`` and the clip are the inner updater's, over the k trained entries.
4. A resumed run gathers v from the restored weights, then loads the inner updater's state: the
   same state as the run that was not interrupted.
5. Pure functions for the hand tests: ``placement_scores``, ``topk_mask``, ``grad_structure_stats``.
   ``topk_mask(..., sizes=[...])`` splits k over modules in proportion to their entries
   (largest remainder), then takes the top entries within each module [INFERRED] (the spec's
   "option: per-module quota" names no rule). Ties rank the lower index first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.updates._lora import largest_remainder
from groupwise.updates._wrap import Wrapped, build_inner

SCORES = ("net", "sign_consistency", "magnitude", "random")


def placement_scores(grads: torch.Tensor, method: str = "net", seed: int = 0) -> torch.Tensor:
    """[S,P] probe gradients → [P] placement scores (module docstring, **Math**)."""
    if method not in SCORES:
        raise ConfigError(f"placement score {method!r}; allowed: {', '.join(SCORES)}")
    grads = grads.double()  # [S,P]
    net = grads.sum(0).abs()  # [P]
    mag = grads.abs().sum(0)  # [P]
    if method == "net":
        return net
    if method == "magnitude":
        return mag
    if method == "sign_consistency":
        return torch.where(mag > 0, net / mag.clamp(min=torch.finfo(torch.float64).tiny), torch.zeros(()))  # [P]
    return torch.rand(grads.shape[1], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)  # [P]


def topk_mask(scores: torch.Tensor, k: int, sizes: list[int] | None = None) -> torch.Tensor:
    """bool [P]: the k highest scores (global), or with ``sizes`` (entries per module, in order,
    summing to P) a quota per module in proportion to its size. Ties: the lower index first."""
    P = scores.numel()
    if not 0 <= k <= P:
        raise ConfigError(f"placement k={k} must be in [0, {P}] (the number of LoRA-B entries)")
    mask = torch.zeros(P, dtype=torch.bool)
    if sizes is None:
        mask[torch.sort(-scores.double(), stable=True).indices[:k]] = True
        return mask
    if sum(sizes) != P or any(s < 0 for s in sizes):
        raise ValueError(f"topk_mask: module sizes {sizes} do not sum to the {P} scores")
    quota = largest_remainder(torch.tensor(sizes, dtype=torch.float64) * (k / max(P, 1)), k)  # [M]
    start = 0
    for size, q in zip(sizes, quota.tolist()):
        part = scores[start : start + size].double()
        mask[start + torch.sort(-part, stable=True).indices[:q]] = True
        start += size
    return mask


def grad_structure_stats(grads: torch.Tensor) -> dict[str, float]:
    """Effective rank and mean successive cosine of stacked probe gradients [S,P] (**Math**)."""
    grads = grads.double()  # [S,P]
    sigma = torch.linalg.svdvals(grads)  # [min(S,P)]
    total = sigma.sum()
    if total > 0:
        p = sigma / total
        p = p[p > 0]
        eff_rank = float(torch.exp(-(p * p.log()).sum()))
    else:
        eff_rank = 0.0
    if grads.shape[0] < 2:
        return {"eff_rank": eff_rank, "mean_cos": float("nan")}
    a, b = grads[:-1], grads[1:]  # [S-1,P]
    norms = a.norm(dim=1) * b.norm(dim=1)  # [S-1]
    # [S-1]
    cos = torch.where(norms > 0, (a * b).sum(1) / norms.clamp(min=torch.finfo(torch.float64).tiny), torch.zeros(()))
    return {"eff_rank": eff_rank, "mean_cos": float(cos.mean())}


@register("update", "lora_placement")
@dataclass
class LoraPlacement(Wrapped):
    """Trains only the LoRA-B entries the placement probe chose (A frozen), with any inner updater."""

    inner: Any = field(default_factory=lambda: {"name": "adamw"})
    artifact: str = "placement"

    def __post_init__(self) -> None:
        if not self.artifact:
            raise ConfigError(
                'update lora_placement: artifact must name the placement phase\'s output (default "placement")'
            )
        self.inner_updater = build_inner(self.inner, "lora_placement")
        self.names: list[str] | None = None
        self.params: list[torch.nn.Parameter] = []
        # (B weight, flat indices of its trained entries [k_i])
        self.slots: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self.values: list[torch.nn.Parameter] = []  # [k_i] each: what the inner updater trains
        self._pending: dict | None = None  # inner state from a checkpoint, loaded once the mask is known
        self._total = 0
        self._placed = False

    @property
    def artifacts(self) -> tuple[str, ...]:
        return (self.artifact, *getattr(self.inner_updater, "artifacts", ()))

    def bind(self, params: list[torch.nn.Parameter], total_steps: int) -> None:
        self.params, self._total = list(params), total_steps  # the inner updater is bound once the mask arrives

    def use_parameter_names(self, names: list[str]) -> None:
        self.names = list(names)  # the inner updater gets the names of what it trains, at use_artifact

    def use_artifact(self, name: str, value: Any) -> None:
        if name != self.artifact:
            self.inner_updater.use_artifact(name, value)
            return
        if self.names is None:
            raise ConfigError("update lora_placement needs the policy's parameter names (a text policy)")
        by_name = dict(zip(self.names, self.params, strict=True))
        self.slots, self.values, placed = [], [], []
        for pname, mask in value["masks"].items():
            if pname not in by_name:
                raise ConfigError(
                    f"update lora_placement: the placement artifact masks {pname!r}, which this policy does not train "
                    f"(model.lora differs from the run that probed it?)"
                )
            p = by_name[pname]
            if tuple(mask.shape) != tuple(p.shape) or not p.is_contiguous():
                raise ConfigError(
                    f"update lora_placement: mask of {pname!r} has shape "
                    f"{tuple(mask.shape)}, the weight {tuple(p.shape)}"
                )
            index = mask.reshape(-1).nonzero().flatten().to(p.device)  # [k_i]
            if index.numel():
                self.slots.append((p, index))
                self.values.append(torch.nn.Parameter(p.detach().reshape(-1)[index].clone()))  # [k_i]
                placed.append(f"{pname}[placed]")
        if not self.values:
            raise ConfigError(
                f"update lora_placement: the artifact {self.artifact!r} "
                "places no entry (k = 0); give the probe phase k >= 1"
            )
        self.inner_updater.bind(self.values, self._total)
        if hasattr(self.inner_updater, "use_parameter_names"):
            self.inner_updater.use_parameter_names(placed)
        self._placed = True
        if self._pending is not None:
            self.inner_updater.load_state_dict(self._pending)
            self._pending = None

    def _write(self) -> None:
        with torch.no_grad():
            for (p, index), v in zip(self.slots, self.values):
                p.view(-1).index_copy_(0, index, v.detach())

    def step(self, closure: Callable[[], torch.Tensor]) -> dict[str, float]:
        if not self._placed:
            raise RuntimeError(
                f"update lora_placement: no placement yet; add the phase that writes the artifact {self.artifact!r} "
                f'(phases=[{{name="lora_placement_probe", artifact="{self.artifact}"}}])'
            )

        def placed() -> torch.Tensor:
            self._write()  # the forward sees the current values (a multi-pass updater moved them)
            for p in self.params:
                p.grad = None
            loss = closure()
            for (p, index), v in zip(self.slots, self.values):
                # [k_i]
                v.grad = p.grad.detach().reshape(-1)[index].clone() if p.grad is not None else torch.zeros_like(v)
            return loss

        out = self.inner_updater.step(placed)
        self._write()
        for p in self.params:  # the full-size gradients are not the update's: drop them
            p.grad = None
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner_updater.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._placed:
            self.inner_updater.load_state_dict(state["inner"])
        else:
            # the mask (and the inner parameters) arrive with the artifact, after the checkpoint
            self._pending = state["inner"]
