"""LoRA placement (spec 29): the scores, the top-k rule and the gradient diagnostics by hand; the
``lora_placement`` updater trains exactly the chosen B entries (everything else stays bit-for-bit
at its initial value, AdamW weight decay included) with SGD and AdamW as the inner step, its state
sized k; the probe phase in a tiny run (k worked out from the adapter shapes, A untouched)."""

from __future__ import annotations

import json

import pytest
import torch

from groupwise.errors import ConfigError
from groupwise.registry import build_spec
from groupwise.run import Run
from groupwise.updates.lora_placement import grad_structure_stats, placement_scores, topk_mask

# spec 29's unit test: B is 2x2 (e00, e01, e10, e11), S = 3 probe gradients
# [S=3, P=4]
SPEC_GRADS = torch.tensor([[0.5, -0.4, 0.4, 0.9], [0.4, 0.5, 0.4, -0.9], [0.6, -0.3, 0.4, 0.8]], dtype=torch.float64)
B_NAME = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
LORA = 'model.lora={r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]}'


def test_scores_of_the_spec_example():
    torch.testing.assert_close(
        placement_scores(SPEC_GRADS, "net"), torch.tensor([1.5, 0.2, 1.2, 0.8], dtype=torch.float64), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(
        placement_scores(SPEC_GRADS, "magnitude"),
        torch.tensor([1.5, 1.2, 1.2, 2.6], dtype=torch.float64),
        rtol=0,
        atol=1e-12,
    )
    torch.testing.assert_close(
        placement_scores(SPEC_GRADS, "sign_consistency"),
        torch.tensor([1.0, 0.2 / 1.2, 1.0, 0.8 / 2.6], dtype=torch.float64),
        rtol=0,
        atol=1e-12,
    )  # [1, .1667, 1, .3077]
    assert topk_mask(placement_scores(SPEC_GRADS, "net"), 2).tolist() == [True, False, True, False]  # {e00, e10}
    assert topk_mask(placement_scores(SPEC_GRADS, "magnitude"), 2).tolist() == [True, False, False, True]  # {e11, e00}
    assert topk_mask(placement_scores(SPEC_GRADS, "sign_consistency"), 2).tolist() == [
        True,
        False,
        True,
        False,
    ]  # 1.0, 1.0


def test_sign_consistency_of_a_zero_gradient_is_zero_and_random_is_seeded():
    grads = torch.tensor([[0.0, 1.0], [0.0, -1.0]])  # entry 0 never moves; entry 1 cancels
    assert placement_scores(grads, "sign_consistency").tolist() == [0.0, 0.0]
    a, b = placement_scores(grads, "random", seed=3), placement_scores(grads, "random", seed=3)
    assert torch.equal(a, b) and not torch.equal(a, placement_scores(grads, "random", seed=4))
    assert ((a >= 0) & (a < 1)).all()
    with pytest.raises(ConfigError, match="allowed: net"):
        placement_scores(grads, "fisher")


def test_topk_ties_global_and_per_module_quota():
    scores = torch.tensor([0.5, 0.5, 0.5, 0.1])
    assert topk_mask(scores, 2).tolist() == [True, True, False, False]  # ties: lower index first
    # modules of 2 and 4 entries, k = 3: quotas 3*2/6 = 1 and 3*4/6 = 2
    scores = torch.tensor([0.1, 0.9, 0.8, 0.7, 0.6, 0.95])
    assert topk_mask(scores, 3).tolist() == [False, True, True, False, False, True]  # global: 0.95, 0.9, 0.8
    assert topk_mask(scores, 3, sizes=[2, 4]).tolist() == [
        False,
        True,
        True,
        False,
        False,
        True,
    ]  # 1 from [0.1, .9]; 2 from the rest
    # sizes [1, 2], k = 2: raw quotas [2/3, 4/3] -> floors [0, 1], the remainder to the larger fraction (2/3): [1, 1]
    assert topk_mask(torch.tensor([0.0, 5.0, 4.0]), 2, sizes=[1, 2]).tolist() == [True, True, False]
    assert topk_mask(torch.tensor([0.0, 5.0, 4.0]), 2).tolist() == [False, True, True]
    with pytest.raises(ConfigError, match="k=5"):
        topk_mask(scores[:4], 5)


def test_grad_structure_stats_by_hand():
    # σ = [1, 1]: eff_rank e^{ln 2} = 2; orthogonal
    stats = grad_structure_stats(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    assert stats["eff_rank"] == pytest.approx(2.0, abs=1e-12) and stats["mean_cos"] == pytest.approx(0.0, abs=1e-12)
    stats = grad_structure_stats(torch.tensor([[1.0, 0.0], [2.0, 0.0], [-1.0, 0.0]]))  # rank 1; cosines +1, -1
    assert stats["eff_rank"] == pytest.approx(1.0, abs=1e-12) and stats["mean_cos"] == pytest.approx(0.0, abs=1e-12)
    # σ of [[3, 0], [0, 1]] = [3, 1]: p = [3/4, 1/4], eff_rank = exp(-(.75 ln .75 + .25 ln .25)) = 1.7548...
    stats = grad_structure_stats(torch.tensor([[3.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    assert stats["eff_rank"] == pytest.approx(1.7547654, abs=1e-6) and stats["mean_cos"] == pytest.approx(
        0.0, abs=1e-12
    )  # a zero row: cos 0
    stats = grad_structure_stats(torch.tensor([[1.0, 1.0], [1.0, 0.0]]))  # cos = 1/sqrt(2)
    assert stats["mean_cos"] == pytest.approx(2**-0.5, abs=1e-12)


def _placed(inner: dict, mask: torch.Tensor, weights: list[torch.nn.Parameter], names: list[str]):
    updater = build_spec("update", {"name": "lora_placement", "inner": inner})
    updater.bind(weights, total_steps=10)
    updater.use_parameter_names(names)
    updater.use_artifact("placement", {"masks": {names[0]: mask}})
    return updater


def test_spec_mask_one_sgd_step_moves_only_the_chosen_entries():
    """Spec 29: after one step with mask {e00, e10}, e01 and e11 stay exactly 0; SGD moves the
    chosen ones by exactly -lr * grad."""
    B = torch.nn.Parameter(torch.zeros(2, 2))
    A = torch.nn.Parameter(torch.tensor([[0.3, -0.2], [0.1, 0.4]]))  # a frozen A: never written
    c = torch.tensor([[2.0, -3.0], [0.5, 7.0]])  # dL/dB = c
    mask = torch.tensor([[True, False], [True, False]])
    updater = _placed({"name": "sgd", "lr": 0.1}, mask, [B, A], [B_NAME, B_NAME.replace("lora_B", "lora_A")])
    out = updater.step(lambda: ((B * c).sum() + (A * 5.0).sum()).backward() or torch.tensor(1.0))
    assert B.tolist() == [[pytest.approx(-0.2, abs=1e-7), 0.0], [pytest.approx(-0.05, abs=1e-7), 0.0]]
    assert B[0, 1].item() == 0.0 and B[1, 1].item() == 0.0  # exactly
    assert torch.equal(A.detach(), torch.tensor([[0.3, -0.2], [0.1, 0.4]]))  # A: not in the mask, never written
    assert out["grad_norm"] == pytest.approx((2.0**2 + 0.5**2) ** 0.5, rel=1e-6)  # over the chosen entries only
    assert B.grad is None and A.grad is None  # the full-size gradients are dropped


def test_adamw_with_weight_decay_keeps_unchosen_entries_exactly_and_state_sized_k():
    torch.manual_seed(0)
    init = torch.randn(4, 3)  # a B that is not zero: weight decay would move every trained entry
    B = torch.nn.Parameter(init.clone())
    target = torch.randn(4, 3)
    mask = torch.zeros(4, 3, dtype=torch.bool)
    mask[0, 1] = mask[2, 0] = mask[3, 2] = True
    updater = _placed(
        {"name": "adamw", "lr": 0.05, "weight_decay": 0.5, "betas": [0.9, 0.999], "max_grad_norm": 0.0},
        mask,
        [B],
        [B_NAME],
    )

    def closure():
        loss = ((B - target) ** 2).sum()
        loss.backward()
        return loss.detach()

    grad0 = 2 * (init - target)  # the first step's gradient
    updater.step(closure)
    # AdamW's first step: p(1 - lr wd) - lr * g / (|g| + eps)
    expected = init * (1 - 0.05 * 0.5) - 0.05 * grad0 / (grad0.abs() + 1e-8)
    torch.testing.assert_close(B.detach()[mask], expected[mask], rtol=1e-6, atol=1e-7)
    for _ in range(3):
        updater.step(closure)
    assert torch.equal(B.detach()[~mask], init[~mask])  # bit-for-bit at init, weight decay included
    assert not torch.equal(B.detach()[mask], init[mask])
    state = updater.inner_updater.optimizer.state
    assert sum(s["exp_avg"].numel() for s in state.values()) == 3  # moments for the k = 3 entries only


def test_resume_loads_the_inner_state_once_the_mask_arrives_and_errors():
    B = torch.nn.Parameter(torch.zeros(2, 2))
    mask = torch.tensor([[True, False], [False, True]])
    first = _placed({"name": "adamw", "lr": 0.1}, mask, [B], [B_NAME])
    first.step(lambda: (B.sum() * 3).backward() or torch.tensor(0.0))
    saved = first.state_dict()
    second = build_spec("update", {"name": "lora_placement", "inner": {"name": "adamw", "lr": 0.1}})
    second.bind([B], 10)
    second.use_parameter_names([B_NAME])
    second.load_state_dict(saved)  # before the artifact, as a resumed run does
    with pytest.raises(RuntimeError, match="no placement yet"):
        second.step(lambda: torch.tensor(0.0))
    second.use_artifact("placement", {"masks": {B_NAME: mask}})
    (m1,), (m2,) = ([s["exp_avg"] for s in u.inner_updater.optimizer.state.values()] for u in (first, second))
    assert torch.equal(m1, m2) and second.values[0].tolist() == first.values[0].tolist()
    with pytest.raises(ConfigError, match="does not train"):
        _placed({"name": "sgd"}, mask, [B], ["other.lora_B.weight"]).use_artifact(
            "placement", {"masks": {B_NAME: mask}}
        )
    with pytest.raises(ConfigError, match="no entry"):
        _placed({"name": "sgd"}, torch.zeros(2, 2, dtype=torch.bool), [B], [B_NAME])
    with pytest.raises(ConfigError, match="shape"):
        _placed({"name": "sgd"}, torch.zeros(3, 2, dtype=torch.bool), [B], [B_NAME])


def _run(tmp_path, *overrides):
    from test_trainer import make_trainer

    return make_trainer(
        tmp_path,
        LORA,
        "eval.size=0",
        'phases=[{name="lora_placement_probe", probes=2, prompts=4, group_size=4}]',
        *overrides,
    )


@pytest.mark.parametrize("inner", ['{name="adamw", lr=1e-2, weight_decay=0.1}', '{name="sgd", lr=1.0}'])
def test_probe_phase_and_training_in_a_run(tmp_path, inner):
    """r = 2 on q_proj [128 -> 128] and v_proj [128 -> 64], 4 layers: B holds (128 + 64) * 2 * 4 = 1536
    entries, k = round(0.02 * 1536) = 31; only those move, A and the base stay at their initial values."""
    trainer = _run(tmp_path / "run", f'update={{name="lora_placement", inner={inner}}}', "train.steps=2")
    before = {n: p.detach().clone() for n, p in trainer.policy.module.named_parameters()}
    # saving merges the adapters in place; the weights are read here
    trainer.policy.save = lambda folder: __import__("os").makedirs(folder)
    Run(trainer).train()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["phases"]["placement"]
    assert summary["entries"] == 1536 and summary["k"] == 31 and sum(summary["by_module"].values()) == 31
    assert set(summary["by_module"]) == {"q_proj", "v_proj"} and sorted(summary["by_layer"]) == ["0", "1", "2", "3"]
    from groupwise.phases import load_output

    masks = load_output(tmp_path / "run" / "phases" / "placement.pt")["artifact"]["masks"]
    assert sum(int(m.sum()) for m in masks.values()) == 31
    for name, p in trainer.policy.module.named_parameters():
        if name in masks:
            # unchosen B entries: exactly 0 still
            assert torch.equal(p.detach()[~masks[name]], before[name][~masks[name]])
            assert (before[name] == 0).all()  # PEFT's B init
        else:
            assert torch.equal(p.detach(), before[name]), name  # A and the base: untouched
    moved = sum(int((p.detach() != before[n]).sum()) for n, p in trainer.policy.module.named_parameters() if n in masks)
    assert 0 < moved <= 31
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["skipped"] == 0.0 for r in rows)


def test_phase_needs_lora_and_valid_fields(tmp_path):
    from test_trainer import make_trainer

    from groupwise.phases.lora_placement_probe import LoraPlacementProbe

    with pytest.raises(ConfigError, match="score='fisher'"):
        LoraPlacementProbe(score="fisher")
    with pytest.raises(ConfigError, match="group_size=1"):
        LoraPlacementProbe(group_size=1)
    trainer = make_trainer(
        tmp_path / "nolora",
        "eval.size=0",
        "train.steps=1",
        'phases=[{name="lora_placement_probe", probes=1, prompts=2}]',
        'update={name="lora_placement", inner="sgd"}',
    )
    with pytest.raises(ConfigError, match="no trainable LoRA-B"):
        Run(trainer).train()
    with pytest.raises(ConfigError, match="needs the artifact 'placement'"):
        make_trainer(tmp_path / "nophase", LORA, "eval.size=0", 'update={name="lora_placement", inner="sgd"}')


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_composes_with_ppo_clip_and_gspo(tmp_path, objective):
    from helpers import train_recorded

    rows, _ = train_recorded(
        tmp_path,
        objective,
        LORA,
        'phases=[{name="lora_placement_probe", probes=2, prompts=4, group_size=4}]',
        'update={name="lora_placement", inner={name="adamw", lr=1e-2}}',
    )
    assert all(r["skipped"] == 0.0 for r in rows)


def test_sft_probe_mask_is_the_top_k_of_the_gradient_worked_out_apart(tmp_path):
    """One SFT probe of 3 rows: the net score is |g| of the teacher-forced cross-entropy, so the
    mask must be the top k of |∂loss/∂B| computed here independently (same rows: the phase's seeded draw)."""
    from test_trainer import make_trainer

    from groupwise.phases import PhaseContext
    from groupwise.phases.lora_placement_probe import LoraPlacementProbe
    from groupwise.phases.sft import teacher_forced
    from groupwise.updates._lora import lora_side

    trainer = make_trainer(tmp_path / "run", LORA, "eval.size=0")
    policy, rows = trainer.policy, trainer.train_rows
    ctx = PhaseContext(policy, rows, [], 0, trainer.prompts, None, lambda line: None)
    out = LoraPlacementProbe(probes=1, prompts=3, objective="sft", k=20)(ctx)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))[:3].tolist()
    batch = teacher_forced(
        [trainer.prompts("train", rows, i) for i in order],
        [policy.encode_completion(str(rows[i]["answer"])) for i in order],
    )
    logp = policy.forward(batch, ["logp"])["logp"]  # [3,1,T]
    (-(logp * batch.mask).sum() / batch.mask.sum()).backward()
    named = [(n, p) for n, p in zip(policy.parameter_names(), policy.parameters()) if lora_side(n) == "B"]
    g = torch.cat([p.grad.reshape(-1) for _, p in named]).abs()  # [P]
    expected = torch.zeros_like(g, dtype=torch.bool)
    expected[torch.sort(-g.double(), stable=True).indices[:20]] = True
    got = torch.cat([out["masks"][n].reshape(-1) for n, _ in named])
    assert torch.equal(got, expected) and out["k"] == 20 and out["summary"]["objective"] == "sft"
    assert (
        out["summary"]["eff_rank"] == pytest.approx(1.0)
        and out["summary"]["mean_cos"] is None
        and out["summary"]["probe_reward"] is None
    )  # one probe: rank 1


def test_a_resumed_placement_run_equals_the_uninterrupted_one(tmp_path):
    """1 step, then resumed to 2 (the artifact and the inner AdamW state reloaded from the run folder)
    against 2 steps in one go: the same merged weights, bit for bit."""
    from safetensors.torch import load_file

    update = 'update={name="lora_placement", inner={name="adamw", lr=1e-2, weight_decay=0.1}}'
    Run(_run(tmp_path / "whole", update, "train.steps=2")).train()
    Run(_run(tmp_path / "cut", update, "train.steps=1")).train()
    resumed = _run(tmp_path / "cut", update, "train.steps=2")
    Run(resumed).train(resume_allow=["train.steps"])
    assert resumed.updater._placed and resumed.step == 2
    whole, cut = (load_file(tmp_path / name / "final" / "model.safetensors") for name in ("whole", "cut"))
    assert whole.keys() == cut.keys() and all(torch.equal(whole[k], cut[k]) for k in whole)
    first = json.loads((tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()[1])
    again = json.loads((tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()[1])
    assert first["loss"] == again["loss"] and first["grad_norm"] == again["grad_norm"]
