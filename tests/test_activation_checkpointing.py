"""``perf.activation_checkpointing`` (issue 38): each decoder layer of the training forward keeps only
its input and runs again in the backward. The log-probs and every parameter's gradient are the same
as without it (the recomputation is the same maths on the same input), on the functional decoder
and on the model's own forward, packed and prompt-sharing; and what autograd keeps for the backward
shrinks to the layers' inputs."""

from __future__ import annotations

import pytest
import torch

from groupwise.policy.forward import completion_logprobs
from groupwise.policy.lm import load_policy


def _batch():
    gen = torch.Generator().manual_seed(0)
    prompts = [[5, 17, 33, 2], [9, 4, 71]]  # B = 2 groups
    actions = torch.randint(1, 300, (2, 3, 5), generator=gen)  # [B,G,T] G = 3, T = 5
    lengths = torch.tensor([[5, 3, 4], [2, 5, 1]])  # [B,G]
    mask = torch.arange(5)[None, None, :] < lengths[..., None]  # [B,G,T]
    return prompts, actions, mask, torch.ones(2, 3, dtype=torch.bool)


def _run(model, checkpoint_layers: bool, functional: bool, share_prefix: bool):
    prompts, actions, mask, rows = _batch()
    model.zero_grad()
    saved: dict[int, int] = {}

    def pack(t):
        saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = completion_logprobs(
            model,
            prompts,
            actions,
            mask,
            rows,
            functional=functional,
            share_prefix=share_prefix,
            checkpoint_layers=checkpoint_layers,
        )
    logp = out["logp"]  # [B,G,T]
    (logp * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), grads, sum(saved.values())


@pytest.mark.parametrize("functional", [True, False])
@pytest.mark.parametrize("share_prefix", [True, False])
def test_activation_checkpointing_changes_no_log_prob_and_no_gradient(functional, share_prefix):
    model, _ = load_policy("default")
    logp_plain, grads_plain, kept_plain = _run(model, False, functional, share_prefix)
    logp_ckpt, grads_ckpt, kept_ckpt = _run(model, True, functional, share_prefix)
    assert torch.equal(logp_ckpt, logp_plain)
    assert grads_ckpt.keys() == grads_plain.keys() and len(grads_plain) == len(list(model.parameters()))
    for name, grad in grads_plain.items():  # the recomputed layer is the same GEMMs on the same input
        torch.testing.assert_close(grads_ckpt[name], grad, atol=1e-7, rtol=1e-6, msg=name)
    assert kept_ckpt < kept_plain / 2, (kept_ckpt, kept_plain)  # 4 layers' activations -> their inputs
    # the model's own forward is itself again afterwards (the swapped layer forwards are restored)
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
