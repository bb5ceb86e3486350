"""Generation hooks (groupwise.hooks): the engine applies them per row on both decoding paths, the
functional decoder and the model's own forward agree, a hook kind the functional decoder lacks falls
back, and an engine that cannot apply a hook refuses at build and at run time."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from groupwise.errors import ConfigError
from groupwise.hooks import EmbedDelta, ResidualAdd, check_hooks, row_hooks
from groupwise.policy import engine as cpu
from groupwise.policy.engine import CPUEngine
from groupwise.policy.functional import DecodeState

PAD, EOS = 0, 1
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12]]


def tiny_model(seed: int = 0, arch: str = "qwen3"):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=64,
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
    config = (
        transformers.Qwen3Config(head_dim=16, **common)
        if arch == "qwen3"
        else transformers.GPT2Config(
            vocab_size=64,
            n_embd=64,
            n_layer=2,
            n_head=4,
            initializer_range=0.2,
            pad_token_id=PAD,
            eos_token_id=EOS,
            bos_token_id=EOS,
        )
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager" if arch != "qwen3" else "sdpa").eval()


def _generate(model, hooks, functional=True, greedy=True, n=3, drop_finished=True):
    engine = CPUEngine(model, [EOS], PAD, functional=functional, drop_finished=drop_finished)
    seeds = torch.arange(len(PROMPTS) * n)
    return engine.generate(PROMPTS, n, seeds, max_new_tokens=8, greedy=greedy, hooks=hooks)


def _seq(out, b, j):
    return out.tokens[b, j, : int(out.lengths[b, j])].tolist()


def _hooks(D=64, n=3, scale=3.0):
    g = torch.Generator().manual_seed(5)
    delta = torch.randn(n, 2, D, generator=g) * scale  # [n,P,D]
    delta[0] = 0.0  # row 0: the clean prompt
    steer = ResidualAdd(layer=1, vector=torch.randn(D, generator=g), alpha=torch.tensor([0.0, 4.0, -4.0]))
    return [EmbedDelta(positions=torch.tensor([0, 2]), delta=delta), steer]


def test_row_hooks_places_each_delta_at_its_prompt_columns():
    delta = torch.arange(2 * 2 * 3, dtype=torch.float32).view(2, 2, 3)  # [n=2,P=2,D=3]
    embed_add, steer = row_hooks([None, EmbedDelta(torch.tensor([0, 2]), delta)], 2, [2, 3], 4, 3)
    assert steer is None
    assert embed_add.shape == (4, 4, 3)
    assert embed_add[:2].abs().sum() == 0  # prompt 0: no hook
    # prompt 1 has 3 tokens left-padded to 4 columns: positions 0 and 2 sit in columns 1 and 3
    torch.testing.assert_close(embed_add[2, 1], delta[0, 0])
    torch.testing.assert_close(embed_add[3, 3], delta[1, 1])
    assert embed_add[2:, [0, 2]].abs().sum() == 0  # the other columns untouched
    _, (layer, add) = row_hooks([ResidualAdd(2, torch.tensor([1.0, -2.0]), torch.tensor([0.5, -1.0]))], 2, [3], 3, 2)
    assert layer == 2
    torch.testing.assert_close(add, torch.tensor([[0.5, -1.0], [-1.0, 2.0]]))
    with pytest.raises(ValueError, match="outside"):
        row_hooks([EmbedDelta(torch.tensor([3]), torch.zeros(2, 1, 3))], 2, [3], 3, 3)
    with pytest.raises(ValueError, match="layers 1 and 2"):
        row_hooks(
            [ResidualAdd(1, torch.zeros(2), torch.zeros(1)), ResidualAdd(2, torch.zeros(2), torch.zeros(1))],
            1,
            [1, 1],
            1,
            2,
        )


def test_zero_hooks_equal_the_clean_model_on_both_paths():
    model = tiny_model()
    clean = _generate(model, None)
    zero = [EmbedDelta(torch.tensor([0, 1]), torch.zeros(3, 2, 64)), ResidualAdd(2, torch.ones(64), torch.zeros(3))]
    for functional in (True, False):
        out = _generate(model, zero, functional=functional)
        assert torch.equal(out.tokens, clean.tokens)
        torch.testing.assert_close(out.logp, clean.logp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("greedy", [True, False])
def test_functional_and_hf_paths_agree_under_hooks(greedy):
    model = tiny_model()
    hooks = _hooks()
    fast = _generate(model, hooks, functional=True, greedy=greedy)
    slow = _generate(model, hooks, functional=False, greedy=greedy)
    assert torch.equal(fast.tokens, slow.tokens)
    torch.testing.assert_close(fast.logp, slow.logp, atol=1e-4, rtol=0)
    clean = _generate(model, None, greedy=greedy)
    for b in range(2):
        assert _seq(fast, b, 0) == _seq(clean, b, 0)  # row 0 of each prompt is clean (zero delta, alpha 0)
        # the perturbed rows do change
        assert _seq(fast, b, 1) != _seq(clean, b, 1) or _seq(fast, b, 2) != _seq(clean, b, 2)
    assert not any(m._forward_hooks for m in model.modules())  # the fallback's module hook is removed afterwards


def test_hooked_rows_equal_a_per_row_reference():
    # residual_add on layer 1 by hand: a forward hook on the model, one row at a time, plain HF forward
    model = tiny_model()
    v = torch.randn(64, generator=torch.Generator().manual_seed(1))
    out = _generate(model, [None, ResidualAdd(1, v, torch.tensor([0.0, 2.0, -2.0]))])
    for j, alpha in enumerate([0.0, 2.0, -2.0]):
        handle = model.model.layers[0].register_forward_hook(lambda m, i, o, a=alpha: o + a * v)
        try:
            ids = list(PROMPTS[1])
            for _ in range(8):
                with torch.no_grad():
                    ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
                if ids[-1] == EOS:
                    break
        finally:
            handle.remove()
        got = out.tokens[1, j, : int(out.lengths[1, j])].tolist()
        assert got == ids[len(PROMPTS[1]) :]


def test_a_hook_the_functional_decoder_lacks_falls_back(monkeypatch):
    model = tiny_model()
    hooks = _hooks()
    states = []
    real_new_state = CPUEngine._new_state
    monkeypatch.setattr(
        CPUEngine,
        "_new_state",
        lambda self, kinds=frozenset(): states.append(real_new_state(self, kinds)) or states[-1],
    )
    fast = _generate(model, hooks)
    assert isinstance(states[-1], DecodeState)
    monkeypatch.setattr(DecodeState, "hooks", frozenset({"embed_delta"}))  # no residual_add in the functional decoder
    fell_back = _generate(model, hooks)
    assert isinstance(states[-1], cpu._HFState)
    assert torch.equal(fast.tokens, fell_back.tokens)
    torch.testing.assert_close(fast.logp, fell_back.logp, atol=1e-4, rtol=0)
    assert isinstance(
        states.append(real_new_state(CPUEngine(model, [EOS], PAD), {"embed_delta"})) or states[-1], DecodeState
    )


def test_a_model_outside_the_family_applies_hooks_through_its_own_forward():
    model = tiny_model(arch="gpt2")
    delta = torch.randn(3, 1, 64) * 3
    delta[0] = 0.0
    hooks = [EmbedDelta(torch.tensor([0]), delta), ResidualAdd(2, torch.randn(64), torch.tensor([0.0, 3.0, -3.0]))]
    assert not CPUEngine(model, [EOS], PAD).functional
    out = _generate(model, hooks, functional=True)
    clean = _generate(model, None)
    for b in range(2):
        assert _seq(out, b, 0) == _seq(clean, b, 0)  # the clean row
        assert [_seq(out, b, j) for j in (1, 2)] != [_seq(clean, b, j) for j in (1, 2)]
    assert not any(m._forward_hooks for m in model.modules())


class _Strategy:
    registry_name = "needs_hooks"
    hooks = ("residual_add",)


class _NoHookPolicy:
    modality = "flow"


def test_an_engine_that_cannot_apply_a_hook_refuses_at_build_and_at_run_time():
    with pytest.raises(ConfigError, match=r"generation hooks \['residual_add'\].*applies none"):
        check_hooks(_Strategy(), _NoHookPolicy())
    engine = CPUEngine(tiny_model(), [EOS], PAD)
    # the text engine applies both kinds
    check_hooks(_Strategy(), type("P", (), {"modality": "text", "hooks": engine.hooks})())
    engine.hooks = frozenset()
    with pytest.raises(ValueError, match="cannot be applied"):
        engine.generate(PROMPTS, 3, torch.arange(6), 4, greedy=True, hooks=_hooks())
    from groupwise.rollout.context import RolloutContext
    from groupwise.types import Request, StepInfo

    ctx = RolloutContext(_NoHookPolicy(), None, None, None, None, None, None, {"max_new_tokens": 4}, 1, 2)
    with pytest.raises(ValueError, match="cannot be applied by the flow policy"):
        ctx._generate([Request(0, 2, hook=_hooks()[1])], StepInfo(0, 0, 4))


@pytest.mark.parametrize(
    "strategy, kind, artifact",
    [("e2po", "embed_delta", "e2po_perturbations"), ("vspo", "residual_add", "steering_vector")],
)
def test_hooked_strategies_refuse_an_engine_without_hooks_and_need_their_phase(tmp_path, strategy, kind, artifact):
    from test_trainer import make_trainer

    from groupwise.build import build
    from groupwise.config import load_config
    from groupwise.trainer import Trainer

    cfg, _ = load_config("flash_grpo", [f'out="{tmp_path}"', f'rollout.name="{strategy}"', "eval.size=0"])
    with pytest.raises(ConfigError, match=rf"generation hooks \['{kind}'\] that the flow policy's engine cannot apply"):
        Trainer(build(cfg))
    with pytest.raises(ConfigError, match=f"needs the artifact '{artifact}', which no offline phase produces"):
        make_trainer(tmp_path / "text", f'rollout.name="{strategy}"', "eval.size=0")
