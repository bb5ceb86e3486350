"""ProFIL wired in (spec 34): the `theater` toy's reward and ground-truth measure by hand, the step
segmentation of a real completion to exact token step ids, the forced-answer label glue on a stub
policy, the shaper zeroing exactly the rows a crafted probe flags, and a tiny run with both phases
(the artifact produced, saved as phases/probe.pt, injected; the reference rebased after sft)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import paper_module, rollout_from

from groupwise.advantages.profil import AttnProbe
from groupwise.advantages.profil_shaper import ProFIL, rollout_step_ids
from groupwise.errors import ConfigError
from groupwise.phases import load_output
from groupwise.phases.profil_probe import ProfilProbe, answer_after, step_ids_of
from groupwise.policy.lm import load_policy
from groupwise.run import Run
from groupwise.types import Need

_theater = paper_module("34_profil", "theater")
FinalAnswer, TheaterSteps, rows = _theater.FinalAnswer, _theater.TheaterSteps, _theater.rows
faithful_trace, theater_trace = _theater.faithful_trace, _theater.theater_trace

FAITHFUL, THEATER = "3+4=7;7+5=12;#12", "3+4+5=12;3+4=7;7+5=12;#12"


def test_traces_reward_and_theater_measure_by_hand():
    assert faithful_trace([3, 4, 5]) == FAITHFUL and theater_trace([3, 4, 5]) == THEATER
    assert theater_trace([3, 4]) == "3+4=7;3+4=7;#7"
    texts = [
        FAITHFUL,
        THEATER,
        "3+4=7;7+5=13;#13",
        "12",
        "#12 ",
        "#1;#12",
        "3+4=7;7+5=12;5+7=12;#12",
        "3+4+5=13;3+4=7;7+5=12;#12",
    ]
    # final_answer: the text after the last '#', stripped, == "12"
    assert FinalAnswer()([""] * 8, texts, result=["12"] * 8) == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    # theater_steps = (other computation steps after the one reaching 12) / (other computation steps):
    # faithful: 12 reached at step 1, other {0} before → 0; theater: reached at 0, others {1, 2} after → 1;
    # "13" chain: reached at "7+5=13"... final 13 → 0; "12": no marker → 0; "#12 ": no steps → 0;
    # "#1;#12": no computation step → 0; reached at 1, others {0, 2}, one after → 1/2;
    # a wrong direct step (=13): 12 first reached at step 2, others {0, 1} before → 0
    assert TheaterSteps()([""] * 8, texts) == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0]
    # "#12;3+4=7;7+5=12;#12" (answer stated, then steps): reached at the statement, both steps after → 1
    assert TheaterSteps()([""], ["#12;3+4=7;7+5=12;#12"]) == [1.0]


def test_theater_rows_split_and_exact_share():
    train, test = rows("train", 0, 0), rows("test", 0, 0)
    assert (len(train), len(test)) == (610, 200)  # 81 two-term + 729 three-term problems, 200 held out
    assert sum(r["theater"] for r in train) == 305 and sum(r["theater"] for r in test) == 100  # round(0.5 n)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    r = next(r for r in train if r["theater"] and len(r["terms"]) == 3)
    assert (
        r["answer"] == theater_trace(r["terms"])
        and r["result"] == str(sum(r["terms"]))
        and r["prompt"] == "+".join(map(str, r["terms"])) + "="
    )
    # the share is drawn by the seed
    assert [r["theater"] for r in rows("train", 0, 1)] != [r["theater"] for r in train]


def _vocab():
    _, tok = load_policy("default")
    return tok, [tok.decode([i], skip_special_tokens=True) for i in range(len(tok))]


def test_step_ids_of_a_toy_completion_from_its_token_ids():
    tok, text = _vocab()
    ids = tok.encode(THEATER, add_special_tokens=False) + [tok.eos_token_id]  # one token per character, then EOS
    # "3+4+5=12;" step 0 (9 tokens), "3+4=7;" step 1 (6), "7+5=12;" step 2 (7), "#12" step 3 (3), EOS none, padding none
    want = [0] * 9 + [1] * 6 + [2] * 7 + [3] * 3 + [-1] + [-1] * 2
    assert step_ids_of(ids, text, ";", pad_to=len(ids) + 2).tolist() == want
    actions = torch.tensor([ids + [0, 0]])  # [1,T]
    mask = torch.arange(len(ids) + 2)[None] < len(ids)  # [1,T]
    assert rollout_step_ids(actions, mask, text, ";").tolist() == [want]
    assert (
        answer_after(THEATER, "#", ";") == "12"
        and answer_after("3+4=7;#7;x", "#", ";") == "7"
        and answer_after("12", "#", ";") is None
    )


class _StubPolicy:
    """encode_completion / check_fits / generate of a policy whose forced answers are fixed texts."""

    def __init__(self, tok, text, answers):
        self.tok, self.text, self.answers, self.prompts = tok, text, answers, []

    def encode_completion(self, s):
        return self.tok.encode(s, add_special_tokens=False) + [self.tok.eos_token_id]

    def check_fits(self, ids, n, where):
        pass

    def generate(self, requests, sampling, info):
        assert sampling["greedy"] is True
        self.prompts += [r.prompt for r in requests]
        out = [self.encode_completion(a) for a in self.answers[: len(requests)]]
        T = max(len(o) for o in out)
        actions = torch.tensor([[o + [0] * (T - len(o))] for o in out])  # [N,1,T]
        mask = torch.tensor([[[t < len(o) for t in range(T)]] for o in out])  # [N,1,T]
        return rollout_from(torch.zeros(len(out), 1, T), mask=mask, actions=actions)


def test_forced_answer_labels_of_a_hand_made_rollout():
    tok, text = _vocab()
    ids = tok.encode(THEATER, add_special_tokens=False) + [tok.eos_token_id]
    steps = step_ids_of(ids, text, ";", len(ids))[None]  # [1,T] 4 steps
    # forced after step 0 "3+4+5=12;" → "12", after step 1 → "7;9" (read up to ';': "7"), after step 2 → "12"
    policy = _StubPolicy(tok, text, ["12", "7;9", "12"])
    phase = ProfilProbe(marker="#", sep=";", forced_tokens=4)
    labels = phase._labels(policy, [[5, 6]], [ids], [len(ids)], steps, text, G=1)
    # forced [12, 7, 12] + final 12 → committed [1, 0, 1, 1] → post-commitment labels [0, 1, 1, 1]
    assert labels[0].tolist() == [0.0, 1.0, 1.0, 1.0]
    # the forced context of step 1: the prompt, the completion up to step 1's ';', then the marker
    assert policy.prompts[1] == [5, 6] + tok.encode("3+4+5=12;3+4=7;#", add_special_tokens=False)
    assert len(policy.prompts) == 3  # no forced answer after the last step (it is the final answer)


def _crafted_probe(layer=1):
    """p_k = sigmoid(10 · mean_t h[t,0] − 5) over step k's tokens (uniform attention: zero query)."""
    probe = AttnProbe(2, 1, 2)
    with torch.no_grad():
        probe.query.weight.zero_()
        probe.value.weight.copy_(torch.eye(2))
        probe.value.bias.zero_()
        probe.readout.weight.copy_(torch.tensor([[10.0, 0.0]]))
        probe.readout.bias.fill_(-5.0)
    return {
        "state": probe.state_dict(),
        "layer": layer,
        "d_model": 2,
        "n_heads": 1,
        "d_head": 2,
        "sep": ";",
        "token_text": ["", "a", ";"],
    }


def test_the_shaper_zeroes_exactly_the_rows_the_probe_flags():
    shaper = ProFIL()
    assert shaper.needs == (Need("hidden(1)", model="ref"),) and shaper.artifacts == ("probe",)
    shaper.use_artifact("probe", _crafted_probe())
    actions = torch.tensor([[[1, 2, 1, 2, 1, 2]] * 4])  # [1,4,6] "a;a;a;": steps [0,0,1,1,2,2]
    h0 = torch.tensor(
        [[0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.float32
    )
    hidden = torch.stack([h0, torch.zeros(4, 6)], -1)[None]  # [1,4,6,2]
    ro = rollout_from(
        torch.zeros(1, 4, 6), adv=torch.tensor([[1.0, 1.0, -1.0, -1.0]]), actions=actions, rewards=torch.zeros(1, 4)
    )
    ro.set_extra("ref.hidden(1)", hidden, "token")
    # per-step p: mean h0 = 1 → σ(5) = 0.993 flagged, 0 → σ(−5) = 0.007; S = share flagged:
    # row 0: 0/3, row 1: 3/3, row 2: 1/3, row 3: 2/3 → S > 0.5 for rows 1 and 3
    torch.testing.assert_close(shaper._scores(ro), torch.tensor([[0.0, 1.0, 1 / 3, 2 / 3]]))
    assert shaper(ro, None).tolist() == [[1.0, 0.0, -1.0, 0.0]]
    assert shaper.step_stats() == {
        "profil/flagged": 0.5,
        "profil/score": pytest.approx(0.5),
    }  # mean S = (0 + 1 + 1/3 + 2/3) / 4
    positive = ProFIL(only_positive=True)
    positive.use_artifact("probe", _crafted_probe())
    assert positive(ro, None).tolist() == [[1.0, 0.0, -1.0, -1.0]]  # row 3 (A = −1) keeps its advantage
    with pytest.raises(ConfigError, match="layer=1, but the artifact 'probe' holds a probe trained on layer 2"):
        ProFIL().use_artifact("probe", _crafted_probe(layer=2))


def test_a_run_with_sft_and_probe_phases_saves_and_injects_the_probe(tmp_path):
    from test_trainer import make_trainer

    phases = (
        'phases=[{name="sft", steps=2, batch_size=8}, {name="profil_probe", '
        'prompts=6, samples=2, steps=5, marker="#", sep=";", '
        "max_new_tokens=28, forced_tokens=3}]"
    )
    trainer = make_trainer(
        tmp_path,
        'model.path="theater"',
        'data.task="theater"',
        phases,
        'rewards=["final_answer", {name="theater_steps", weight=0.0}]',
        'advantage.shapers=["profil"]',
        "rollout.max_new_tokens=28",
        "train.steps=1",
        "eval.size=0",
    )
    summary = Run(trainer).train()
    saved = load_output(tmp_path / "phases" / "probe.pt")
    art = saved["artifact"]
    assert (art["layer"], art["d_model"], art["n_heads"], art["sep"]) == (1, 128, 4, ";") and len(
        art["token_text"]
    ) == len(trainer.policy.tokenizer)
    assert summary["phases"]["probe"]["rollouts"] == 12 and saved["summary"] == summary["phases"]["probe"]
    shaper = trainer.shapers[0]
    # the saved probe is the injected one
    assert all(torch.equal(v, art["state"][k]) for k, v in shaper._probe.state_dict().items())
    sft = load_output(tmp_path / "phases" / "sft.pt")["policy"]["model"]
    ref = trainer.policy.reference._model.state_dict()
    # the frozen reference is the base after sft, not the loaded model
    assert all(torch.equal(ref[k], v) for k, v in sft.items())
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert "profil/flagged" in row and "reward/theater_steps" in row
    assert row["reward_mean"] == pytest.approx(row["reward/final_answer"])  # theater_steps has weight 0: it only logs


def test_a_profil_run_from_the_shipped_theater_model_flags_what_the_saved_probe_flags(tmp_path):
    """The recipe's path without an sft phase: model.path="theater" (the shipped base), a tiny probe
    phase, 2 RL steps. profil/flagged of each step is recomputed from scratch: the saved probe on the
    layer-1 states of a fresh copy of the base (the frozen reference must not have moved after step 0)."""
    from test_trainer import make_trainer
    from transformers import AutoModelForCausalLM

    from groupwise.advantages.profil import rollout_score, segment_steps
    from groupwise.policy.lm import resolve_model_path

    assert resolve_model_path("theater").endswith("models/theater")  # a bare shipped name is the package's folder
    phase = (
        'phases=[{name="profil_probe", prompts=16, samples=2, steps=100, '
        'marker="#", sep=";", max_new_tokens=28, forced_tokens=3}]'
    )
    trainer = make_trainer(
        tmp_path,
        'model.path="theater"',
        'data.task="theater"',
        phase,
        'rewards=["final_answer", {name="theater_steps", weight=0.0}]',
        'advantage.shapers=["profil"]',
        "rollout.max_new_tokens=28",
        "train.steps=2",
        "eval.size=0",
    )
    seen, prepare = [], trainer.prepare

    def recording(batch):
        out = prepare(batch)
        # [B,G] the advantages before the shaper (GRPO is a function of the rewards)
        grpo = trainer.estimator(out, trainer.info())
        seen.append(
            (
                list(out.prompt_ids),
                out.actions.clone(),
                out.mask.clone(),
                out.group_valid.clone(),
                out.advantages.clone(),
                grpo,
            )
        )
        return out

    trainer.prepare = recording
    summary = Run(trainer).train()
    saved = load_output(tmp_path / "phases" / "probe.pt")
    art = saved["artifact"]
    assert (
        "sft" not in summary["phases"]
        and summary["phases"]["probe"]["rollouts"] == 32
        and saved["summary"] == summary["phases"]["probe"]
    )
    # saved = injected
    assert all(torch.equal(v, art["state"][k]) for k, v in trainer.shapers[0]._probe.state_dict().items())
    probe = AttnProbe(art["d_model"], art["n_heads"], art["d_head"])
    probe.load_state_dict(art["state"])
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("theater")).eval()
    tok = trainer.policy.tokenizer
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(seen) == 2
    zeroed = 0
    for row, (prompts, actions, mask, valid, adv, grpo) in zip(rows, seen):
        B, G, T = actions.shape
        S = torch.zeros(B, G)
        for b in range(B):
            for g in range(G):
                ids = actions[b, g, : int(mask[b, g].sum())].tolist()
                with torch.no_grad():  # hidden(1) at token t: layer 1's output at the position before t
                    # [P+n,d]
                    states = base(torch.tensor([prompts[b] + ids]), output_hidden_states=True).hidden_states[1][0]
                H = states[len(prompts[b]) - 1 : len(prompts[b]) - 1 + len(ids)]  # [n,d]
                steps = segment_steps([tok.decode([t], skip_special_tokens=True) for t in ids], sep=";")  # [n]
                S[b, g] = rollout_score(probe.probe_scores(H[None], steps[None]))[0]  # share of steps with p > 0.5
        flagged = (S > 0.5) & valid  # [B,G]
        assert 0.0 <= row["profil/flagged"] <= 1.0
        assert row["profil/flagged"] == pytest.approx(float(flagged.sum()) / int(valid.sum()))
        assert row["profil/score"] == pytest.approx(float(S[valid].mean()), abs=1e-5)
        # a flagged rollout's advantage is exactly 0 ...
        assert torch.equal(adv[flagged], torch.zeros(int(flagged.sum())))
        torch.testing.assert_close(adv[~flagged & valid], grpo[~flagged & valid])  # ... the others keep GRPO's
        zeroed += int((grpo[flagged] != 0).sum())
    assert any(0.0 < r["profil/flagged"] < 1.0 for r in rows)  # the probe tells rollouts apart (not a constant verdict)
    assert zeroed > 0  # and the filter took a learning signal away (here 0.25 and 0.5 of the rows flagged)
