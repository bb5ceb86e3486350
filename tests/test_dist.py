"""Data parallel: one optimiser step over 2 ranks (torchrun, gloo) equals one process over the same
global batch — same loss, same gradient (SGD with lr 1 makes the weight change the gradient)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import groupwise.models

ARGS = [
    "train",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=6",
    "train.steps=1",
    "eval.size=0",
    'update={name="sgd", lr=1.0}',
    'objective.terms=["ppo_clip", {name="kl", coef=0.1}]',
    'advantage.estimator={name="grpo", scale="batch"}',  # needs every rank's rewards
    "threads=1",
    f'model.path="{os.environ.get("GROUPWISE_TEST_MODEL", "default")}"',
]


def run(cmd, out):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([*cmd, *ARGS, f"out={out}"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0]), load_file(
        out / "final" / "model.safetensors"
    )


@pytest.mark.dist
def test_two_ranks_equal_one_process(tmp_path):
    single_row, single = run([sys.executable, "-m", "groupwise"], tmp_path / "one")
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
    ddp_row, ddp = run(torchrun, tmp_path / "two")
    assert single_row["reward_mean"] != 0.0 or single_row["reward_std"] > 0  # a step with signal
    assert abs(single_row["loss"] - ddp_row["loss"]) < 1e-6, (single_row["loss"], ddp_row["loss"])
    assert abs(single_row["grad_norm"] - ddp_row["grad_norm"]) < 1e-5 * max(1.0, single_row["grad_norm"])
    for name, weight in single.items():
        torch.testing.assert_close(ddp[name], weight, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.dist
def test_two_trained_roles_under_two_ranks_equal_one_process(tmp_path):
    """A run with a second trained model (CoDistill's teacher: its own rollouts, rewards, advantage,
    objective and optimiser) over 2 ranks equals one process: both models' weights after one SGD step."""
    roles = ["codistill", 'roles.teacher.update={name="sgd", lr=1.0}', 'roles.teacher.objective={terms=["ppo_clip"]}']
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

    def run_roles(cmd, out):
        args = [ARGS[0], *roles, *ARGS[1:]]
        result = subprocess.run([*cmd, *args, f"out={out}"], capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return [load_file(out / "final" / f) for f in ("model.safetensors", "teacher/model.safetensors")]

    single = run_roles([sys.executable, "-m", "groupwise"], tmp_path / "one")
    ddp = run_roles(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "groupwise"],
        tmp_path / "two",
    )
    teacher_start = load_file(Path(groupwise.models.__file__).parent / "hinted" / "model.safetensors")
    # the teacher took a step: the comparison means something
    assert any(not torch.equal(single[1][n], w) for n, w in teacher_start.items())
    for one, two in zip(single, ddp):
        for name, weight in one.items():
            torch.testing.assert_close(two[name], weight, atol=1e-6, rtol=1e-5, msg=name)


def test_every_process_reduces_the_normalizers_in_one_order():
    """The normalizers are all-reduced one tensor per aggregation, in dict order: that order must not
    follow the per-process string hash (a set), or two ranks sum one aggregation's row count into the
    other's group count (ConSPO's group_mean next to the KL term's seq_mean_token_mean did at world size 2)."""
    code = (
        "from groupwise.objective import Objective; print(list(Objective.from_config(['conspo', "
        "'lpo', {'name': 'kl', 'agg': 'token_mean'}], 'seq_mean_token_mean').aggregations))"
    )
    orders = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        ).stdout.strip()
        for seed in range(6)
    }
    assert orders == {str(["group_mean", "seq_mean_token_mean", "token_mean"])}, orders
