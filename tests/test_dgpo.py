"""DGPO (specs/40): margin loss of coherent over inconsistent rows + variance regulariser, by hand;
the FOBAR-style reverse data (papers/40_dgpo/fobar.py), rollout ``directions`` and ``eval.by``.

Spec unit test (scores given directly, beta = 1, gamma = 0.2): s_P = [−0.5, −0.7], s_N = [−0.6, −1.5]::

    gaps s_p − s_n − γ:  (−0.5+0.6−0.2) = −0.1, (−0.5+1.5−0.2) = 0.8, (−0.7+0.6−0.2) = −0.3, (−0.7+1.5−0.2) = 0.6
    softplus(−gap):      0.744397, 0.371101, 0.854355, 0.437488  → mean 0.601835
    Var(s_P) = ((0.1)² + (0.1)²)/2 = 0.01 (population)            → total (λ_var = 1) 0.611835
    ∂/∂s_p = −¼ Σ_n σ(−gap) + (s_p − mean_P):  p0 −0.208751 + 0.1 = −0.108751,  p1 −0.232197 − 0.1 = −0.332197
    ∂/∂s_n = +¼ Σ_p σ(−gap):                   n0 0.274855,  n1 0.166092
Reverse builder: "Tom has 3 apples and buys 4. How many?", 7 → masks 3 → answer "3".
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import check_micro_batching, info_for, leaf, make_rollout, objective_for, paper_module, rollout_from

from groupwise.errors import ConfigError
from groupwise.losses.dgpo import dgpo_loss
from groupwise.registry import build
from groupwise.run import Run
from groupwise.tasks import get_task
from groupwise.types import Need

_fobar = paper_module("40_dgpo", "fobar")
COMPACT_TEMPLATE, make_reverse_question, solve = _fobar.COMPACT_TEMPLATE, _fobar.make_reverse_question, _fobar.solve
fobar_rows = _fobar.rows

S_SPEC = [-0.5, -0.7, -0.6, -1.5]  # two coherent, two inconsistent
R_SPEC = [1.0, 1.0, 0.0, 0.0]
DS = [-0.108751, -0.332197, 0.274855, 0.166092]  # ∂L/∂s (docstring)


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def _group(scores, rewards, T=2, lengths=None, ref=0.0):
    """One group whose rows have length-normalised Σ_t mask·(logp − logp_ref) / |y| = score: every token
    of row i carries logp = ref + score_i (``lengths``: a mask prefix per row, garbage beyond it)."""
    G = len(scores)
    lengths = lengths or [T] * G
    mask = torch.tensor([[[t < n for t in range(T)] for n in lengths]])  # [1,G,T]
    ro = rollout_from(
        torch.zeros(1, G, T),
        torch.zeros(1, G),
        mask=mask,
        rewards=torch.tensor([rewards]),
        logp_ref=torch.full((1, G, T), ref),
    )
    # garbage off the mask
    logp = torch.tensor([[[ref + s if t < n else 1e4 for t in range(T)] for s, n in zip(scores, lengths)]])
    return ro, leaf(logp)


def _loss_grad(term, ro, logp, agg="group_mean"):
    obj = objective_for([term], agg)
    info = info_for(ro.shape[2])
    loss = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info), info)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


# ---------------------------------------------------------------------------------------------- spec numbers
def test_spec_interface_numbers():
    logp, mask = torch.tensor(S_SPEC)[:, None], torch.ones(4, 1, dtype=torch.bool)  # one token each: s = logp
    labels, ids = torch.tensor(R_SPEC).bool(), torch.zeros(4, dtype=torch.long)
    _close(dgpo_loss(logp, mask, labels, ids), 0.611835)
    _close(dgpo_loss(logp, mask, labels, ids, lam_var=0.0), 0.601835)  # the mean of the four pair losses alone
    _close(dgpo_loss(logp, mask, labels, ids, lam_var=3.0), 0.601835 + 0.03)
    # gamma = 0: gaps +0.1, +1.0, −0.1, +0.8 → softplus(−gap) 0.644397, 0.313262, 0.744397, 0.371101 → 0.518289 + 0.01
    _close(dgpo_loss(logp, mask, labels, ids, gamma=0.0), 0.528289)
    # two question groups: the spec's and a copy shifted by +1 (same gaps, same variance) → the same mean
    two = dgpo_loss(
        torch.cat([logp, logp + 1.0]),
        torch.ones(8, 1, dtype=torch.bool),
        labels.repeat(2),
        torch.tensor([0] * 4 + [5] * 4),
    )
    _close(two, 0.611835)


def test_spec_numbers_through_the_objective_with_gradient():
    ro, logp = _group(S_SPEC, R_SPEC)
    L, grad = _loss_grad(build("objective", "dgpo"), ro, logp)
    _close(L, 0.611835)
    _close(grad, [[[d / 2, d / 2] for d in DS]])  # s is the mean of 2 tokens: ∂s/∂logp_t = 1/2


def test_ref_score_is_length_normalised_log_ratio():
    # score "ref", beta 0.5: s = 0.5·(logp − logp_ref) per token averaged over
    # 1..4 tokens → s_P = [−.25, −.35], s_N = [−.3, −.75]
    # gaps −0.15, 0.3, −0.25, 0.2 → softplus(−gap) 0.770957, 0.554355,
    # 0.825939, 0.598139 → 0.687348; Var = 0.0025 → 0.689848
    ro, logp = _group(S_SPEC, R_SPEC, T=4, lengths=[1, 2, 3, 4], ref=-2.0)
    term = build("objective", "dgpo", score="ref", beta=0.5)
    assert term.needs == (Need("logp", model="ref"),)
    L, grad = _loss_grad(term, ro, logp)
    _close(L, 0.689848)
    assert torch.equal(grad[~ro.mask], torch.zeros_like(grad[~ro.mask]))  # the 1e4 garbage off the mask never reaches s
    # score "logp" reads no reference: the same rows without logp_ref, beta 1 → s = logp mean = ref + score = −2 + s
    term = build("objective", "dgpo")
    assert term.needs == ()
    ro.logp_ref = None
    L, _ = _loss_grad(term, ro, logp)
    _close(L, 0.611835)  # a common shift changes no gap and no variance
    with pytest.raises(ValueError, match="logp_ref"):
        build("objective", "dgpo", score="ref")(ro, {"logp": logp}, info_for(4))


def test_groups_without_positives_or_negatives_give_exactly_zero():
    for rewards in ([1.0] * 4, [0.0] * 4):
        ro, logp = _group(S_SPEC, rewards)
        L, grad = _loss_grad(build("objective", "dgpo"), ro, logp)
        assert L == 0 and torch.equal(grad, torch.zeros_like(grad))
    # one coherent row: variance 0; gaps −0.1, 0.8 → (0.744397 + 0.371101)/2 = 0.557749
    ro, logp = _group(S_SPEC[:1] + S_SPEC[2:], [1.0, 0.0, 0.0])
    _close(_loss_grad(build("objective", "dgpo"), ro, logp)[0], 0.557749)


def test_coherent_labels_above_the_mean_or_a_threshold():
    # rewards [0.9, 0.5, 0.2, 0.1]: mean 0.425 → rows 0, 1 coherent: the spec's group
    ro, logp = _group(S_SPEC, [0.9, 0.5, 0.2, 0.1])
    _close(_loss_grad(build("objective", "dgpo"), ro, logp)[0], 0.611835)
    # positive_at = 0.6: row 0 alone over rows 1..3: gaps 0, −0.1, 0.8 → (0.693147 + 0.744397 + 0.371101)/3 = 0.602882
    _close(_loss_grad(build("objective", "dgpo", positive_at=0.6), ro, logp)[0], 0.602882)
    ro, logp = _group(S_SPEC, [0.1] * 4)  # a constant non-binary group: no row above the mean, exactly 0
    L, grad = _loss_grad(build("objective", "dgpo"), ro, logp)
    assert L == 0 and torch.equal(grad, torch.zeros_like(grad))
    # positive_at = 0.1 makes all four coherent: no inconsistent row, 0
    assert _loss_grad(build("objective", "dgpo", positive_at=0.1), ro, logp)[0] == 0


def test_invalid_nan_and_empty_rows_are_not_members():
    # the spec's group plus an invalid coherent row, a NaN-reward row and an empty completion: the spec's value,
    # no gradient to them
    ro, logp = _group([*S_SPEC, 5.0, 5.0, 5.0], [*R_SPEC, 1.0, float("nan"), 0.0])
    ro.group_valid[0, 4] = False
    ro.mask[0, 6] = False
    term = build("objective", "dgpo")
    L, grad = _loss_grad(term, ro, logp)
    _close(L, 0.611835)
    _close(grad[0, :4], [[d / 2, d / 2] for d in DS])
    assert torch.equal(grad[0, 4:], torch.zeros(3, 2))
    stats = term.stats(ro, {"logp": logp})
    assert stats["dgpo/term_frac"].tolist() == [[1.0] * 4 + [0.0] * 3]
    # pair_acc: gaps −0.1, 0.8 | −0.3, 0.6 → each coherent row wins 2 of the group's 4 pairs' share: 2/4
    _close(stats["dgpo/pair_acc"][0, :4], [0.5] * 4)
    # a second, all-correct group counts in the mean as 0: (0.611835 + 0)/2
    ro2, logp2 = _group(S_SPEC, [1.0] * 4)
    both = type(ro).concat([ro, ro2.pad_rows(7)])  # [2,7,2]
    L2, _ = _loss_grad(
        term, both, leaf(torch.cat([logp.detach(), torch.nn.functional.pad(logp2.detach(), (0, 0, 0, 3))]))
    )
    _close(L2, 0.611835 / 2)


def test_directions_split_or_pooled():
    # rows: forward [coherent −0.5, wrong −0.6], reverse [coherent −0.7, wrong −1.5] in one pooled group
    ro, logp = _group([-0.5, -0.6, -0.7, -1.5], [1.0, 0.0, 1.0, 0.0])
    ro.set_extra("direction", torch.tensor([[0, 0, 1, 1]]), "row")
    # per direction: L_f = softplus(0.1) = 0.744397, L_r = softplus(−0.6) = 0.437488,
    # no variance (one coherent row each) → mean 0.590942
    _close(_loss_grad(build("objective", "dgpo"), ro, logp)[0], 0.590942)
    # pooled: the spec's group → 0.611835
    _close(_loss_grad(build("objective", "dgpo", pool_directions=True), ro, logp)[0], 0.611835)
    # without the extra a group is one question group, whatever pool_directions says
    del ro.extras["direction"], ro.extra_levels["direction"]
    _close(_loss_grad(build("objective", "dgpo"), ro, logp)[0], 0.611835)


def test_micro_batching_invariance():
    ro = make_rollout(6, 4, 5, seed=3, binary=True)  # awkward: invalid row, NaN reward, empty row, garbage padding
    check_micro_batching(
        objective_for([build("objective", "dgpo")], "group_mean"), ro, [[0, 4], [1], [2, 3, 5]], info_for(5)
    )
    ro.set_extra("direction", torch.randint(0, 2, (6, 4), generator=torch.Generator().manual_seed(0)), "row")
    check_micro_batching(
        objective_for([build("objective", "dgpo", score="ref")], "group_mean"),
        ro,
        [[0, 4], [1], [2, 3, 5]],
        info_for(5),
    )


def test_advantages_are_not_read():
    ro, logp = _group(S_SPEC, R_SPEC)
    term = build("objective", "dgpo")
    values = []
    for adv in (
        build("advantage", "grpo")(ro, info_for(2)),
        build("advantage", "sign")(ro, info_for(2)),
        torch.randn(1, 4),
        None,
    ):
        ro.advantages = adv
        values.append(term(ro, {"logp": logp}, info_for(2)))
    for v in values[1:]:
        assert torch.equal(v, values[0])


def test_declaration_and_errors():
    term = build("objective", "dgpo")
    assert (term.beta, term.gamma, term.lam_var, term.positive_at, term.agg, term.rollout_extras) == (
        1.0,
        0.2,
        1.0,
        None,
        "group_mean",
        (),
    )
    assert build("objective", "dgpo", pool_directions=True).rollout_extras == ("direction",)
    for key, bad in (("beta", 0.0), ("gamma", -0.1), ("lam_var", -1.0), ("score", "logprob")):
        with pytest.raises(ValueError, match=key):
            build("objective", "dgpo", **{key: bad})


# ---------------------------------------------------------------------------------------------- reverse data
def test_reverse_builder_by_hand():
    q_rev, a_rev = make_reverse_question("Tom has 3 apples and buys 4. How many?", 7)
    assert a_rev == "3"
    assert (
        q_rev == "Tom has X apples and buys 4. How many? If we know the answer to "
        "the above question is 7, what is the value of unknown variable X?"
    )
    assert make_reverse_question("Tom has 3 apples and buys 4. How many?", 7, which=1)[1] == "4"
    assert make_reverse_question("37+45=", "82", 0, COMPACT_TEMPLATE) == ("X+45=82;X=", "37")
    assert make_reverse_question("37+45=", "82", 1, COMPACT_TEMPLATE) == ("37+X=82;X=", "45")
    assert make_reverse_question("120+7=", "127", -1, COMPACT_TEMPLATE) == (
        "120+X=127;X=",
        "7",
    )  # numbers are whole digit runs
    with pytest.raises(ValueError, match="2 numbers"):
        make_reverse_question("37+45=", "82", 2)


def test_fobar_rows_pairs_splits_and_verifier():
    test = fobar_rows("test")
    assert test[:4] == [
        {"prompt": "13+54=", "answer": "67", "problem": 0, "direction": "forward"},
        {"prompt": "X+54=67;X=", "answer": "13", "problem": 0, "direction": "reverse"},  # even id: first operand
        {"prompt": "26+16=", "answer": "42", "problem": 1, "direction": "forward"},
        {"prompt": "26+X=42;X=", "answer": "16", "problem": 1, "direction": "reverse"},
    ]  # odd id: second
    train = get_task("fobar").rows("train", 0, 0)
    assert len(test) == 1000 and len(train) == 19000
    assert {r["problem"] for r in test}.isdisjoint(r["problem"] for r in train)
    assert all(
        a["problem"] == b["problem"] and (a["direction"], b["direction"]) == ("forward", "reverse")
        for a, b in zip(train[::2], train[1::2])
    )
    fwd = get_task("fobar_forward")
    assert fwd.rows("train", 0, 0) == train[::2] and fwd.rows("test", 0, 0) == test and fwd.reward == "fobar"
    assert get_task("fobar").rows("train", 5, 1) != get_task("fobar").rows("train", 5, 2)  # pairs shuffled by seed
    # the verifier solves each question from its text and agrees with every answer column
    assert all(str(solve(r["prompt"])) == r["answer"] for r in train + test)
    reward = build("reward", "fobar")
    assert reward(["37+45=", "X+45=82;X=", "37+X=82;X=", "37+45="], ["82", " 37\n", "45", "83"]) == [1.0, 1.0, 1.0, 0.0]
    for bad in ("X+X=3;X=", "what is 2+2?"):
        with pytest.raises(ValueError, match="cannot read"):
            reward([bad], ["4"])


# ---------------------------------------------------------------------------------------------- the trainer
def _trainer(tmp_path, *overrides):
    from test_trainer import make_trainer

    return make_trainer(tmp_path, 'data.task="fobar"', *overrides)


def _observed(trainer):
    from pathlib import Path

    seen = []
    observe = trainer.observe
    trainer.observe = lambda batch: (seen.append(batch), observe(batch))
    Run(trainer).train()
    rows = [json.loads(line) for line in (Path(trainer.cfg.out) / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in rows)
    return rows, seen


def _expected_term_frac(batch, pooled):
    members = batch.row_mask.any(-1) & torch.isfinite(batch.rewards)  # [B,G]
    d = batch.extras.get("direction", torch.zeros_like(batch.rewards, dtype=torch.long))
    same = members[:, :, None] & members[:, None, :] & ((d[:, :, None] == d[:, None, :]) | pooled)  # [B,G,G]
    ok = batch.rewards >= 1.0  # [B,G]
    has = (same & ok[:, None, :]).any(-1) & (same & ~ok[:, None, :]).any(-1)  # [B,G]
    return float(has.sum()) / float(batch.row_mask.any(-1).sum())


def test_directions_rollout_pools_both_questions_of_a_problem(tmp_path):
    trainer = _trainer(
        tmp_path,
        'rollout.name="directions"',
        'objective.terms=[{name="dgpo", pool_directions=true}]',
        "train.steps=1",
        "eval.size=0",
    )
    rows, (batch,) = _observed(trainer)
    G = trainer.cfg.rollout.group_size
    B = trainer.cfg.rollout.prompts_per_step // 2
    assert batch.shape[:2] == (B, 2 * G)
    assert batch.extras["direction"].tolist() == [[0] * G + [1] * G] * B
    train = trainer.train_rows
    for b in range(B):
        fwd = batch.meta[b]
        rev = next(r for r in train if r["problem"] == fwd["problem"] and r["direction"] == "reverse")
        assert fwd["direction"] == "forward"
        for g in range(2 * G):  # each row trained under its own question, rewarded by the verifier of that question
            row = fwd if g < G else rev
            assert batch.ctx[b][g] == trainer.policy.encode(row["prompt"])
            assert batch.rewards[b, g] == float(batch.completions[b][g].strip() == str(solve(row["prompt"])))
    assert rows[0]["dgpo/term_frac"] == pytest.approx(_expected_term_frac(batch, True), abs=1e-6)


def test_pooling_needs_the_directions_rollout(tmp_path):
    with pytest.raises(ConfigError, match="direction"):
        _trainer(tmp_path, 'objective.terms=[{name="dgpo", pool_directions=true}]', "train.steps=1")


@pytest.mark.parametrize("ratio", ["ppo_clip", "gspo"])
def test_composes_with_ratio_terms(tmp_path, ratio):
    trainer = _trainer(
        tmp_path, f'objective.terms=["{ratio}", {{name="dgpo", coef=0.5}}]', "train.steps=2", "eval.size=0"
    )
    rows, seen = _observed(trainer)
    assert [t.registry_name for t in trainer.objective.terms] == [ratio, "dgpo"]
    for row, batch in zip(rows, seen):
        assert row["dgpo/term_frac"] == pytest.approx(_expected_term_frac(batch, False), abs=1e-6)


def test_estimator_does_not_change_the_loss(tmp_path):
    # same seed, same first batch: the first update's loss is the same under grpo and sign advantages
    losses = []
    for estimator in ("grpo", "sign"):
        trainer = _trainer(
            tmp_path / estimator,
            f'advantage.estimator="{estimator}"',
            'objective.terms=["dgpo"]',
            "train.steps=1",
            "eval.size=0",
        )
        rows, (batch,) = _observed(trainer)
        assert rows[0]["dgpo/term_frac"] == pytest.approx(_expected_term_frac(batch, False), abs=1e-6)
        losses.append(rows[0]["loss"])
    assert losses[0] == losses[1] and losses[0] > 0


def test_eval_by_direction(tmp_path):
    trainer = _trainer(tmp_path, 'eval.by="direction"', "eval.size=8", "train.steps=1")
    summary = Run(trainer).train()
    for key in ("accuracy_before", "accuracy_after"):  # 4 forward + 4 reverse held-out rows: the mean of the two
        assert summary[key] == pytest.approx((summary[f"{key}/forward"] + summary[f"{key}/reverse"]) / 2)
    with pytest.raises(ConfigError, match="eval.by"):
        Run(_trainer(tmp_path / "bad", 'eval.by="colour"', "eval.size=8", "train.steps=1")).train()


def test_sft_phase_task_trains_on_that_tasks_rows():
    # the claim's shared warm start: an sft phase with task="fobar" on a run whose own rows are forward-only
    from groupwise.phases import PhaseContext
    from groupwise.phases.sft import SFT

    seen = {}
    phase = SFT(steps=1, task="fobar", train_size=6)
    phase.fit = lambda policy, rows, val, seed, prompt, accuracy: seen.update(rows=rows) or {"steps": 0}
    forward_only = get_task("fobar_forward").rows("train", 6, 3)
    ctx = PhaseContext(None, forward_only, [], 3, lambda *a: [], lambda *a: 0.0, lambda line: None)
    phase(ctx)
    expected = get_task("fobar").rows("train", 6, 3)
    assert sorted(map(str, seen["rows"])) == sorted(map(str, expected)) and {r["direction"] for r in seen["rows"]} == {
        "forward",
        "reverse",
    }
    phase = SFT(steps=1)
    phase.fit = lambda policy, rows, val, seed, prompt, accuracy: seen.update(rows=rows) or {"steps": 0}
    phase(ctx)
    assert sorted(map(str, seen["rows"])) == sorted(map(str, forward_only))  # without task: the run's rows
    with pytest.raises(ConfigError, match="unknown task"):
        SFT(steps=1, task="nope")(ctx)


def test_ref_score_in_a_run_reads_the_reference(tmp_path):
    trainer = _trainer(tmp_path, 'objective.terms=[{name="dgpo", score="ref"}]', "train.steps=1", "eval.size=0")
    rows, (batch,) = _observed(trainer)
    assert batch.logp_ref is not None
    # on step 0 the policy is the reference: every score is 0, so every pair loses
    # softplus(gamma) = log(1 + e^0.2) = 0.798139
    # and no variance; the loss is that times the share of groups with a term (group_mean counts every group)
    members = batch.row_mask.any(-1) & torch.isfinite(batch.rewards)  # [B,G]
    ok = batch.rewards >= 1.0
    has = ((members & ok).any(-1) & (members & ~ok).any(-1)).float()  # [B]
    assert rows[0]["loss"] == pytest.approx(0.798139 * float(has.mean()), abs=1e-5)


def test_directions_rollout_pairs_by_problem_and_samples_a_lone_row_alone():
    from types import SimpleNamespace

    from helpers import make_rollout

    rows = [
        {"prompt": "1+2=", "problem": 7, "direction": "forward"},
        {"prompt": "X+2=3;X=", "problem": 7, "direction": "reverse"},
        {"prompt": "4+5=", "problem": 8, "direction": "forward"},
    ]  # problem 8's reverse row was cut
    strategy = build("rollout", "directions")
    strategy.use_rows(rows)
    asked = []

    def rollout(requests):
        asked.extend((r.key, r.n) for r in requests)
        ro = make_rollout(len(requests), 2, 3, awkward=False)
        ro.prompt_ids = [[10 + r.key] for r in requests]
        return ro

    ctx = SimpleNamespace(
        group_size=2,
        batch_size=3,
        draw=lambda n: [2, 1][:n],
        rollout=rollout,
        keep=lambda b: torch.ones(b.shape[0], dtype=torch.bool),
    )
    # ceil(3/2) = 2 drawn rows: 8's lone forward row, then 7's reverse row → 7's forward and reverse
    batch = strategy(ctx)
    assert asked == [(2, 2), (0, 2), (1, 2)]
    assert batch.shape[:2] == (2, 4)
    assert batch.group_valid.tolist() == [[True, True, False, False], [True] * 4]
    assert batch.extras["direction"].tolist() == [[0, 0, 0, 0], [0, 0, 1, 1]]
    assert batch.row_contexts()[1] == [[10], [10], [11], [11]] and batch.prompt_ids == [[12], [10]]
    with pytest.raises(ConfigError, match="no column 'direction'"):
        strategy.use_rows([{"prompt": "1+2=", "problem": 1}])
