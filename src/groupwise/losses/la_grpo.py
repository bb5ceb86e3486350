"""LA-GRPO's anchor: the clipped surrogate again on the functional-token positions, averaged over their number.

ATLAS (a single discrete "functional token" as an agentic operation and latent visual reasoning
unit) and its Latent-Anchored GRPO (LA-GRPO), 2026 (the full title and the authors are not in our
sources). https://arxiv.org/abs/2605.15198, project page https://atlas-oneword.github.io/ (spec:
specs/18, status PARTIAL: the abstract, the project page and a summary; the loss form and its
weight are the spec's reconstruction). The functional-token-usage reward is ``rewards/functional_usage.py``.

**Change vs GRPO**

- A few vocabulary items are *functional tokens* F (ATLAS: ``<zoom>``, ``<aux_line>``, ...). They
  are rare in a rollout, so under sequence-mean GRPO each gets 1/|o_i| of its row's gradient,
  diluted by the ordinary tokens. LA-GRPO adds a statically weighted auxiliary term, the same
  per-token surrogate on the functional positions only, normalised by the *number of functional
  tokens in the batch*: each functional token gets a gradient of order A, not A/|o_i|.
- An objective term next to the main one: ``terms = ["ppo_clip", {name="la_grpo", coef=0.5}]``
  (or ``gspo``, any main term); ``coef`` is λ_anchor.

**Math** (``f`` = functional positions: loss tokens whose id is in F; ``ratio = exp(logp − logp_old)``)::

    loss_t = −min(ratio_t · adv_t, clip(ratio_t, 1 − eps_low, 1 + eps_high) · adv_t)   on f   (anchor="surrogate")
    loss_t = −adv_t · logp_t                                                             on f   (anchor="logprob")
    loss_t = 0                                                                           off f
    L_anchor = Σ_{rows,t} f · loss_t / max(1, Σ_{rows,t} f)      (agg="token_mean" over f: whole step batch, all ranks)
    L = L_main + coef · L_anchor

**Defaults**

- ``coef = 0.5`` [INFERRED] the spec's λ_anchor (the summary says only "static weighted").
- ``anchor = "surrogate"`` [INFERRED] the spec's reconstruction; ``"logprob"`` (a REINFORCE anchor
  −A·logπ) is the spec's alternative, kept because the loss form is not published.
- ``agg = "token_mean"`` [INFERRED] the spec's normaliser, the number of functional tokens in the
  batch; another aggregation applies to the functional tokens alone (e.g. ``seq_mean_token_mean``:
  the mean over rows with a functional token of their functional-token mean).
- ``eps_low = eps_high = 0.2`` [INFERRED] PPO's ε, as the main term.
- ``tokens = ["+", "-", "*"]`` [INFERRED] the operators of the ``op_select`` toy (the spec's CPU
  implementation: "op token selects the arithmetic operation"); ATLAS's own tokens are its own.

**Notes**

1. F is given as token *texts*, resolved once at build through the policy's vocabulary
   (``use_vocabulary``): a text must be the whole text of at least one token id (every id with that
   text is functional); one the tokenizer splits (``"<op1>"`` in the embedded model) is a build
   error naming it.
2. The term has its own tokens (``token_subset``, objective.py): the objective aggregates it over
   the functional loss tokens and its normaliser counts them once per optimiser step on the whole
   step batch, summed over ranks, so loss and gradient do not depend on the micro-batch split or
   the world size. A batch without a functional token gives exactly 0 (normaliser clamped to 1).
3. Values off ``f`` are exactly 0 and padding is neutralised before ``exp`` (``ratio_and_adv``).
   Token weights multiply the anchor like any term; a token a weight removes leaves ``f`` too.
4. ``on_policy_reinforce = False``: on-policy the anchor's gradient is REINFORCE's −adv·∇logp on
   the functional tokens only, under its own normaliser, not REINFORCE over every token.
5. Spec unit test (T = 10, A = +1, ratio 1, one functional token at t = 3, seq-mean main term):
   ∂L/∂logp_3 = −1/10 − 0.5·1 = −0.6 against −0.1 without the anchor; other tokens −0.1.
6. ``stats``: ``la_grpo/func_frac`` (share of loss tokens that are functional) and
   ``la_grpo/func_rows`` (share of rows with one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.losses._common import check_clip, clipped_surrogate, ratio_and_adv, term_mask
from groupwise.masked import masked_input
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

ANCHORS = ("surrogate", "logprob")


def resolve_tokens(tokens: list[str], token_text: list[str], who: str) -> list[int]:
    """Every token id whose text is one of ``tokens``; a text no single token has is an error."""
    ids = []
    for text in tokens:
        found = [i for i, t in enumerate(token_text) if t == text]
        if not found:
            raise ConfigError(
                f"{who}: functional token {text!r} is not one token of the policy's vocabulary (no token id has "
                f"this text; the tokenizer splits it into several): list single-token texts, or add it to the tokenizer"
            )
        ids += found
    return sorted(set(ids))


def functional_token_mask(token_ids: Tensor, func_ids: Tensor, mask: Tensor) -> Tensor:
    """[..., T] bool: loss positions whose token id is functional (spec interface)."""
    return torch.isin(token_ids, func_ids) & mask.bool()  # [..., T]


@register("objective", "la_grpo")
@dataclass
class LAGRPOAnchor:
    """Clipped surrogate on functional-token positions, normalised by their count (LA-GRPO anchor, ATLAS 2026)."""

    tokens: list = field(default_factory=lambda: ["+", "-", "*"])
    anchor: str = "surrogate"  # "surrogate" | "logprob"
    eps_low: float = 0.2
    eps_high: float = 0.2
    coef: float = 0.5
    agg: str | None = "token_mean"
    _ids: Any = field(default=None, init=False, repr=False)

    needs = ()
    on_policy_reinforce = False  # REINFORCE on the functional tokens only (Note 4)

    def __post_init__(self) -> None:
        check_clip("la_grpo", self.eps_low, self.eps_high)
        if self.anchor not in ANCHORS:
            raise ConfigError(f"objective la_grpo: anchor must be one of {ANCHORS}, got {self.anchor!r}")
        if (
            not isinstance(self.tokens, (list, tuple))
            or not self.tokens
            or not all(isinstance(t, str) and t for t in self.tokens)
        ):
            raise ConfigError(
                f"objective la_grpo: tokens must be a non-empty list of non-empty token texts, got {self.tokens!r}"
            )
        if len(set(self.tokens)) != len(self.tokens):
            raise ConfigError(f"objective la_grpo: tokens lists a text twice: {self.tokens!r}")

    def use_vocabulary(self, token_text: list[str]) -> None:
        self._ids = torch.tensor(resolve_tokens(list(self.tokens), token_text, "objective la_grpo"), dtype=torch.long)

    def token_subset(self, rollout: Rollout) -> Tensor:
        """[b,G,T] bool: positions holding a functional token (the objective intersects the loss mask)."""
        if self._ids is None:
            raise ValueError(
                "objective la_grpo has no vocabulary: it needs a text "
                "policy (the trainer calls use_vocabulary at build)"
            )
        return torch.isin(rollout.actions, self._ids)  # [b,G,T]

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        mask = term_mask(mb)  # [b,G,T]
        # [b,G,T]
        f = functional_token_mask(mb.actions, self._ids, mask) if self._ids is not None else self.token_subset(mb)
        ratio, adv = ratio_and_adv(mb, out, "la_grpo")  # [b,G,T], [b,G,T]
        if self.anchor == "surrogate":
            loss = clipped_surrogate(ratio, adv, self.eps_low, self.eps_high)  # [b,G,T]
        else:
            loss = -adv * masked_input(out["logp"], mask)  # [b,G,T]
        return torch.where(f, loss, torch.zeros((), dtype=loss.dtype))  # [b,G,T] exactly 0 off f

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        f = (
            functional_token_mask(mb.actions, self._ids, term_mask(mb))
            if self._ids is not None
            else self.token_subset(mb)
        )  # [b,G,T]
        return {"la_grpo/func_frac": f.float(), "la_grpo/func_rows": f.any(-1).float()}  # [b,G,T], [b,G]
