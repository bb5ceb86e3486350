"""Core contracts (core-2.md §1–2): an idempotent update closure, build errors for needs nobody
provides, views that really edit the context, one override per objective term, reward weights
applied once, schedules resolved per step, observers and the shared prompt table, and all of it
through a resume. Each test names the defect it pins down and how today's code fails it."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from test_trainer import make_trainer

from groupwise.config import load_config
from groupwise.errors import ConfigError
from groupwise.run import Run
from groupwise.types import Need

SGD = 'update={name="sgd", lr=0.5}'


class _TwiceUpdater:
    """Test updater: zero → closure → step → zero → closure → step (GXPO-like repeated calls)."""

    def __init__(self, lr: float = 0.5):
        self.lr = lr

    def bind(self, params, total_steps):
        self.params = params

    def step(self, closure):
        losses = []
        for _ in range(2):
            for p in self.params:
                p.grad = None
            losses.append(float(closure()))
            with torch.no_grad():
                for p in self.params:
                    if p.grad is not None:
                        p -= self.lr * p.grad
        return {"loss": losses[0], "second_loss": losses[1]}


def _record_log_ratios(trainer):
    """Wrap the objective: per call, max |logp − logp_old| over loss tokens."""
    seen = []
    loss = trainer.objective.loss

    def recording(mb, out, norms, info, record=True):
        m = trainer.objective.loss_mask(mb)  # [b,G,T]
        seen.append(float((out["logp"].detach() - mb.logp_old).abs()[m].max()))
        return loss(mb, out, norms, info, record=record)

    trainer.objective.loss = recording
    return seen


def test_defect1_a_second_closure_call_sees_the_moved_weights(tmp_path):
    """Defect 1: with μ = 1 and one mini-batch, today's closure re-took the old log-probs on every
    call, so after the first optimiser step the second call still saw ratio exactly 1 (both recorded
    values 0) and term statistics were counted twice."""
    trainer = make_trainer(tmp_path, SGD)
    trainer.updater = _TwiceUpdater()
    trainer.updater.bind(trainer.params, 1)
    seen = _record_log_ratios(trainer)
    batch = trainer.prepare(trainer.collect())
    assert batch.logp_old is None  # on-policy: no separate no-grad pass
    counted = {}
    pop = trainer.objective.pop_stats

    def popping(reduce=None):
        counted.update(trainer.objective.stat_counts)
        return pop(reduce)

    trainer.objective.pop_stats = popping
    row = trainer.update(batch)
    assert seen[0] == 0.0  # first call: the old log-probs are this forward's own
    assert seen[1] > 1e-3, seen  # second call: the weights moved, the old log-probs did not
    n_tokens = int(trainer.objective.loss_mask(batch).sum())
    assert counted["ratio"] == n_tokens  # statistics from the first call only
    assert row["ratio"] == pytest.approx(1.0)
    assert row["second_loss"] != row["loss"]


def test_defect1_micro_batched_closure_is_idempotent_too(tmp_path):
    """The same with two micro-batches: the second call reuses every micro-batch's old log-probs."""
    trainer = make_trainer(tmp_path, SGD, "train.micro_batch_groups=2")
    trainer.updater = _TwiceUpdater()
    trainer.updater.bind(trainer.params, 1)
    seen = _record_log_ratios(trainer)
    trainer.update(trainer.prepare(trainer.collect()))
    assert seen[:2] == [0.0, 0.0] and min(seen[2:]) > 1e-3, seen


@dataclass
class _Needy:
    needs: tuple


@pytest.mark.parametrize(
    "need,words",
    [
        (Need("logp", view="teacher_with_answer"), ["teacher_with_answer", "ground_truth"]),
        (Need("attention(2)"), ["attention", "logp", "kl_to"]),
        (Need("logp", model="teacher"), ["teacher", "policy", "ref"]),
        (Need("topk(x)"), ["topk(x)", "integer"]),
        (Need("kl_to(ground_truth)", grad=True), ["autograd"]),
    ],
)
def test_defect4_a_need_nobody_provides_is_a_build_error_naming_what_exists(tmp_path, need, words):
    """Defect 4: ``Need(view=...)`` was accepted and silently served the default view; unknown
    quantities or models were only caught for the closed (quantity, model) table."""
    from groupwise.needs import NeedResolver

    models = {"policy": None, "ref": None}
    with pytest.raises(ConfigError) as err:
        NeedResolver([need], models, {}, forward=None, encode=None)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_a_view_rescores_rows_under_the_edited_context(tmp_path):
    """Need(view="ground_truth") is the forward of the edited prompt, not the default one: equal to
    completion_logprobs on prompts built by the view, different from logp_old; kl_to(view) equals
    the full-vocabulary KL computed from materialised logits."""
    from groupwise.policy.forward import completion_logprobs

    trainer = make_trainer(tmp_path)
    batch = trainer.collect()
    needs = [Need("logp"), Need("logp", view="ground_truth"), Need("kl_to(ground_truth)")]
    for need in needs:
        trainer.needs.check(need)
    trainer.needs.fill(batch, needs)
    view = trainer.needs.views["ground_truth"]
    edited = view.apply(batch, trainer.needs.encode)
    assert edited.prompt_ids != batch.prompt_ids and len(edited.prompt_ids[0]) > len(batch.prompt_ids[0])
    with torch.no_grad():
        expected = completion_logprobs(
            trainer.policy.module, edited.prompt_ids, batch.actions, batch.mask, batch.group_valid, quantities=["logp"]
        )
        full_p = _full_logprobs(trainer.policy.module, batch.prompt_ids, batch)
        full_q = _full_logprobs(trainer.policy.module, edited.prompt_ids, batch)
    m = batch.row_mask
    torch.testing.assert_close(batch.extras["policy@ground_truth.logp"], expected["logp"], atol=1e-6, rtol=1e-6)
    assert (batch.extras["policy@ground_truth.logp"] - batch.logp_old).abs()[m].max() > 1e-3
    kl = (full_p.exp() * (full_p - full_q)).sum(-1)  # [B,G,T]
    torch.testing.assert_close(batch.extras["kl_to(ground_truth)"][m], kl[m], atol=1e-5, rtol=1e-4)


def _full_logprobs(model, prompt_ids, batch):
    """[B,G,T,V] next-token log-probs from one plain forward per row (test reference)."""
    B, G, T = batch.shape
    out = torch.zeros(B, G, T, model.config.vocab_size)
    for b in range(B):
        for g in range(G):
            L = int(batch.mask[b, g].sum())
            if L == 0 or not batch.group_valid[b, g]:
                continue
            P = len(prompt_ids[b])
            seq = torch.tensor([prompt_ids[b] + batch.actions[b, g, :L].tolist()])
            out[b, g, :L] = model(seq).logits[0, P - 1 : P - 1 + L].float().log_softmax(-1)
    return out


def test_defect5_one_term_parameter_is_overridden_alone():
    """Defect 5: overriding one parameter of one term replaced the whole list (dropping grpo's KL),
    and `objective.terms.0.eps_high` was rejected."""
    by_name, _ = load_config("grpo", ["objective.terms.ppo_clip.eps_high=0.28"])
    by_index, _ = load_config("grpo", ["objective.terms.0.eps_high=0.28"])
    expected = [{"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.28}, {"name": "kl", "coef": 0.04, "estimator": "k3"}]
    assert by_name.objective.terms == expected and by_index.objective.terms == expected
    added, _ = load_config(None, ["objective.terms.kl.coef=0.1"])  # default terms ["ppo_clip"] + a KL term
    assert added.objective.terms == ["ppo_clip", {"name": "kl", "coef": 0.1}]  # the untouched entry stays as written
    keyed, _ = load_config(
        None,
        [
            'objective.terms=[{name="kl", key="kl_a", coef=0.1}, {name="kl", key="kl_b", coef=0.2}]',
            "objective.terms.kl_b.coef=0.3",
        ],
    )
    assert [t["coef"] for t in keyed.objective.terms] == [0.1, 0.3]
    with pytest.raises(ConfigError, match="distinct `key`"):
        load_config(
            None, ['objective.terms=[{name="kl", coef=0.1}, {name="kl", coef=0.2}]', "objective.terms.kl.coef=0.3"]
        )
    with pytest.raises(ConfigError, match="has 2 entries"):
        load_config("grpo", ["objective.terms.5.coef=1"])


def test_keyed_terms_build(tmp_path):
    trainer = make_trainer(
        tmp_path,
        'objective.terms=[{name="ppo_clip", key="clip"}, {name="kl", key="kl_a", coef=0.1}]',
        "objective.terms.clip.eps_high=0.3",
    )
    assert trainer.objective.terms[0].eps_high == 0.3 and trainer.objective.terms[1].coef == 0.1


def test_defect6_every_consumer_sees_the_reward_with_its_scorer_terms(tmp_path):
    """Defect 6: text rewards were weighted inside `score` and rollout scorers added in `prepare`,
    so dynamic sampling's keep saw rewards without the scorer (KL) terms while the logged
    reward_mean included them. Now both come from one weighted total."""
    trainer = make_trainer(
        tmp_path,
        'rewards=[{name="exact", weight=2.0}, {name="kl_penalty", coef=0.5, weight=3.0}]',
        'sampling={name="dynamic"}',
        SGD,
    )
    seen = {}
    keep = trainer.sampler.keep

    def recording(batch):
        seen["rewards"] = batch.rewards.clone()
        seen["parts"] = batch.reward_parts.clone()
        return keep(batch)

    trainer.sampler.keep = recording
    trainer.step = 1  # the reference differs from the policy only after an update
    with torch.no_grad():
        for p in trainer.policy.module.parameters():
            p.add_(0.01 * torch.randn_like(p))
    batch = trainer.collect()
    # keep saw the weighted total of its round: 2·exact + 3·kl scorer, weights applied once
    torch.testing.assert_close(
        seen["rewards"], 2.0 * seen["parts"][..., 0] + 3.0 * seen["parts"][..., 1], atol=1e-6, rtol=1e-6
    )
    # the kept batch carries its own parts: the KL column is −coef·Σ_t k1(logp_old, logp_ref) of each kept row
    kl = -(0.5) * ((batch.logp_old - batch.logp_ref) * batch.row_mask).sum(-1)  # [B,G]
    torch.testing.assert_close(batch.reward_parts[..., 1], kl, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        batch.rewards, 2.0 * batch.reward_parts[..., 0] + 3.0 * batch.reward_parts[..., 1], atol=1e-6, rtol=1e-6
    )
    assert kl.abs().max() > 1e-4, "a scorer term of zero tests nothing"


def test_schedules_are_resolved_once_per_step_and_logged(tmp_path):
    """A KL coefficient given as a linear schedule: the term sees 0 at step 0 and end at the last
    step; the metrics carry the value."""
    import json

    trainer = make_trainer(
        tmp_path,
        "train.steps=3",
        "eval.size=0",
        'objective.terms=["ppo_clip", {name="kl", coef={schedule="linear", start_value=0.0, end=0.2, steps=2}}]',
        SGD,
    )
    assert trainer.objective.terms[1].coef == 0.0  # constructed with start()
    Run(trainer).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["coef/kl.coef"] for r in rows] == pytest.approx([0.0, 0.1, 0.2])
    assert trainer.objective.terms[1].coef == pytest.approx(0.2)


@dataclass
class _Watcher:
    seen: list

    def observe(self, rollout, info):
        self.seen.append(
            (
                info.step,
                rollout.shape,
                rollout.advantages is not None,
                info.prompt_stats.seen(int(rollout.prompt_index[0])),
            )
        )


def test_observers_see_the_whole_scored_batch_after_the_update(tmp_path):
    trainer = make_trainer(tmp_path, "train.steps=2", "eval.size=0", SGD)
    watcher = _Watcher([])
    original = trainer.components
    trainer.components = lambda: [*original(), watcher]  # any component may observe
    Run(trainer).train()
    assert [s[0] for s in watcher.seen] == [0, 1]
    assert all(s[2] for s in watcher.seen) and watcher.seen[0][1][0] == 4
    assert watcher.seen[0][3] == 0  # the prompt table is updated after every observer ran
    assert sum(trainer.prompt_stats.seen(p) for p in trainer.prompt_stats.prompts()) == 8  # 2 steps × 4 groups


def test_prompt_stats_by_hand():
    from helpers import make_rollout

    from groupwise.stats import PromptStats
    from groupwise.types import StepInfo

    ro = make_rollout(2, 3, 2, seed=0, awkward=False)
    ro.rewards = torch.tensor([[1.0, 0.0, 1.0], [float("nan"), 0.5, 0.5]])
    ro.prompt_index = torch.tensor([7, 9])
    stats = PromptStats(history=2)
    stats.update(ro, StepInfo(3, 0, 2))
    # ((1/3)²·2+(2/3)²)/3
    assert stats.last_mean(7, -1) == pytest.approx(2 / 3) and stats.recent_variances(7) == [pytest.approx(2 / 9)]
    assert stats.last_mean(9, -1) == 0.5 and stats.recent_variances(9) == [0.0]  # NaN row excluded
    ro.rewards = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    stats.update(ro, StepInfo(4, 0, 2))
    stats.update(ro, StepInfo(5, 0, 2))
    # history keeps the last 2
    assert stats.recent_means(7) == [0.0, 0.0] and stats.seen(7) == 3 and stats.last_step(7) == 5
    assert stats.running_mean(7, -1) == pytest.approx(2 / 9)  # (2 + 0 + 0) / 9 rewards
    again = PromptStats()
    again.load_state_dict(copy.deepcopy(stats.state_dict()))
    assert again.state_dict() == stats.state_dict() and again.last_mean(404, 0.25) == 0.25


RESUMABLE = [
    [
        'sampling={name="dynamic"}',
        'objective.terms=["ppo_clip", {name="kl", coef={schedule="linear", start_value=0.0, end=0.2, steps=4}}]',
    ],
]


@pytest.mark.parametrize("extra", RESUMABLE)
def test_stateful_components_resume_exactly(tmp_path, extra):
    """Four steps straight equal two steps, a checkpoint, a new process-like Trainer and two more:
    same weights, sampler state, schedules and prompt table (in-process; the process-killing
    version is tests/test_resume.py under make test-slow)."""
    common = ["train.steps=4", "eval.size=0", "checkpoint.every=2", *extra]
    straight = make_trainer(tmp_path / "a", *common)
    Run(straight).train()
    first = make_trainer(tmp_path / "b", *common)
    first.cfg.train.steps = 2  # stop half-way (the updater's schedule was bound for 4 steps, as in a real interruption)
    Run(first).train()
    resumed = make_trainer(tmp_path / "b", *common)
    Run(resumed).train(resume_allow=["train.steps"])
    assert resumed.step == straight.step == 4
    for (name, p), q in zip(straight.policy.module.named_parameters(), resumed.policy.module.parameters()):
        assert torch.equal(p, q), name
    assert straight.sampler.state_dict() == resumed.sampler.state_dict()
    assert straight.prompt_stats.state_dict() == resumed.prompt_stats.state_dict()
    for a, b in zip(straight.components(), resumed.components()):
        if hasattr(a, "state_dict") and a is not straight.updater:
            assert repr(a.state_dict()) == repr(b.state_dict()), type(a).__name__


@pytest.mark.parametrize(
    "coef",
    ['{schedule="adaptive_kl", target=0.01, horizon=100}', '{schedule="linear", start_value=0.1, end=0.5, steps=4}'],
)
def test_a_scheduled_reward_coefficient_resumes_exactly(tmp_path, coef):
    """A reward scorer runs before the step's schedules are resolved, so after a resume it must see
    the value the uninterrupted run had in force (the last step's), not the schedule's start."""
    common = [
        "train.steps=4",
        "eval.size=0",
        "checkpoint.every=2",
        SGD,
        f'rewards=["exact", {{name="kl_penalty", coef={coef}}}]',
    ]
    straight = make_trainer(tmp_path / "a", *common)
    Run(straight).train()
    first = make_trainer(tmp_path / "b", *common)
    first.cfg.train.steps = 2
    Run(first).train()
    resumed = make_trainer(tmp_path / "b", *common)
    Run(resumed).train(resume_allow=["train.steps"])
    for (name, p), q in zip(straight.policy.module.named_parameters(), resumed.policy.module.parameters()):
        assert torch.equal(p, q), name
