"""M7: forced completion prefixes (``Request.prefix``, ``rollout/context.py: force_prefixes``) and the
objective's per-term row filter (``rows = {extra, equals}``, ``objective.RowFilter``)."""

from __future__ import annotations

import pytest
import torch
from helpers import info_for, leaf, objective_for, rollout_from
from test_trainer import make_trainer

from groupwise.errors import ConfigError
from groupwise.objective import Objective, RowFilter
from groupwise.rollout.context import RolloutContext
from groupwise.types import FORCED, Request, Rollout, StepInfo


class _Scripted:
    """A text policy stand-in: every row writes [5, 6] then EOS 0 (logp_sampler −0.5 each), and its
    forward gives each token the log-prob −token/10 (hand-checkable)."""

    modality = "text"
    request_options = frozenset({"greedy"})
    hooks = frozenset()

    def __init__(self):
        self.forwarded = []

    def encode(self, text):
        return [int(c) for c in text]

    def check_fits(self, ids, max_new_tokens, where):
        pass

    def decode(self, rollout):
        return [
            ["".join(str(int(t)) for t in row[m]) for row, m in zip(a, k)]
            for a, k in zip(rollout.actions, rollout.mask)
        ]

    def generate(self, requests, sampling, info):
        B, G = len(requests), max(r.n for r in requests)
        tokens = torch.tensor([5, 6, 0]).expand(B, G, 3).clone()  # [B,G,3]
        valid = torch.arange(G)[None, :] < torch.tensor([r.n for r in requests])[:, None]  # [B,G]
        return Rollout(
            prompt_ids=[list(r.prompt) for r in requests],
            actions=tokens,
            mask=valid[..., None].expand(B, G, 3).clone(),
            group_valid=valid,
            truncated=torch.zeros(B, G, dtype=torch.bool),
            prompt_index=torch.tensor([r.key for r in requests]),
            logp_sampler=torch.full((B, G, 3), -0.5),
        )

    def forward(self, rollout, quantities=("logp",)):
        self.forwarded.append([list(p) for p in rollout.prompt_ids])
        return {"logp": -rollout.actions.float() / 10 * rollout.mask}  # [B,G,T]


def _context(policy, prompts):
    info = StepInfo(step=0, seed=0, max_new_tokens=3)
    return RolloutContext(
        policy, None, None, lambda r: None, lambda k: policy.encode(prompts[k]), lambda k: {}, lambda r=0: info,
        {"max_new_tokens": 3, "temperature": 1.0, "top_p": 1.0, "top_k": 0}, 2, 2,
    )  # fmt: skip


def test_forced_prefix_shifts_the_sampled_tokens_and_holes_the_loss():
    policy = _Scripted()
    ctx = _context(policy, {0: "12", 1: "34"})
    out = ctx.generate([Request(key=0, n=2, prefix=[7, 8]), Request(key=1, n=1)])
    # group 0: prefix 7 8 then the sampled 5 6 EOS; group 1 (no prefix): 5 6 EOS, padded; its row 1 is padding
    assert out.actions[0].tolist() == [[7, 8, 5, 6, 0]] * 2
    assert out.actions[1, 0].tolist() == [5, 6, 0, 0, 0]
    assert out.mask[0].all() and out.mask[1, 0].tolist() == [True] * 3 + [False] * 2 and not out.mask[1, 1].any()
    # forced tokens carry no loss; the sampled ones do
    assert out.loss_mask[0, 0].tolist() == [False, False, True, True, True]
    assert out.loss_mask[1, 0].tolist() == [True] * 3 + [False] * 2
    assert out.flag(FORCED).tolist() == [[True, True], [False, False]]
    # the row is trained under the prompt alone (the engine saw prompt + prefix: 1 2 7 8)
    assert out.prompt_ids == [[1, 2], [3, 4]]
    # logp_sampler at the forced positions: the forward's −7/10, −8/10 after the prompt [1, 2]; the engine's −0.5 after
    torch.testing.assert_close(out.logp_sampler[0, 1], torch.tensor([-0.7, -0.8, -0.5, -0.5, -0.5]))
    assert policy.forwarded == [[[1, 2]]]  # one forward, one row per forced group
    assert out.completions[0] == ["78560", "78560"]


def test_a_trained_prefix_stays_in_the_loss():
    ctx = _context(_Scripted(), {0: "12"})
    out = ctx.generate([Request(key=0, n=1, prefix=[9], train_prefix=True)])
    assert out.loss_mask[0, 0].tolist() == [True] * 4 and out.actions[0, 0].tolist() == [9, 5, 6, 0]


def test_forced_prefix_on_the_embedded_model_is_exact(tmp_path):
    """On the real LM: the sampled continuation is the one sampled after prompt + prefix (same seeds), and
    logp_sampler at the forced tokens equals the trainer's forward of the whole row."""
    trainer = make_trainer(tmp_path)
    policy = trainer.policy
    prompt, prefix = policy.encode("37+45="), policy.tokenizer.encode("8", add_special_tokens=False)
    ctx = RolloutContext(
        policy, None, None, lambda r: None, lambda k: prompt, lambda k: {}, lambda r=0: info_for(6),
        {"max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "top_k": 0}, 1, 3,
    )  # fmt: skip
    forced = ctx.generate([Request(key=0, n=3, prefix=prefix)])
    plain = ctx.generate([Request(key=0, n=3, prompt=prompt + prefix)])
    n = plain.mask.sum(-1)  # [1,3]
    assert torch.equal(forced.actions[0, :, 0], torch.tensor(prefix * 3))
    assert torch.equal(forced.actions[0, :, 1:][plain.mask[0]], plain.actions[0][plain.mask[0]])
    assert torch.equal(forced.mask.sum(-1), n + 1)
    with torch.no_grad():
        logp = policy.forward(forced, ("logp",))["logp"]  # [1,3,T]
    torch.testing.assert_close(forced.logp_sampler[0, :, 0], logp[0, :, 0], atol=1e-5, rtol=0)
    assert [c[0] for c in forced.completions[0]] == ["8"] * 3


class _NoEncode(_Scripted):
    encode = property(lambda self: _raise(AttributeError("encode")))  # a policy without encode (hasattr is False)


def _raise(error):
    raise error


def test_prefix_needs_a_policy_that_encodes():
    ctx = _context(_NoEncode(), {})
    with pytest.raises(ValueError, match="no encode"):
        ctx._generate([Request(key=0, n=1, prompt=[1], prefix=[2])], info_for(3))


class _Constant:
    """A term whose per-token loss is the token's log-prob (gradient 1 per token, before aggregation)."""

    registry_name = "constant_term"
    coef = 1.0
    token_weights = "exempt"

    def __call__(self, mb, out, info):
        return out["logp"]  # [b,G,T]


def test_row_filter_restricts_the_term_and_its_normaliser():
    # 2 rows (role 0, role 1), 3 tokens each, row 1 has 2 tokens; logp = 1 everywhere
    # token_mean: unfiltered term = 5 tokens · 1 / 5 = 1; filtered to role 1: its 2 tokens / 2 = 1,
    # gradient 1/2 on role 1's tokens and 0 on role 0's (unfiltered: 1/5 on every token)
    mask = torch.tensor([[[True, True, True], [True, True, False]]])
    mb = rollout_from(torch.zeros(1, 2, 3), torch.zeros(1, 2), mask)
    mb.set_extra("role", torch.tensor([[0.0, 1.0]]), "row")
    logp = leaf(torch.ones(1, 2, 3))
    obj = objective_for([_Constant(), _Constant()])
    obj.row_filters = [None, RowFilter("role", 1.0)]
    norms = obj.normalizers(mb, info_for(3))
    loss = obj.loss(mb, {"logp": logp}, norms, info_for(3))
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(2.0)
    torch.testing.assert_close(grad, torch.tensor([[[0.2, 0.2, 0.2], [0.7, 0.7, 0.0]]]))
    assert norms["token_mean@term1"] != norms["token_mean"]


def test_row_filter_from_config_is_the_objectives_not_the_terms():
    obj = Objective.from_config(
        ["ppo_clip", {"name": "kl", "key": "kl_v", "coef": 0.04, "rows": {"extra": "game_role", "equals": 1}}],
        "token_mean",
    )
    assert obj.row_filters == [None, RowFilter("game_role", 1.0)] and obj.rollout_extras == ("game_role",)
    assert not hasattr(obj.terms[1], "rows")
    with pytest.raises(ConfigError, match="row filter is a table"):
        Objective.from_config([{"name": "kl", "rows": {"extra": "game_role"}}], "token_mean")
    mb = rollout_from(torch.zeros(1, 1, 2), torch.zeros(1, 1))
    with pytest.raises(ValueError, match="game_role"):
        RowFilter("game_role", 1.0)(mb)
