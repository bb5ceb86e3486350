"""completion_logprobs: packed forward == padded forward == naive per-row forward, rows isolated."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from groupwise.policy.forward import completion_logprobs, pack_bins

V = 64


def tiny_model(arch: str = "qwen3", attn: str = "sdpa"):
    torch.manual_seed(0)
    common = dict(
        vocab_size=V,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        initializer_range=0.2,
    )
    config = transformers.Qwen3Config(head_dim=16, **common) if arch == "qwen3" else transformers.LlamaConfig(**common)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


def batch(seed: int = 0):
    """B=2 groups, G=3 rows, T=6: lengths [[6,2,0],[4,1,3]]; row (1,1) not scored; row (0,2) empty."""
    g = torch.Generator().manual_seed(seed)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    actions = torch.randint(0, V, (2, 3, 6), generator=g)  # [B,G,T]
    lengths = torch.tensor([[6, 2, 0], [4, 1, 3]])  # [B,G]
    mask = torch.arange(6) < lengths[..., None]  # [B,G,T]
    actions = actions.masked_fill(~mask, 0)  # pad after the end, as the engine returns it
    rows = torch.tensor([[True, True, True], [True, False, True]])  # [B,G]
    return prompts, actions, mask, rows


def naive(model, prompts, actions, mask, rows):
    """Per-row reference: one plain forward per row, full logits, log_softmax, gather; entropy likewise."""
    B, G, T = actions.shape
    logp, entropy = torch.zeros(B, G, T), torch.zeros(B, G, T)  # [B,G,T] each
    for b in range(B):
        for g in range(G):
            L = int(mask[b, g].sum())
            if not rows[b, g] or L == 0:
                continue
            seq = torch.tensor([prompts[b] + actions[b, g, :L].tolist()])  # [1,P+L]
            P = len(prompts[b])
            logp_all = model(seq).logits[0, P - 1 : P - 1 + L].float().log_softmax(-1)  # [L,V]
            logp[b, g, :L] = logp_all.gather(1, seq[0, P:, None])[:, 0]
            entropy[b, g, :L] = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("arch,attn", [("qwen3", "sdpa"), ("qwen3", "eager"), ("llama", "sdpa")])
def test_packed_equals_padded_equals_naive(arch, attn):
    model = tiny_model(arch, attn)
    prompts, actions, mask, rows = batch()
    with torch.no_grad():
        packed = completion_logprobs(model, prompts, actions, mask, rows, want_entropy=True)
        padded = completion_logprobs(model, prompts, actions, mask, rows, want_entropy=True, packed=False)
        ref_logp, ref_entropy = naive(model, prompts, actions, mask, rows)
    assert packed["logp"].dtype == torch.float32 and packed["logp"].shape == (2, 3, 6)
    assert torch.allclose(packed["logp"], padded["logp"], atol=1e-5)
    assert torch.allclose(packed["entropy"], padded["entropy"], atol=1e-5)
    assert torch.allclose(packed["logp"], ref_logp, atol=1e-5)
    assert torch.allclose(packed["entropy"], ref_entropy, atol=1e-5)
    scored = mask & rows[..., None]  # [B,G,T]
    assert (packed["logp"][scored] < 0).all() and (packed["entropy"][scored] > 0).all()
    assert (packed["logp"][~scored] == 0).all() and (packed["entropy"][~scored] == 0).all()
    assert "entropy" not in completion_logprobs(model, prompts, actions, mask, rows)


def test_rows_cannot_see_each_other():
    model = tiny_model()
    prompts, actions, mask, rows = batch()
    with torch.no_grad():
        base = completion_logprobs(model, prompts, actions, mask, rows)["logp"]  # [B,G,T]
        # Row (0,0) comes first in the pack: if attention leaked forward, every later row would move.
        edited = actions.clone()
        edited[0, 0, :6] = (edited[0, 0, :6] + 7) % V
        after = completion_logprobs(model, prompts, edited, mask, rows)["logp"]  # [B,G,T]
        # ... and the last row comes last: editing it must not move the earlier rows either.
        edited_last = actions.clone()
        edited_last[1, 2, :3] = (edited_last[1, 2, :3] + 7) % V
        after_last = completion_logprobs(model, prompts, edited_last, mask, rows)["logp"]  # [B,G,T]

        # Control: the same edit DOES move row (0,1) when the rows share one causal context.
        def seq(a):
            return torch.tensor([prompts[0] + a[0, 0].tolist() + prompts[0] + a[0, 1, :2].tolist()])  # [1,S]

        leak = (model(seq(actions)).logits[0, -3:-1] - model(seq(edited)).logits[0, -3:-1]).abs().max()
    assert not torch.allclose(after[0, 0], base[0, 0])
    assert torch.allclose(after[:, 1:], base[:, 1:], atol=1e-6) and torch.allclose(after[1], base[1], atol=1e-6)
    assert not torch.allclose(after_last[1, 2], base[1, 2])
    assert torch.allclose(after_last[0], base[0], atol=1e-6) and torch.allclose(
        after_last[1, :2], base[1, :2], atol=1e-6
    )
    assert leak > 1e-3


def test_gradient_matches_padded_path():
    model = tiny_model()
    prompts, actions, mask, rows = batch(seed=1)
    grads = []
    for packed in (True, False):
        model.zero_grad()
        out = completion_logprobs(model, prompts, actions, mask, rows, want_entropy=True, packed=packed)
        (out["logp"].sum() + 0.1 * out["entropy"].sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(model.parameters()))
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4), name
    assert sum(g.abs().sum() for g in grads[0].values()) > 0


def test_lm_head_runs_only_at_completion_positions():
    model = tiny_model()
    prompts, actions, mask, rows = batch()
    seen = []
    handle = model.lm_head.register_forward_hook(lambda module, inputs, output: seen.append(tuple(inputs[0].shape)))
    with torch.no_grad():
        completion_logprobs(model, prompts, actions, mask, rows)
    handle.remove()
    n_tokens = int((mask & rows[..., None]).sum())  # 6 + 2 + 4 + 3 = 15
    assert seen == [(n_tokens, 64)]


def test_edge_cases():
    model = tiny_model()
    prompts, actions, mask, rows = batch()
    none = completion_logprobs(model, prompts, actions, mask, torch.zeros(2, 3, dtype=torch.bool), want_entropy=True)
    assert (none["logp"] == 0).all() and (none["entropy"] == 0).all()  # nothing to score: no forward at all
    with torch.no_grad():
        assert not completion_logprobs(model, prompts, actions, mask, rows)["logp"].requires_grad
    assert completion_logprobs(model, prompts, actions, mask, rows)["logp"].requires_grad
    holey = mask.clone()
    holey[0, 0, 2] = False  # a hole inside a completion
    with pytest.raises(ValueError, match="prefix"):
        completion_logprobs(model, prompts, actions, holey, rows)
    one = torch.zeros(2, 3, dtype=torch.bool)
    one[1, 2] = True  # a single scored row: the pack holds one sequence, plain causal attention
    with torch.no_grad():
        single = completion_logprobs(model, prompts, actions, mask, one)["logp"]
        full = completion_logprobs(model, prompts, actions, mask, rows)["logp"]
    assert torch.allclose(single[1, 2], full[1, 2], atol=1e-6) and (single[0] == 0).all()


def test_lora_model_is_packed_and_sliced_too():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        tiny_model(),
        peft.LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )  # random adapters: not a no-op
    prompts, actions, mask, rows = batch()
    seen = []
    handle = model.get_base_model().lm_head.register_forward_hook(
        lambda module, inputs, output: seen.append(tuple(inputs[0].shape))
    )
    out = completion_logprobs(model, prompts, actions, mask, rows)["logp"]  # [B,G,T]
    handle.remove()
    assert seen == [(int((mask & rows[..., None]).sum()), 64)]  # the head runs on completion positions only
    with torch.no_grad():
        ref_logp, _ = naive(model, prompts, actions, mask, rows)
        with model.disable_adapter():
            base_logp, _ = naive(model, prompts, actions, mask, rows)
    assert torch.allclose(out, ref_logp, atol=1e-5) and not torch.allclose(out, base_logp, atol=1e-3)
    out.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


def test_pack_bins_first_fit_decreasing():
    # lengths 5,3,8,2,4 with capacity 8: sorted 8,5,4,3,2 → [8] [5,3] [4,2]
    assert pack_bins([5, 3, 8, 2, 4], 8) == [[2], [0, 1], [4, 3]]
    assert pack_bins([9, 1], 4) == [[0], [1]]  # capacity grows to the longest row


@pytest.mark.parametrize("pack_tokens", [1, 12, 10_000])
def test_bins_of_any_size_match_the_padded_path(pack_tokens):
    model = tiny_model()
    prompts, actions, mask, rows = batch()
    with torch.no_grad():
        binned = completion_logprobs(model, prompts, actions, mask, rows, want_entropy=True, pack_tokens=pack_tokens)
        padded = completion_logprobs(model, prompts, actions, mask, rows, want_entropy=True, packed=False)
    torch.testing.assert_close(binned["logp"], padded["logp"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(binned["entropy"], padded["entropy"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pack_tokens", [1, 40, 10_000])
def test_shared_prefix_tree_matches_padded_path_with_gradients(pack_tokens):
    model = tiny_model()
    prompts, actions, mask, rows = batch()
    shared = completion_logprobs(
        model, prompts, actions, mask, rows, want_entropy=True, share_prefix=True, pack_tokens=pack_tokens
    )
    padded = completion_logprobs(model, prompts, actions, mask, rows, want_entropy=True, packed=False)
    torch.testing.assert_close(shared["logp"], padded["logp"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared["entropy"], padded["entropy"], atol=1e-5, rtol=1e-5)
    shared["logp"].sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    padded["logp"].sum().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-4)


def test_shared_prefix_rows_do_not_see_each_other():
    model = tiny_model()
    prompts, actions, mask, rows = batch()
    other = actions.clone()
    other[0, 1] = (other[0, 1] + 1) % 64  # change one row of group 0
    with torch.no_grad():
        a = completion_logprobs(model, prompts, actions, mask, rows, share_prefix=True)["logp"]
        b = completion_logprobs(model, prompts, other, mask, rows, share_prefix=True)["logp"]
    torch.testing.assert_close(a[0, 0], b[0, 0])  # its sibling is unchanged
    torch.testing.assert_close(a[1], b[1])  # and so is the other group
    assert not torch.allclose(a[0, 1], b[0, 1])


# ---------------------------------------------------------------------------------------------- quantities
def naive_quantities(model, prompts, actions, mask, rows, k: int, layer: int):
    """Per-row reference for topk(k), hidden(layer) and the full next-token distribution: one plain
    forward per row with output_hidden_states (hidden_states[l] = after layer l, 0 = embeddings)."""
    B, G, T = actions.shape
    H = model.config.hidden_size
    topk, hidden, logprobs = torch.zeros(B, G, T, k), torch.zeros(B, G, T, H), torch.zeros(B, G, T, V)
    for b in range(B):
        for g in range(G):
            L = int(mask[b, g].sum())
            if not rows[b, g] or L == 0:
                continue
            seq = torch.tensor([prompts[b] + actions[b, g, :L].tolist()])  # [1,P+L]
            P = len(prompts[b])
            out = model(seq, output_hidden_states=True)
            logp_all = out.logits[0, P - 1 : P - 1 + L].float().log_softmax(-1)  # [L,V]
            topk[b, g, :L] = logp_all.topk(k, dim=-1).values
            hidden[b, g, :L] = out.hidden_states[layer][0, P - 1 : P - 1 + L]
            logprobs[b, g, :L] = logp_all
    return topk, hidden, logprobs


@pytest.mark.parametrize(
    "packed,share_prefix,functional",
    [(True, False, True), (True, True, True), (True, False, False), (False, False, False)],
)
def test_requested_quantities_match_the_naive_forward(packed, share_prefix, functional):
    """topk(k) and hidden(l) on every path (functional packed, tree, the model's own packed forward,
    padded) equal a per-row forward of the model; hidden(1) is a layer inside the stack."""
    model = tiny_model()
    prompts, actions, mask, rows = batch()
    with torch.no_grad():
        out = completion_logprobs(
            model,
            prompts,
            actions,
            mask,
            rows,
            packed=packed,
            share_prefix=share_prefix,
            functional=functional,
            quantities=["logp", "topk(3)", "hidden(1)", "hidden(0)"],
        )
        ref_topk, ref_hidden, _ = naive_quantities(model, prompts, actions, mask, rows, k=3, layer=1)
        _, ref_embed, _ = naive_quantities(model, prompts, actions, mask, rows, k=3, layer=0)
    assert out["topk(3)"].shape == (2, 3, 6, 3) and out["hidden(1)"].shape == (2, 3, 6, 64)
    torch.testing.assert_close(out["topk(3)"], ref_topk, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out["hidden(1)"], ref_hidden, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out["hidden(0)"], ref_embed, atol=0, rtol=0)
    assert (out["topk(3)"][..., 0] >= out["topk(3)"][..., 1]).all()  # descending
    assert (out["hidden(1)"][~(mask & rows[..., None])] == 0).all()  # nothing outside the scored tokens


def test_full_vocabulary_kl_between_two_contexts_matches_materialised_logits():
    """token_kl on the final-norm hidden states of two contexts, head in chunks of 2 tokens, equals
    KL(p ‖ q) = Σ_y p (log p − log q) from the fully materialised [N,T,V] distributions."""
    from groupwise.policy.forward import token_kl

    model = tiny_model()
    prompts, actions, mask, rows = batch()
    edited = [[9, 9] + p for p in prompts]  # a second context: a prefix added to each group's prompt
    with torch.no_grad():
        own = completion_logprobs(model, prompts, actions, mask, rows, quantities=["last_hidden"])
        other = completion_logprobs(model, edited, actions, mask, rows, quantities=["last_hidden"])
        scored = mask & rows[..., None]  # [B,G,T]
        kl = token_kl(model, own["last_hidden"], other["last_hidden"], scored, chunk_tokens=2)  # [B,G,T]
        _, _, logp = naive_quantities(model, prompts, actions, mask, rows, k=1, layer=0)
        _, _, logq = naive_quantities(model, edited, actions, mask, rows, k=1, layer=0)
    expected = (logp.exp() * (logp - logq)).sum(-1) * scored  # [B,G,T]
    torch.testing.assert_close(kl, expected, atol=1e-5, rtol=1e-4)
    assert (kl[scored] > 0).all()  # a different context changes every distribution here
    assert (kl[~scored] == 0).all()


def test_unknown_quantity_is_an_error_naming_the_known_ones():
    model = tiny_model()
    prompts, actions, mask, rows = batch()
    with pytest.raises(ValueError, match="topk"):
        completion_logprobs(model, prompts, actions, mask, rows, quantities=["attention(2)"])
