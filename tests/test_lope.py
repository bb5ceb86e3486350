"""LoPE (spec 61): the Lorem vocabulary and prompts, the regroup rule, the G + G' advantage shaping,
the shaped unclipped ratio, the lope strategy's batch by hand on a scripted rollout context, and
the three components end to end on the embedded model (with ppo_clip and gspo)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import info_for, objective_for, rollout_from, train_recorded
from test_trainer import make_trainer

from groupwise.errors import ConfigError
from groupwise.losses.lope import shaped_ratio
from groupwise.registry import build
from groupwise.rollout.lope import EXTRA, TAIL, load_words, lope_regroup, lorem_prompt, lorem_words, make_lorem_prompt
from groupwise.types import INJECTED, Need, Rollout, StepInfo


# ---------------------------------------------------------------------------------------------- vocabulary and prompts
def test_the_shipped_vocabulary_and_the_word_draw():
    words = load_words()
    assert len(words) == 200 and len(set(words)) == 200 and all(w.isalpha() and w.islower() for w in words)
    assert {"lorem", "ipsum", "dolor", "sit", "amet"} <= set(words)
    counts = [len(lorem_words(100, 300, random.Random(s))) for s in range(200)]
    # uniform over the range, both ends inclusive
    assert min(counts) >= 100 and max(counts) <= 300 and len(set(counts)) > 50
    assert {len(lorem_words(2, 3, random.Random(s))) for s in range(50)} == {2, 3}
    assert lorem_words(5, 5, random.Random(7)) == lorem_words(5, 5, random.Random(7))  # seeded: same words
    assert lorem_words(0, 0, random.Random(0)) == []


def test_lorem_prompt_text_and_chat_forms():
    assert lorem_prompt("7+8=", ["lorem", "ipsum"]) == f"lorem ipsum\n{TAIL}\n7+8="
    assert lorem_prompt("7+8=", ["dolor"], tail="", separator=" ") == "dolor 7+8="
    assert lorem_prompt("7+8=", [], tail="") == "7+8="  # the naive-resampling control
    chat = lorem_prompt([{"role": "user", "content": "7+8="}], ["lorem"])
    assert chat == [{"role": "system", "content": f"lorem\n{TAIL}"}, {"role": "user", "content": "7+8="}]
    own = lorem_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}], ["sit", "amet"])
    assert own == [{"role": "system", "content": "sit amet\nBe brief."}, {"role": "user", "content": "q"}]
    drawn = make_lorem_prompt("7+8=", random.Random(3), 2, 2, tail="")
    assert drawn == " ".join(lorem_words(2, 2, random.Random(3))) + "\n7+8="


def test_a_vocabulary_file_replaces_the_shipped_words(tmp_path):
    path = tmp_path / "words.txt"
    path.write_text("# two words\nfoo\n\nbar\n")
    assert load_words(str(path)) == ("foo", "bar")
    with pytest.raises(ConfigError, match="does not exist"):
        build("rollout", "lope", vocabulary=str(tmp_path / "none.txt"))
    with pytest.raises(ConfigError, match="n_min"):
        build("rollout", "lope", n_min=5, n_max=2)
    with pytest.raises(ConfigError, match="fit"):
        build("rollout", "lope", fit="crop")


# ---------------------------------------------------------------------------------------------- regroup
def test_regroup_spec_numbers():
    # G = 4, every original wrong, 6 of 24 resamples correct: 6 >= G,
    # so G − 1 = 3 slots take 3 of them and one failure stays
    correct = [1, 4, 9, 10, 17, 23]
    slots, chosen = lope_regroup([0.0, 0.0, 0.0, 0.0], correct, random.Random(0))
    assert slots == [0, 1, 2] and len(chosen) == 3 and len(set(chosen)) == 3 and set(chosen) <= set(correct)
    picks = {tuple(lope_regroup([0.0] * 4, correct, random.Random(s))[1]) for s in range(30)}
    assert len(picks) > 10  # the 3 are a random choice among the 6
    # 2 correct (< G): both replace the first 2 slots, in order
    assert lope_regroup([0.0] * 4, [5, 12], random.Random(0)) == ([0, 1], [5, 12])
    assert lope_regroup([0.0] * 4, [0, 1, 2, 3], random.Random(0))[0] == [
        0,
        1,
        2,
    ]  # exactly G correct: still keep one failure
    assert lope_regroup([0.0] * 4, [], random.Random(0)) == ([], [])
    # a ragged group (slot 1 invalid, NaN): 3 valid slots, so at most 2 replaced, never the invalid one
    assert lope_regroup([0.0, float("nan"), 0.0, 0.0], [3, 4, 8, 9], random.Random(0))[0] == [0, 2]


# ---------------------------------------------------------------------------------------------- advantage
def _rescued(extra):
    ro = rollout_from(torch.zeros(1, 4, 1), rewards=torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    ro.set_extra(EXTRA, torch.tensor([extra]), "group")
    return ro


def test_advantage_shaping_spec_numbers():
    # base [0, 0, 0, 0] + 24 resamples (6 right): 3 swapped in;
    # the extra holds the 3 replaced originals and the 21 others (3 right)
    extra = [0.0] * 3 + [1.0] * 3 + [0.0] * 18
    full = torch.tensor([0.0] * 4 + [1.0] * 6 + [0.0] * 18, dtype=torch.float64)  # the 28-vector
    assert round(float(full.mean()), 6) == 0.214286 and round(float(full.std()), 6) == 0.417855
    adv = build("advantage", "lope", eps=0.0)(_rescued(extra), info_for(1))  # the spec's numbers are worked without eps
    torch.testing.assert_close(adv, torch.tensor([[1.880350, 1.880350, 1.880350, -0.512823]]), atol=1e-6, rtol=0)
    # eps = 1e-6: (1 − 0.214286) / (0.417855 + 1e-6)
    with_eps = build("advantage", "lope")(_rescued(extra), info_for(1))
    torch.testing.assert_close(with_eps, torch.tensor([[1.880346, 1.880346, 1.880346, -0.512822]]), atol=1e-6, rtol=0)
    plain = build("advantage", "lope", shaping=False)(_rescued(extra), info_for(1))  # GRPO on [1, 1, 1, 0]
    torch.testing.assert_close(plain, torch.tensor([[0.5, 0.5, 0.5, -1.5]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(plain, build("advantage", "grpo", eps=1e-6)(_rescued(extra), info_for(1)))


def test_advantage_extra_edge_cases():
    est = build("advantage", "lope")
    nan = float("nan")
    no_extra = rollout_from(torch.zeros(2, 4, 1), rewards=torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]]))
    grpo = build("advantage", "grpo", eps=1e-6)(no_extra, info_for(1))
    torch.testing.assert_close(est(no_extra, info_for(1)), grpo)  # no extra at all: GRPO
    padded = rollout_from(torch.zeros(2, 4, 1), rewards=no_extra.rewards.clone())
    padded.set_extra(EXTRA, torch.tensor([[nan, nan], [nan, nan]]), "group")
    torch.testing.assert_close(est(padded, info_for(1)), grpo)  # all-NaN extra: GRPO
    constant = rollout_from(torch.zeros(1, 4, 1), rewards=torch.zeros(1, 4))
    constant.set_extra(EXTRA, torch.tensor([[0.0, 0.0, nan]]), "group")
    assert est(constant, info_for(1)).abs().sum() == 0  # constant pool: exactly 0
    # one finite extra reward per group, as a [B] extra: pool [1, 0, 0, 0, 1] → mean 0.4, std sqrt(0.3)
    one = rollout_from(torch.zeros(1, 4, 1), rewards=torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    one.set_extra(EXTRA, torch.tensor([1.0]), "group")
    want = (torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64) - 0.4) / (0.3**0.5 + 1e-6)
    torch.testing.assert_close(est(one, info_for(1)), want.float())
    invalid = _rescued([0.0] * 24)
    invalid.group_valid[0, 0] = False
    assert est(invalid, info_for(1))[0, 0] == 0  # an invalid row gets 0 and leaves the statistics
    assert build("advantage", "lope").rollout_extras == (EXTRA,)
    with pytest.raises(ConfigError, match="std"):
        build("advantage", "lope", std="sample")


def test_the_advantage_fails_at_build_without_the_lope_strategy(tmp_path):
    with pytest.raises(ConfigError, match="lope_extra_rewards"):
        make_trainer(tmp_path, 'advantage.estimator="lope"')


# ---------------------------------------------------------------------------------- shaped ratio and the objective term
@pytest.mark.parametrize("rho,value,grad", [(1.0, 0.909091, 0.082645), (0.1, 0.5, 0.25), (2.0, 0.952381, 0.045351)])
def test_shaped_ratio_spec_numbers(rho, value, grad):
    log_rho = torch.tensor(rho, dtype=torch.float64).log().requires_grad_(True)
    shaped = shaped_ratio(log_rho, 0.1)
    shaped.backward()
    assert round(float(shaped.detach()), 6) == value and round(float(log_rho.grad), 6) == grad  # d/dlogπ = ργ/(ρ+γ)²


def _term_case():
    """One group of 2 rows, 2 tokens: row 0 real, row 1 swapped in; logp − logp_old = log 2 (beyond the clip),
    logp − logp_sampler = log 0.1 / log 2."""
    logp = torch.log(torch.tensor([[[0.4, 0.4], [0.4, 0.4]]])).requires_grad_(True)  # [1,2,2]
    ro = rollout_from(torch.log(torch.tensor([[[0.2, 0.2], [0.2, 0.2]]])), adv=torch.tensor([[1.0, 2.0]]))
    ro.logp_sampler = torch.log(torch.tensor([[[0.4, 0.4], [4.0, 0.2]]]))  # row 1: ρ = 0.1 at token 0, ρ = 2 at token 1
    ro.set_flag(INJECTED, torch.tensor([[False, True]]))
    return ro, logp


def test_the_term_shapes_swapped_rows_and_clips_real_ones():
    ro, logp = _term_case()
    term = build("objective", "lope")
    values = term(ro, {"logp": logp}, info_for(2))
    # row 0 (real): ppo_clip, ratio 2 clipped at 1.2 → −1.2·A = −1.2, no gradient;
    # row 1: −A·ρ/(ρ+0.1) = −2·0.5, −2·0.952381
    torch.testing.assert_close(values, torch.tensor([[[-1.2, -1.2], [-1.0, -2 * 0.952381]]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(values[0, 0], build("objective", "ppo_clip")(ro, {"logp": logp}, info_for(2))[0, 0])
    (grad,) = torch.autograd.grad(values.sum(), logp)
    # unclipped: ρ = 2 still pushes
    torch.testing.assert_close(grad, torch.tensor([[[0.0, 0.0], [-2 * 0.25, -2 * 0.045351]]]), atol=1e-5, rtol=0)
    seq = build("objective", "lope", level="sequence")(ro, {"logp": logp}, info_for(2))
    # the row's mean log-ratio: ρ = sqrt(0.2)
    rho = (0.5 * (torch.log(torch.tensor(0.1)) + torch.log(torch.tensor(2.0)))).exp()
    torch.testing.assert_close(seq[0, 1], torch.full((2,), float(-2 * rho / (rho + 0.1))), atol=1e-6, rtol=0)
    stats = term.stats(ro, {"logp": logp})
    assert stats["lope_shaped"].tolist() == [[0.0, 1.0]] and "clip_high" in stats


def test_the_term_is_its_base_without_swapped_rows_and_checks_its_inputs():
    ro, logp = _term_case()
    ro.row_flags[INJECTED] = torch.zeros(1, 2, dtype=torch.bool)
    for base in ("ppo_clip", "gspo"):
        wrapped = build("objective", "lope", base=base)
        torch.testing.assert_close(
            wrapped(ro, {"logp": logp}, info_for(2)), build("objective", base)(ro, {"logp": logp}, info_for(2))
        )
    ro, logp = _term_case()
    ro.logp_sampler = None
    with pytest.raises(ValueError, match="logp_sampler"):
        build("objective", "lope")(ro, {"logp": logp}, info_for(2))
    obj = objective_for([build("objective", "lope", base_params={"eps_high": 0.28})])
    assert obj.terms[0].inner.eps_high == 0.28
    with pytest.raises(ConfigError, match="gamma"):
        build("objective", "lope", gamma=0.0)
    with pytest.raises(ConfigError, match="wrap itself"):
        build("objective", "lope", base="lope")
    with pytest.raises(ConfigError, match="coef and agg"):
        build("objective", "lope", base_params={"coef": 2.0})


# ---------------------------------------------------------------------------------------------- the strategy, by hand
def _rows(keys, rewards, prompts, logp):
    """A scored batch: one group per key, one-token rows (token 20 + row index), the given sampler log-prob."""
    B, G = len(keys), len(rewards[0])
    return Rollout(
        prompt_ids=prompts,
        actions=(20 + torch.arange(G)).repeat(B, 1)[..., None],
        mask=torch.ones(B, G, 1, dtype=torch.bool),
        group_valid=torch.ones(B, G, dtype=torch.bool),
        truncated=torch.zeros(B, G, dtype=torch.bool),
        prompt_index=torch.tensor(keys),
        meta=[{"prompt": f"{k}+1=", "answer": str(k + 1)} for k in keys],
        completions=[[f"c{k}{g}" for g in range(G)] for k in keys],
        rewards=torch.tensor(rewards),
        logp_sampler=torch.full((B, G, 1), logp),
    )


class Scripted:
    """A rollout context answering lope's two rounds: prompt 5 all wrong, prompt 6 mixed; then the resamples."""

    batch_size, group_size, max_rounds = 2, 4, 1
    sampling = {"max_new_tokens": 1}

    def __init__(self, resample_rewards):
        self.requests, self.resample_rewards = [], resample_rewards
        self.policy = type("P", (), {"encode": staticmethod(lambda text: [ord(c) for c in text]), "context": None})()

    def draw(self, n, round_=0):
        return [5, 6]

    def rollout(self, requests, round_=0):
        self.requests.append(requests)
        if len(self.requests) == 1:
            return _rows([5, 6], [[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]], [[1], [2]], -1.0)
        return _rows([r.key for r in requests], self.resample_rewards, [r.prompt for r in requests], -3.0)

    def keep(self, batch):
        return torch.ones(batch.shape[0], dtype=torch.bool)

    def info(self, round_=0):
        return StepInfo(step=0, seed=0, max_new_tokens=1)


def test_lope_batch_by_hand():
    ctx = Scripted([[0.0, 1.0], [0.0, 1.0]])  # P = 2 perturbations × n_per = 2: resamples k = 0..3, k = 1 and 3 right
    strategy = build("rollout", "lope", num_perturbation=2, n_per=2, n_min=1, n_max=2, tail="", separator=" ")
    batch = strategy(ctx)
    asked = ctx.requests[1]
    assert [(r.key, r.n, r.offset) for r in asked] == [
        (5, 2, 4),
        (5, 2, 6),
    ]  # only the all-wrong prompt, fresh sample indices G + j·n_per
    for j, r in enumerate(asked):  # the words of perturbation j of row 5 come from (seed, step, row, LOREM_STREAM + j)
        from groupwise.rollout.lope import LOREM_STREAM
        from groupwise.seeds import sample_seed

        words = lorem_words(1, 2, random.Random(sample_seed(0, 0, 5, LOREM_STREAM + j)), load_words())
        assert r.prompt == [ord(c) for c in " ".join(words) + " 5+1="]
    # 2 correct (< G = 4): slots 0 and 1 take resamples 1 and 3; slots 2, 3 keep original failures
    assert batch.rewards.tolist() == [[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    assert batch.row_flags[INJECTED].tolist() == [[True, True, False, False], [False] * 4]
    # the swapped rows were sampled under their perturbed prompts (resample 1 of perturbation j: asked[j]);
    # the others under their own
    assert batch.behav_ctx == [[asked[0].prompt, asked[1].prompt, [], []], [[]] * 4]
    assert batch.behaviour_contexts()[0] == [asked[0].prompt, asked[1].prompt, [1], [1]]
    assert batch.actions[0, :, 0].tolist() == [21, 21, 22, 23]  # resample r = 1 of each perturbation (token 20 + r)
    assert batch.logp_sampler[0, :, 0].tolist() == [
        -3.0,
        -3.0,
        -1.0,
        -1.0,
    ]  # the swapped rows keep their perturbed-prompt log-probs
    assert batch.prompt_ids == [[1], [2]] and not batch.ctx  # trained under the original prompt
    # extra: the 2 replaced originals (0, 0) and the 2 resamples not chosen (k = 0, 2: 0, 0); none for the mixed group
    extra = batch.extras[EXTRA]
    assert extra[0].tolist() == [0.0, 0.0, 0.0, 0.0] and torch.isnan(extra[1]).all()
    # the pool is 2 ones and 6 zeros: mean 0.25, std sqrt(0.25·0.75·8/7)
    adv = build("advantage", "lope")(batch, ctx.info())
    std = (2 * 0.75**2 + 6 * 0.25**2) / 7
    torch.testing.assert_close(adv[0], torch.tensor([0.75, 0.75, -0.25, -0.25]) / (std**0.5 + 1e-6))
    assert strategy.step_stats() == {"lope/all_wrong_frac": 0.5, "lope/rescued_frac": 0.5, "lope/resample_acc": 0.5}


def test_lope_keeps_one_failure_when_at_least_g_resamples_are_right():
    ctx = Scripted([[1.0, 1.0], [1.0, 1.0], [0.0, 1.0]])  # 5 of 6 right ≥ G = 4
    batch = build("rollout", "lope", num_perturbation=3, n_per=2, n_min=0, n_max=0, tail="")(ctx)
    assert batch.rewards[0].tolist() == [1.0, 1.0, 1.0, 0.0] and batch.row_flags[INJECTED][0].tolist() == [
        True,
        True,
        True,
        False,
    ]
    # 0 words, no tail: the original prompt
    assert [r.prompt for r in ctx.requests[1]] == [[ord(c) for c in "5+1="]] * 3
    extra = batch.extras[EXTRA][0]
    assert sorted(extra.tolist()) == [
        0.0,
        0.0,
        0.0,
        0.0,
        1.0,
        1.0,
    ]  # 3 replaced originals (0), the 3 resamples not chosen (2 right, 1 wrong)
    nothing = build("rollout", "lope", num_perturbation=1, n_per=2)(Scripted([[0.0, 0.0]]))
    assert (
        not nothing.row_flags[INJECTED].any() and not nothing.behav_ctx and nothing.rewards[0].tolist() == [0.0] * 4
    )  # no success: the group stays as it was


# ---------------------------------------------------------------------------------------------- end to end
PLUS = ['rollout.name="lope"', "rollout.prompts_per_step=8", "rollout.group_size=4"]


def _plus_params(tmp_path, **more):
    """A vocabulary of one word, "+": on the embedded model "+12+34=" is
    the one prefix that keeps some accuracy (~9 %)."""
    (tmp_path / "plus.txt").write_text("+\n")
    params = {
        "num_perturbation": 2,
        "n_per": 4,
        "n_min": 1,
        "n_max": 1,
        "tail": "",
        "separator": "",
        "vocabulary": str(tmp_path / "plus.txt"),
        **more,
    }
    return "rollout.params={" + ", ".join(f"{k}={v!r}".replace("'", '"') for k, v in params.items()) + "}"


def test_rescued_groups_on_the_embedded_model(tmp_path):
    trainer = make_trainer(
        tmp_path / "run",
        *PLUS,
        _plus_params(tmp_path),
        'advantage.estimator="lope"',
        'objective.terms=["lope"]',
        "train.steps=2",
        "eval.size=0",
    )
    seen = []

    def prepare(batch, prepare=trainer.prepare):
        out = prepare(batch)
        # re-score every row under "+" + its prompt, before the update moves the weights
        sampled = out.select(list(range(out.shape[0])))
        sampled.ctx = [[trainer.policy.encode("+" + m["prompt"])] * out.shape[1] for m in out.meta]
        probe = out.select(list(range(out.shape[0])))
        # the behaviour view: each row under the context it was sampled under
        trainer.needs.fill(probe, [Need("logp", view="behaviour")])
        with torch.no_grad():
            seen.append(
                (
                    out,
                    trainer.policy.forward(sampled)["logp"],
                    trainer.policy.forward(out)["logp"],
                    probe.extras["policy@behaviour.logp"],
                )
            )
        return out

    trainer.prepare = prepare
    rows = []
    for _ in range(2):
        rows.append(trainer.run_step())
        trainer.step += 1
    assert any(r["lope/rescued_frac"] > 0 for r in rows), "the seed must rescue a group"
    for row, (batch, perturbed, original, behaviour) in zip(rows, seen):
        swapped = batch.row_flags[INJECTED]  # [B,G]
        # the one perturbed prompt of this vocabulary
        prompts = [trainer.policy.encode("+" + m["prompt"]) for m in batch.meta]
        assert (
            all(
                c == (prompts[b] if swapped[b, g] else [])
                for b, row_ in enumerate(batch.behav_ctx)
                for g, c in enumerate(row_)
            )
            or not swapped.any()
        )
        own = batch.row_mask  # [B,G,T]
        torch.testing.assert_close(
            behaviour[own & swapped[..., None]], perturbed[own & swapped[..., None]], atol=1e-5, rtol=0
        )  # = a direct forward under δ ⊕ x
        torch.testing.assert_close(
            behaviour[own & ~swapped[..., None]], original[own & ~swapped[..., None]], atol=1e-5, rtol=0
        )  # = under x
        assert row["lope/rescued_frac"] == float(swapped.any(1).float().mean())
        # every rescued group: ≥ 1 success (the swapped rows) and ≥ 1 original failure
        for b in swapped.any(1).nonzero().flatten().tolist():
            assert (batch.rewards[b][swapped[b]] == 1).all() and ((batch.rewards[b] == 0) & ~swapped[b]).any()
            assert (batch.advantages[b][swapped[b]] > 0).all() and (batch.advantages[b][~swapped[b]] < 0).all()
        m = batch.row_mask & swapped[..., None]  # [B,G,T] tokens of swapped rows
        # behaviour = the policy under δ ⊕ x
        torch.testing.assert_close(batch.logp_sampler[m], perturbed[m], atol=1e-4, rtol=0)
        if m.any():
            assert (batch.logp_sampler[m] - original[m]).abs().max() > 0.1  # … which is not the policy under x
            assert 0 < row["lope_shaped"] < 1
        real = batch.row_mask & ~swapped[..., None]
        torch.testing.assert_close(batch.logp_sampler[real], original[real], atol=1e-4, rtol=0)


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_two_steps_with_ppo_clip_and_gspo(tmp_path, objective):
    rows, seen = train_recorded(tmp_path, objective, *PLUS, _plus_params(tmp_path), 'advantage.estimator="lope"')
    assert any(r["lope/rescued_frac"] > 0 for r in rows)
    for batch in seen:
        # the shaped advantage, not GRPO's
        torch.testing.assert_close(batch.advantages, build("advantage", "lope")(batch, info_for(6)))
        assert batch.shape[1] == 4 and batch.extras[EXTRA].shape[1] == 8


def test_the_term_reads_the_behaviour_view(tmp_path):
    rows, seen = train_recorded(
        tmp_path,
        "lope",
        *PLUS,
        _plus_params(tmp_path),
        'advantage.estimator="lope"',
        'objective.terms=[{name="lope", behaviour="view"}]',
    )
    assert any(r["lope_shaped"] > 0 for r in rows)
    for batch in seen:  # the re-scored behaviour log-probs are the sampler's up to the engine's numerics
        m = batch.row_mask & batch.row_flags[INJECTED][..., None]  # [B,G,T]
        torch.testing.assert_close(batch.extras["policy@behaviour.logp"][m], batch.logp_sampler[m], atol=1e-4, rtol=0)
    with pytest.raises(ConfigError, match="behaviour"):
        build("objective", "lope", behaviour="old")
    assert Need("logp", view="behaviour") in build("objective", "lope", behaviour="view").needs


def test_two_steps_of_the_shaping_term_around_gspo(tmp_path):
    rows, seen = train_recorded(
        tmp_path,
        "lope",
        *PLUS,
        _plus_params(tmp_path),
        'advantage.estimator="lope"',
        'objective.terms=[{name="lope", base="gspo", level="sequence"}, {name="kl", coef=0.04}]',
    )
    assert any(r["lope_shaped"] > 0 for r in rows) and all("clip_high" in r for r in rows)
