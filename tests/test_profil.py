"""ProFIL filter, commitment labels, attention-pooling probe and step segmentation (spec 34)."""

from __future__ import annotations

import pytest
import torch

from groupwise.advantages.profil import (
    AttnProbe,
    commitment_labels,
    committed_steps,
    profil_filter,
    rollout_score,
    segment_steps,
)

NAN = float("nan")


def test_filter_spec_numbers():
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    scores = torch.tensor([0.2, 0.8, 0.6, 0.1])
    # scores > 0.5 are rows 1 and 2 → both zeroed; with only_positive row 2 (A = −1) keeps its advantage
    assert profil_filter(adv, scores, 0.5).tolist() == [1.0, 0.0, 0.0, -1.0]
    assert profil_filter(adv, scores, 0.5, only_positive=True).tolist() == [1.0, 0.0, -1.0, -1.0]
    # the threshold is strict: a score equal to tau is kept; NaN never filters
    assert profil_filter(adv, torch.tensor([0.5, NAN, 0.0, 0.0])).tolist() == [1.0, 1.0, -1.0, -1.0]


def test_filter_token_level_advantages():
    adv = torch.tensor([[1.0, 2.0], [-1.0, 3.0]])  # [N,T]
    out = profil_filter(adv, torch.tensor([0.9, 0.9]), only_positive=True)
    assert out.dtype == torch.float32 and out.tolist() == [[0.0, 0.0], [-1.0, 0.0]]  # per token: only A_t > 0
    with pytest.raises(ValueError, match="leading shape"):
        profil_filter(adv, torch.tensor([0.9, 0.9, 0.9]))


def test_commitment_labels_spec_numbers():
    forced = ["x", 7, 7, 7]
    assert committed_steps(forced, 7).tolist() == [False, True, True, True]  # [0,1,1,1]
    assert commitment_labels(forced, 7).tolist() == [0.0, 0.0, 1.0, 1.0]  # step 1 commits; steps 2, 3 come after
    # commitment only at the last step: no step follows it → nothing is post-commitment
    assert commitment_labels([1, 2, 3], 3).tolist() == [0.0, 0.0, 0.0]
    # once committed, a later wobble stays post-commitment (the decision was already made)
    assert commitment_labels([7, 1, 7], 7).tolist() == [0.0, 1.0, 1.0]
    # a verifier comparison instead of ==
    assert commitment_labels(["7.0", "7", "x"], "7", equal=lambda a, b: a.strip() == b or a == b + ".0").tolist() == [
        0.0,
        1.0,
        1.0,
    ]
    assert commitment_labels([], 7).tolist() == []


def test_probe_output_in_unit_interval_and_permutation_invariant():
    torch.manual_seed(0)
    probe = AttnProbe(d_model=8, n_heads=4)
    H = torch.randn(5, 8)  # one step, 5 tokens
    p = probe(H)
    assert p.shape == () and 0.0 < p.item() < 1.0
    for perm in (torch.tensor([4, 3, 2, 1, 0]), torch.tensor([1, 0, 3, 4, 2])):
        torch.testing.assert_close(probe(H[perm]), p)
    # not constant: a different step gets a different score (the invariance above is not vacuous)
    assert abs(probe(torch.randn(5, 8) * 3).item() - p.item()) > 1e-4


def test_probe_scores_per_step_ignores_other_tokens():
    torch.manual_seed(1)
    probe = AttnProbe(d_model=6, n_heads=2)
    hidden = torch.randn(2, 7, 6)
    ids = torch.tensor([[0, 0, -1, 1, 1, 1, -1], [0, 0, 0, -1, -1, -1, -1]])  # row 1 has no step 1
    p = probe.probe_scores(hidden, ids)
    assert p.shape == (2, 2) and torch.isnan(p[1, 1]) and ((p[~torch.isnan(p)] > 0) & (p[~torch.isnan(p)] < 1)).all()
    # each step equals the probe on its own tokens
    torch.testing.assert_close(p[0, 1], probe(hidden[0, 3:6]))
    # tokens of no step (even NaN) and tokens of another step leave a step's score unchanged
    edited = hidden.clone()
    edited[0, 2], edited[0, 6], edited[0, 3:6] = NAN, NAN, 100.0
    torch.testing.assert_close(probe.probe_scores(edited, ids)[0, 0], p[0, 0])
    # a loss on the present steps only has finite gradients despite the absent step and NaN states
    q = probe.probe_scores(edited, ids)
    q[~torch.isnan(q)].sum().backward()
    assert all(torch.isfinite(w.grad).all() for w in probe.parameters())
    # shuffling token positions (states and ids together) changes nothing
    perm = torch.tensor([6, 3, 0, 5, 2, 1, 4])
    torch.testing.assert_close(probe.probe_scores(hidden[:, perm], ids[:, perm]), p, equal_nan=True)


def test_rollout_score_modes():
    p = torch.tensor([[0.9, 0.2, 0.7, NAN], [0.1, 0.3, NAN, NAN], [NAN, NAN, NAN, NAN]])
    # row 0: 2 of 3 steps above 0.5; row 1: none; row 2: no steps → 0
    torch.testing.assert_close(rollout_score(p), torch.tensor([2 / 3, 0.0, 0.0]))
    torch.testing.assert_close(rollout_score(p, "max"), torch.tensor([0.9, 0.3, 0.0]))
    torch.testing.assert_close(rollout_score(p, "mean_prob"), torch.tensor([0.6, 0.2, 0.0]))  # (0.9+0.2+0.7)/3
    with pytest.raises(ValueError, match="mode must be one of"):
        rollout_score(p, "median")


def test_segment_steps_by_newlines():
    # "ab\nc\n\nd": lines "ab\n" → 0, "c\n" → 1, "\n" blank → none, "d" → 2; "\n\n" starts with c's newline
    assert segment_steps(["a", "b", "\n", "c", "\n\n", "d"]).tolist() == [0, 0, 0, 1, 1, 2]
    # a token straddling a boundary takes the step of its first visible character
    assert segment_steps(["x", "\ny", "z"]).tolist() == [0, 1, 1]
    # leading blank line: no step; padding to T
    assert segment_steps(["\n", "ab", "\n"], pad_to=5).tolist() == [-1, 0, 0, -1, -1]
    # completion text with a tokenizer's offsets; and per character without offsets
    assert segment_steps("ab\n\ncd", offsets=[(0, 2), (2, 4), (4, 6)]).tolist() == [0, 0, 1]
    assert segment_steps("a\n b").tolist() == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="shorter"):
        segment_steps(["a", "b"], pad_to=1)


def test_probe_learns_a_separable_step_labelling():
    # step label y; every token of the step has a component (2y − 1)(1 + |z|) along a fixed direction u
    # and Gaussian noise orthogonal to it → mean-pooled states are linearly separable with margin 1
    g = torch.Generator().manual_seed(0)
    d, N, K, L = 8, 96, 3, 4
    u = torch.nn.functional.normalize(torch.randn(d, generator=g), dim=0)

    def data():
        y = torch.randint(0, 2, (N, K), generator=g).float()  # [N,K]
        ids = torch.arange(K).repeat_interleave(L).repeat(N, 1)  # [N,K·L]
        ids[:, ::5] = -1  # some tokens in no step
        sign = (2 * y - 1).repeat_interleave(L, dim=1)  # [N,K·L]
        noise = torch.randn(N, K * L, d, generator=g)
        noise = noise - (noise @ u)[..., None] * u  # orthogonal to u
        hidden = noise + (sign * (1 + torch.randn(N, K * L, generator=g).abs()))[..., None] * u
        hidden[ids < 0] = 50.0  # garbage outside steps
        return hidden, ids, y

    (h_tr, id_tr, y_tr), (h_te, id_te, y_te) = data(), data()
    torch.manual_seed(0)
    probe = AttnProbe(d, n_heads=4)
    opt = torch.optim.Adam(probe.parameters(), lr=1e-2)
    acc0 = ((probe.probe_scores(h_te, id_te) > 0.5).float() == y_te).float().mean().item()
    for _ in range(300):
        p = probe.probe_scores(h_tr, id_tr)  # [N,K]; every row has all K steps
        loss = torch.nn.functional.binary_cross_entropy(p, y_tr)
        opt.zero_grad()
        loss.backward()
        opt.step()
    acc = ((probe.probe_scores(h_te, id_te) > 0.5).float() == y_te).float().mean().item()
    print(f"probe accuracy {acc0:.3f} -> {acc:.3f}")
    assert acc > 0.95 and acc > acc0 + 0.2, (acc0, acc)
