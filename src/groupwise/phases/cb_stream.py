"""CB-Stream loss: class-balanced cross-entropy at the decision positions of a pre-RL SFT phase.

Citation: "StreamPro: From Reactive Perception to Proactive Decision-Making in Streaming Video",
Ao Li et al., 2026, https://arxiv.org/abs/2605.16381 (spec 42; abstract only). The weighting is
the effective-number class balance of Cui et al. 2019 ("Class-Balanced Loss Based on Effective
Number of Samples", https://arxiv.org/abs/1901.05555), the spec's [INFERRED] reading of "CB-Stream".

**Change vs GRPO**: none to GRPO; an option of the ``sft`` phase (``loss = "cb_stream"``). Plain
SFT averages the cross-entropy over every answer token; when most rows teach the majority decision
(silence ≫ respond), the model learns "always silent". CB-Stream reweights the *decision* token of
each row by its class's inverse effective number.

**Math** (``class_balanced_weights``, ``cb_stream_loss``; ``ce`` [N,L] the per-token
cross-entropy, ``decision_mask`` the decision positions, ``decision_class`` their class ``c``)::

    E_c   = (1 − beta^{n_c}) / (1 − beta)            (n_c = decision positions of class c)
    w_c   = C · (1/E_c) / Σ_{c': n_c' > 0} 1/E_c'     (present classes; w_c = 0 when n_c = 0)
    L_dec = Σ_pos w_{c(pos)} · ce(pos) / Σ_pos w_{c(pos)}      over the decision positions
    L_con = Σ_pos ce(pos) / #pos                       over the other (content) positions
    L     = L_dec + L_con

**Defaults**

- ``beta = 0.999`` with ``counts = "dataset"`` (the class counts of every training row) [INFERRED]
  spec 42 after Cui et al.; ``counts = "batch"`` counts the batch's own decisions instead.
- the decision position is the first token of a row's answer and its class the row's ``decision``
  column (0 silence, 1 respond) [INFERRED] spec 42: one decision per turn; the answer's later
  tokens (and EOS) are content.

**Notes**

1. ``beta → 0``: every present class weighs 1 (plain mean over decisions); ``beta → 1``: inverse
   frequency. ``beta`` must lie in [0, 1).
2. A class absent from the counts gets weight 0 (it has no position to weigh); with one class
   present ``L_dec`` is the plain mean CE of the decisions.
3. No content position (every answer one token): ``L_con = 0``; no decision position: ``L_dec = 0``.
   Masked positions (``valid`` False, label ``-100``) contribute exactly 0.
4. Since ``w`` appears in the numerator and the denominator of ``L_dec``, its normalisation
   (Σ w = C) changes no gradient; it makes the weights readable (metrics ``w_c``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from groupwise.errors import ConfigError

COUNTS = ("dataset", "batch")


def check_beta(beta: float, who: str = "cb_stream") -> None:
    if not 0.0 <= beta < 1.0:
        raise ConfigError(
            f"{who}: beta={beta} must be in [0, 1) (0 = uniform over classes, towards 1 = inverse frequency)"
        )


def class_balanced_weights(counts: torch.Tensor, beta: float) -> torch.Tensor:
    """``w`` [C]: effective-number weights of the class ``counts`` [C], normalised to sum to C over present classes."""
    check_beta(beta)
    n = counts.double()  # [C]
    present = n > 0  # [C]
    if not bool(present.any()):
        return torch.zeros_like(n)
    # [C] E_c (1 for absent: unused)
    effective = torch.where(present, (1.0 - beta**n) / (1.0 - beta), torch.ones_like(n))
    inv = torch.where(present, 1.0 / effective, torch.zeros_like(n))  # [C]
    return inv * n.numel() / inv.sum()  # [C]


def balanced_from_ce(
    ce: torch.Tensor,
    valid: torch.Tensor,
    decision_mask: torch.Tensor,
    decision_class: torch.Tensor,
    weights: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``L_dec + L_con`` from the per-token cross-entropy ``ce`` [N,L] (module **Math**)."""
    dec = decision_mask & valid  # [N,L]
    con = valid & ~decision_mask  # [N,L]
    w_pos = torch.where(
        dec, weights.to(ce.dtype)[decision_class.clamp(min=0, max=weights.numel() - 1)], torch.zeros_like(ce)
    )  # [N,L]
    ce0 = torch.where(dec | con, ce, torch.zeros_like(ce))  # [N,L] masked → exact 0
    denom = w_pos.sum()
    l_dec = (w_pos * ce0).sum() / denom if float(denom) > 0 else ce0.sum() * 0.0
    l_con = (ce0 * con).sum() / con.sum() if bool(con.any()) else ce0.sum() * 0.0
    metrics = {
        "loss_dec": float(l_dec.detach()),
        "loss_content": float(l_con.detach()),
        "plain_ce": float(ce0.detach().sum() / (dec | con).sum().clamp(min=1)),
    }
    metrics.update({f"w_{c}": float(w) for c, w in enumerate(weights.tolist())})
    return l_dec + l_con, metrics


def cb_stream_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    decision_mask: torch.Tensor,
    decision_class: torch.Tensor,
    beta: float,
    num_classes: int = 2,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CB-Stream loss of ``logits`` [N,L,V] against ``labels`` [N,L] (``-100`` = ignored); class
    counts from ``counts`` [C] when given (dataset counts), else from this batch's decisions."""
    valid = labels != -100  # [N,L]
    ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.clamp(min=0).flatten(), reduction="none").view(
        labels.shape
    )  # [N,L]
    if counts is None:
        # [C]
        counts = torch.bincount(decision_class[decision_mask & valid].clamp(min=0), minlength=num_classes)[:num_classes]
    return balanced_from_ce(ce, valid, decision_mask, decision_class, class_balanced_weights(counts, beta))
