"""This session's variant recipes under data parallel: one step over 2 ranks (torchrun, gloo) equals
one process — same loss and, after one SGD step of lr 1, the same weights. The offline phases (DISA's
frozen log Z table, LoRA placement's trained-entry mask, E²PO's prompt perturbations, VSPO's steering
vector, PAIR's probe) run on every rank with the same seeds, so their artifacts must come out the
same (every rank then uses rank 0's; a rank whose own differs would say so, which fails here);
the rest checks the rollout strategies, rewards, advantages
and terms of each recipe at world size 2 (sft warm starts are dropped: ``phases=[]``). la_grpo and
rubricem are left out: without their warm start one step has no gradient (no functional tokens, no
stage tags); their components are in the registry's world-size sweep (tests/test_dist_scope.py)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.dist  # launches torchrun

COMMON = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "train.steps=1",
    "eval.size=0",
    "eval.samples=0",
    "threads=1",
    "train.max_seconds=0",
]
SGD = 'update={name="sgd", lr=1.0}'
CASES = {
    "disa": ['phases=[{name="disa_logz", beta=15.0, samples=4, temperature=1.2}]', "data.train_size=8", SGD],
    "lora_placement": [
        'phases=[{name="lora_placement_probe", probes=2, score="net", fraction=0.02, per_module=false, '
        "prompts=4, group_size=4, max_new_tokens=6}]",
        'update.inner={name="sgd", lr=1.0}',
    ],
    "lora_rank_allocation": ['update.inner={name="sgd", lr=1.0}'],
    "pair_grpo": [SGD],
    "hard_pair": [SGD],
    "ssopd": [SGD],
    "dgpo": ["phases=[]", SGD],
    "streampro": ["phases=[]", SGD],
    "dpa_grpo_inferred": ["phases=[]", SGD],  # forced-prefix rows, pair groups, row-filtered KL terms (issue 41)
    "signal_reshaping": [SGD],
    "e2po": [
        'phases=[{name="e2po_perturbations", conditions=4, steps=3, '
        "lam_div=0.1, mu=0.95, eps=0.03, sigma_init=0.1, lr=0.05}]",
        "data.train_size=8",
        SGD,
    ],
    "vspo": ["data.train_size=32", SGD],
    # paper 28's bridge: the forward-KL warm-up on the teacher's samples, then the opd term (issue 42)
    "sparse_to_dense_inferred": [
        'phases=[{name="fkl_warmup", steps=2, prompts_per_step=4, kl_prompts=4, kl_samples=2}]',
        "data.train_size=8",
        SGD,
    ],
    "pair": [
        'phases=[{name="pair_probe", hidden_layer=4, attn_layers=[1, 2, 3, 4], C=0.01, prompts=8, samples=4}]',
        "data.train_size=8",
        SGD,
    ],
}
# in `make test`: a phase artifact, a wrapped updater; the others in `make test-slow`
FAST = ("disa", "lora_placement")


def _run(cmd, args, out):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [*cmd, "train", *args, *COMMON, f"out={out}"], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # each phase itself is rank-independent (phases.same_on_every_rank)
    assert "the ranks computed different artifacts" not in result.stderr
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0]), load_file(
        out / "final" / "model.safetensors"
    )


@pytest.mark.parametrize("recipe", [r if r in FAST else pytest.param(r, marks=pytest.mark.slow) for r in CASES])
def test_recipe_step_under_two_ranks_equals_one_process(recipe, tmp_path):
    args = [recipe, *CASES[recipe]]
    one_row, one = _run([sys.executable, "-m", "groupwise"], args, tmp_path / "one")
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "groupwise",
    ]
    two_row, two = _run(torchrun, args, tmp_path / "two")
    assert one_row["grad_norm"] > 0  # a step with a gradient: the comparison means something
    assert abs(one_row["loss"] - two_row["loss"]) < 1e-6, (one_row["loss"], two_row["loss"])
    assert abs(one_row["grad_norm"] - two_row["grad_norm"]) < 1e-5 * max(1.0, one_row["grad_norm"])
    for name, weight in one.items():
        torch.testing.assert_close(two[name], weight, atol=1e-6, rtol=1e-5, msg=name)
