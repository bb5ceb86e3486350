"""Offline phases under data parallel: a run whose components read a phase's artifact (DISA's
frozen log Z table, LoRA placement's trained-entry mask, whose updater wraps another) over 2 ranks
(torchrun, gloo) equals one process — same loss and, after one SGD step of lr 1, the same weights.
Every rank runs the phase itself with the same seeds, so the artifact must come out the same."""

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

COMMON = ["rollout.prompts_per_step=4", "rollout.group_size=4", "train.steps=1", "eval.size=0", "eval.samples=0", "threads=1",
          "train.max_seconds=0"]
CASES = {
    "disa": ["disa", 'phases=[{name="disa_logz", beta=15.0, samples=4, temperature=1.2}]', "data.train_size=8",
             'update={name="sgd", lr=1.0}'],
    "lora_placement": ["lora_placement", 'phases=[{name="lora_placement_probe", probes=2, score="net", fraction=0.02, per_module=false, '
                       'prompts=4, group_size=4, max_new_tokens=6}]', 'update.inner={name="sgd", lr=1.0}'],
}


def _run(cmd, args, out):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([*cmd, "train", *args, *COMMON, f"out={out}"], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0]), load_file(out / "final" / "model.safetensors")


def _compare(case, tmp_path):
    one_row, one = _run([sys.executable, "-m", "groupwise"], CASES[case], tmp_path / "one")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "groupwise"]
    two_row, two = _run(torchrun, CASES[case], tmp_path / "two")
    assert one_row["grad_norm"] > 0  # a step with a gradient: the comparison means something
    assert abs(one_row["loss"] - two_row["loss"]) < 1e-6, (one_row["loss"], two_row["loss"])
    assert abs(one_row["grad_norm"] - two_row["grad_norm"]) < 1e-5 * max(1.0, one_row["grad_norm"])
    for name, weight in one.items():
        torch.testing.assert_close(two[name], weight, atol=1e-6, rtol=1e-5, msg=name)


def test_disa_phase_and_objective_under_two_ranks_equal_one_process(tmp_path):
    _compare("disa", tmp_path)


def test_lora_placement_probe_and_masked_update_under_two_ranks_equal_one_process(tmp_path):
    _compare("lora_placement", tmp_path)
