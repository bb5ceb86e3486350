"""F-GRPO (specs/24): the two reward channels, the phase advantage and the two-phase loss, by hand.

Spec unit test: Rel = {A, B} (binary gains), K = 3, G = 4 rollouts whose set is their ranking::

    [A,B,C]  recall 2/2 = 1     DCG = 1 + 1/log2 3 = 1.63093 = IDCG          NDCG 1
    [C,A,B]  recall 1           DCG = 1/log2 3 + 1/log2 4 = .63093 + .5 = 1.13093  NDCG 1.13093/1.63093 = .69342
    [C,D,A]  recall 1/2         DCG = 1/log2 4 = .5      NDCG .5/1.63093 = .30657;
                                conditional: IDCG(S∩Rel = {A}) = 1 → .5
    [C,D,E]  recall 0           NDCG 0
    A_gen  (population std): mean .625, dev [.375, .375, −.125, −.625], var .6875/4 = .171875, std .414578
           → [.90453, .90453, −.30151, −1.50756]
    A_rank: mean .5, dev [.5, .19342, −.19342, −.5], var (.25 + .037411)·2/4 = .143706, std .379086
           → [1.31896, .51023, −.51023, −1.31896]
Rollout 2 gets positive generation credit but less ranking credit: the point of F-GRPO.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from helpers import info_for, rollout_from
from test_trainer import make_trainer

from groupwise.advantages.f_grpo import fgrpo_token_adv, phase_ids
from groupwise.errors import ConfigError
from groupwise.losses.f_grpo import PHASE_KEY, fgrpo_loss
from groupwise.registry import build
from groupwise.rewards.ranking import fgrpo_rewards, parse_ranking
from groupwise.run import Run

VOCAB = ["", "[", "]", ",", ">", "A", "B", "C", "D", "E", "]A"]  # id 0 is EOS (no text); id 10 straddles the boundary
IDS = {t: i for i, t in enumerate(VOCAB) if t}
SETS = [list("ABC"), list("CAB"), list("CDA"), list("CDE")]
R_GEN, R_RANK, R_COND = [1.0, 1.0, 0.5, 0.0], [1.0, 0.69342, 0.30657, 0.0], [1.0, 0.69342, 0.5, 0.0]
A_GEN, A_RANK = [0.90453, 0.90453, -0.30151, -1.50756], [1.31896, 0.51023, -0.51023, -1.31896]


def text(ids_):
    return "[" + ",".join(ids_) + "]" + ">".join(ids_)


def tokens(s):
    return [IDS[c] for c in s] + [0]  # one token per character, then EOS


def test_rewards_by_hand():
    r_gen, r_rank = fgrpo_rewards(SETS, SETS, ["A", "B"], 3)
    torch.testing.assert_close(r_gen, torch.tensor(R_GEN))
    torch.testing.assert_close(r_rank, torch.tensor(R_RANK), atol=1e-5, rtol=0)
    _, r_cond = fgrpo_rewards(SETS, SETS, ["A", "B"], 3, mode="conditional")
    torch.testing.assert_close(r_cond, torch.tensor(R_COND), atol=1e-5, rtol=0)
    completions = [text(s) for s in SETS]  # the registered rewards on the text
    rel = [["A", "B"]] * 4
    assert build("reward", "recall_at_k")([""] * 4, completions, gains=rel) == R_GEN
    assert build("reward", "ndcg_at_k")([""] * 4, completions, gains=rel) == pytest.approx(R_RANK, abs=1e-5)
    assert build("reward", "ndcg_at_k", mode="conditional")([""] * 4, completions, gains=rel) == pytest.approx(
        R_COND, abs=1e-5
    )


def test_reward_edge_cases():
    gains = [{"D": 3, "G": 2, "B": 1}]
    ndcg, recall = build("reward", "ndcg_at_k"), build("reward", "recall_at_k")
    # graded: "D>B" → DCG 3 + 1/log2 3 = 3.63093; IDCG 3 + 2/log2 3 + 1/2 = 4.76186 → .76251
    assert ndcg([""], ["[B,D,G]D>B"], gains=gains) == pytest.approx([3.63093 / 4.76186], abs=1e-5)
    assert ndcg([""], ["[B,D,G]D>D>G"], gains=gains) == [0.0]  # duplicate → invalid
    assert ndcg([""], ["[B,D,G]D>A>G"], gains=gains) == [0.0]  # A is not in the set → invalid
    assert ndcg([""], ["D>G>B"], gains=gains) == [0.0]  # no candidate segment → parse failure
    assert recall([""], ["[B,D,G,A]D"], gains=gains) == [0.0]  # 4 > max_set = k = 3
    assert recall([""], ["[B,D,B]"], gains=gains) == [pytest.approx(2 / 3)]  # a set: B counts once
    assert recall([""], ["[D]"], gains=[[]]) == [None]  # no relevant item: no verdict
    assert build("reward", "ndcg_at_1")([""], ["[B,D,G]G>D"], gains=gains) == [pytest.approx(2 / 3)]  # gain 2 / ideal 3
    assert parse_ranking("<cand> A, B </cand><rank> B > A </rank>", ["<cand>", "</cand>"], ["<rank>", "</rank>"]) == (
        ["A", "B"],
        ["B", "A"],
    )
    with pytest.raises(ConfigError, match="cand_tags"):
        build("reward", "recall_at_k", cand_tags=["["])


def _rollout(parts, sets=SETS, valid=None):
    acts = [tokens(text(s)) for s in sets]
    T = max(len(a) for a in acts)
    actions = torch.zeros(1, len(sets), T, dtype=torch.long)
    mask = torch.zeros(1, len(sets), T, dtype=torch.bool)
    for g, a in enumerate(acts):
        actions[0, g, : len(a)], mask[0, g, : len(a)] = torch.tensor(a), True
    parts = torch.tensor(parts, dtype=torch.float32).T[None]  # [1,G,2]
    ro = rollout_from(
        torch.zeros(1, len(sets), T), mask=mask, actions=actions, reward_parts=parts, rewards=parts.sum(-1)
    )
    if valid is not None:
        ro.group_valid = torch.tensor([valid])
    return ro


def _advantage(**kw):
    est = build("advantage", "f_grpo", std="population", eps=0.0, **kw)
    est.use_vocabulary(VOCAB)
    return est


def test_phase_advantages_by_hand():
    ro = _rollout([R_GEN, R_RANK])
    adv = _advantage()(ro, info_for(13))  # [1,4,13]: "[A,B,C]" (7 tokens) then "A>B>C" + EOS (6 tokens)
    assert adv.shape == (1, 4, 13)
    for g in range(4):
        torch.testing.assert_close(adv[0, g, :7], torch.full((7,), A_GEN[g]), atol=1e-4, rtol=0)
        torch.testing.assert_close(adv[0, g, 7:], torch.full((6,), A_RANK[g]), atol=1e-4, rtol=0)
    assert adv[0, 1, 0] > 0 and adv[0, 1, 7] < adv[0, 0, 7]  # rollout 2: credited for its set, less for its order
    adv2 = _advantage(rank_coef=0.5)(ro, info_for(13))
    torch.testing.assert_close(adv2[0, :, 7:], 0.5 * adv[0, :, 7:])  # λ_rank scales the ranking phase only
    torch.testing.assert_close(adv2[0, :, :7], adv[0, :, :7])
    m_gen = torch.arange(13)[None] < 7  # the spec's interface gives the same tokens
    torch.testing.assert_close(
        fgrpo_token_adv(torch.tensor(A_GEN), torch.tensor(A_RANK), m_gen.expand(4, 13), ~m_gen.expand(4, 13)),
        adv[0],
        atol=1e-4,
        rtol=0,
    )


def test_phase_ids_boundary_tags_and_straddling_token():
    vocab, mask = VOCAB, torch.ones(3, 6, dtype=torch.bool)
    # "[A]A", "[A]A>B", "A>B" (no set)
    actions = torch.tensor([[1, 5, 2, 5, 0, 0], [1, 5, 10, 4, 6, 0], [5, 4, 6, 0, 0, 0]])
    mask[0, 5] = False
    ph = phase_ids(actions, mask, vocab, ["[", "]"])
    assert ph[0].tolist() == [0, 0, 0, 1, 1, -1]  # the close tag is generation; EOS after it is ranking; masked → −1
    assert ph[1].tolist() == [0, 0, 0, 1, 1, 1]  # "]A" starts before the boundary → generation
    assert ph[2].tolist() == [0] * 6  # no candidate segment: everything is the generation phase


def test_edge_cases_exact_zeros():
    # constant group in both channels → 0; a NaN phase reward → 0 for that phase; invalid rows → exactly 0
    ro = _rollout([[1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    assert (_advantage()(ro, info_for(13)) == 0).all()
    ro = _rollout([[1.0, 0.0, float("nan"), 1.0], R_RANK], valid=[True, True, True, False])
    ro.rewards = torch.nan_to_num(ro.rewards)  # a finite total (reward.missing skips the missing part), one part NaN
    adv = _advantage()(ro, info_for(13))
    assert (adv[0, 3] == 0).all()  # group_valid False
    assert (adv[0, 2, :7] == 0).all() and (adv[0, 2, 7:] != 0).all()  # NaN recall: no generation credit, ranking kept
    assert (adv[~ro.mask] == 0).all()  # masked tokens
    ro = _rollout([R_GEN, R_RANK], valid=[True, False, False, False])
    assert (_advantage()(ro, info_for(13)) == 0).all()  # one valid row


def test_one_reward_column_is_grpo_broadcast_and_bad_indices_fail():
    ro = _rollout([R_GEN, R_RANK])
    ro.reward_parts = ro.reward_parts[..., 1:]  # one reward: both phases use it
    adv = _advantage()(ro, info_for(13))
    grpo = build("advantage", "grpo", std="population", eps=0.0)
    ro.rewards = ro.reward_parts[..., 0]
    torch.testing.assert_close(adv, grpo(ro, info_for(13))[..., None].expand_as(adv) * ro.mask)
    with pytest.raises(ConfigError, match="reward columns"):
        _advantage(rank_part=2)(_rollout([R_GEN, R_RANK]), info_for(13))
    with pytest.raises(ValueError, match="vocabulary"):
        build("advantage", "f_grpo")(_rollout([R_GEN, R_RANK]), info_for(13))


def test_two_phase_loss_by_hand():
    # gen tokens: logp − old = [.1, .3] → mean .2, rho e^.2 = 1.22140 → clip 1.2; A_gen = +1 → −min(1.2214, 1.2) = −1.2
    # rank tokens: [−.5, −.1] → mean −.3, rho e^−.3 = .74082 → clip .8; A_rank = −1 → −min(−.74082, −.8) = .8
    # row loss −1.2 + .8 = −.4; both phases clipped → zero gradient
    old = torch.zeros(1, 1, 4)
    logp = torch.tensor([[[0.1, 0.3, -0.5, -0.1]]], requires_grad=True)
    adv = torch.tensor([[[1.0, 1.0, -1.0, -1.0]]])
    phase = torch.tensor([[[0, 0, 1, 1]]])
    mask = torch.ones(1, 1, 4, dtype=torch.bool)
    loss, rho, A = fgrpo_loss(logp, old, adv, phase, mask)
    assert loss.item() == pytest.approx(-0.4, abs=1e-6)
    assert rho[0, 0].tolist() == pytest.approx([math.exp(0.2), math.exp(-0.3)], abs=1e-6) and A[0, 0].tolist() == [
        1.0,
        -1.0,
    ]
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert (grad == 0).all()
    # rank tokens [−.1, .1] → rho 1 (inside the clip), A = −1: loss_rank = rho →
    # d/dlogp_t = rho/2 = .5 on each rank token
    logp = torch.tensor([[[0.1, 0.3, -0.1, 0.1]]], requires_grad=True)
    loss, _, _ = fgrpo_loss(logp, old, adv, phase, mask)
    assert loss.item() == pytest.approx(-1.2 + 1.0, abs=1e-6)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[[0.0, 0.0, 0.5, 0.5]]]))
    # a phase without tokens adds nothing; masked tokens get no gradient
    mask[0, 0, 2:] = False
    loss, _, _ = fgrpo_loss(logp, old, adv, phase, mask)
    assert loss.item() == pytest.approx(-1.2, abs=1e-6)


def test_loss_term_reads_the_phase_map_and_token_level_is_ppo():
    term = build("objective", "f_grpo")
    term.use_vocabulary(VOCAB)
    ro = _rollout([R_GEN, R_RANK])
    ro.advantages = _advantage()(ro, info_for(13))
    term.prepare(ro, info_for(13))
    assert ro.extras[PHASE_KEY][0, 0].tolist() == [0] * 7 + [1] * 6
    logp = (0.05 * torch.arange(13.0)).expand(1, 4, 13).clone().requires_grad_(True)  # off-policy, inside the clip
    out = term(ro, {"logp": logp}, info_for(13))  # [1,4] rows: −(rho_gen A_gen + rho_rank A_rank)
    # gen tokens t = 0..6: mean log-ratio .05·3 = .15 → rho_gen = e^.15 = 1.16183 (inside [.8, 1.2]): −rho_gen·A_gen
    # rank tokens t = 7..12: mean .05·9.5 = .475 → rho_rank = 1.60801 > 1.2:
    # −1.2·A_rank if A_rank > 0, else −rho_rank·A_rank
    rho_gen, rho_rank = math.exp(0.15), math.exp(0.475)
    expect = [-rho_gen * a + (-1.2 * b if b > 0 else -rho_rank * b) for a, b in zip(A_GEN, A_RANK)]
    torch.testing.assert_close(out[0], torch.tensor(expect), atol=1e-4, rtol=0)
    tok = build("objective", "f_grpo", level="token")(ro, {"logp": logp}, info_for(13))
    torch.testing.assert_close(tok, build("objective", "ppo_clip")(ro, {"logp": logp}, info_for(13)))


def _batches(trainer):
    seen = []
    observe = trainer.observe
    trainer.observe = lambda batch: (seen.append(batch), observe(batch))
    return seen


FGRPO = [
    'data.task="ranking"',
    'rewards=["recall_at_k", "ndcg_at_k"]',
    'advantage.estimator="f_grpo"',
    "rollout.max_new_tokens=16",
    "rollout.group_size=8",
    'phases=[{name="sft", steps=40, batch_size=16, update={name="adamw", lr=2e-3}}]',
    "train.steps=2",
    "eval.size=0",
]


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo", "f_grpo"])
def test_composes_with_objectives(tmp_path, objective):
    trainer = make_trainer(tmp_path, *FGRPO, f'objective.terms=["{objective}"]')
    seen = _batches(trainer)
    Run(trainer).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert all(0 < r["f_grpo/gen_share"] < 1 for r in rows)  # the phase map split the completions
    for batch in seen:  # generation tokens carry the group-normalised recall, ranking tokens the normalised NDCG
        assert batch.advantages.dim() == 3
        est, phase = build("advantage", "grpo"), phase_of(trainer, batch)  # [B,G,T]
        for k in (0, 1):
            one = dataclasses.replace(batch, rewards=batch.reward_parts[..., k])
            want = est(one, info_for(16))[..., None].expand_as(batch.advantages)  # [B,G,T]
            on = batch.row_mask & (phase == k)
            torch.testing.assert_close(batch.advantages[on], want[on], atol=1e-5, rtol=1e-5)
        if PHASE_KEY in batch.extras:  # the loss term's map (its prepare) is the estimator's
            assert torch.equal(batch.extras[PHASE_KEY][batch.row_mask], phase[batch.row_mask])
    assert any(bool((b.advantages != 0).any()) for b in seen)
    if objective == "f_grpo":
        assert "ratio_gen" in rows[0] and "ratio_rank" in rows[0]


def phase_of(trainer, batch):
    B, G, T = batch.shape
    return phase_ids(
        batch.actions.reshape(B * G, T), batch.row_mask.reshape(B * G, T), trainer.estimator._token_text, ["[", "]"]
    ).reshape(B, G, T)


def test_the_trainer_gives_the_policy_vocabulary_and_token_texts_spell_the_completion(tmp_path):
    trainer = make_trainer(tmp_path, *FGRPO, 'objective.terms=["f_grpo"]')
    texts = trainer.estimator._token_text
    assert texts == trainer.objective.terms[0]._token_text  # both readers got the vocabulary
    assert len(texts) == len(trainer.policy.tokenizer)
    ids = trainer.policy.tokenizer.encode("[A, B] > B > A", add_special_tokens=False)
    # the phase map's character offsets are the decoded text's
    assert "".join(texts[i] for i in ids) == trainer.policy.tokenizer.decode(ids)
    assert all(texts[i] == "" for i in trainer.policy.tokenizer.all_special_ids)


def test_a_policy_without_token_texts_fails_at_build(tmp_path):
    from groupwise.build import build
    from groupwise.config import load_config
    from groupwise.trainer import Trainer

    cfg, _ = load_config("flash_grpo", [f'out="{tmp_path}"', 'advantage.estimator="f_grpo"'])
    with pytest.raises(ConfigError, match="f_grpo.*token texts"):
        Trainer(build(cfg))
