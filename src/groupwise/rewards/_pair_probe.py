"""PAIR's two-stage linear probe (spec 03): standardised L2 logistic regressions, stage 1 on the
turn's hidden state, stage 2 on its attention statistics plus stage 1's softened score.

Fitted once by the ``pair_probe`` phase, read by the ``pair`` reward (``rewards/pair.py``).
``fit_logistic`` minimises sklearn's ``LogisticRegression(penalty="l2", C)`` objective (divided
by C·n: the same optimum) [CODE]; ``tclip`` is the score softening both stage 2 and the reward use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


def tclip(p: Tensor, temperature: float = 2.0, eps: float = 0.05) -> Tensor:
    """clamp(σ(logit(p)/T), eps, 1−eps), elementwise (p clamped into (0, 1) before the logit)."""
    p = p.double().clamp(1e-12, 1 - 1e-12)
    return torch.sigmoid(torch.logit(p) / temperature).clamp(eps, 1 - eps)


def _standardise(X: Tensor) -> tuple[Tensor, Tensor]:
    mean = X.mean(0)  # [F]
    scale = X.std(0, unbiased=False)  # [F]
    return mean, torch.where(scale > 1e-12, scale, torch.ones_like(scale))  # a constant feature: scale 1 (as sklearn)


def fit_logistic(X: Tensor, y: Tensor, C: float = 0.01, max_iter: int = 200) -> tuple[Tensor, Tensor]:
    """(w [F], b) minimising mean_i logloss(σ(w·x_i + b), y_i) + ‖w‖² / (2·C·n): sklearn's L2
    ``LogisticRegression(C)`` objective divided by C·n, so the same optimum. Full-batch L-BFGS, float64."""
    X, y = X.double(), y.double()  # [n,F], [n]
    n, F = X.shape
    w = torch.zeros(F + 1, dtype=torch.float64, requires_grad=True)  # [F+1] weights, then the bias
    opt = torch.optim.LBFGS(
        [w], lr=1.0, max_iter=max_iter, tolerance_grad=1e-12, tolerance_change=1e-14, line_search_fn="strong_wolfe"
    )

    def closure():
        opt.zero_grad()
        z = X @ w[:F] + w[F]  # [n]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z, y) + (w[:F] ** 2).sum() / (2 * C * n)
        loss.backward()
        return loss

    opt.step(closure)
    return w[:F].detach(), w[F].detach()


@dataclass
class PairProbe:
    """Two-stage probe: stage 1 on h, stage 2 on [a ; tclip(s_bc)]; each a standardised L2 logistic regression."""

    C: float = 0.01
    temperature: float = 2.0
    eps: float = 0.05
    params: dict = field(default_factory=dict)

    def fit(self, H: Tensor, A: Tensor, y: Tensor) -> PairProbe:
        """H [n,D], A [n,F], y [n] (1 = clean turn); stage 2 trains on stage 1's in-sample probabilities [CODE]."""
        H, A, y = H.double(), A.double().reshape(len(H), -1), y.double()
        if len(H) < 2 or y.min() == y.max():
            raise ValueError(
                f"PairProbe.fit: need turns of both labels, got {len(H)} turns with labels {sorted(set(y.tolist()))}"
            )
        m1, sc1 = _standardise(H)
        w1, b1 = fit_logistic((H - m1) / sc1, y, self.C)
        s_bc = torch.sigmoid((H - m1) / sc1 @ w1 + b1)  # [n] in-sample
        X2 = torch.cat([A, s_bc[:, None]], 1)  # [n,F+1]
        m2, sc2 = _standardise(X2)
        w2, b2 = fit_logistic((X2 - m2) / sc2, y, self.C)
        self.params = {"mean1": m1, "scale1": sc1, "w1": w1, "b1": b1, "mean2": m2, "scale2": sc2, "w2": w2, "b2": b2}
        return self

    def score(self, h: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
        """(s_bc [n], s_final [n]) of turns h [n,D], a [n,F]; stage 2 reads tclip(s_bc) [CODE]."""
        p = self.params
        h, a = h.double(), a.double().reshape(len(h), -1)
        s_bc = torch.sigmoid((h - p["mean1"]) / p["scale1"] @ p["w1"] + p["b1"])  # [n]
        x2 = torch.cat([a, tclip(s_bc, self.temperature, self.eps)[:, None]], 1)  # [n,F+1]
        s_final = torch.sigmoid((x2 - p["mean2"]) / p["scale2"] @ p["w2"] + p["b2"])  # [n]
        return s_bc, s_final

    def state(self) -> dict:
        return {
            "C": self.C,
            "temperature": self.temperature,
            "eps": self.eps,
            **{k: v.clone() for k, v in self.params.items()},
        }

    @classmethod
    def from_state(cls, state: dict) -> PairProbe:
        keys = ("mean1", "scale1", "w1", "b1", "mean2", "scale2", "w2", "b2")
        return cls(
            state["C"],
            state["temperature"],
            state["eps"],
            {k: torch.as_tensor(state[k], dtype=torch.float64) for k in keys},
        )
