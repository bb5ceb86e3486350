"""StreamPro (spec 42): the CB-Stream class-balanced SFT loss (phases/cb_stream.py, the sft phase's
``loss = "cb_stream"``), the clue-stream env and its multi-grained reward (papers/42_streampro/clue_stream.py)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import paper_module, train_recorded

from groupwise.errors import ConfigError
from groupwise.phases.cb_stream import balanced_from_ce, cb_stream_loss, class_balanced_weights
from groupwise.registry import build

_clue = paper_module("42_streampro", "clue_stream")
ClueStream, RewardConfig, decision_rows = _clue.ClueStream, _clue.RewardConfig, _clue.decision_rows
episode_reward = _clue.episode_reward
parse_action, rows, streampro_reward = _clue.parse_action, _clue.rows, _clue.streampro_reward


def _logits_for(ce: list[float]) -> torch.Tensor:
    """[N,1,2] logits whose cross-entropy against label 0 is ``ce``: logits (0, log(e^ce − 1))."""
    z = torch.log(torch.expm1(torch.tensor(ce, dtype=torch.float64)))  # [N]
    return torch.stack([torch.zeros_like(z), z], -1)[:, None, :]  # [N,1,2]


# ---------------------------------------------------------------------------------------------- CB-Stream
def test_class_balanced_weights_spec_hand_numbers():
    w = class_balanced_weights(torch.tensor([9, 1]), 0.9)
    torch.testing.assert_close(w, torch.tensor([0.280670, 1.719330], dtype=torch.float64), atol=1e-6, rtol=0)
    # E_sil = (1 − 0.9^9)/0.1 = 6.125795: w_sil / w_resp = 1 / E_sil
    assert math.isclose(float(w[1] / w[0]), (1 - 0.9**9) / 0.1, rel_tol=1e-9)


def test_cb_stream_loss_spec_hand_number_and_plain_mean():
    ce = [0.1] * 9 + [2.0]
    labels = torch.zeros(10, 1, dtype=torch.long)  # [N,L]
    cls = torch.tensor([0] * 9 + [1])[:, None]  # [N,L]
    loss, m = cb_stream_loss(_logits_for(ce), labels, torch.ones(10, 1, dtype=torch.bool), cls, beta=0.9)
    torch.testing.assert_close(loss, torch.tensor(0.869481), atol=1e-6, rtol=0)
    assert math.isclose(m["plain_ce"], 0.29, abs_tol=1e-6)  # the plain mean CE the spec contrasts
    # dataset counts given explicitly win over the batch's: counts (1, 1) → uniform → the plain mean
    loss_u, _ = cb_stream_loss(
        _logits_for(ce), labels, torch.ones(10, 1, dtype=torch.bool), cls, beta=0.9, counts=torch.tensor([1, 1])
    )
    torch.testing.assert_close(loss_u, torch.tensor(0.29), atol=1e-6, rtol=0)


def test_beta_limits_uniform_and_inverse_frequency():
    torch.testing.assert_close(
        class_balanced_weights(torch.tensor([9, 1]), 0.0), torch.tensor([1.0, 1.0], dtype=torch.float64)
    )
    w = class_balanced_weights(torch.tensor([9, 1]), 0.999999)  # → inverse frequency: w ∝ (1/9, 1)
    torch.testing.assert_close(w, torch.tensor([0.2, 1.8], dtype=torch.float64), atol=1e-5, rtol=0)


def test_absent_class_gets_zero_weight_and_one_class_is_the_plain_mean():
    w = class_balanced_weights(torch.tensor([5, 0]), 0.9)
    torch.testing.assert_close(w, torch.tensor([2.0, 0.0], dtype=torch.float64))
    ce = torch.tensor([[0.5], [1.5]])  # [N,L]
    ones = torch.ones(2, 1, dtype=torch.bool)
    loss, _ = balanced_from_ce(ce, ones, ones, torch.zeros(2, 1, dtype=torch.long), w)
    torch.testing.assert_close(loss, torch.tensor(1.0))
    torch.testing.assert_close(class_balanced_weights(torch.tensor([0, 0]), 0.9), torch.zeros(2, dtype=torch.float64))


def test_content_tokens_get_plain_ce_and_masked_tokens_exact_zero():
    # two rows: decision (pos 0) then content; row 1 has a masked position 2 with a NaN-free huge CE
    ce = torch.tensor([[0.1, 0.4, 0.0], [2.0, 0.6, 50.0]], requires_grad=True)  # [N,L]
    valid = torch.tensor([[True, True, False], [True, True, False]])
    dec = torch.tensor([[True, False, False], [True, False, False]])
    cls = torch.tensor([[0, 0, 0], [1, 1, 1]])
    w = torch.tensor([0.5, 1.5], dtype=torch.float64)
    loss, m = balanced_from_ce(ce, valid, dec, cls, w)
    want = (0.5 * 0.1 + 1.5 * 2.0) / 2.0 + (0.4 + 0.6) / 2  # L_dec + L_con
    torch.testing.assert_close(loss, torch.tensor(want), atol=1e-6, rtol=0)
    loss.backward()
    assert ce.grad[:, 2].eq(0).all()  # masked → exact 0 gradient
    torch.testing.assert_close(ce.grad[:, 1], torch.tensor([0.5, 0.5]))
    # no content position at all: L_con = 0
    loss2, _ = balanced_from_ce(ce.detach()[:, :1], valid[:, :1], dec[:, :1], cls[:, :1], w)
    torch.testing.assert_close(loss2, torch.tensor((0.5 * 0.1 + 1.5 * 2.0) / 2.0))


def test_sft_balanced_loss_weighs_the_first_answer_token_as_the_decision():
    from groupwise.phases.sft import _balanced_loss, teacher_forced

    # rows: silence "." + EOS (ce 0.1, 0.2), silence (0.1, 0.2), respond "3" + EOS (2.0, 0.4)
    ce = torch.tensor([[0.1, 0.2], [0.1, 0.2], [2.0, 0.4]])  # [N,T]
    logp = (-ce)[:, None, :].clone().requires_grad_(True)  # [N,1,T]

    class Fixed:
        def forward(self, batch, wants):
            return {"logp": logp}

    batch = teacher_forced([[1], [1], [1]], [[5, 0], [5, 0], [6, 0]])
    w = class_balanced_weights(torch.tensor([2, 1]), 0.9)  # E = (1.9, 1) → w ∝ (1/1.9, 1)
    loss = _balanced_loss(Fixed(), batch, torch.tensor([0, 0, 1]), w)
    w0, w1 = float(w[0]), float(w[1])
    want = (2 * w0 * 0.1 + w1 * 2.0) / (2 * w0 + w1) + (0.2 + 0.2 + 0.4) / 3
    torch.testing.assert_close(loss, torch.tensor(want), atol=1e-6, rtol=0)
    # d loss / d logp of the respond decision
    torch.testing.assert_close(logp.grad[2, 0, 0], torch.tensor(-w1 / (2 * w0 + w1)))


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="beta=1.0"):
        class_balanced_weights(torch.tensor([1, 1]), 1.0)
    with pytest.raises(ConfigError, match="cb_beta"):
        build("phase", "sft", loss="cb_stream", cb_beta=-0.1)
    with pytest.raises(ConfigError, match="loss='focal'"):
        build("phase", "sft", loss="focal")
    with pytest.raises(ConfigError, match="cb_counts"):
        build("phase", "sft", loss="cb_stream", cb_counts="running")
    with pytest.raises(ConfigError, match="'decision' column"):
        build("phase", "sft", loss="cb_stream")._classes([{"prompt": "1+1=", "answer": "2"}])
    with pytest.raises(ConfigError, match="alpha=1.5"):
        RewardConfig(alpha=1.5)


# ---------------------------------------------------------------------------------------------- reward
CFG = RewardConfig()


def test_reward_spec_hand_number_and_components():
    traj_only = RewardConfig(alpha=0.0)
    # T=10, t_resp=4 correct: 1 + 0.5·6/10
    assert math.isclose(episode_reward(["sil"] * 4 + [7], 7, 2, 10, traj_only), 1.3)
    # default alpha 0.3: turns r = (0.05, 0.05, 0, 0, 0) → mean 0.02; R = 0.3·0.02 + 0.7·1.3
    assert math.isclose(episode_reward(["sil"] * 4 + [7], 7, 2, 10, CFG), 0.3 * 0.02 + 0.7 * 1.3)
    # false alarm at turn 1 (wrong digit): r = (0.05, −0.5), no trajectory credit, not a miss
    assert math.isclose(episode_reward(["sil", 3], 7, 2, 10, CFG), 0.3 * (-0.45 / 2))
    # never answered over 4 turns, t_open 2: r = (0.05, 0.05, 0, 0); R_traj = −c_miss
    assert math.isclose(episode_reward(["sil"] * 4, 7, 2, 4, CFG), 0.3 * 0.025 - 0.7 * 0.5)
    # an invalid action earns no silence bonus; the stream continues to the correct answer at turn 2 of 4
    assert math.isclose(episode_reward(["invalid", "sil", 7], 7, 2, 4, CFG), 0.3 * (0.05 / 3) + 0.7 * (1 + 0.5 * 2 / 4))
    # correctness only (lambda_time = alpha = 0): the timing no longer matters
    plain = RewardConfig(lambda_time=0.0, alpha=0.0)
    assert (
        episode_reward(["sil"] * 2 + [7], 7, 2, 10, plain) == episode_reward(["sil"] * 8 + [7], 7, 2, 10, plain) == 1.0
    )


def test_streampro_reward_batches_and_pads_ragged_groups_with_nan():
    out = streampro_reward([[["sil", 1], [1]], [["sil"]]], [1, 2], [1, 0], 2, RewardConfig(alpha=0.0))  # [B=2,G=2]
    assert out.shape == (2, 2)
    torch.testing.assert_close(out[0], torch.tensor([1 + 0.5 * 1 / 2, 1 + 0.5 * 2 / 2], dtype=torch.float64))
    assert out[1, 0] == -0.5 and math.isnan(out[1, 1])


def test_env_plays_the_stream_and_pays_the_return_at_the_end():
    row = {"label": 4, "t_open": 2, "turns": 4}
    env = ClueStream()
    assert env.reset(row, 0) == "?"
    assert env.step(".") == ("?", 0.0, False)
    obs, r, done = env.step(" . ")
    assert (obs, r, done) == ("4", 0.0, False)
    obs, r, done = env.step("4")
    assert done and math.isclose(r, episode_reward(["sil", "sil", 4], 4, 2, 4, CFG))
    env.reset(row, 0)
    for _ in range(3):
        assert env.step("x")[2] is False
    obs, r, done = env.step(".")  # the last turn ends it: a miss
    assert done and math.isclose(r, 0.3 * (0.0 / 4) - 0.7 * 0.5)
    assert (env.outcome()["answered"], env.outcome()["correct"]) == (0.0, 0.0)
    assert math.isnan(env.outcome()["response_turn"]) and math.isnan(env.outcome()["delay"])
    env.reset(row, 0)
    env.step("."), env.step("."), env.step("."), env.step("4")
    assert env.outcome() == {"answered": 1.0, "correct": 1.0, "response_turn": 3.0, "delay": 1.0}
    env.reset(row, 0)
    env.step("9")  # a false alarm at turn 0
    s = env.outcome()
    assert (s["answered"], s["correct"], s["response_turn"]) == (1.0, 0.0, 0.0) and math.isnan(s["delay"])
    assert [parse_action(a) for a in (".", "7", "77", "", "?")] == ["sil", 7, "invalid", "invalid", "invalid"]


def test_task_rows_are_decision_positions_with_disjoint_streams():
    assert decision_rows(3, 2, 5) == [
        {"prompt": "?", "answer": ".", "decision": 0, "env": "streampro", "label": 3, "t_open": 2, "turns": 5},
        {"prompt": "?.?", "answer": ".", "decision": 0, "env": "streampro", "label": 3, "t_open": 2, "turns": 5},
        {"prompt": "?.?.3", "answer": "3", "decision": 1, "env": "streampro", "label": 3, "t_open": 2, "turns": 5},
    ]
    train, test = rows("train", 0), rows("test", 0)
    assert all(r["decision"] == 1 for r in test) and len(test) == 40
    assert not {(r["label"], r["t_open"]) for r in train} & {(r["label"], r["t_open"]) for r in test}
    ratio = sum(1 - r["decision"] for r in train) / sum(r["decision"] for r in train)
    assert 15 < ratio < 18  # ≈ 16.5 silent decisions per answer
    scores = build("reward", "env_return")(["?"] * 3, ["3", ".", "4"], env=["streampro"] * 3, answer=["3", ".", "3"])
    assert scores == [1.0, 1.0, 0.0]


# ---------------------------------------------------------------------------------------------- composition
STREAM = [
    'data.task="clue_stream"',
    'rollout.name="episodes"',
    'rollout.params={max_turns=24, separator="", env_params={alpha=0.3}}',
    "rollout.max_new_tokens=1",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
]


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_two_steps_reward_every_episode_with_the_multi_grained_return(tmp_path, objective):
    extra = (
        ['phases=[{name="sft", loss="cb_stream", cb_beta=0.9, steps=2, batch_size=8}]']
        if objective == "ppo_clip"
        else []
    )
    logged, seen = train_recorded(tmp_path, objective, *STREAM, *extra)
    for row, batch in zip(logged, seen):
        answered = [
            any(isinstance(parse_action(a), int) for a in info["actions"]) for group in batch.info for info in group
        ]
        # the env's outcome() means
        assert math.isclose(row["env/answered"], sum(answered) / len(answered), rel_tol=1e-6)
        B, G = batch.rewards.shape
        for b in range(B):
            meta = batch.meta[b]
            for g in range(G):
                events = [parse_action(a) for a in batch.info[b][g]["actions"]]
                want = episode_reward(events, meta["label"], meta["t_open"], meta["turns"], CFG)
                assert math.isclose(float(batch.rewards[b, g]), want, rel_tol=1e-5, abs_tol=1e-6)
                n = int(batch.mask[b, g].sum())  # one-token actions, one-token observations between them
                assert batch.loss_mask[b, g, :n].tolist() == [t % 2 == 0 for t in range(n)]  # env tokens are holes
    if extra:
        assert (tmp_path / "phases" / "sft.pt").exists()  # the cb_stream sft phase ran before RL
