"""Paper 45 Flow-OPD: the per-step KL term against spec 45's hand numbers, its gradient paths, the clamp and
the gkd form, per-group teacher routing, the SDE mean of the Flow-GRPO kernel, the two-task toy and its reward,
and the whole pipeline (base → teachers → averaged student) on a few steps with its ledger."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from groupwise.losses.flow_opd import FlowOPD, flow_opd_step_loss, gaussian_mean_kl
from groupwise.modalities.flow_sde import sde_step_with_logprob
from groupwise.modalities.flow_toy import mixture_centres


def test_spec_45_unit_numbers_and_both_gradient_paths():
    # μ_θ = [1, 2], μ_T = [0, 0], std 0.5: KL = mean(1, 4) / (2·0.25) = 2.5 / 0.5 = 5.0; A = −5 (inside the
    # clamp); ρ = 1 → L_pg = max(5·1, 5·1) = 5.0. MAR with μ_MAR = [1, 1]: mean(0, 1) / 0.5 = 1.0, × 0.04 = 0.04.
    mu = torch.tensor([[1.0, 2.0]], dtype=torch.float64, requires_grad=True)
    zero, std = torch.zeros(1, dtype=torch.float64), torch.tensor([0.5], dtype=torch.float64)
    anchor = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    loss, kl, mar = flow_opd_step_loss(zero, zero, mu, torch.zeros(1, 2, dtype=torch.float64), std, anchor)
    assert kl.item() == 5.0 and mar.item() == 1.0 and loss.item() == pytest.approx(5.04, abs=1e-12)
    # not detached [CODE]: L_pg = KL·ρ carries ∂KL/∂μ = (μ − μ_T)/(D·std²) = [1, 2]/0.5 = [2, 4]; MAR adds
    # β(μ − μ_MAR)/(D·std²) = 0.04·[0, 1]/0.5 = [0, 0.08]
    loss.sum().backward()
    assert mu.grad is not None and torch.allclose(mu.grad, torch.tensor([[2.0, 4.08]], dtype=torch.float64), atol=1e-12)
    # detached: only the MAR path reaches μ (the ratio's path goes through log p, here a constant)
    mu.grad = None
    flow_opd_step_loss(zero, zero, mu, torch.zeros(1, 2), std, anchor, detach_advantage=True)[0].sum().backward()
    assert mu.grad is not None and torch.allclose(mu.grad, torch.tensor([[0.0, 0.08]], dtype=torch.float64), atol=1e-12)
    assert gaussian_mean_kl(torch.tensor([3.0, 0.0]), torch.zeros(2), torch.tensor(0.5)).item() == 9.0


def test_the_clamp_the_ratio_clip_and_the_gkd_form():
    zero, std = torch.zeros(1), torch.tensor([0.5])
    # μ_θ = [3, 0]: KL = 9/2/0.5 = 9 → A = clamp(−9, ±5) = −5, L_pg = 5; the clamp cuts the KL's gradient
    mu = torch.tensor([[3.0, 0.0]], requires_grad=True)
    loss, kl, _ = flow_opd_step_loss(zero, zero, mu, torch.zeros(1, 2), std)
    loss.sum().backward()
    assert kl.item() == 9.0 and loss.item() == 5.0 and mu.grad is not None and torch.equal(mu.grad, torch.zeros(1, 2))
    # ρ = 2 (log p − log p_old = ln 2), A = −5: max(5·2, 5·clip(2, 1 ± 1e-4)) = max(10, 5.0005) = 10
    mu = torch.tensor([[1.0, 2.0]])
    logp = torch.tensor([math.log(2.0)])
    assert flow_opd_step_loss(logp, zero, mu, torch.zeros(1, 2), std, beta=0.0)[0].item() == pytest.approx(10.0)
    # gkd: KL + β·MAR whatever the ratio: 5 + 0.04·1 = 5.04
    gkd = flow_opd_step_loss(logp, zero, mu, torch.zeros(1, 2), std, torch.tensor([[1.0, 1.0]]), reward_mode="gkd")
    assert gkd[0].item() == pytest.approx(5.04)


def test_groups_are_routed_to_their_task_teacher_and_an_unknown_task_is_named():
    term = FlowOPD(teachers={"A": "teacher_a", "B": "teacher_b"})
    assert [(n.quantity, n.model, n.grad) for n in term.needs] == [
        ("step_mean", "policy", True),
        ("step_mean", "teacher_a", False),
        ("step_mean", "teacher_b", False),
        ("step_mean", "mar", False),  # measured at β = 0 too: the MAR claim compares it
    ]
    a, b = torch.zeros(2, 3, 1, 2), torch.ones(2, 3, 1, 2)  # [B,G,T,D]
    mb = SimpleNamespace(
        meta=[{"task": "B"}, {"task": "A"}], extras={"teacher_a.step_mean": a, "teacher_b.step_mean": b}
    )
    means = term._teacher_means(mb)  # group 0 from teacher_b's rows, group 1 from teacher_a's
    assert torch.equal(means[0], b[0]) and torch.equal(means[1], a[1])
    mb.meta = [{"task": "C"}, {"task": "A"}]
    with pytest.raises(
        ValueError, match=r"'task' is 'C', which names no teacher \(flow_opd.teachers routes \['A', 'B'\]"
    ):
        term._teacher_means(mb)
    with pytest.raises(ValueError, match="flow_opd.teachers must map each 'task' value to a frozen role"):
        FlowOPD()
    with pytest.raises(ValueError, match="anchor role when beta > 0"):
        FlowOPD(teachers={"A": "t"}, anchor="")


def test_the_flow_grpo_sde_mean_of_spec_45():
    # σ = 0.5, σ' = 0.25 (dt = −0.25), a = 0.7: std_t = 0.7·sqrt(0.5/0.5) = 0.7; x = 1, v = −1:
    # μ = 1·(1 − 0.49/(2·0.5)·0.25) + (−1)·(1 + 0.49·0.5/(2·0.5))·(−0.25) = 0.8775 + 0.31125 = 1.18875
    out = sde_step_with_logprob(
        torch.tensor([[-1.0]], dtype=torch.float64),
        torch.tensor([[1.0]], dtype=torch.float64),
        0.5,
        0.25,
        0.0,
        1.0,
        noise=torch.zeros(1, 1),
        schedule="flow_grpo",
        noise_level=0.7,
    )
    assert out[2].item() == pytest.approx(1.18875, abs=1e-12) and out[3].item() == pytest.approx(0.7, abs=1e-12)


def test_the_two_task_toy_and_its_reward():
    import importlib

    toy = importlib.import_module("groupwise.papers.45_flow_opd.multi_task")
    from groupwise.tasks import get_task

    rows = get_task("flow2d_multi").rows("train", 200, 3)
    assert {r["task"] for r in rows if r["prompt"] < 4} == {"A"} and {r["task"] for r in rows if r["prompt"] >= 4} == {
        "B"
    }
    assert {r["task"] for r in get_task("flow2d_multi_b").rows("train", 50, 3)} == {"B"}
    held = get_task("flow2d_multi").rows("test", 0, 3)
    assert len(held) == 128 and held != get_task("flow2d_multi").rows("train", 128, 3)
    mu = mixture_centres(8, 2.0)  # μ_1 = (√2, √2), μ_5 = −μ_1
    x = torch.stack([mu[1], mu[1], mu[5], mu[5]])[None]  # [1,4,2] one group of four points
    labels = torch.tensor([[1, 5, 5, 1]])  # [1,4]
    # task A pays the own mode: label 1 at μ_1 → 1, label 1 at μ_5 → 0 (labels 5 under A: own mode μ_5 → 1)
    assert toy.multi_task_reward(x, labels, ["A"], "by_task", 0.75, 2.0).tolist() == [[1.0, 0.0, 1.0, 0.0]]
    # task B pays the opposite mode k + 4: label 5 at μ_1 → 1, label 5 at μ_5 → 0, label 1 at μ_5 → 1
    assert toy.multi_task_reward(x, labels, ["B"], "by_task", 0.75, 2.0).tolist() == [[0.0, 1.0, 0.0, 1.0]]
    # sum: either mode → 1 (the two regions are 4 apart, never both)
    assert toy.multi_task_reward(x, labels, ["B"], "sum", 0.75, 2.0).tolist() == [[1.0, 1.0, 1.0, 1.0]]


@pytest.mark.slow
def test_the_flow_opd_pipeline_runs_its_student_on_its_teachers_with_a_label_free_ledger(tmp_path):
    from groupwise.pipeline import run_pipeline

    tiny = ["train.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4", "eval.size=16", "eval.every=0"]
    result = run_pipeline(
        "flow_opd",
        tmp_path,
        seed=0,
        common=["log.samples=0"],
        own={s: tiny for s in ("teacher_a", "teacher_b", "student")} | {"base": ["phases.0.steps=20", "eval.size=16"]},
    )
    stages = {s["name"]: s for s in result["stages"]}
    student = stages["student"]
    # every model the student loaded is pinned by its stage's final sha256
    assert student["loaded"]["roles.teacher_a.model.path"] == stages["teacher_a"]["final_sha256"]
    assert student["loaded"]["roles.teacher_b.model.path"] == stages["teacher_b"]["final_sha256"]
    assert student["loaded"]["roles.mar.model.path"] == stages["base"]["final_sha256"]
    # the student reads no label: rewards weigh 0, average_init reads no rows; each teacher reads its own task's
    assert student["ledger"]["labelled"]["rows"] == 0 and student["ledger"]["unlabelled"]["rows"] == 1024
    for name, task in (("teacher_a", "A"), ("teacher_b", "B")):
        assert 0 < stages[name]["ledger"]["labelled"]["rows"] <= 8 and stages[name]["config"]["data"]["task"].endswith(
            task.lower()
        )
    import json

    rows = [json.loads(line) for line in (tmp_path / "student" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["opd_kl"] > 0 and r["opd_mar"] > 0 for r in rows)


def test_the_energy_distance_of_the_anchor_measure():
    import importlib

    energy = importlib.import_module("groupwise.papers.45_flow_opd.anchor_distance").energy_distance
    x = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    # Y = {(3,0), (4,0)}: cross pairs i≠j |x0−y1| = 4, |x1−y0| = 2 → 2·3 = 6; within X 1, within Y 1 → E = 6 − 1 − 1 = 4
    assert energy(x, torch.tensor([[3.0, 0.0], [4.0, 0.0]])).item() == 4.0
    # Y = {(0,0), (2,0)}: cross 2 and 1 → 3; within X 1, Y 2 → E = 0
    assert energy(x, torch.tensor([[0.0, 0.0], [2.0, 0.0]])).item() == 0.0
    assert energy(x[None].expand(3, 2, 2), x[None].expand(3, 2, 2) + 3).shape == (3,)  # batched over rows
