"""Paper 28, the sparse-to-dense bridge: the `nano` student, the phase `fkl_warmup`, the term `opd` and
the shaper `opd_token` (spec 28's hand numbers), and the bridge recipe as one run."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from groupwise.models.build import PRESETS, build_model, count_parameters
from groupwise.policy.lm import DEFAULT_MODEL, resolve_model_path

STUDENT_SHA256 = "cb44c10ca51144b81723a39bd926395292ec5124976fb2c783384b48b6d9fb02"
TEACHER_RL_SHA256 = "bf48456e72ca5ac1ad00441eda59f90cf04e4688dc8ca231ddcf1c3257804336"


# ---------------------------------------------------------------------------------------------- the nano student
def test_nano_preset_is_the_shipped_student_with_the_default_tokenizer():
    """hidden 64, 2 layers; 119,104 parameters with the 319-token vocabulary: embedding 319·64 = 20,416,
    per layer q 64·64 + k 64·32 + v 64·32 + o 64·64 = 12,288, MLP 3·64·192 = 36,864, norms 64·2 + q/k norms
    16·2 = 160 → 49,312 per layer, two layers 98,624, final norm 64: 20,416 + 98,624 + 64 = 119,104."""
    assert PRESETS["nano"]["hidden_size"] == 64 and PRESETS["nano"]["num_hidden_layers"] == 2
    assert count_parameters(build_model(319, "nano")) == 119_104
    path = resolve_model_path("student")
    assert path == str(DEFAULT_MODEL.parent / "student")
    weights = DEFAULT_MODEL.parent / "student" / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == STUDENT_SHA256
    record = json.loads((DEFAULT_MODEL.parent / "student" / "warmstart.json").read_text())
    assert record["preset"] == "nano" and record["parameters"] == 119_104
    same = [json.loads((DEFAULT_MODEL.parent / name / "tokenizer.json").read_text()) for name in ("student", "default")]
    assert same[0]["model"]["vocab"] == same[1]["model"]["vocab"]


def test_the_shipped_student_scores_its_recorded_accuracy():
    """Greedy accuracy on the first 100 test prompts is the record's (12 %): the folder is the warm start's output."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from groupwise.models.warmstart import greedy_accuracy, load_rows

    path = resolve_model_path("student")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    record = json.loads((DEFAULT_MODEL.parent / "student" / "warmstart.json").read_text())
    rows = load_rows(["arithmetic"], "test", 500, 0)[:100]
    assert math.isclose(greedy_accuracy(model, tokenizer, rows, 5), record["test_greedy_accuracy_first_100"])
    assert record["test_greedy_accuracy_first_100"] == 0.12


def test_the_pinned_rl_teacher_is_the_recorded_run_and_beats_the_student():
    """`models/teacher_rl` (the claim's teacher: the demo's GRPO on `default` with 256 labelled rows, 150 steps,
    seed 0; command in build.json) has the pinned sha256 and its recorded held-out greedy accuracy: 49.4 % on
    the 500 test prompts (50 % on the first 100), against 28.8 % for `default` and 16.0 % for the student."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from groupwise.models.warmstart import greedy_accuracy, load_rows

    folder = DEFAULT_MODEL.parent / "teacher_rl"
    assert hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest() == TEACHER_RL_SHA256
    record = json.loads((folder / "build.json").read_text())
    assert record["label_budget_train_rows"] == 256 and record["held_out_greedy_accuracy_after"] == 0.494
    path = resolve_model_path("teacher_rl")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    rows = load_rows(["arithmetic"], "test", 500, 0)[:100]
    assert greedy_accuracy(model, tokenizer, rows, 5) == 0.5


# ---------------------------------------------------------------------------------------------- spec 28's hand numbers
# One position, two tokens: p_T = [0.5, 0.5], p_S = [0.25, 0.75] (logits = their logs).
P_T, P_S = torch.tensor([0.5, 0.5]), torch.tensor([0.25, 0.75])


def _one_position(p: torch.Tensor, grad: bool = False) -> torch.Tensor:
    return p.log().reshape(1, 1, 2).clone().requires_grad_(grad)  # [N=1,T=1,V=2]


def test_forward_and_reverse_kl_and_the_forward_kl_gradient():
    """KL(p_T‖p_S) = .5 ln(.5/.25) + .5 ln(.5/.75) = .346574 − .202733 = 0.143841;
    KL(p_S‖p_T) = .25 ln(.25/.5) + .75 ln(.75/.5) = −.173287 + .304099 = 0.130812;
    ∂L_FKL/∂logits_S = p_S − p_T = [−0.25, 0.25]."""
    from groupwise.losses.opd import forward_kl_loss, reverse_kl_loss

    mask = torch.ones(1, 1, dtype=torch.bool)
    student = _one_position(P_S, grad=True)
    fkl = forward_kl_loss(student, _one_position(P_T), mask)
    assert math.isclose(float(fkl.detach()), 0.143841, abs_tol=1e-6)
    assert math.isclose(float(reverse_kl_loss(student, _one_position(P_T), mask).detach()), 0.130812, abs_tol=1e-6)
    (grad,) = torch.autograd.grad(fkl, student)
    torch.testing.assert_close(grad[0, 0], torch.tensor([-0.25, 0.25]), atol=1e-6, rtol=0)


def test_opd_token_reward_is_ln2_when_the_teacher_likes_the_token_more():
    """log p_T(y) = ln .5, log p_S(y) = ln .25 → r = ln 2 = 0.693147; a masked position gives 0."""
    from groupwise.losses.opd import opd_token_rewards

    r = opd_token_rewards(
        torch.tensor([[math.log(0.25), 5.0]]), torch.tensor([[math.log(0.5), -9.0]]), torch.tensor([[True, False]])
    )
    torch.testing.assert_close(r, torch.tensor([[math.log(2.0), 0.0]]))
    assert math.isclose(float(r[0, 0]), 0.693147, abs_tol=1e-6)


def test_sum_to_go_discounts_over_the_row_and_skips_padding():
    """r = [1, 2, 3, pad 7], γ = 0.5: Â = [1 + .5·2 + .25·3, 2 + .5·3, 3, 0] = [2.75, 3.5, 3, 0]; γ = 0: Â = r."""
    from groupwise.losses.opd import sum_to_go

    r, mask = torch.tensor([[1.0, 2.0, 3.0, 7.0]]), torch.tensor([[True, True, True, False]])
    torch.testing.assert_close(sum_to_go(r, mask, 0.5), torch.tensor([[2.75, 3.5, 3.0, 0.0]]))
    torch.testing.assert_close(sum_to_go(r, mask, 0.0), torch.tensor([[1.0, 2.0, 3.0, 0.0]]))
    torch.testing.assert_close(sum_to_go(r, mask, 1.0), torch.tensor([[6.0, 5.0, 3.0, 0.0]]))


def _opd_batch(form: str):
    """One group of two rows, two tokens each; row 1's second token is padding. The student's and the
    teacher's distributions at every position are p_S and p_T above; the sampled tokens are id 0."""
    from groupwise.types import Need, Rollout

    mask = torch.tensor([[[True, True], [True, False]]])  # [1,2,2]
    ro = Rollout(
        prompt_ids=[[1]],
        actions=torch.zeros(1, 2, 2, dtype=torch.long),
        mask=mask,
        group_valid=torch.ones(1, 2, dtype=torch.bool),
        truncated=torch.zeros(1, 2, dtype=torch.bool),
        prompt_index=torch.arange(1),
        rewards=torch.zeros(1, 2),
        advantages=torch.zeros(1, 2),
        logp_old=torch.full((1, 2, 2), math.log(0.25)),
    )
    ro.set_extra(Need("logprobs", model="teacher").key, P_T.log().expand(1, 2, 2, 2).clone(), "token")
    ro.set_extra(Need("logp", model="teacher").key, torch.full((1, 2, 2), math.log(0.5)), "token")
    logits = P_S.log().expand(1, 2, 2, 2).clone().requires_grad_(True)  # [1,2,2,V]
    out = {"logprobs": logits.log_softmax(-1), "logp": logits.log_softmax(-1)[..., 0]}
    return ro, out, logits


def test_opd_full_form_is_the_reverse_kl_per_token_with_its_exact_gradient():
    """ℓ_t = 0.130812 on the three real tokens, 0 on padding. ∂ℓ/∂logits_S = p_S ⊙ (log(p_S/p_T) − KL)
    = [.25·(−.693147 − .130812), .75·(.405465 − .130812)] = [−0.205990, 0.205990]; padding gets 0."""
    from groupwise.losses.opd import OPD
    from groupwise.types import StepInfo

    ro, out, logits = _opd_batch("full")
    loss = OPD(form="full")(ro, out, StepInfo(step=0, seed=0, max_new_tokens=2))  # [1,2,2]
    torch.testing.assert_close(loss, torch.tensor([[[0.130812, 0.130812], [0.130812, 0.0]]]), atol=1e-6, rtol=0)
    (grad,) = torch.autograd.grad(loss.sum(), logits)
    torch.testing.assert_close(grad[0, 0, 0], torch.tensor([-0.205990, 0.205990]), atol=1e-6, rtol=0)
    assert (grad[0, 1, 1] == 0).all()


def test_opd_sampled_form_equals_the_shaper_with_reinforce():
    """r_t = ln 2 on every real token. γ = 0: ℓ_t = −ln 2 · log p_S(y_t), ∂ℓ/∂logp = −0.693147.
    γ = 0.5: row 0 Â = [ln 2 + .5 ln 2, ln 2] = [1.039721, 0.693147]; row 1 Â = [ln 2]. The shaper
    `opd_token` (mode replace) with `reinforce` gives the same per-token loss and gradient."""
    from groupwise.advantages.opd_token import OPDToken
    from groupwise.losses.opd import OPD
    from groupwise.losses.reinforce import Reinforce
    from groupwise.types import StepInfo

    info = StepInfo(step=0, seed=0, max_new_tokens=2)
    for discount, expected in (
        (0.0, [[0.693147, 0.693147], [0.693147, 0.0]]),
        (0.5, [[1.039721, 0.693147], [0.693147, 0.0]]),
    ):
        ro, out, _ = _opd_batch("sampled")
        (grad,) = torch.autograd.grad(OPD(form="sampled", discount=discount)(ro, out, info).sum(), out["logp"])
        torch.testing.assert_close(-grad[0], torch.tensor(expected), atol=1e-6, rtol=0)
        ro2, out2, _ = _opd_batch("sampled")
        shaped = OPDToken(discount=discount)(ro2, info)  # [1,2,2]
        torch.testing.assert_close(shaped[0], torch.tensor(expected), atol=1e-6, rtol=0)
        ro2.advantages = shaped
        (grad2,) = torch.autograd.grad(Reinforce()(ro2, out2, info).sum(), out2["logp"])
        torch.testing.assert_close(grad2, grad)


def test_opd_token_add_mode_keeps_the_sparse_advantage():
    """mode add: A_t = A_i + coef·r_t = 1 + 2·ln 2 = 2.386294 on real tokens, 0 on padding."""
    from groupwise.advantages.opd_token import OPDToken
    from groupwise.types import StepInfo

    ro, _, _ = _opd_batch("sampled")
    ro.advantages = torch.ones(1, 2)
    adv = OPDToken(mode="add", coef=2.0)(ro, StepInfo(step=0, seed=0, max_new_tokens=2))
    torch.testing.assert_close(adv[0], torch.tensor([[2.386294, 2.386294], [2.386294, 0.0]]), atol=1e-6, rtol=0)


def test_topk_teacher_renormalises_its_k_largest_entries():
    """p_T = [.5, .3, .2], k = 2 → [.5/.8, .3/.8, 0] = [0.625, 0.375, 0]; FKL to p_S = [.5, .25, .25] is
    .625 ln(.625/.5) + .375 ln(.375/.25) = .625 ln 1.25 + .375 ln 1.5 = .139465 + .152049 = 0.291514
    (the dropped entry adds 0)."""
    from groupwise.phases.fkl_warmup import forward_kl_tokens, topk_teacher

    kept = topk_teacher(torch.tensor([0.5, 0.3, 0.2]).log(), 2)
    torch.testing.assert_close(kept.exp(), torch.tensor([0.625, 0.375, 0.0]))
    student = torch.tensor([0.5, 0.25, 0.25]).log().requires_grad_(True)
    ell = forward_kl_tokens(student, kept, torch.tensor(True))
    assert math.isclose(float(ell.detach()), 0.291514, abs_tol=1e-6)
    (grad,) = torch.autograd.grad(ell, student)
    assert torch.isfinite(grad).all()


def test_bad_options_name_the_fix():
    import pytest

    from groupwise.advantages.opd_token import OPDToken
    from groupwise.errors import ConfigError
    from groupwise.losses.opd import OPD
    from groupwise.phases.fkl_warmup import FKLWarmup

    with pytest.raises(ValueError, match="form must be one of full, sampled"):
        OPD(form="topk")
    with pytest.raises(ValueError, match="frozen role"):
        OPD(teacher="policy")
    with pytest.raises(ValueError, match="discount must be in"):
        OPDToken(discount=2.0)
    with pytest.raises(ConfigError, match="form='x' is not one of full, topk, sampled"):
        FKLWarmup(form="x")


# ---------------------------------------------------------------------------------------------- the bridge as one run
def _bridge(tmp_path, *extra):
    from groupwise.build import build
    from groupwise.config import load_config
    from groupwise.run import Run
    from groupwise.trainer import Trainer

    cfg, _ = load_config(
        "sparse_to_dense_inferred",
        [
            "threads=1",
            "train.steps=2",
            "eval.size=0",
            "rollout.prompts_per_step=4",
            "rollout.group_size=2",
            'phases=[{name="fkl_warmup", steps=5, prompts_per_step=8, kl_prompts=8, kl_samples=2}]',
            f'out="{tmp_path}"',
            *extra,
        ],
    )
    return Run(Trainer(build(cfg))).train()


def test_the_bridge_runs_as_one_run_and_the_warmup_lowers_the_forward_kl(tmp_path):
    """The phase reads no label and draws 5 steps × 8 prompts (40 draws of distinct rows: one epoch of the
    9,000 train rows has room); the forward KL on the teacher's samples of the 8 probe prompts falls
    (what it minimises); the RL steps log the OPD term's reverse KL, equal to its loss under token_mean."""
    summary = _bridge(tmp_path)
    phase = summary["phases"]["fkl_warmup"]
    assert phase["labels_read"] == 0 and phase["prompts_drawn"] == 40 and phase["steps"] == 5
    assert phase["fkl_after"] < phase["fkl_before"], phase
    assert all(math.isfinite(phase[k]) and phase[k] > 0 for k in ("kl_before", "kl_after"))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isclose(r["loss"], r["opd_rkl"], rel_tol=1e-5) for r in rows)


def test_a_missing_teacher_role_is_named_with_the_fix(tmp_path):
    import pytest

    from groupwise.errors import ConfigError

    with pytest.raises(ConfigError, match="teacher"):
        _bridge(tmp_path, "roles={}")


@pytest.mark.slow  # three short runs (~25 s on a busy 2-core machine)
def test_the_pipeline_spends_labels_on_the_teacher_only(tmp_path):
    """`pipelines/sparse_to_dense.toml` with 2 steps per stage: teacher_rl's rewards read labels of the
    rows it drew (2 steps × 4 prompts, within its 256-row budget); the bridge loads teacher_rl's final
    weights (the sha256 the ledger records for both) and reads no label (rewards at weight 0, a label-free
    phase: every train row counted as unlabelled); no stage touches a held-out row."""
    from groupwise import cli

    args = [
        "pipeline",
        "sparse_to_dense",
        "--out",
        str(tmp_path),
        "--seed",
        "0",
        "threads=1",
        "train.steps=2",
        "eval.size=20",
        "rollout.prompts_per_step=4",
        "student_rl:train.steps=0",
        'bridge:phases=[{name="fkl_warmup", steps=2, prompts_per_step=4, kl_prompts=4, kl_samples=2}]',
    ]
    assert cli.main(args) == 0
    stages = {s["name"]: s for s in json.loads((tmp_path / "pipeline.json").read_text())["stages"]}
    teacher, bridge = stages["teacher_rl"], stages["bridge"]
    assert teacher["ledger"]["labelled"]["rows"] == 8 and max(teacher["ledger"]["labelled"]["indices"]) < 256
    assert bridge["loaded"]["roles.teacher.model.path"] == teacher["final_sha256"]
    assert bridge["ledger"]["labelled"]["rows"] == 0 and bridge["ledger"]["reward_weights"] == [0.0]
    assert bridge["ledger"]["unlabelled"]["rows"] == bridge["ledger"]["train_rows"] > 256
    assert all(s["ledger"]["held_out_overlap"] == 0 for s in stages.values())


def test_fkl_warmup_loss_forms_on_a_stub_student():
    """One row of two tokens plus a padded one (mask [1, 1, 0]); the student puts p_S = [.25, .75] at every
    position, the teacher p_T = [.5, .5], the sampled tokens are id 0. full: the token mean of
    KL(p_T‖p_S) = 0.143841; sampled: −mean log p_S(y_t) = ln 4 = 1.386294; topk with k = 1 keeps p_T = [1, 0]:
    KL = ln(1/.25) = 1.386294 as well. Padding adds nothing."""
    from types import SimpleNamespace

    from groupwise.phases.fkl_warmup import FKLWarmup, topk_teacher

    logits = P_S.log().expand(1, 1, 3, 2).clone().requires_grad_(True)  # [1,1,3,V]

    class Stub:
        def forward(self, roll, quantities):
            logprobs = logits.log_softmax(-1)
            return {"logprobs": logprobs, "logp": logprobs[..., 0]}

    roll = SimpleNamespace(mask=torch.tensor([[[True, True, False]]]), group_valid=torch.ones(1, 1, dtype=torch.bool))
    teacher = P_T.log().expand(1, 1, 3, 2).clone()
    cases = (
        ("full", teacher, 0.143841),
        ("sampled", None, math.log(4.0)),
        ("topk", topk_teacher(teacher, 1), math.log(4.0)),
    )
    for form, target, expected in cases:
        loss = FKLWarmup(form=form, topk=1)._loss(Stub(), roll, target)
        assert math.isclose(float(loss), expected, abs_tol=1e-6), form
