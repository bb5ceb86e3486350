"""The composed objective: ``loss = Σ_k coef_k · aggregate_k(term_k)``.

Each term returns losses per token ``[b,G,T]`` or per row ``[b,G]`` for one micro-batch. Token
weights (stage ``weight``, combined by :func:`token_weights`) reach a term as the term declares with
its class attribute ``token_weights`` (one declaration per term, so no combination is silent):

- ``"token"`` (the default): the term returns per-token values and the weight multiplies each one
  (TRL and verl multiply ``per_token_loss`` / ``pg_losses`` by the IS ratio, entropy or off-policy
  mask). A term declaring it must return ``[b,G,T]``.
- ``"row:<reduction>"``: the term returns row values and the weight is first reduced to one factor
  per row over the row's loss tokens, ``ROW_REDUCTIONS``: ``"row:geo_mean"`` is exp(mean_t log w),
  verl's sequence geometric mean of ``rollout_is_weights`` in ``compute_policy_loss_geo_mean`` (GMPO).
- ``"exempt"``: the weight's values never scale the term, by design of the references (the KL term
  and the entropy bonus, which TRL and verl add after weighting the policy loss); tokens a weight of
  scope ``"token"`` removes still leave it.
- ``"none"``: the term cannot take token weights (a group contrast or a regression of whole
  sequences: no reference defines a weighted form); a configuration that combines it with any token
  weight is a ``ConfigError`` (:func:`check_token_weights`, run where the objective is built), which
  names the term, the weight and the term's ``token_weights_reason``.

A configuration whose token weights reach no term (every term ``"exempt"``) is refused too. A token
removed by a weight of scope ``"token"`` leaves the loss and every normaliser (``rollout.extras["counted"]``).
Normalisers are computed once per optimiser step on the whole step batch (and summed over
ranks) by :meth:`Objective.normalizers`, so that the micro-batch losses add up exactly to the loss
of the whole batch: loss and gradient do not depend on the micro-batch split or world size.

A term may define ``token_subset(rollout) -> [B,G,T] bool``: its own tokens. It is then aggregated
over ``loss_mask & token_subset`` only, and its aggregation's normaliser counts only those tokens
(computed with the others, once per optimiser step on the whole step batch and summed over ranks),
e.g. a term on a sparse set of token positions averaged over their number (LA-GRPO's anchor).

Any term entry may carry a row filter, ``rows = {extra = "NAME", equals = V}`` (a key of the entry,
read by the objective, never by the term): the term is then aggregated over the rows whose row
extra ``NAME`` equals ``V`` only (or, when ``NAME`` is a token extra, over the tokens whose value is
``V``), and its normaliser counts only their tokens, exactly as a ``token_subset`` does
(:class:`RowFilter`). Two entries of one term with different filters are role-specific copies of it:
DPA-GRPO's KL per game role, ``{name = "kl", key = "kl_v", rows = {extra = "game_role", equals = 1}}``
and ``kl_g`` on ``equals = 0``; LAC's per-part clips, two ``ppo_clip`` entries on the planner kind's
token extra ``part`` (0 plan positions, 1 generator steps), each with its own clip range.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.registry import build, build_spec
from groupwise.types import ANCHOR, Need, Rollout, StepInfo


def geo_mean_factor(weight: Tensor, mask: Tensor) -> Tensor:
    """[b,G] exp(Σ_t mask·log w / Σ_t mask): the sequence geometric mean of the token weights (verl
    ``compute_policy_loss_geo_mean``: ``exp(Σ log(w + 1e-10)·mask / (|y| + 1e-8))``). A weight 0 on one of
    the row's tokens gives 0 (verl: 1e-10^(k/|y|)); a row without loss tokens gives 1 (it does not count)."""
    log_w = torch.where(mask, weight.double().log(), torch.zeros((), dtype=torch.float64))  # [b,G,T] −inf at w = 0
    n = mask.sum(-1).clamp(min=1).double()  # [b,G]
    return torch.exp(log_w.sum(-1) / n).float()  # [b,G]


ROW_REDUCTIONS = {"geo_mean": geo_mean_factor}  # "row:<name>": [b,G,T] weight, mask -> [b,G] row factor
TOKEN_WEIGHT_MODES = ("token", "exempt", "none", *(f"row:{name}" for name in ROW_REDUCTIONS))


def _name(component: Any) -> str:
    return getattr(component, "registry_name", type(component).__name__)


def token_weight_mode(term: Any) -> str:
    """How token weights reach ``term``: its ``token_weights`` declaration ("token" when it has none)."""
    mode = getattr(term, "token_weights", "token")
    if mode not in TOKEN_WEIGHT_MODES:
        raise ConfigError(
            f"objective term {_name(term)!r} declares token_weights={mode!r}; "
            f"a term declares one of {TOKEN_WEIGHT_MODES}"
        )
    return mode


def check_token_weights(terms: list[Any], weights: list[Any]) -> None:
    """Refuse token weights that a term cannot take (``token_weights = "none"``) or that reach no term."""
    if not weights:
        return
    named = ", ".join(repr(_name(w)) for w in weights)
    modes = [token_weight_mode(term) for term in terms]
    for term, mode in zip(terms, modes):
        if mode == "none":
            reason = getattr(term, "token_weights_reason", "it declares token_weights = 'none'")
            raise ConfigError(
                f"objective term {_name(term)!r} cannot take the token weight(s) {named}: {reason}. "
                f"Remove objective.weights or use a term that takes token weights "
                f"(e.g. ppo_clip, gspo, luspo, gmpo)"
            )
    if terms and all(mode == "exempt" for mode in modes):
        exempt = ", ".join(repr(_name(t)) for t in terms)
        raise ConfigError(
            f"the token weight(s) {named} reach no objective term: every term ({exempt}) is exempt from "
            f"token weights; add a policy-gradient term (ppo_clip, gspo, ...) or drop objective.weights"
        )


@dataclass(frozen=True)
class RowFilter:
    """A term entry's ``rows = {extra = NAME, equals = V}``: the rows whose row extra ``NAME`` equals ``V``
    (a token extra: the tokens whose value is ``V``)."""

    extra: str
    equals: float

    @classmethod
    def from_spec(cls, spec: Any, where: str) -> RowFilter:
        if not isinstance(spec, dict) or set(spec) != {"extra", "equals"}:
            raise ConfigError(
                f'{where}: rows={spec!r}; a row filter is a table rows = {{extra = "NAME", equals = VALUE}} '
                "(the rows whose row extra NAME equals VALUE)"
            )
        if not isinstance(spec["equals"], (int, float)) or isinstance(spec["equals"], bool):
            raise ConfigError(f"{where}: rows.equals={spec['equals']!r} must be a number (row extras are float32)")
        return cls(str(spec["extra"]), float(spec["equals"]))

    def __call__(self, rollout: Rollout) -> Tensor:
        """[B,G,1] bool: the rows this filter keeps (a row extra); [B,G,T]: the tokens (a token extra)."""
        value, level = rollout.extras.get(self.extra), rollout.extra_levels.get(self.extra)
        if value is None or level not in ("row", "token") or value.dim() != 2 + (level == "token"):
            raise ValueError(
                f"an objective term's rows filter reads the extra {self.extra!r}, which this batch does not carry "
                f"as a row extra [B,G] or a token extra [B,G,T] (it has {sorted(rollout.extras) or 'no extras'}); "
                "use a rollout strategy that sets it (its collects) or a policy that writes it, or drop the filter"
            )
        keep = value == self.equals  # [B,G] or [B,G,T]
        return keep[..., None] if level == "row" else keep  # [B,G,1] or [B,G,T]


@dataclass
class Objective:
    terms: list[Any]
    aggregations: dict[str, Any]  # aggregation name -> component
    default_agg: str
    stat_sums: dict[str, float] = field(default_factory=dict)
    stat_counts: dict[str, float] = field(default_factory=dict)
    row_filters: list[RowFilter | None] = field(default_factory=list)  # per term (empty: none filtered)

    @classmethod
    def from_config(cls, term_specs: list, default_agg: str, weights: Sequence[Any] = ()) -> Objective:
        """The objective of ``term_specs``; ``weights``: the built token-weight components it will be
        given (a combination a term cannot take is a ``ConfigError`` here, at build). An entry's
        ``rows`` key is its row filter (module docstring), not a parameter of the term."""
        filters = [
            RowFilter.from_spec(spec["rows"], f"objective.terms[{i}]")
            if isinstance(spec, dict) and "rows" in spec
            else None
            for i, spec in enumerate(term_specs)
        ]
        terms = [build_spec("objective", spec) for spec in term_specs]  # build_spec leaves the entry's rows to us
        check_token_weights(terms, list(weights))
        agg_names = {default_agg} | {t.agg for t in terms if getattr(t, "agg", None)}
        # sorted: normalizers all-reduce one tensor per aggregation in this order, which must be the same
        # on every rank (a set's order follows the per-process string hash)
        aggregations = {name: build("aggregation", name) for name in sorted(agg_names)}
        return cls(terms, aggregations, default_agg, row_filters=filters if any(filters) else [])

    @property
    def needs(self) -> list[Need]:
        return [n for t in self.terms for n in getattr(t, "needs", ())]

    @property
    def rollout_extras(self) -> tuple[str, ...]:
        """The extras the terms' row filters read (the strategy must collect them, or the policy write them:
        ``check_strategy``)."""
        return tuple(sorted({f.extra for f in self.row_filters if f is not None}))

    def _agg_name(self, term: Any) -> str:
        return getattr(term, "agg", None) or self.default_agg

    def _row_filter(self, index: int) -> RowFilter | None:
        return self.row_filters[index] if self.row_filters else None

    def _own_tokens(self, index: int, term: Any) -> bool:
        """Whether the term is aggregated over tokens of its own (a ``token_subset`` or a row filter)."""
        return hasattr(term, "token_subset") or self._row_filter(index) is not None

    def _norm_key(self, index: int, term: Any) -> str:
        """Key of a term's normaliser: its aggregation's, or its own when it has tokens of its own."""
        agg = self._agg_name(term)
        return f"{agg}@term{index}" if self._own_tokens(index, term) else agg

    def _term_mask(self, index: int, term: Any, mask: Tensor, rollout: Rollout) -> Tensor:
        """[B,G,T] bool: ``mask`` restricted to the term's own tokens (``token_subset``) and rows (``rows``)."""
        if hasattr(term, "token_subset"):
            mask = mask & term.token_subset(rollout).bool()  # [B,G,T]
        row_filter = self._row_filter(index)
        if row_filter is not None:
            mask = mask & row_filter(rollout)  # [B,G,T]
        return mask

    def loss_mask(self, rollout: Rollout) -> Tensor:
        """[B,G,T] bool: the tokens that receive loss and count in every normaliser: valid rows, mask,
        not an ``anchor`` row (generated and scored, never trained: ``types.ANCHOR``), and not removed
        by a token weight (``extras["counted"]``; without it, non-zero ``weight``)."""
        mask = rollout.row_mask  # [B,G,T]
        if ANCHOR in rollout.row_flags:
            mask = mask & ~rollout.flag(ANCHOR)[..., None]  # [B,G,T]
        if "counted" in rollout.extras:
            mask = mask & rollout.extras["counted"]  # [B,G,T]
        elif rollout.weight is not None:
            mask = mask & (rollout.weight != 0)  # [B,G,T]
        return mask

    def normalizers(
        self, rollout: Rollout, info: StepInfo, all_reduce: Callable[[Tensor], Tensor] | None = None
    ) -> dict[str, dict[str, Tensor]]:
        """Once per optimiser step, over the whole step batch; every value is a sum over rows so
        that summing over ranks gives the global value."""
        mask = self.loss_mask(rollout)  # [B,G,T]
        norms = {}
        for name, agg in self.aggregations.items():
            norm = agg.normalizer(mask, info)
            if all_reduce is not None:
                norm = {k: all_reduce(v) for k, v in norm.items()}
            norms[name] = norm
        for index, term in enumerate(self.terms):  # terms with their own tokens: in term order, the same on every rank
            if self._own_tokens(index, term):
                norm = self.aggregations[self._agg_name(term)].normalizer(
                    self._term_mask(index, term, mask, rollout), info
                )
                norms[self._norm_key(index, term)] = (
                    {k: all_reduce(v) for k, v in norm.items()} if all_reduce is not None else norm
                )
        return norms

    def loss(
        self,
        mb: Rollout,
        out: dict[str, Tensor],
        norms: dict[str, dict[str, Tensor]],
        info: StepInfo,
        record: bool = True,
    ) -> Tensor:
        """Scalar loss of one micro-batch: its share of the whole step's loss. ``record``: accumulate
        the terms' statistics (the trainer records them on the first call of a closure only)."""
        mask = self.loss_mask(mb)  # [b,G,T]
        total = out["logp"].new_zeros(())
        for index, term in enumerate(self.terms):
            values = term(mb, out, info)  # [b,G,T] or [b,G]
            term_mask = self._term_mask(index, term, mask, mb)  # [b,G,T]
            values = self._weigh(term, values, mb.weight, term_mask)  # [b,G,T] or [b,G]
            agg = self.aggregations[self._agg_name(term)]
            total = total + term.coef * agg.reduce(values, term_mask, norms[self._norm_key(index, term)])
            if record and hasattr(term, "stats"):
                with torch.no_grad():
                    # a row-filtered term's statistics are its own rows' (the roles' KL terms: each its role's)
                    self._accumulate(term.stats(mb, out), term_mask if self._row_filter(index) else mask)
        return total

    @staticmethod
    def _weigh(term: Any, values: Tensor, weight: Tensor | None, mask: Tensor) -> Tensor:
        """``values`` with the token weight applied as the term declares (module docstring)."""
        mode = token_weight_mode(term)
        name = _name(term)
        if mode == "token" and values.dim() != 3:
            raise ValueError(
                f"objective term {name!r} returned row values {tuple(values.shape)} but takes token "
                f"weights per token (token_weights = 'token'): return [b,G,T] values or declare "
                f"token_weights = 'row:<reduction>' or 'none'"
            )
        if mode.startswith("row:") and values.dim() != 2:
            raise ValueError(
                f"objective term {name!r} declares token_weights = {mode!r} but returned "
                f"{tuple(values.shape)}, not [b,G] row values"
            )
        if weight is None or mode == "exempt":
            return values
        if mode == "none":
            reason = getattr(term, "token_weights_reason", "token_weights = 'none'")
            raise ValueError(
                f"objective term {name!r} cannot take token weights ({reason}), but the batch carries "
                f"them: build the objective with Objective.from_config(..., weights) to refuse the pair"
            )
        if mode == "token":
            return values * weight  # [b,G,T]
        return values * ROW_REDUCTIONS[mode[4:]](weight, mask)  # [b,G]

    # ------------------------------------------------------------------ statistics
    def _accumulate(self, stats: dict[str, Tensor], mask: Tensor) -> None:
        for key, value in stats.items():
            m = mask if value.dim() == 3 else mask.any(-1)  # [b,G,T] or [b,G]
            self.stat_sums[key] = self.stat_sums.get(key, 0.0) + float(value.float()[m].sum())
            self.stat_counts[key] = self.stat_counts.get(key, 0.0) + float(m.sum())

    def pop_stats(self, all_reduce: Callable[[Tensor], Tensor] | None = None) -> dict[str, float]:
        """Token-mean of every term statistic since the last call (e.g. clip fractions), over all ranks."""
        keys = sorted(self.stat_sums)
        sums = torch.tensor([[self.stat_sums[k], self.stat_counts[k]] for k in keys], dtype=torch.float64).reshape(
            -1, 2
        )  # [K,2]
        if all_reduce is not None:
            sums = all_reduce(sums)
        self.stat_sums.clear()
        self.stat_counts.clear()
        return {k: float(total / max(count, 1.0)) for k, (total, count) in zip(keys, sums.tolist())}


def token_weights(components: list[Any], rollout: Rollout, info: StepInfo) -> tuple[Tensor, Tensor]:
    """(weight [B,G,T] float32, counted [B,G,T] bool) from the token-weight components, on the whole batch.

    ``weight`` is the product of every component's output; it reaches each term as the term declares
    (``token_weights``: per token, reduced per row, exempt; see the module docstring).
    A component of ``scope = "token"`` (the default) also removes its zero-weight tokens from the loss
    of every term and from every normaliser (overlong filtering); one of ``scope = "loss"`` only scales
    the terms, so its zero-weight tokens still count in the normalisers (the 80/20 rule's token count)."""
    weight = torch.ones_like(rollout.mask, dtype=torch.float32)  # [B,G,T]
    counted = torch.ones_like(rollout.mask, dtype=torch.bool)  # [B,G,T]
    for component in components:
        w = component(rollout, info)  # [B,G,T]
        weight = weight * w  # [B,G,T]
        scope = getattr(component, "scope", "token")
        if scope not in ("token", "loss"):
            raise ValueError(
                f"{getattr(component, 'registry_name', component)}: scope must be 'token' or 'loss', got {scope!r}"
            )
        if scope == "token":
            counted = counted & (w != 0)  # [B,G,T]
    return weight, counted
