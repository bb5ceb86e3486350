"""FSDP2 sharding (``dist.shard="fsdp2"``, issue 38): one optimiser step over 2 gloo ranks, each
holding half of every trained parameter, equals one unsharded process over the same global batch —
the same loss and gradient norm, and (SGD with lr 1: the weight change IS the gradient) every
parameter's all-gathered gradient equal within float32 rounding. Combinations sharding does not
support are refused at build, naming them."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import groupwise.models
from groupwise.build import build
from groupwise.config import load_config
from groupwise.errors import ConfigError

MODEL = os.environ.get("GROUPWISE_TEST_MODEL", "default")
ARGS = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=6",
    "train.steps=1",
    "eval.size=0",
    'update={name="sgd", lr=1.0}',
    'objective.terms=["ppo_clip", {name="kl", coef=0.1}]',  # the reference: kept whole, scored on every rank
    'advantage.estimator={name="grpo", scale="batch"}',  # needs every rank's rewards
    "threads=1",
    f'model.path="{MODEL}"',
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
SHARDED = 'dist.shard="fsdp2"'


def train(launcher: list[str], args: list[str], out: Path) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """The first metrics row and the final weights (the policy's, then each role's) of a CLI run."""
    result = subprocess.run(
        [*launcher, "-m", "groupwise", "train", *args, f"out={out}"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    folders = [out / "final"] + sorted(p for p in (out / "final").iterdir() if p.is_dir())
    return row, [load_file(folder / "model.safetensors") for folder in folders]


def assert_same_step(one: tuple, two: tuple, start: dict[str, torch.Tensor]) -> None:
    (row1, weights1), (row2, weights2) = one, two
    # the GRPO loss at ratio 1 is ~0 (advantages sum to 0 per group): compare absolutely
    assert abs(row1["loss"] - row2["loss"]) < 1e-6, (row1["loss"], row2["loss"])
    assert abs(row1["grad_norm"] - row2["grad_norm"]) < 1e-5 * max(1.0, row1["grad_norm"])
    assert len(weights1) == len(weights2)
    for w1, w2 in zip(weights1, weights2):
        assert sorted(w1) == sorted(w2)
        for name, weight in w1.items():  # w = w0 - 1.0 * grad: equal weights are equal gradients
            torch.testing.assert_close(w2[name], weight, atol=1e-6, rtol=1e-5, msg=name)
    moved = [n for n, w in weights1[0].items() if not torch.equal(w, start[n])]
    assert len(moved) == len(start), sorted(set(start) - set(moved))  # every parameter had a gradient


def default_weights() -> dict[str, torch.Tensor]:
    return load_file(Path(groupwise.models.__file__).parent / "default" / "model.safetensors")


@pytest.mark.dist
def test_fsdp2_two_ranks_equal_one_process(tmp_path):
    one = train([sys.executable], ARGS, tmp_path / "one")
    two = train(TORCHRUN, [*ARGS, SHARDED], tmp_path / "two")
    assert one[0]["reward_std"] > 0  # a step with signal: the comparison means something
    assert_same_step(one, two, default_weights())


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp2_unequal_shares_equal_one_process(tmp_path):
    """Dynamic sampling keeps 3 of the 4 groups at seed 3 (asserted): rank 0 trains on 2 groups, rank 1
    on 1, one group per micro-batch, so rank 1 runs an idle pass for every sharded collective rank 0's
    second micro-batch makes. The sharded ranks also checkpoint activations (each layer recomputed in the
    backward, inside FSDP2's gather of it). The step still equals one plain process's."""
    args = [*ARGS, "seed=3", 'sampling={name="dynamic", max_rounds=1}', "train.micro_batch_groups=1"]
    one = train([sys.executable], args, tmp_path / "one")
    assert one[0]["groups"] == 3
    two = train(TORCHRUN, [*args, SHARDED, "perf.activation_checkpointing=true"], tmp_path / "two")
    assert_same_step(one, two, default_weights())


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp2_trained_role_equals_one_process(tmp_path):
    """CoDistill's teacher, a second trained model with its own objective and optimiser, sharded as the
    policy is: both models' weights after one SGD step equal one unsharded process's."""
    args = [
        "codistill",
        'roles.teacher.update={name="sgd", lr=1.0}',
        'roles.teacher.objective={terms=["ppo_clip"]}',
        *ARGS,
    ]
    one = train([sys.executable], args, tmp_path / "one")
    two = train(TORCHRUN, [*args, SHARDED], tmp_path / "two")
    teacher_start = load_file(Path(groupwise.models.__file__).parent / "hinted" / "model.safetensors")
    assert any(not torch.equal(one[1][1][n], w) for n, w in teacher_start.items())  # the teacher took a step
    assert_same_step(one, two, default_weights())


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp2_shards_and_gathers_once_per_rollout_phase(tmp_path):
    """Each rank holds half the model (2 ranks; the 4 decoder layers' and the root's every parameter is
    a shard), the whole weights are gathered once per step (generation and the policy's no-grad
    scoring share one gather) and freed before the update."""
    args = [*ARGS, "train.steps=2", 'update={name="adamw", lr=1e-3, max_grad_norm=1.0}', SHARDED]
    driver = str(Path(__file__).parent / "fsdp_driver.py")
    result = subprocess.run([*TORCHRUN, driver, str(tmp_path), *args], capture_output=True, text=True, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["world"] == 2 and record["all_sharded"]
        # dim 0 of every parameter split in two, rank 0 taking the odd row (the 319-token embedding: 160 | 159)
        rows = [(s[0] + 1) // 2 if rank == 0 else s[0] // 2 for s in record["shapes"]]
        assert record["local_elements"] == sum(r * math.prod(s[1:]) for r, s in zip(rows, record["shapes"]))
        assert 0.49 < record["local_elements"] / sum(math.prod(s) for s in record["shapes"]) < 0.51
        assert record["gathers_at_start"] == 0
        assert record["gathers_after_step"] == [1, 2]
        assert record["copy_elements_after_step"] == [0, 0]
        assert all(r["skipped"] == 0 for r in record["rows"])
    final, start = torch.load(tmp_path / "final.pt"), default_weights()  # the whole weights, gathered
    for name, weight in start.items():
        assert final[name].shape == weight.shape and not torch.equal(final[name], weight), name


@pytest.mark.parametrize(
    "override, named",
    [
        ('model.lora={r=4, target_modules=["q_proj"]}', "model.lora"),
        ('model.matmul="bfloat16"', "model.matmul"),
        ('model.dtype="bfloat16"', "model.dtype"),
        ("model.ref_sync_every=2", "model.ref_sync_every"),
        ('phases=[{name="sft", steps=1}]', "phases"),
        ('model.policy="flow"', "model.policy"),
        ('rollout.backend="server"', "rollout.backend"),
    ],
)
def test_fsdp2_refuses_what_it_does_not_support(override, named):
    cfg, _ = load_config(None, [SHARDED, override, f'model.path="{MODEL}"'])
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")) as err:
        build(cfg)
    assert 'dist.shard="fsdp2"' in str(err.value)


def test_unknown_shard_mode_is_refused():
    with pytest.raises(ConfigError, match=r"dist\.shard.*one of none, fsdp2"):
        load_config(None, ['dist.shard="zero3"'])


# ----------------------------------------------------------------------------- sharded checkpoints
CKPT_ARGS = [
    *[a for a in ARGS if not a.startswith(("train.steps", "update="))],
    "train.steps=3",
    "checkpoint.every=1",
    "checkpoint.keep_last=3",
    'update={name="adamw", lr=1e-3, max_grad_norm=1.0}',  # moments: optimiser state that is sharded too
    SHARDED,
]


def _launch(out: Path, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [*TORCHRUN, "-m", "groupwise", "train", *args, f"out={out}"],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: a SIGKILL reaches the launcher and both ranks at once
    )


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp2_checkpoint_is_sharded_and_resumes_bit_identically_after_sigkill(tmp_path):
    """Each rank writes its own shard (torch.distributed.checkpoint); the manifest hashes every shard
    file; a 2-rank run SIGKILLed (launcher and ranks at once) once its first checkpoint is complete
    and then rerun ends with the same bytes as one never interrupted; the same checkpoint loads in one
    process, resharded, with the same weights as final/."""
    import signal
    import time

    from groupwise import checkpoint

    whole = _launch(tmp_path / "whole", CKPT_ARGS)
    assert whole.wait(timeout=600) == 0, whole.stderr.read().decode()[-3000:]

    killed = tmp_path / "killed"
    proc = _launch(killed, CKPT_ARGS)
    while proc.poll() is None and not checkpoint.complete(killed):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "final").exists()  # killed mid-run, not after it
    rerun = _launch(killed, CKPT_ARGS)
    assert rerun.wait(timeout=600) == 0, rerun.stderr.read().decode()[-3000:]
    for name in ("model.safetensors",):
        assert (killed / "final" / name).read_bytes() == (tmp_path / "whole" / "final" / name).read_bytes()
    assert (killed / "metrics.jsonl").read_text().splitlines()[-1].split('"step_seconds"')[0] == (
        (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()[-1].split('"step_seconds"')[0]
    )

    last = checkpoint.latest_intact(tmp_path / "whole")
    manifest = json.loads((last / "MANIFEST.json").read_text())
    shard_files = sorted(n for n in manifest["files"] if n.startswith("shards/"))
    assert "shards/.metadata" in shard_files
    assert sum(n.endswith(".distcp") for n in shard_files) == 2  # one file per rank
    state = checkpoint.load(last)  # one process: every sharded tensor read whole
    final = load_file(tmp_path / "whole" / "final" / "model.safetensors")
    for name, weight in final.items():
        assert torch.equal(state["policy"]["model"][name], weight), name
    moments = state["components"]["update.adamw"]["optimizer"]["state"]  # whole, one per parameter
    assert sorted(tuple(m["exp_avg"].shape) for m in moments.values()) == sorted(tuple(w.shape) for w in final.values())

    # a byte changed in one rank's shard file is found and named
    shard = last / next(n for n in shard_files if n.endswith(".distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointCorrupt, match=shard.name):
        checkpoint.verify(last)


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp2_checkpoint_resumes_in_one_process(tmp_path):
    """A run saved at 2 sharded ranks resumes in one unsharded process (resharding): it continues from
    the checkpoint's step with the checkpoint's weights (a step of SGD with lr 0 leaves them as loaded)."""
    args = [*[a for a in CKPT_ARGS if not a.startswith("train.steps")], "train.steps=2"]
    two = _launch(tmp_path, args)
    assert two.wait(timeout=600) == 0, two.stderr.read().decode()[-3000:]
    saved = load_file(tmp_path / "final" / "model.safetensors")
    more = [*[a for a in args if not a.startswith("train.steps")], "train.steps=3", "update.lr=0.0"]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "groupwise",
            "train",
            *more,
            f"out={tmp_path}",
            "--resume-allow",
            "train.steps,update.lr",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming" in result.stderr and "from step 2" in result.stderr, result.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    resumed = load_file(tmp_path / "final" / "model.safetensors")
    for name, weight in saved.items():  # lr 0 (and no weight decay at lr 0): the loaded weights unchanged
        assert torch.equal(resumed[name], weight), name


# ----------------------------------------------------------------------------- several nodes
def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


@pytest.mark.dist
@pytest.mark.slow
def test_two_nodes_of_one_process_each_equal_one_process(tmp_path):
    """Two torchrun launchers on this machine act as two nodes of one process each (``--nnodes 2``,
    c10d rendezvous on localhost, as on a cluster with the first node's address): the sharded step
    over them equals one process's, as over two processes of one launcher."""
    endpoint = f"localhost:{_free_port()}"
    out = tmp_path / "nodes"
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
            + ["--node_rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "test"]
            + ["-m", "groupwise", "train", *ARGS, SHARDED, f"out={out}"],
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for node in (0, 1)
    ]
    for launcher in launchers:
        assert launcher.wait(timeout=600) == 0, launcher.stderr.read().decode()[-3000:]
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    two = (row, [load_file(out / "final" / "model.safetensors")])
    assert_same_step(train([sys.executable], ARGS, tmp_path / "one"), two, default_weights())
