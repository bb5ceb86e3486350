"""Contract tests over every registry entry of the stages advantage, objective, weight,
aggregation and kl (DESIGN §6). Components are built with their defaults, so a new variant is
picked up automatically.

Checked for each entry: output shapes and dtype; finite outputs on constant groups, NaN rewards,
invalid rows and garbage padding; masked tokens get exactly zero gradient through the composed
``Objective``; permuting a group's rows (every row field) permutes the outputs.

On-policy reduction: an objective term whose output depends on ``logp_old`` (a ratio term) must,
on-policy (``logp_old = logp.detach()``), have exactly the REINFORCE gradient −adv·∇logp under
every aggregation. For ``gspo`` this is its GSPO-token form: the sequence-level REINFORCE gradient
adv·∇mean_t(logp) it reduces to is the same thing once rows are token-averaged. A term whose
on-policy gradient is legitimately different opts out with a class attribute
``on_policy_reinforce = False`` (and says why in its docstring).
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers import (
    EXAMPLE_ARTIFACTS,
    fill_inputs,
    info_for,
    make_logp,
    make_rollout,
    objective_for,
    permute_rows,
    permute_tensor,
    random_perm,
)

from groupwise.registry import build, entries

STAGES = ("advantage", "objective", "weight", "aggregation", "kl")
# the sweeps build text rollouts: components of another modality or reading a non-text policy's extras are left out
ALL = [
    (s, n)
    for s, n, c in entries()
    if s in STAGES and getattr(c, "modality", "text") == "text" and not getattr(c, "reads_extras", ())
]
ADV = [n for s, n in ALL if s == "advantage"]
TERMS = [n for s, n in ALL if s == "objective"]
WEIGHTS = [n for s, n in ALL if s == "weight"]
AGGS = [n for s, n in ALL if s == "aggregation"]
KLS = [n for s, n in ALL if s == "kl"]

B, G, T = 3, 4, 5


def _term_setup(name, seed=0, **kw):
    term = build("objective", name)
    # a term that reads right/wrong verdicts gets 0/1 rewards
    kw.setdefault("binary", getattr(term, "binary_rewards", False))
    ro = make_rollout(B, G, T, seed=seed, **kw)
    # needs, and token texts for a term that reads them (la_grpo's functional tokens)
    out = fill_inputs(ro, term, seed=seed + 10)
    # an offline phase's output (DISA's log Z table): the sweeps' example
    for artifact in getattr(term, "artifacts", ()):
        term.use_artifact(artifact, EXAMPLE_ARTIFACTS[artifact](seed))
    logp = make_logp(ro, seed=seed + 1)
    out["logp"] = logp
    return term, ro, out, logp


def _grad_through_objective(terms, ro, out, logp, agg):
    obj = objective_for(terms, agg)
    info = info_for(T)
    loss = obj.loss(ro, out, obj.normalizers(ro, info), info)
    # every grad input of the terms counts: logp, entropy for an entropy bonus, and a per-token vector
    # such as logprobs [B,G,T,V] (ssopd), reduced to its magnitude per token
    inputs = [logp] + [v for v in out.values() if v is not logp and v.requires_grad and v.shape[:3] == logp.shape]
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    grad = sum(
        torch.zeros_like(logp) if g is None else g if g.dim() == 3 else g.abs().flatten(3).sum(-1) for g in grads
    )
    return loss, grad, obj.loss_mask(ro)


def test_every_stage_has_entries():
    for stage in STAGES:
        assert [n for s, n in ALL if s == stage], f"no {stage} component registered"


# Stages whose components follow the DESIGN §4 docstring template (a superset of STAGES, which
# parametrises the numeric contracts above and below).
DOC_STAGES = STAGES + ("reward", "sampling", "update", "rollout", "schedule", "view", "provider")
SECTIONS = ("Change vs GRPO", "Math", "Defaults", "Notes")
PROVENANCE = re.compile(r"\[(CODE|PAPER|ABSTRACT|INFERRED)")


def _template_problems(cls) -> list[str]:
    """What the module docstring of ``cls`` lacks of the DESIGN §4 template (empty: nothing)."""
    import dataclasses

    doc = __import__(cls.__module__, fromlist=["_"]).__doc__ or ""
    heads = [doc.find(f"**{word}**") for word in SECTIONS]
    problems = [f"no **{word}** heading" for word, at in zip(SECTIONS, heads) if at < 0]
    if problems:
        return problems
    if heads != sorted(heads):
        problems.append(f"headings out of order (want {' · '.join(SECTIONS)})")
    defaults = doc[heads[2] : heads[3]]
    fields = [f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]
    if fields and not PROVENANCE.search(defaults):
        problems.append(
            f"**Defaults** tags none of its defaults ({', '.join(fields)}) with [CODE]/[PAPER]/[ABSTRACT]/[INFERRED]"
        )
    if not re.search(r"^\s*1\. ", doc[heads[3] :], re.M):
        problems.append("**Notes** are not numbered (no '1. ' item)")
    return problems


def test_docstrings_and_dataclass_fields():
    import dataclasses
    import sys
    import types

    # the check itself can fail: a fake variant module with an unheaded docstring, then a partial one
    fake = dataclasses.make_dataclass("Fake", [("coef", float, 1.0)])
    fake.__module__ = "groupwise_fake_variant"
    sys.modules[fake.__module__] = types.ModuleType(fake.__module__, "A variant. Math, Defaults and Notes, unheaded.")
    try:
        assert len(_template_problems(fake)) == len(SECTIONS)  # every heading missing
        sys.modules[
            fake.__module__
        ].__doc__ = "**Change vs GRPO**: x\n**Math** y\n**Defaults**\n- coef = 1\n**Notes**\nsee above"
        assert [p.split(" ")[0] for p in _template_problems(fake)] == [
            "**Defaults**",
            "**Notes**",
        ]  # untagged, unnumbered
        sys.modules[
            fake.__module__
        ].__doc__ = "**Change vs GRPO**: x\n**Math** y\n**Defaults**\n- coef = 1 [PAPER]\n**Notes**\n1. z"
        assert _template_problems(fake) == []
    finally:
        del sys.modules[fake.__module__]

    failures = []
    for stage, name, cls in entries():
        if stage not in DOC_STAGES:
            continue
        assert dataclasses.is_dataclass(cls), f"{stage}/{name}"
        assert (cls.__doc__ or "").strip().splitlines()[0], f"{stage}/{name}: class docstring needs a first line"
        failures += [f"{stage}/{name} ({cls.__module__}): {p}" for p in _template_problems(cls)]
    assert not failures, "module docstrings off the DESIGN §4 template:\n" + "\n".join(failures)


SUMMARY_SOURCE = re.compile(r"summary|project page|arxivlens", re.I)


def _paper_tags_on_summaries(text: str, by_line: bool = False) -> list[str]:
    """The items of ``text`` (``- `` bullets and numbered notes of a docstring, or lines of a recipe) that
    tag ``[PAPER]`` a value they say comes from a summary or a project page: specs/README's
    ``[PAPER-SUMMARY]``, not the paper."""
    items = text.splitlines() if by_line else re.split(r"\n(?=\s*- |\s*\d+\. )", text)
    return [item.strip()[:100] for item in items if "[PAPER]" in item and SUMMARY_SOURCE.search(item)]


def test_paper_tag_is_not_given_to_a_summary_source():
    from pathlib import Path

    import groupwise

    check = _paper_tags_on_summaries("- a = 1 [PAPER] (arxivlens summary)\n- b = 2 [PAPER-SUMMARY] summary")
    assert check == ["- a = 1 [PAPER] (arxivlens summary)"]  # the check itself can fail
    found = [
        f"{m}: {item}"
        for m in sorted({c.__module__ for _, _, c in entries()})
        for item in _paper_tags_on_summaries(__import__(m, fromlist=["_"]).__doc__ or "")
    ]
    recipes = sorted((Path(groupwise.__file__).parent / "recipes").glob("*.toml"))
    found += [f"{p.name}: {item}" for p in recipes for item in _paper_tags_on_summaries(p.read_text(), by_line=True)]
    assert not found, "[PAPER] on a value read in a summary or project page (tag [PAPER-SUMMARY]):\n" + "\n".join(found)


# ---------------------------------------------------------------------------------------------- advantage
@pytest.mark.parametrize("name", ADV)
def test_advantage_shape_finite_and_invalid_rows_zero(name):
    est = build("advantage", name)
    ro = make_rollout(B, G, T, seed=1)
    fill_inputs(ro, est)
    adv = est(ro, info_for(T))
    assert adv.dtype == torch.float32
    assert tuple(adv.shape[:2]) == (B, G) and adv.dim() in (2, 3)
    assert torch.isfinite(adv).all()
    excluded = ~(ro.group_valid & torch.isfinite(ro.rewards))  # [B,G]
    excl = excluded if adv.dim() == 2 else excluded[..., None].expand_as(adv)
    assert (adv[excl] == 0).all()


@pytest.mark.parametrize("name", ADV)
def test_advantage_constant_and_degenerate_groups_finite(name):
    est = build("advantage", name)
    ro = make_rollout(4, G, T, seed=2, binary=True)
    ro.rewards = torch.tensor([[1.0, 1, 1, 1], [0, 0, 0, 0], [0.3, 0.3, 0.3, 0.3], [1, 0, 1, 0]])
    ro.group_valid = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    fill_inputs(ro, est)
    adv = est(ro, info_for(T))
    assert torch.isfinite(adv).all()
    assert (adv[3] == 0).all()  # empty group
    assert (adv[2, 1:] == 0).all()  # single-sample group: only its valid row may be non-zero


@pytest.mark.parametrize("name", ADV)
def test_advantage_row_permutation_equivariant(name):
    est = build("advantage", name)
    ro = make_rollout(B, G, T, seed=3)
    fill_inputs(ro, est)
    perm = random_perm(B, G)
    adv = est(ro, info_for(T))
    adv_p = est(permute_rows(ro, perm), info_for(T))
    torch.testing.assert_close(adv_p, permute_tensor(adv, perm), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ADV)
def test_advantage_feeds_objective_with_zero_grad_on_masked(name):
    est = build("advantage", name)
    ro = make_rollout(B, G, T, seed=4)
    fill_inputs(ro, est)
    ro.advantages = est(ro, info_for(T))
    logp = make_logp(ro)
    loss, grad, mask = _grad_through_objective([build("objective", "ppo_clip")], ro, {"logp": logp}, logp, "token_mean")
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert (grad[~mask] == 0).all()


# ---------------------------------------------------------------------------------------------- objective
@pytest.mark.parametrize("name", TERMS)
@pytest.mark.parametrize("token_adv", [False, True])
def test_term_shape_dtype_finite(name, token_adv):
    term, ro, out, _ = _term_setup(name, token_adv=token_adv)
    values = term(ro, out, info_for(T))
    assert values.dtype == torch.float32
    assert tuple(values.shape) in ((B, G, T), (B, G))
    assert torch.isfinite(values).all()
    for attr in ("coef", "agg"):
        assert hasattr(term, attr), f"{name} lacks {attr}"
    if hasattr(term, "stats"):
        for key, v in term.stats(ro, out).items():
            assert tuple(v.shape) in ((B, G, T), (B, G)), key
            assert not v.requires_grad, key


@pytest.mark.parametrize("name", TERMS)
@pytest.mark.parametrize("agg", AGGS)
def test_term_masked_tokens_get_zero_grad(name, agg):
    term, ro, out, logp = _term_setup(name, seed=5, token_adv=True)
    loss, grad, mask = _grad_through_objective([term], ro, out, logp, agg)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert (grad[~mask] == 0).all(), f"{name}/{agg}: gradient leaks to masked tokens"
    assert (grad[mask] != 0).any(), f"{name}: no gradient at all"


@pytest.mark.parametrize("name", TERMS)
def test_term_row_permutation_equivariant(name):
    term, ro, out, logp = _term_setup(name, seed=6)
    perm = random_perm(B, G)
    values = term(ro, out, info_for(T))
    out_p = {k: permute_tensor(v, perm) for k, v in out.items()}
    values_p = term(permute_rows(ro, perm), out_p, info_for(T))
    mask = ro.row_mask if values.dim() == 3 else ro.row_mask.any(-1)
    mask_p = permute_tensor(mask, perm)
    torch.testing.assert_close(values_p[mask_p], permute_tensor(values, perm)[mask_p], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", TERMS)
def test_term_constant_groups_finite(name):
    term, ro, out, logp = _term_setup(name, seed=7)
    ro.rewards = torch.ones(B, G)
    ro.advantages = build("advantage", "grpo")(ro, info_for(T))  # all zero
    loss, grad, mask = _grad_through_objective([term], ro, out, logp, "token_mean")
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


@pytest.mark.parametrize("name", TERMS)
def test_term_keeps_float32_under_bf16_logp(name):
    term, ro, out, logp = _term_setup(name, seed=8)
    rounded = logp.detach().to(torch.bfloat16)
    v16 = term(ro, {**out, "logp": rounded}, info_for(T))
    v32 = term(ro, {**out, "logp": rounded.float()}, info_for(T))
    assert v16.dtype == torch.float32, f"{name}: losses must be float32 even for bf16 log-probs"
    torch.testing.assert_close(v16, v32, atol=1e-6, rtol=1e-6)


def _uses_logp_old(term, ro, out):
    with torch.no_grad():
        a = term(ro, out, info_for(T))
        shifted = ro.select(list(range(B)))
        shifted.logp_old = ro.logp_old + 0.5
        b = term(shifted, out, info_for(T))
    m = ro.row_mask if a.dim() == 3 else ro.row_mask.any(-1)
    return not torch.equal(a[m], b[m])


@pytest.mark.parametrize("name", TERMS)
@pytest.mark.parametrize("agg", AGGS)
def test_ratio_terms_on_policy_equal_reinforce(name, agg):
    term, ro, out, logp = _term_setup(name, seed=9, token_adv=False)
    if not _uses_logp_old(term, ro, out):
        pytest.skip(f"{name} does not use logp_old (no ratio)")
    if not getattr(term, "on_policy_reinforce", True):
        pytest.skip(f"{name} opts out: on_policy_reinforce = False")
    ro.logp_old = torch.where(ro.mask, logp.detach(), ro.logp_old)  # on-policy inside the mask
    _, grad, mask = _grad_through_objective([term], ro, out, logp, agg)
    _, grad_pg, _ = _grad_through_objective([build("objective", "reinforce")], ro, out, logp, agg)
    torch.testing.assert_close(grad, grad_pg, atol=1e-7, rtol=1e-6)
    assert (grad_pg[mask] != 0).any()


# ---------------------------------------------------------------------------------------------- weight
@pytest.mark.parametrize("name", WEIGHTS)
def test_weight_shape_and_zero_grad(name):
    w = build("weight", name)
    ro = make_rollout(B, G, T, seed=11)
    fill_inputs(ro, w)  # needs, and token texts for a weight that maps roles from tags (srpo)
    weight = w(ro, info_for(T))
    assert tuple(weight.shape) == (B, G, T) and weight.dtype == torch.float32
    assert torch.isfinite(weight).all() and (weight >= 0).all()
    ro.weight = weight
    logp = make_logp(ro)
    for agg in AGGS:
        loss, grad, mask = _grad_through_objective([build("objective", "ppo_clip")], ro, {"logp": logp}, logp, agg)
        assert torch.isfinite(grad).all()
        assert (grad[(weight == 0) | ~ro.row_mask] == 0).all()
        assert not mask[weight == 0].any()


@pytest.mark.parametrize("name", WEIGHTS)
def test_weight_row_permutation_equivariant(name):
    w = build("weight", name)
    ro = make_rollout(B, G, T, seed=12)
    fill_inputs(ro, w)  # needs, and token texts for a weight that maps roles from tags (srpo)
    perm = random_perm(B, G)
    weight = w(ro, info_for(T))
    weight_p = w(permute_rows(ro, perm), info_for(T))
    mask_p = permute_tensor(ro.row_mask, perm)
    torch.testing.assert_close(weight_p[mask_p], permute_tensor(weight, perm)[mask_p])


# ---------------------------------------------------------------------------------------------- aggregation
@pytest.mark.parametrize("name", AGGS)
@pytest.mark.parametrize("level", ["token", "row"])
def test_aggregation_scalar_sum_normaliser_and_invariance(name, level):
    agg = build("aggregation", name)
    ro = make_rollout(B, G, T, seed=13)
    mask = ro.row_mask
    g = torch.Generator().manual_seed(0)
    values = torch.randn((B, G, T) if level == "token" else (B, G), generator=g).requires_grad_(True)
    norm = agg.normalizer(mask, info_for(T))
    for key, v in norm.items():  # sums over rows: halves of the batch add up to the whole
        lo, hi = agg.normalizer(mask[:1], info_for(T))[key], agg.normalizer(mask[1:], info_for(T))[key]
        assert torch.equal(lo + hi, v), key
    loss = agg.reduce(values, mask, norm)
    assert loss.dim() == 0 and torch.isfinite(loss)
    (grad,) = torch.autograd.grad(loss, values)
    row_mask = mask if level == "token" else mask.any(-1)
    assert (grad[~row_mask] == 0).all()
    perm = random_perm(B, G)
    loss_p = agg.reduce(permute_tensor(values, perm), permute_tensor(mask, perm), norm)
    torch.testing.assert_close(loss_p, loss)
    parts = agg.reduce(values[:1], mask[:1], norm) + agg.reduce(values[1:], mask[1:], norm)
    torch.testing.assert_close(parts, loss)


@pytest.mark.parametrize("name", AGGS)
def test_aggregation_empty_mask_is_zero(name):
    agg = build("aggregation", name)
    mask = torch.zeros(2, 3, 4, dtype=torch.bool)
    loss = agg.reduce(torch.randn(2, 3, 4), mask, agg.normalizer(mask, info_for(4)))
    assert loss.item() == 0.0


# ---------------------------------------------------------------------------------------------- kl
@pytest.mark.parametrize("name", KLS)
def test_kl_estimator_elementwise_zero_at_equal_and_masked_grad(name):
    est = build("kl", name)
    ro = make_rollout(B, G, T, seed=14)
    logp = make_logp(ro)
    kl = est(logp, ro.logp_ref.float())
    assert kl.shape == logp.shape
    assert torch.equal(est(ro.logp_ref, ro.logp_ref), torch.zeros_like(ro.logp_ref))
    perm = random_perm(B, G)
    torch.testing.assert_close(
        est(permute_tensor(logp, perm), permute_tensor(ro.logp_ref, perm)), permute_tensor(kl, perm)
    )
    term = build("objective", "kl", estimator=name)
    loss, grad, mask = _grad_through_objective([term], ro, {"logp": logp}, logp, "token_mean")
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert (grad[~mask] == 0).all() and (grad[mask] != 0).any()


# ---------------------------------------------------------------------------------------------- term × token weight
# Every objective term declares how token weights reach it (``token_weights``, objective.py): "token" (the
# default: each per-token value is multiplied), "row:geo_mean" (a row value times exp(mean_t log w) over the
# row's loss tokens), "exempt" (never scaled) or "none" (a configuration with any token weight is refused).
# The sweep runs every registered weight (defaults; flow weights on synthetic flow extras) into every term
# and checks, with the expected loss recomputed here from the term's own unweighted values, that the
# combination changes the loss exactly as declared, or that building it is a ConfigError.
ALL_WEIGHTS = [n for s, n, c in entries() if s == "weight"]  # flow- and mdlm-only ones too (building needs no policy)


def _mode(term) -> str:
    return getattr(term, "token_weights", "token")


def _weigh_batch(name: str, ro, seed: int = 0):
    """Run the weight ``name`` on ``ro`` as the trainer does (whole batch, before the loss): IS ratios away
    from 1 (sampler log-probs ≠ logp_old) and flow extras, so each weight has something to act on."""
    from groupwise.objective import token_weights

    B_, G_, T_ = ro.shape
    g = torch.Generator().manual_seed(seed)
    ro.logp_sampler = ro.logp_old - 0.4 * torch.randn(B_, G_, T_, generator=g)  # [B,G,T]
    sigma = 0.4 + 0.5 * torch.rand(B_, G_, T_, generator=g)  # [B,G,T] a flow policy's SDE-step extras
    std = 0.1 + torch.rand(B_, G_, T_, generator=g)  # [B,G,T]
    for key, value in (("flow_sigma", sigma), ("flow_sigma_next", sigma - 0.2), ("flow_std", std)):
        ro.set_extra(key, value, "token")
    # a masked-diffusion sampler's trace (the dps weight): commit steps 1..4, step probabilities
    ro.set_extra("commit_step", torch.randint(1, 5, (B_, G_, T_), generator=g), "token")  # [B,G,T]
    ro.set_extra("q_trace", torch.rand(B_, G_, T_, 4, generator=g), "token")  # [B,G,T,S]
    w = build("weight", name)
    fill_inputs(ro, w, seed=seed + 3)
    ro.weight, counted = token_weights([w], ro, info_for(T_))  # [B,G,T] x2
    ro.set_extra("counted", counted, "token")
    return w


def _geo_mean(weight, mask):
    """[B,G] Π_t w_t^(1/n) over the row's mask (n its tokens; 1 for a row without), written as a product."""
    n = mask.sum(-1, keepdim=True).clamp(min=1).double()  # [B,G,1]
    one = torch.ones((), dtype=torch.float64)
    return torch.where(mask, weight.double() ** (1.0 / n), one).prod(-1).float()  # [B,G]


@pytest.mark.parametrize("weight_name", ALL_WEIGHTS)
@pytest.mark.parametrize("name", TERMS)
def test_term_takes_token_weights_as_declared_or_refuses(name, weight_name):
    from groupwise.errors import ConfigError
    from groupwise.objective import Objective

    term, ro, out, logp = _term_setup(name, seed=21)
    mode = _mode(term)
    w = _weigh_batch(weight_name, ro, seed=22)
    if mode == "none":  # refused where the objective is built, naming the term, the weight and why
        with pytest.raises(ConfigError) as err:
            Objective.from_config([name], "seq_mean_token_mean", [w])
        assert name in str(err.value) and weight_name in str(err.value) and term.token_weights_reason in str(err.value)
        obj = objective_for([term], "seq_mean_token_mean")
        with pytest.raises(ValueError, match=name):  # and a batch that carries weights anyway is an error, not ignored
            obj.loss(ro, out, obj.normalizers(ro, info_for(T)), info_for(T))
        return
    obj = objective_for([term], "seq_mean_token_mean")
    info = info_for(T)
    norms = obj.normalizers(ro, info)
    loss = obj.loss(ro, out, norms, info)
    values = term(ro, out, info)  # the term's own values on the same batch (tokens a weight removed already out)
    mask = obj.loss_mask(ro)  # [B,G,T] (no term here has a token_subset with a weight-dependent normaliser)
    if hasattr(term, "token_subset"):
        mask = mask & term.token_subset(ro).bool()
    agg_name = term.agg or "seq_mean_token_mean"
    key = f"{agg_name}@term0" if hasattr(term, "token_subset") else agg_name
    agg = obj.aggregations[agg_name]
    if mode == "token":
        assert values.dim() == 3, f"{name} takes token weights per token but returns row values: declare their way"
        factor = ro.weight  # [B,G,T]
    elif mode == "row:geo_mean":
        assert values.dim() == 2
        factor = _geo_mean(ro.weight, mask)  # [B,G]
    else:
        assert mode == "exempt", f"{name}: unknown declaration {mode!r}"
        factor = torch.ones(())
    expected = term.coef * agg.reduce(values * factor, mask, norms[key])
    unweighted = term.coef * agg.reduce(values, mask, norms[key])
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-5)
    (grad,) = torch.autograd.grad(loss, logp, retain_graph=True, allow_unused=True)
    (grad_expected,) = torch.autograd.grad(expected, logp, allow_unused=True)
    if grad is not None or grad_expected is not None:
        torch.testing.assert_close(grad, grad_expected, atol=1e-6, rtol=1e-5)
    where = mask if values.dim() == 3 else mask.any(-1)  # [B,G,T] or [B,G] the values the aggregation reads
    change = (factor.expand(values.shape) - 1).abs() * values.detach().abs()  # where a weight ≠ 1 meets a value ≠ 0
    moved = mode != "exempt" and float(change[where].sum()) > 1e-4
    # ... unless the weighting cancels by construction: weights of mean 1 per row (dps) on a term whose values are
    # one per row (gspo, luspo: a sequence ratio) under a token mean leave the loss as it is (the expected loss,
    # computed independently above and matched by the objective's, equals the unweighted one)
    moved = moved and abs(float((expected - unweighted).detach())) > 1e-7
    if moved:  # the weight is not silently dropped: the loss differs from the unweighted one
        assert abs(float((loss - unweighted).detach())) > 1e-7, f"{name} × {weight_name}: weight did not reach the loss"
    if mode == "exempt":  # a weight that reaches no term is refused; beside a policy term it builds
        with pytest.raises(ConfigError, match="reach no objective term"):
            Objective.from_config([name], "seq_mean_token_mean", [w])
        Objective.from_config([name, "ppo_clip"], "seq_mean_token_mean", [w])
    else:
        Objective.from_config([name], "seq_mean_token_mean", [w])
