"""CPUEngine and per-row seeds: exactness against HF generate, determinism, sampling distribution."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from groupwise.policy.engine import CPUEngine, filter_logits
from groupwise.seeds import noise_at, reference_uniform, row_seeds, sample_seed, uniform_noise

PAD, EOS = 0, 1


def tiny_model(arch: str = "qwen3", vocab: int = 64, attn: str = "sdpa", seed: int = 0):
    """A random tiny causal LM; initializer_range 0.2 gives peaked logits, so argmax has no near-ties."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        initializer_range=0.2,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=None,
    )
    if arch == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, **common)
    else:
        config = transformers.LlamaConfig(**common)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


def bias_token(model, token: int, bias: float):
    """Add ``bias`` to one logit of every forward (returns the hook handle)."""

    def hook(module, inputs, logits):
        logits = logits.clone()
        logits[..., token] += bias
        return logits

    return model.lm_head.register_forward_hook(hook)


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16], [17], [18, 19, 20, 21, 22]]


# --------------------------------------------------------------------------- seeds
def test_sample_seed_is_stable_and_non_negative():
    # Pinned values: a change of the mixing function would silently change every resumed run.
    assert sample_seed(0, 0, 0, 0) == 1195769770526638388
    assert sample_seed(1234, 5, 67, 3) == 7771919099125955633
    seeds = {sample_seed(s, t, p, i) for s in range(3) for t in range(3) for p in range(3) for i in range(3)}
    assert len(seeds) == 81  # every field changes the seed
    assert all(0 <= s < 2**63 for s in seeds)
    # fields are not interchangeable
    assert sample_seed(0, 1, 0, 0) != sample_seed(0, 0, 1, 0) != sample_seed(0, 0, 0, 1)
    assert row_seeds(7, 2, [4, 9], 3).tolist() == [sample_seed(7, 2, p, i) for p in (4, 9) for i in range(3)]


def test_uniform_noise_is_bit_exact_to_the_python_definition():
    seeds = row_seeds(3, 1, [0, 1], 2)  # [4] large 63-bit values exercise the wrapping arithmetic
    u = uniform_noise(seeds, 7, 50)  # [4,50]
    for r, v in [(0, 0), (1, 13), (2, 49), (3, 31)]:
        assert u[r, v].item() == reference_uniform(int(seeds[r]), 7, v)
    assert torch.equal(uniform_noise(seeds, 7, 50), u)  # deterministic


def test_uniform_noise_does_not_depend_on_the_batch():
    seeds = row_seeds(0, 0, [0, 1, 2], 4)  # [12]
    full = uniform_noise(seeds, 3, 100)  # [12,100]
    assert torch.equal(uniform_noise(seeds[5:6], 3, 100), full[5:6])
    assert torch.equal(uniform_noise(seeds.flip(0), 3, 100), full.flip(0))
    ids = torch.tensor([[7, 99, 0], [3, 3, 50]])  # [2,3] candidate ids (as top-k would pass them)
    assert torch.equal(noise_at(seeds[:2], 3, ids), full[:2].gather(1, ids))


def test_uniform_noise_is_uniform_in_open_interval():
    seeds = row_seeds(1, 0, list(range(100)), 1)  # [100]
    u = uniform_noise(seeds, 0, 1000).flatten()  # [1e5]
    assert 0.0 < u.min() and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.005  # sd of the mean is 0.29/sqrt(1e5) ~ 0.0009
    # Kolmogorov-Smirnov: the 0.1% critical value for n=1e5 is 1.95/sqrt(n) ~ 0.0062
    n = u.numel()
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    ecdf_gap = torch.maximum(ranks / n - u.sort().values.double(), u.sort().values.double() - (ranks - 1) / n)
    assert ecdf_gap.max().item() < 1.95 / math.sqrt(n)
    # Extremes of the 24-bit mapping stay strictly inside (0,1) in float32.
    from groupwise.seeds import _UNIFORM_SCALE

    extremes = (torch.tensor([0.0, 2.0**24 - 1]) + 1.0) * _UNIFORM_SCALE
    assert 0.0 < extremes[0] and extremes[1] < 1.0


def test_uniform_noise_changes_with_position_and_seed():
    seeds = row_seeds(0, 0, [0], 2)  # [2]
    a = uniform_noise(seeds, 0, 1000)  # [2,1000]
    b = uniform_noise(seeds, 1, 1000)  # [2,1000]
    assert (a == b).float().mean() < 0.01
    assert (a[0] == a[1]).float().mean() < 0.01
    assert abs(torch.corrcoef(torch.stack([a[0], b[0]]))[0, 1].item()) < 0.1


# --------------------------------------------------------------------------- filter_logits
def test_filter_logits_hand_worked():
    logits = torch.tensor([[math.log(0.5), math.log(0.25), math.log(0.15), math.log(0.10)]])  # probs .5 .25 .15 .10
    inf = float("-inf")
    # top_p=0.7: mass before each token .0 .5 .75 .9 -> need tokens while mass < .7 -> {0,1}
    assert torch.isinf(filter_logits(logits, top_p=0.7)).tolist() == [[False, False, True, True]]
    # top_p=0.8: .75 < .8 -> {0,1,2}
    assert torch.isinf(filter_logits(logits, top_p=0.8)).tolist() == [[False, False, False, True]]
    # top_p=0.3: the top token alone already reaches it; top_p=0 still keeps the top token
    assert torch.isinf(filter_logits(logits, top_p=0.3)).tolist() == [[False, True, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.0)).tolist() == [[False, True, True, True]]
    # top_k=2 first renormalises to (2/3, 1/3): top_p=0.6 keeps {0}; top_p=0.7 keeps {0,1}
    assert torch.isinf(filter_logits(logits, top_k=2, top_p=0.6)).tolist() == [[False, True, True, True]]
    assert torch.isinf(filter_logits(logits, top_k=2, top_p=0.7)).tolist() == [[False, False, True, True]]
    # temperature divides the kept logits: [2, 1, 0] / 2 = [1, .5, 0]; top_k=2 drops the last
    out = filter_logits(torch.tensor([[2.0, 1.0, 0.0]]), temperature=2.0, top_k=2)
    assert out.tolist() == [[1.0, 0.5, inf]]
    # order of tokens does not matter: the same set is kept by vocab id
    perm = torch.tensor([2, 0, 3, 1])
    assert torch.equal(filter_logits(logits[:, perm], top_p=0.7), filter_logits(logits, top_p=0.7)[:, perm])


# --------------------------------------------------------------------------- engine vs HF generate
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_matches_hf_generate(arch):
    model = tiny_model(arch)
    max_new = 10

    def hf_greedy(prompt, eos):
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=PAD,
        )
        return out[0, len(prompt) :].tolist()

    # Make EOS a token greedy decoding really emits for prompt 0 (at step 3), so the end logic is exercised.
    eos = hf_greedy(PROMPTS[0], [63])[3]
    references = [hf_greedy(p, [eos]) for p in PROMPTS]
    assert len(references[0]) == 4 and references[0][-1] == eos
    engine = CPUEngine(model, [eos], PAD)
    out = engine.generate(PROMPTS, 2, row_seeds(0, 0, [0, 1, 2, 3], 2), max_new, greedy=True)
    for b, ref in enumerate(references):
        for i in range(2):
            L = int(out.lengths[b, i])
            assert out.tokens[b, i, :L].tolist() == ref
            assert (out.tokens[b, i, L:] == PAD).all()
            assert bool(out.truncated[b, i]) == (eos not in ref)


def test_shared_prefix_equals_unshared():
    model = tiny_model()
    seeds = row_seeds(5, 1, [0, 1, 2, 3], 3)
    kw = dict(max_new_tokens=12, temperature=0.9, top_p=0.95)
    shared = CPUEngine(model, [EOS], PAD).generate(PROMPTS, 3, seeds, **kw)
    unshared = CPUEngine(model, [EOS], PAD, share_prefix=False).generate(PROMPTS, 3, seeds, **kw)
    assert torch.equal(shared.tokens, unshared.tokens)
    assert torch.equal(shared.lengths, unshared.lengths)
    assert torch.allclose(shared.logp, unshared.logp, atol=1e-5)
    assert len(set(map(tuple, shared.tokens[1].tolist()))) == 3  # samples of one prompt differ


def test_row_sample_does_not_depend_on_batch_composition():
    model = tiny_model()
    engine = CPUEngine(model, [EOS], PAD)
    a, b = PROMPTS[0], PROMPTS[1]  # b is longer: a gets left-padding only in the joint batch
    seeds_a, seeds_b = row_seeds(0, 3, [10], 4), row_seeds(0, 3, [11], 4)
    alone = engine.generate([a], 4, seeds_a, 15)
    joint = engine.generate([b, a], 4, torch.cat([seeds_b, seeds_a]), 15)
    assert torch.equal(alone.tokens[0], joint.tokens[1, :, : alone.tokens.shape[-1]])
    assert torch.equal(alone.lengths[0], joint.lengths[1])
    assert torch.allclose(alone.logp[0], joint.logp[1, :, : alone.tokens.shape[-1]], atol=1e-5)
    other = engine.generate([a], 4, row_seeds(1, 3, [10], 4), 15)  # another run seed: other samples
    assert not torch.equal(alone.tokens, other.tokens[..., : alone.tokens.shape[-1]])


def test_top_k_1_equals_greedy():
    model = tiny_model()
    engine = CPUEngine(model, [EOS], PAD)
    seeds = row_seeds(0, 0, [0, 1, 2, 3], 2)
    greedy = engine.generate(PROMPTS, 2, seeds, 8, greedy=True)
    top1 = engine.generate(PROMPTS, 2, seeds, 8, top_k=1, temperature=1.7)
    assert torch.equal(greedy.tokens, top1.tokens)
    assert torch.allclose(greedy.logp, top1.logp)


def test_forced_eos_and_never_eos():
    model = tiny_model()
    engine = CPUEngine(model, [EOS], PAD)
    seeds = row_seeds(0, 0, [0, 1, 2, 3], 2)
    handle = bias_token(model, EOS, 100.0)  # EOS is certain: every row ends after one token
    out = engine.generate(PROMPTS, 2, seeds, 6)
    handle.remove()
    assert out.tokens.shape == (4, 2, 1)  # the loop stopped once every row had finished
    assert (out.tokens == EOS).all() and (out.lengths == 1).all() and not out.truncated.any()
    assert out.logp.abs().max() < 1e-6  # log(1)
    handle = bias_token(model, EOS, -1e9)  # EOS impossible: every row runs to the limit
    out = engine.generate(PROMPTS, 2, seeds, 6)
    handle.remove()
    assert out.tokens.shape == (4, 2, 6)
    assert (out.lengths == 6).all() and out.truncated.all() and (out.tokens != EOS).all()
    assert (out.logp < 0).all()


def test_ragged_ends_and_dropping_finished_rows_change_nothing():
    model = tiny_model()
    handle = bias_token(model, EOS, 3.0)  # EOS ~ 1 in 4: lengths spread over the budget
    seeds = row_seeds(2, 0, [0, 1, 2, 3], 8)
    dropped = CPUEngine(model, [EOS], PAD).generate(PROMPTS, 8, seeds, 12)
    kept = CPUEngine(model, [EOS], PAD, drop_finished=False).generate(PROMPTS, 8, seeds, 12)
    handle.remove()
    assert torch.equal(dropped.tokens, kept.tokens) and torch.equal(dropped.lengths, kept.lengths)
    assert torch.allclose(dropped.logp, kept.logp, atol=1e-5)
    lengths, T = dropped.lengths, dropped.tokens.shape[-1]
    assert len(set(lengths.flatten().tolist())) > 3 and dropped.truncated.any() and not dropped.truncated.all()
    mask = torch.arange(T) < lengths[..., None]  # [B,n,T]
    ends = torch.gather(dropped.tokens, 2, (lengths - 1)[..., None])[..., 0]  # [B,n] last token of each row
    assert torch.equal(ends == EOS, ~dropped.truncated)  # a row ends with EOS exactly when not truncated
    assert ((dropped.tokens == EOS) & mask).sum(-1).le(1).all()  # EOS appears at most once, at the end
    assert (dropped.tokens[~mask] == PAD).all() and (dropped.logp[~mask] == 0).all() and (dropped.logp[mask] < 0).all()
    assert torch.equal(dropped.mask, mask)


def test_logp_is_the_raw_model_logprob_whatever_the_sampling_temperature():
    model = tiny_model()
    out = CPUEngine(model, [EOS], PAD).generate(PROMPTS[:2], 2, row_seeds(0, 0, [0, 1], 2), 6, temperature=0.5, top_k=5)
    for b in range(2):
        for i in range(2):
            L = int(out.lengths[b, i])
            seq = torch.tensor([PROMPTS[b] + out.tokens[b, i, :L].tolist()])  # [1,P+L]
            with torch.no_grad():
                logp_all = model(seq).logits[0].float().log_softmax(-1)  # [P+L,V]
            P = len(PROMPTS[b])
            ref = logp_all[P - 1 : P - 1 + L].gather(1, seq[0, P:, None])[:, 0]  # [L]
            assert torch.allclose(out.logp[b, i, :L], ref, atol=1e-5)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.5, 0, 0.8), (0.7, 6, 1.0)])
def test_one_step_sampling_matches_the_filtered_softmax(temperature, top_k, top_p):
    model = tiny_model(vocab=16, seed=1)
    # Known logits, shuffled over the vocab: probabilities from .27 down to .003 (a peaked, spread law
    # on which Gumbel noise and, say, exponential noise give clearly different frequencies).
    order = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    logits = (-0.3 * torch.arange(16.0))[order]  # [V]
    handle = model.lm_head.register_forward_hook(lambda module, inputs, out: logits.expand_as(out).clone())
    n = 4000
    out = CPUEngine(model, [EOS], PAD).generate(
        [[3, 4, 5]], n, row_seeds(9, 0, [0], n), 1, temperature=temperature, top_k=top_k, top_p=top_p
    )
    handle.remove()
    expected = filter_logits(logits[None], temperature, top_k, top_p).softmax(-1)[0].double() * n  # [V]
    counts = torch.bincount(out.tokens.flatten(), minlength=16).double()  # [V]
    assert counts[expected == 0].sum() == 0  # filtered tokens are never sampled
    support = expected > 0
    dof = int(support.sum()) - 1
    assert dof >= 5  # the test has something to tell apart
    chi2 = ((counts[support] - expected[support]) ** 2 / expected[support]).sum().item()
    # 0.999 quantile of chi-square(dof), Wilson-Hilferty approximation (z = 3.09)
    q999 = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < q999


@pytest.mark.parametrize("spread", [0.5, 8.0])
def test_top_p_matches_a_brute_force_nucleus(spread):
    # spread 0.5: nearly flat over 1000 tokens, the nucleus is wider than the 256-token probe (full sort);
    # spread 8.0: peaked, the nucleus lies inside the probe (fast path). Both must equal the definition.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g) * spread  # [N,V]
    for top_p in (0.3, 0.9):
        kept = ~torch.isinf(filter_logits(logits, top_p=top_p))  # [N,V]
        for row in range(6):
            probs = logits[row].double().softmax(-1)  # [V]
            order = probs.argsort(descending=True)
            mass_before = probs[order].cumsum(0) - probs[order]  # [V]
            expected = torch.zeros(1000, dtype=torch.bool)
            expected[order[mass_before < top_p]] = True
            assert torch.equal(kept[row], expected)
    sizes = (~torch.isinf(filter_logits(logits, top_p=0.9))).sum(-1)  # [N]
    assert (sizes > 256).all() if spread == 0.5 else (sizes < 256).all()  # each regime is really exercised


def test_noise_spans_draw_the_same_samples_as_per_token_noise(monkeypatch):
    """Plain sampling reads Gumbel noise from multi-position spans; the per-token path (used when a
    span would not fit the noise budget) must give the very same tokens."""
    import groupwise.policy.engine as cpu

    model = tiny_model()
    seeds = row_seeds(4, 0, [0, 1, 2, 3], 4)
    spans = CPUEngine(model, [EOS], PAD).generate(PROMPTS, 4, seeds, 10, temperature=0.7)
    monkeypatch.setattr(cpu, "_SAMPLE_BLOCK_ELEMENTS", 64 * 8)  # 16 rows x 64 vocab no longer fit: per-token noise
    per_token = CPUEngine(model, [EOS], PAD).generate(PROMPTS, 4, seeds, 10, temperature=0.7)
    assert torch.equal(spans.tokens, per_token.tokens) and torch.equal(spans.lengths, per_token.lengths)
    torch.testing.assert_close(spans.logp, per_token.logp, atol=1e-5, rtol=0)
    assert len(set(spans.tokens.flatten().tolist())) > 8  # really sampled, not a constant
