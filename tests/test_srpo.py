"""SRPO (specs/51): role-aware positive token weights, the two contrast views, the evidence task, eval views.

Spec unit test (one trajectory, perception d = [2, 0], reasoning c = [1, −1], role_norm off, κ = 1)::

    s = [2, 0, 1, −1]        b = mean(s) = 0.5
    s − b = [1.5, −.5, .5, −1.5]   (inside clip ±3)
    u = exp(·) = [4.481689, .606531, 1.648721, .223130]   mean 1.740018
    w = u / mean = [2.575657, .348577, .947531, .128234]  (mean 1 over the 4 role tokens)
    A = −1  →  adv_tok = −w;  tags, answer and EOS tokens keep w = 1

The token axis used below (vocabulary ``VOCAB``)::

    t   0    1  2   3    4    5  6   7    8    9   10   11
        <p>  x  y  </p>  <r>  u  v  </r> <a>   z  </a> EOS
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import info_for, train_recorded

from groupwise.errors import ConfigError
from groupwise.needs import NeedResolver, check_view_rollout
from groupwise.registry import build
from groupwise.run import Run
from groupwise.textspans import segment_ids
from groupwise.types import Need, Rollout
from groupwise.views import Remapped
from groupwise.views.ablate_role import ablate, spell
from groupwise.weights.srpo import ABLATE, CORRUPT, apply_token_weights, srpo_token_weights

VOCAB = ["", "<p>", "</p>", "<r>", "</r>", "<a>", "</a>", "x", "y", "u", "v", "z"]
SEQ = [1, 7, 8, 2, 3, 9, 10, 4, 5, 11, 6, 0]  # <p>xy</p><r>uv</r><a>z</a> EOS
P, R = [1, 2], [5, 6]  # perception tokens x y, reasoning tokens u v
SPEC_W = [2.575657, 0.348577, 0.947531, 0.128234]
SHORT = {"perception_tags": ["<p>", "</p>"], "reasoning_tags": ["<r>", "</r>"]}


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def _weight(**params):
    w = build("weight", "srpo", **{**SHORT, **params})
    w.use_vocabulary(VOCAB)
    return w


def _rollout(rows: list[list[int]], d: list[list[float]], c: list[list[float]], valid=None) -> Rollout:
    """B=1 group of len(rows) rows; logp_old = 0, so d = −logp@corrupt_context and c = −logp@ablate_role."""
    G, T = len(rows), max(len(r) for r in rows)
    actions = torch.zeros(1, G, T, dtype=torch.long)
    mask = torch.zeros(1, G, T, dtype=torch.bool)
    for g, r in enumerate(rows):
        actions[0, g, : len(r)] = torch.tensor(r)
        mask[0, g, : len(r)] = True
    ro = Rollout(
        prompt_ids=[[1]],
        actions=actions,
        mask=mask,
        group_valid=torch.ones(1, G, dtype=torch.bool) if valid is None else torch.tensor([valid]),
        truncated=torch.zeros(1, G, dtype=torch.bool),
        prompt_index=torch.arange(1),
        rewards=torch.zeros(1, G),
        advantages=-torch.ones(1, G),
        logp_old=torch.zeros(1, G, T),
    )
    ro.set_extra(CORRUPT.key, -torch.tensor([d], dtype=torch.float32), "token")
    ro.set_extra(ABLATE.key, -torch.tensor([c], dtype=torch.float32), "token")
    return ro


def _spec_contrasts(d=(2.0, 0.0), c=(1.0, -1.0)):
    dd, cc = [0.0] * 12, [0.0] * 12
    dd[1], dd[2], cc[5], cc[6] = d[0], d[1], c[0], c[1]
    return dd, cc


# ---------------------------------------------------------------------------------------------- spec numbers
def test_spec_numbers_through_the_function():
    d = torch.tensor([[2.0, 0.0, 0.0, 0.0, 0.0]])  # [N=1,T=5]; token 4 is the answer (no role)
    c = torch.tensor([[0.0, 0.0, 1.0, -1.0, 0.0]])
    perc = torch.tensor([[1, 1, 0, 0, 0]], dtype=torch.bool)
    reas = torch.tensor([[0, 0, 1, 1, 0]], dtype=torch.bool)
    raw = torch.exp(torch.tensor([1.5, -0.5, 0.5, -1.5], dtype=torch.float64))
    _close(raw, [4.481689, 0.606531, 1.648721, 0.223130])  # the spec's raw w (b = 0.5)
    w = srpo_token_weights(d, c, perc, reas, kappa=1.0, clip=3.0, role_norm=False)
    _close(w, [SPEC_W + [1.0]])
    _close(w[0, :4].mean(), 1.0, atol=1e-12)
    mask = torch.ones(1, 1, 5, dtype=torch.bool)
    # A = −1 → −w
    _close(apply_token_weights(torch.tensor([[-1.0]]), w.view(1, 1, 5), mask), [[[-x for x in SPEC_W] + [-1.0]]])


def test_spec_numbers_through_the_registered_weight_and_role_map():
    d, c = _spec_contrasts()
    ro = _rollout([SEQ], [d], [c])
    w = _weight()(ro, info_for(12))
    assert w.shape == (1, 1, 12) and w.dtype == torch.float32
    expected = [1.0] * 12
    for t, v in zip(P + R, SPEC_W):
        expected[t] = v
    _close(w, [[expected]])  # tags, answer "z", "</a>" and EOS stay 1
    _close(apply_token_weights(ro.advantages, w, ro.mask), [[[-v for v in expected]]])


def test_weights_multiply_the_ppo_clip_advantage():
    # on-policy token_mean: ∂loss/∂logp_t = −A·w_t / 12 = w_t / 12 with A = −1
    d, c = _spec_contrasts()
    ro = _rollout([SEQ], [d], [c])
    ro.weight = _weight()(ro, info_for(12))
    from helpers import objective_for

    obj = objective_for([build("objective", "ppo_clip")], "token_mean")
    logp = ro.logp_old.clone().requires_grad_(True)
    loss = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info_for(12)), info_for(12))
    (grad,) = torch.autograd.grad(loss, logp)
    _close(grad, ro.weight / 12, atol=1e-7)


@pytest.mark.parametrize(
    "params,d,c,expected",
    [
        # κ = 2: clip first (±1.5, ±.5 inside ±3), then ×2 →
        # exp[3,−1,1,−3] = [20.0855,.36788,2.71828,.04979], mean 5.80537
        ({"kappa": 2.0}, (2.0, 0.0), (1.0, -1.0), [3.45982, 0.063369, 0.468236, 0.008576]),
        # clip: d = [10, 0], c = [0, 0]: b = 2.5, s − b = [7.5, −2.5, −2.5, −2.5] → clip [3, −2.5, −2.5, −2.5]
        # exp = [20.0855, .082085 ×3], mean 5.08292 → [3.951553, .016149 ×3]
        ({}, (10.0, 0.0), (0.0, 0.0), [3.951553, 0.016149, 0.016149, 0.016149]),
        # clip on both sides, driven by a reasoning contrast: d = [0, 0], c = [0, −20]: b = −5, s − b = [5, 5, 5, −15]
        # → clip [3, 3, 3, −3]; exp = [20.0855 ×3, .049787], mean 15.0766 → [1.332233 ×3, .003302]
        ({}, (0.0, 0.0), (0.0, -20.0), [1.332233, 1.332233, 1.332233, 0.003302]),
        # role_norm: z(d=[2,0]) = [1,−1] (mean 1, pop std 1), z(c=[1,−1]) = [1,−1]; b = 0 → e^±1 / cosh 1
        ({"role_norm": True}, (2.0, 0.0), (1.0, -1.0), [1.761594, 0.238406, 1.761594, 0.238406]),
    ],
)
def test_kappa_clip_and_role_norm_by_hand(params, d, c, expected):
    dd, cc = _spec_contrasts(d, c)
    w = _weight(**params)(_rollout([SEQ], [dd], [cc]), info_for(12))
    _close(w[0, 0, P + R], expected, atol=2e-6)
    _close(w[0, 0, P + R].mean(), 1.0, atol=1e-6)


# ---------------------------------------------------------------------------------------------- edge cases
def test_edge_cases_no_roles_masked_invalid_nan_and_one_token():
    d, c = _spec_contrasts()
    no_roles = [5, 11, 6, 0]  # <a>z</a> EOS
    one = [1, 7, 2, 5, 11, 6, 0]  # <p>x</p><a>z</a>: one role token
    rows = [SEQ, no_roles, one, SEQ, SEQ]
    dn = [float("nan")] * 12  # a NaN row: every contrast non-finite
    ro = _rollout(
        rows,
        [d, [0.0] * 12, [3.0] + [5.0] * 11, dn, d],
        [c, [0.0] * 12, [0.0] * 12, dn, c],
        valid=[True, True, True, True, False],
    )
    ro.logp_old[0, 1, 6:] = 77.0  # garbage off the mask
    w = _weight()(ro, info_for(12))
    assert torch.isfinite(w).all()
    _close(w[0, 1], [1.0] * 4 + [0.0] * 8)  # no role tokens → 1; padding → exactly 0
    _close(w[0, 2], [1.0] * 7 + [0.0] * 5)  # a lone role token: s − b = 0 → 1
    _close(w[0, 3], [1.0] * 12)  # NaN contrasts fall back to 1
    _close(w[0, 4], [0.0] * 12)  # invalid row → exactly 0
    _close(w[0, 0, P + R], SPEC_W)  # the other rows do not move the first one's weights


def test_role_masks_from_tags_on_a_hand_made_vocabulary():
    w = _weight()
    actions = torch.tensor([SEQ, [3, 9, 4, 1, 7, 2, 5, 11, 6, 0, 0, 0]])  # row 1: reasoning before perception
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 10:] = False
    perc, reas = w._role_masks(actions, mask)
    assert perc[0].nonzero().flatten().tolist() == P and reas[0].nonzero().flatten().tolist() == R
    assert perc[1].nonzero().flatten().tolist() == [4] and reas[1].nonzero().flatten().tolist() == [1]
    assert not (perc & reas).any()
    seg = segment_ids(actions, mask, VOCAB, [["<p>", "</p>"], ["<r>", "</r>"]])
    assert seg[0].tolist() == [0, 1, 1, 0, 0, 2, 2, 0, 0, 0, 0, 0] and seg[1].tolist() == [
        0,
        2,
        0,
        0,
        1,
        0,
        0,
        0,
        0,
        0,
        -1,
        -1,
    ]
    with pytest.raises(ValueError, match="no vocabulary"):
        build("weight", "srpo", **SHORT)._role_masks(actions, mask)


def test_an_unclosed_segment_runs_to_the_end_and_a_straddling_token_belongs_where_it_starts():
    vocab = VOCAB + ["y</p>", "<p"]
    # "<p>xy</p><r>u" EOS, "<p>xy" EOS, "<pz" EOS
    actions = torch.tensor([[1, 7, 12, 3, 9, 0], [1, 7, 8, 0, 0, 0], [13, 11, 0, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    seg = segment_ids(actions, mask, vocab, [["<p>", "</p>"], ["<r>", "</r>"]])
    assert seg[0].tolist() == [
        0,
        1,
        1,
        0,
        2,
        0,
    ]  # "y</p>" starts inside → perception; unclosed <r>: u; EOS (at the end) → none
    assert seg[1].tolist() == [0, 1, 1, 0, -1, -1]  # unclosed <p>: x, y; masked → −1
    assert seg[2].tolist() == [0, 0, 0, -1, -1, -1]  # "<p" is no tag


def test_bad_parameters_and_missing_needs_are_named():
    with pytest.raises(ConfigError, match="kappa"):
        build("weight", "srpo", kappa=0.0)
    with pytest.raises(ConfigError, match="perception_tags"):
        build("weight", "srpo", perception_tags=["<p>"])
    dd, cc = _spec_contrasts()
    ro = _rollout([SEQ], [dd], [cc])
    del ro.extras[ABLATE.key]
    with pytest.raises(ValueError, match="ablate_role"):
        _weight()(ro, info_for(12))
    assert build("weight", "srpo").needs == (
        Need("logp"),
        Need("logp", view="corrupt_context"),
        Need("logp", view="ablate_role"),
    )


# ---------------------------------------------------------------------------------------------- ablate_role view
def _view_rollout(rows, loss_mask=None):
    ro = _rollout(rows, [[0.0] * max(map(len, rows))] * len(rows), [[0.0] * max(map(len, rows))] * len(rows))
    if loss_mask is not None:
        ro.loss_mask = torch.tensor([loss_mask], dtype=torch.bool)
    return ro


def test_ablate_role_removes_the_perception_content_and_maps_positions_by_hand():
    view = build("view", "ablate_role", tags=["<p>", "</p>"])
    view.use_vocabulary(VOCAB)
    short = [1, 7, 2, 3, 9, 4, 0]  # <p>x</p><r>u</r> EOS
    out = view.apply(_view_rollout([SEQ, short]), None)
    assert isinstance(out, Remapped)
    # row 0: <p></p><r>uv</r><a>z</a>EOS (10 tokens); row 1: <p></p><r>u</r>EOS (6)
    assert out.rows.actions[0, 0].tolist() == [1, 2, 3, 9, 10, 4, 5, 11, 6, 0]
    assert out.rows.actions[0, 1].tolist() == [1, 2, 3, 9, 4, 0, 0, 0, 0, 0]
    assert out.rows.mask[0].sum(-1).tolist() == [10, 6]
    assert out.positions[0, 0].tolist() == [0, -1, -1, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # reasoning u, v: 5 → 3, 6 → 4
    assert out.positions[0, 1].tolist() == [0, -1, 1, 2, 3, 4, 5, -1, -1, -1, -1, -1]
    check_view_rollout("ablate_role", _view_rollout([SEQ, short]), out.rows, positions=out.positions)


def test_ablate_role_placeholder_loss_mask_and_rows_without_a_segment():
    view = build("view", "ablate_role", tags=["<p>", "</p>"], placeholder="zz")
    view.use_vocabulary(VOCAB)
    plain = [5, 11, 6, 0]
    holes = [True] * 12
    holes[5] = False  # an environment token inside the reasoning
    out = view.apply(_view_rollout([SEQ, plain], loss_mask=[holes, [True] * 12]), None)
    assert out.rows.actions[0, 0].tolist()[:5] == [1, 11, 11, 2, 3]  # <p>zz</p><r>…
    assert out.positions[0, 0].tolist()[:6] == [0, -1, -1, 3, 4, 5]
    assert out.rows.loss_mask[0, 0].tolist()[:6] == [
        True,
        False,
        False,
        True,
        True,
        False,
    ]  # placeholder: no loss; the hole moved to 5
    # unchanged
    assert out.positions[0, 1].tolist()[:4] == [0, 1, 2, 3] and out.rows.actions[0, 1, :4].tolist() == plain
    assert spell("zz", VOCAB) == [11, 11]
    with pytest.raises(ConfigError, match="spells"):
        spell("q", VOCAB)
    assert ablate([4, 5, 6], [False, True, True], [9]) == ([4, 9], [0, -1, -1])


def test_the_resolver_maps_an_edited_completion_back_and_checks_the_map():
    view_rows = []

    def forward(model, rows, quantities):  # "log-prob" of token t = its id + 100·(its position in the scored rows)
        view_rows.append(rows)
        B, G, T = rows.shape
        return {"logp": (rows.actions + 100 * torch.arange(T)).float() * rows.mask}

    import contextlib

    resolver = NeedResolver(
        [Need("logp", view="ablate_role")],
        {"policy": contextlib.nullcontext},
        {"ablate_role": {"tags": ["<p>", "</p>"]}},
        forward,
        encode=None,
        bind_view=lambda v: v.use_vocabulary(VOCAB),
    )
    ro = _view_rollout([SEQ])
    del ro.extras[ABLATE.key]
    resolver.fill(ro, [Need("logp", view="ablate_role")])
    got = ro.extras[ABLATE.key][0, 0]
    # original token t at edited position pos[t] = [0,-,-,1,2,…,9]: value id + 100·pos, 0 for the removed x, y
    pos = [0, -1, -1, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    _close(got, [SEQ[t] + 100 * p if p >= 0 else 0.0 for t, p in enumerate(pos)])
    edited = view_rows[-1]
    bad = edited.actions.clone()
    bad[0, 0, 3] = 8  # the copy of u is no longer u
    with pytest.raises(ValueError, match="same token"):
        check_view_rollout(
            "ablate_role", ro, Rollout(**{**edited.__dict__, "actions": bad}), positions=torch.tensor([[pos]])
        )
    with pytest.raises(ValueError, match="token axis"):
        check_view_rollout("ablate_role", ro, edited)  # an edited completion without its position map


# ---------------------------------------------------------------------------------------------- corrupt_context view
ROWS = [{"prompt": f"{p}\na+b?", "passage": p} for p in ("a=1 b=2", "a=3 b=4", "a=5 b=6")]


def test_corrupt_context_donor_is_another_train_row_chosen_by_seed_and_row():
    import random

    view = build("view", "corrupt_context")
    view.use_rows(ROWS)
    for key in range(20):
        j = random.Random(key).randrange(3)  # seed 0: Random(0·1_000_003 + key)
        own = ROWS[1]["passage"]
        expected = ROWS[j]["passage"] if ROWS[j]["passage"] != own else ROWS[(j + 1) % 3]["passage"]
        assert view.prompt(ROWS[1], key) == f"{expected}\na+b?"
    chat = {
        "prompt": [{"role": "system", "content": "a=1 b=2"}, {"role": "user", "content": "a=1 b=2\na+b?"}],
        "passage": "a=1 b=2",
    }
    edited = view.prompt(chat, 0)
    assert (
        edited[0]["content"] == "a=1 b=2"
        and edited[1]["content"] != "a=1 b=2\na+b?"
        and chat["prompt"][1]["content"] == "a=1 b=2\na+b?"
    )


def test_corrupt_context_apply_encodes_the_edited_prompts_independently_of_the_batch():
    view = build("view", "corrupt_context")
    view.use_rows(ROWS)
    encode = lambda text: [ord(ch) for ch in text]  # noqa: E731
    ro = _view_rollout([SEQ, SEQ])
    ro = Rollout(
        **{
            **ro.__dict__,
            "prompt_ids": [encode(r["prompt"]) for r in ROWS],
            "prompt_index": torch.tensor([0, 1, 2]),
            "actions": ro.actions.expand(3, 2, 12),
            "mask": ro.mask.expand(3, 2, 12),
            "group_valid": torch.ones(3, 2, dtype=torch.bool),
            "truncated": torch.zeros(3, 2, dtype=torch.bool),
            "meta": [dict(r) for r in ROWS],
            "extras": {},
            "extra_levels": {},
            "rewards": None,
            "advantages": None,
            "logp_old": None,
        }
    )
    out = view.apply(ro, encode)
    assert out.prompt_ids == [encode(view.prompt(r, k)) for k, r in enumerate(ROWS)]
    assert all(a != b for a, b in zip(out.prompt_ids, ro.prompt_ids))
    # same donor whatever else is in the batch
    assert view.apply(ro.select([2]), encode).prompt_ids == [out.prompt_ids[2]]
    assert torch.equal(out.actions, ro.actions) and out.extras is not ro.extras


def test_corrupt_context_without_a_passage_keeps_or_refuses():
    keep, strict = build("view", "corrupt_context"), build("view", "corrupt_context", on_missing="raise")
    for v in (keep, strict):
        v.use_rows(ROWS)
    plain = {"prompt": "37+45=", "answer": "82"}
    assert keep.prompt(plain, 0) == "37+45="
    with pytest.raises(ValueError, match="no 'passage' column"):
        strict.prompt(plain, 0)
    with pytest.raises(ValueError, match="does not contain"):
        strict.prompt({"prompt": "x", "passage": "a=1 b=2"}, 0)
    lonely = build("view", "corrupt_context", on_missing="raise")
    lonely.use_rows(ROWS[:1])
    with pytest.raises(ValueError, match="no donor"):
        lonely.prompt(ROWS[0], 0)
    with pytest.raises(ConfigError, match="on_missing"):
        build("view", "corrupt_context", on_missing="drop")


# ---------------------------------------------------------------------------------------------- with the real model
def _trainer(tmp_path, *overrides):
    from test_trainer import make_trainer

    return make_trainer(
        tmp_path,
        "data.task=evidence",
        "rollout.max_new_tokens=36",
        "eval.size=4",
        'objective.weights=[{name="srpo", perception_tags=["<p>", "</p>"], reasoning_tags=["<r>", "</r>"]}]',
        'views={ablate_role={tags=["<p>", "</p>"]}}',
        *overrides,
    )


def test_view_log_probs_equal_a_forward_of_the_hand_built_sequences(tmp_path):
    from groupwise.policy.forward import completion_logprobs
    from groupwise.tasks.evidence import rows

    trainer = _trainer(tmp_path)
    tok = trainer.policy.tokenizer
    data = rows("train", 2, 0)
    completions = [tok.encode(r["answer"]) + [0] for r in data]
    T = max(map(len, completions))
    actions = torch.zeros(2, 1, T, dtype=torch.long)
    mask = torch.zeros(2, 1, T, dtype=torch.bool)
    for b, ids in enumerate(completions):
        actions[b, 0, : len(ids)], mask[b, 0, : len(ids)] = torch.tensor(ids), True
    ro = Rollout(
        prompt_ids=[trainer.policy.encode(r["prompt"]) for r in data],
        actions=actions,
        mask=mask,
        group_valid=torch.ones(2, 1, dtype=torch.bool),
        truncated=torch.zeros(2, 1, dtype=torch.bool),
        prompt_index=torch.tensor([5, 9]),
        meta=data,
    )
    trainer.needs.fill(ro, trainer.step_needs)
    with torch.no_grad():
        # corrupted: the prompt with another train row's passage, same completion
        donor = [
            trainer.policy.encode(trainer.needs.views["corrupt_context"].prompt(r, k)) for r, k in zip(data, (5, 9))
        ]
        expected = completion_logprobs(trainer.policy.module, donor, actions, mask, ro.group_valid)["logp"]
        torch.testing.assert_close(ro.extras[CORRUPT.key], expected, atol=1e-5, rtol=1e-5)
        assert (ro.extras[CORRUPT.key] - ro.logp_old).abs().max() > 1e-2
        # ablated: the completion without the perception content, scored by hand, read at the kept tokens
        for b, r in enumerate(data):
            head, rest = r["answer"].split("</p>", 1)
            cut = tok.encode("<p>") + tok.encode("</p>" + rest) + [0]
            out = completion_logprobs(
                trainer.policy.module,
                [ro.prompt_ids[b]],
                torch.tensor([[cut]]),
                torch.ones(1, 1, len(cut), dtype=torch.bool),
                torch.ones(1, 1, dtype=torch.bool),
            )["logp"][0, 0]
            n_perc = len(tok.encode(head)) - len(tok.encode("<p>"))
            kept = list(range(3)) + list(range(3 + n_perc, len(completions[b])))
            torch.testing.assert_close(ro.extras[ABLATE.key][b, 0, kept], out, atol=1e-5, rtol=1e-5)
            assert (ro.extras[ABLATE.key][b, 0, 3 : 3 + n_perc] == 0).all()  # removed tokens: no value
    w = trainer.weights[0](ro, info_for(T))  # [2,1,T]
    perc, reas = trainer.weights[0]._role_masks(actions.reshape(2, T), mask.reshape(2, T))
    role = (perc | reas).reshape(2, 1, T)
    inner = lambda text, o, c: text.split(o, 1)[1].split(c, 1)[0]  # noqa: E731
    assert role.sum().item() == sum(
        len(tok.encode(inner(r["answer"], "<p>", "</p>"))) + len(tok.encode(inner(r["answer"], "<r>", "</r>")))
        for r in data
    )  # the quoted facts and the sum
    _close((w * role).sum(-1) / role.sum(-1), torch.ones(2, 1), atol=1e-5)  # mean 1 over each row's role tokens
    assert (w[~role & mask] == 1).all() and float(w[role].min()) < 1 < float(w[role].max())


def test_eval_views_score_edited_held_out_prompts_and_log_the_gap(tmp_path):
    import json

    trainer = _trainer(tmp_path, "train.steps=1", "eval.every=1", 'eval.views=["corrupt_context"]')
    Run(trainer).train()
    view = trainer.parts.eval_views["corrupt_context"]
    for i in range(4):
        assert trainer.prompts.cache[("eval@corrupt_context", i)] == trainer.policy.encode(
            view.prompt(trainer.parts.eval_rows[i], i)
        )
        assert trainer.prompts.cache[("eval@corrupt_context", i)] != trainer.prompts.cache[("eval", i)]
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["eval_gap@corrupt_context"] == row["eval_accuracy"] - row["eval_accuracy@corrupt_context"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "accuracy_after@corrupt_context" in summary and "accuracy_before@corrupt_context" in summary
    with pytest.raises(ConfigError, match="edits more than the prompt"):
        _trainer(tmp_path / "x", 'eval.views=["ablate_role"]')
    with pytest.raises(ConfigError, match="corrup_context"):
        _trainer(tmp_path / "y", 'eval.views=["corrup_context"]')


# ---------------------------------------------------------------------------------------------- composition
@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_composes_with_ppo_clip_and_gspo(tmp_path, objective):
    # a 40-step sft phase first, so that sampled completions carry the tags and SRPO has role tokens
    sft = 'phases=[{name="sft", steps=40, batch_size=16, update={name="adamw", lr=3e-3, warmup_steps=5}}]'
    rows, seen = train_recorded(
        tmp_path,
        objective,
        "data.task=evidence",
        "rollout.max_new_tokens=36",
        'objective.weights=[{name="srpo", perception_tags=["<p>", "</p>"], reasoning_tags=["<r>", "</r>"]}]',
        'views={ablate_role={tags=["<p>", "</p>"]}, corrupt_context={on_missing="raise"}}',
        sft,
    )
    assert all(r["srpo/perc_frac"] > 0 and r["srpo/reas_frac"] > 0 for r in rows)
    w = build("weight", "srpo", **SHORT)
    w.use_vocabulary(_vocab())
    for batch in seen:
        # what the loss used
        torch.testing.assert_close(batch.weight, w(batch, info_for(batch.shape[2])), atol=1e-6, rtol=0)
        B, G, T = batch.shape
        perc, reas = w._role_masks(batch.actions.reshape(B * G, T), batch.mask.reshape(B * G, T))
        role = (perc | reas).reshape(B, G, T) & batch.row_mask
        has = role.any(-1)  # [B,G]
        mean = (batch.weight * role).sum(-1)[has] / role.sum(-1)[has]
        _close(mean, torch.ones_like(mean), atol=1e-5)  # mean 1 over each row's role tokens
        assert (batch.weight[batch.row_mask & ~role] == 1).all() and (batch.weight[~batch.row_mask] == 0).all()
        assert batch.weight[role].std() > 0


def _vocab() -> list[str]:
    """The embedded model's token texts, as the trainer's LM policy gives them (``token_texts``)."""
    from test_trainer import MODEL
    from transformers import AutoTokenizer

    from groupwise.policy.lm import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(MODEL))
    special = set(tok.all_special_ids)
    return ["" if i in special else tok.decode([i]) for i in range(len(tok))]


# ---------------------------------------------------------------------------------------------- task and reward
def test_evidence_task_rows_and_reward():
    from groupwise.registry import build_spec
    from groupwise.tasks import get_task

    task = get_task("evidence")
    train, test = task.rows("train", 0, 0), task.rows("test", 0, 0)
    assert len(train) == 8000 and len(test) == 300 and not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert task.rows("train", 5, 1) == task.rows("train", 5, 1) != task.rows("train", 5, 2)
    reward = build_spec("reward", task.reward)
    for r in train[:200]:
        values = dict(kv.split("=") for kv in r["passage"].split())
        x, y = r["question"].split("+")
        assert (
            r["value"] == str(int(values[x]) + int(values[y]))
            and r["passage"] in r["prompt"]
            and len(r["passage"]) == 15
        )
        assert r["answer"] == f"<p>{x}={values[x]} {y}={values[y]}</p><r>{values[x]}+{values[y]}</r><a>{r['value']}</a>"
    scores = reward(
        [r["prompt"] for r in train[:3]] * 3,
        [r["answer"] for r in train[:3]] + ["<a>99</a>"] * 3 + [r["value"] for r in train[:3]],
        value=[r["value"] for r in train[:3]] * 3,
    )
    assert scores == [1.0] * 3 + [0.0] * 3 + [0.0] * 3  # a bare value without <a> gets 0
    assert 0.25 < sum(r["shortcut"] for r in train) / len(train) < 0.33
    assert all(
        r["value"]
        == str({"a": 1, "b": 2, "c": 3, "d": 4}[r["question"][0]] + {"a": 1, "b": 2, "c": 3, "d": 4}[r["question"][2]])
        for r in train
        if r["shortcut"]
    )


def test_exact_start_cuts_before_stop():
    exact = build("reward", "exact", start="<a>", stop="</a>")
    assert exact(["q"] * 4, ["<p>x</p><a> 7 </a>tail", "<a>7", "7", "<a>8</a><a>7</a>"], answer=["7"] * 4) == [
        1.0,
        1.0,
        0.0,
        0.0,
    ]
    assert exact(["q"], ["no tag"], answer=[None]) == [None]
    assert math.isclose(build("reward", "exact")(["q"], ["7"], answer=["7"])[0], 1.0)
