"""E²PO's phase I: learn K−1 perturbations of every train prompt's content-token embeddings, the
policy frozen, before RL.

"E²PO: Embedding-perturbed Exploration Preference Optimization", arXiv 2605.15803 (ICML 2026),
https://arxiv.org/abs/2605.15803 — spec 15 (a public paper note with the equations; no code).

**Change vs GRPO**: none by itself. It runs before the RL steps on the policy as it is then and
produces the artifact that the rollout strategy ``e2po`` (``rollout/e2po.py``) samples under.

**Math** (``rollout.e2po.learn_prompt_perturbations``; per train row, all rows optimised together)::

    ids   = the row's prompt ids (as RL encodes them);  𝓘 = positions of its non-special tokens
    E     = table[ids] [S,d];  scale = RMS of the table's entries          (prompt_space: below)
    δ_k   ~ N(0, (sigma_init · scale)²) on 𝓘, k = 1..conditions−1
    e_k   = f(E + δ_k),  e_anc = f(E)        f = text: final-norm hidden state, last prompt token
                                                    (pool = "last") or mean;
                                             flow (condition = "embedding"): the policy's frozen random MLP encoder
    L_emb = lam_div · mean_{k≠k'} cos(e_k, e_k') + Σ_k max(0, |cos(e_k, e_anc) − mu| − eps)
    Adam(lr · scale) on δ for ``steps`` steps

The policy decides the table and f (``prompt_space``): a text policy's input embeddings and the
policy itself as encoder; a policy with ``prompt_encoder()`` (the flow toy's embedding condition,
``modalities/flow.py``: each label one 8-d token, S = 1, no special tokens) its token table and
its frozen encoder, the velocity net never run — the spec's CPU implementation.

**Defaults**

- ``conditions = 4`` [PAPER] the paper's "efficient" configuration (G, K) = (2, 4): the original
  plus 3 perturbations.
- ``steps = 200`` [INFERRED] the spec's CPU implementation ("Adam for 200 steps").
- ``lam_div = 1.0``, ``mu = 0.8``, ``eps = 0.1`` [INFERRED] the paper note gives no values; μ and ε
  are the spec's unit-test numbers.
- ``sigma_init = 0.5``, ``lr = 0.05`` [INFERRED] both in units of the embeddings' RMS entry, so
  they carry across models; the note gives no σ_init.
- ``pool = "last"`` [INFERRED] the text encoder f of the paper is the frozen policy itself here;
  its final hidden state at the last prompt token (the state every completion starts from).
  ``"mean"``: the mean over the prompt's tokens.
- ``rows = 0`` [INFERRED] every train row (RL may draw any of them); ``n > 0`` the first n (the
  ``e2po`` strategy then refuses a drawn row without perturbations).
- ``chunk = 256`` [INFERRED] prompts optimised together (memory only: the result is the same).

**Notes**

1. The policy is frozen: a text policy's parameters' ``requires_grad`` is switched off for the
   phase and restored after (a flow policy's encoder is buffers, its net is not run); the phase
   never changes the weights. ``δ`` is exactly 0 off 𝓘 (special tokens,
   padding), so the perturbation only touches content tokens.
2. With ``conditions = 2`` there is one perturbation and no diversity term (``L_div = 0``).
3. The artifact: ``keys`` [N] (train row indices), ``positions`` [N,L] (prompt positions of 𝓘,
   −1 padding), ``delta`` [N,conditions−1,L,d], ``conditions``; its summary the final mean
   ``L_emb``, ``L_div``, mean cos to the anchor and the seconds taken.
4. Randomness: δ's initialisation draws from ``ctx.seed`` (one generator per chunk, seeded by
   the seed and the chunk's first row), so a run's perturbations do not depend on anything else.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from groupwise.errors import ConfigError
from groupwise.phases import PhaseContext
from groupwise.registry import register
from groupwise.rollout.e2po import learn_prompt_perturbations


def lm_encoder(model, pool: str = "last"):
    """f(emb [M,S,d], real [M,S]) -> [M,D]: the model's final-norm hidden state of left-padded
    prompts given as input embeddings (the last column, or the mean over real tokens)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base.model

    def encode(emb: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)  # [M,S]
        # [M,S,D]
        h = decoder(inputs_embeds=emb, attention_mask=real.long(), position_ids=positions).last_hidden_state.float()
        if pool == "last":
            return h[:, -1]  # [M,D] left-padded: the last column is the last prompt token
        w = real.float()[..., None]  # [M,S,1]
        return (h * w).sum(1) / w.sum(1).clamp(min=1.0)  # [M,D]

    return encode


@contextlib.contextmanager
def _frozen_lm(model):
    """The LM's parameters without gradients and the model in eval mode, restored after."""
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    was_training = model.training
    model.eval()
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in frozen:
            p.requires_grad_(flag)
        model.train(was_training)


def prompt_space(policy, pool: str = "last") -> tuple[torch.Tensor, set[int], Callable, Any]:
    """What phase I needs of a policy: ``(table [V,d], special ids, f, frozen)`` — the token
    embedding table its prompt ids index, the ids never perturbed, the frozen encoder
    ``f(emb [M,S,d], real [M,S]) -> [M,D]`` and a context manager that freezes what f runs on.

    A text policy: its input embeddings, its tokenizer's special ids, :func:`lm_encoder` (the
    policy itself, ``pool``). A policy with its own prompt encoder (``prompt_encoder() -> (table,
    f)``, the flow toy's embedding condition, ``modalities/flow.py``): those, no special ids,
    nothing to freeze (the encoder is frozen by construction, the velocity net is not run)."""
    if hasattr(policy, "prompt_encoder"):
        try:
            table, encode = policy.prompt_encoder()
        except ValueError as err:
            raise ConfigError(f"phase e2po_perturbations: {err}") from None
        return table.detach(), set(), encode, contextlib.nullcontext()
    model, tok = getattr(policy, "module", None), getattr(policy, "tokenizer", None)
    if model is None or tok is None:
        raise ConfigError(
            "phase e2po_perturbations needs a text policy with a tokenizer "
            "or a policy with a prompt encoder (the flow toy with "
            f'model.params.condition = "embedding"); this one is {getattr(policy, "modality", "?")}'
        )
    return (
        model.get_input_embeddings().weight.detach(),
        set(tok.all_special_ids),
        lm_encoder(model, pool),
        _frozen_lm(model),
    )


@register("phase", "e2po_perturbations")
@dataclass
class E2POPerturbations:
    """E²PO phase I: conditions−1 diverse, meaning-anchored perturbations of each train prompt's content-token
    embeddings."""

    kind = "offline"
    artifact: str = "e2po_perturbations"
    conditions: int = 4
    steps: int = 200
    lam_div: float = 1.0
    mu: float = 0.8
    eps: float = 0.1
    sigma_init: float = 0.5
    lr: float = 0.05
    pool: str = "last"
    rows: int = 0
    chunk: int = 256

    def __post_init__(self) -> None:
        if self.conditions < 2:
            raise ConfigError(
                f"phase e2po_perturbations: conditions={self.conditions} must "
                "be >= 2 (the original prompt plus at least one perturbation)"
            )
        for key in ("steps", "chunk"):
            if getattr(self, key) < 1:
                raise ConfigError(f"phase e2po_perturbations: {key}={getattr(self, key)} must be >= 1")
        if (
            self.rows < 0
            or self.lam_div < 0
            or self.eps < 0
            or not -1.0 <= self.mu <= 1.0
            or self.sigma_init <= 0
            or self.lr <= 0
        ):
            raise ConfigError(
                f"phase e2po_perturbations: need rows >= 0 (got {self.rows}), lam_div "
                f">= 0 ({self.lam_div}), eps >= 0 ({self.eps}), mu in [-1, 1] "
                f"({self.mu}), sigma_init > 0 ({self.sigma_init}), lr > 0 ({self.lr})"
            )
        if self.pool not in ("last", "mean"):
            raise ConfigError(f"phase e2po_perturbations: pool={self.pool!r} must be 'last' or 'mean'")

    def __call__(self, ctx: PhaseContext) -> dict:
        policy, t0 = ctx.policy, time.perf_counter()
        n = len(ctx.train_rows) if self.rows == 0 else min(self.rows, len(ctx.train_rows))
        table, special, encoder, frozen = prompt_space(policy, self.pool)  # [V,d]
        scale = float(table.float().pow(2).mean().sqrt())
        K = self.conditions - 1
        keys, positions, deltas, losses, divs, coss = [], [], [], [], [], []
        with frozen:
            for start in range(0, n, self.chunk):
                idx = list(range(start, min(n, start + self.chunk)))
                prompts = [ctx.prompt("train", ctx.train_rows, i) for i in idx]
                content = [[j for j, t in enumerate(p) if t not in special] for p in prompts]
                if any(not c for c in content):
                    raise ConfigError(
                        "phase e2po_perturbations: train row "
                        f"{idx[[bool(c) for c in content].index(False)]} has no content tokens to perturb"
                    )
                S, L = max(len(p) for p in prompts), max(len(c) for c in content)
                ids = torch.zeros(len(idx), S, dtype=torch.long)  # [N,S] left-padded
                real = torch.zeros(len(idx), S, dtype=torch.bool)  # [N,S]
                cols = torch.full((len(idx), L), -1, dtype=torch.long)  # [N,L] content columns
                pos = torch.full((len(idx), L), -1, dtype=torch.long)  # [N,L] content prompt positions
                for r, (p, c) in enumerate(zip(prompts, content)):
                    ids[r, S - len(p) :], real[r, S - len(p) :] = torch.tensor(p), True
                    cols[r, : len(c)], pos[r, : len(c)] = torch.tensor(c) + S - len(p), torch.tensor(c)
                emb = table[ids].float()  # [N,S,d]
                gen = torch.Generator().manual_seed(ctx.seed * 1_000_003 + start)
                delta, stats = learn_prompt_perturbations(
                    emb,
                    real,
                    cols,
                    encoder,
                    K,
                    self.steps,
                    self.lam_div,
                    self.mu,
                    self.eps,
                    self.sigma_init * scale,
                    self.lr * scale,
                    gen,
                )  # [N,K,L,d]
                keys += idx
                positions.append(pos)
                deltas.append(delta)
                losses.append(stats["loss"])
                divs.append(stats["div"])
                coss.append(stats["cos_anchor"].reshape(-1))
        L = max(p.shape[1] for p in positions)
        position = torch.cat([torch.nn.functional.pad(p, (0, L - p.shape[1]), value=-1) for p in positions])  # [N,L]
        delta = torch.cat([torch.nn.functional.pad(d, (0, 0, 0, L - d.shape[2])) for d in deltas])  # [N,K,L,d]
        summary = {
            "rows": n,
            "conditions": self.conditions,
            "loss": float(torch.cat(losses).mean()),
            "div": float(torch.cat(divs).mean()),
            "cos_anchor": float(torch.cat(coss).mean()),
            "delta_rms_over_embedding_rms": float(
                delta[position[:, None, :].expand(-1, K, -1) >= 0].pow(2).mean().sqrt() / scale
            ),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        ctx.say(
            f"phase {self.artifact!r}: {n} prompts x {K} perturbations; L_emb {summary['loss']:.3f}, L_div "
            f"{summary['div']:.3f}, cos to the original {summary['cos_anchor']:.3f} ({summary['seconds']} s)"
        )
        return {
            "keys": torch.tensor(keys, dtype=torch.long),
            "positions": position,
            "delta": delta,
            "conditions": self.conditions,
            "summary": summary,
        }
