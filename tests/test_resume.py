"""Exact resume across process deaths: SIGKILL at seeded random moments, SIGTERM (preemption) and a
crash in the middle of a checkpoint write all end with final weights bit-identical (sha256) to an
uninterrupted run. Slow (many process starts): `make test-slow`."""

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

MODEL = os.environ.get("GROUPWISE_TEST_MODEL", "default")
ARGS = [
    "train",
    "demo",
    "train.steps=12",
    "checkpoint.every=1",
    "eval.size=20",
    "rollout.prompts_per_step=16",
    "threads=1",
    f'model.path="{MODEL}"',
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def start(out, *extra, **env):
    return subprocess.Popen(
        [sys.executable, "-m", "groupwise", *ARGS, *extra, f"out={out}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**ENV, **env},
    )


def final_sha(out):
    return hashlib.sha256((out / "final" / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    t0 = time.monotonic()
    proc = start(out)
    while proc.poll() is None and not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text()):
        time.sleep(0.02)
    first_step = time.monotonic() - t0
    assert proc.wait(timeout=600) == 0, proc.stderr.read().decode()[-2000:]
    TIMING.update(first_step=first_step, training=time.monotonic() - t0 - first_step)
    return final_sha(out)


TIMING: dict[str, float] = {}  # the uninterrupted run on this machine: start-up to its first step, then the training


def kill_at_random_moment(proc, out, rng, timing=TIMING) -> bool:
    """SIGKILL ``proc`` at a seeded random moment: a third of the time during start-up (loading,
    resuming), otherwise within the step after the next one is logged (generation, backward,
    checkpointing), so each launch advances about a step and ten kills land before the run ends on
    any machine (a fixed 3–9 s let a fast CPU finish after two). False if it ended first."""
    log = out / "metrics.jsonl"
    if rng.random() < 1 / 3:
        deadline = time.monotonic() + rng.uniform(0.3, timing["first_step"])
    else:
        seen = log.read_text().count("\n") if log.exists() else 0
        while proc.poll() is None and not (log.exists() and log.read_text().count("\n") > seen):
            time.sleep(0.01)
        deadline = time.monotonic() + rng.uniform(0.0, timing["training"] / 12)  # within about one step
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        return False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return True


def test_sigkill_at_random_moments(tmp_path, reference):
    rng = random.Random(20261202)
    kills, launches = 0, 0
    while True:
        proc = start(tmp_path)
        launches += 1
        if kills < 10 and kill_at_random_moment(proc, tmp_path, rng):
            kills += 1
            continue
        assert proc.wait(timeout=600) == 0, proc.stderr.read().decode()[-2000:]
        if (tmp_path / "final" / "model.safetensors").exists():
            break
    print(f"{kills} SIGKILLs over {launches} launches")
    assert kills >= 10
    assert final_sha(tmp_path) == reference


def test_sigterm_checkpoints_and_resumes(tmp_path, reference):
    terms = 0
    for delay in (0.2, 0.6, 1.0):
        seen = (
            len((tmp_path / "metrics.jsonl").read_text().splitlines()) if (tmp_path / "metrics.jsonl").exists() else 0
        )
        proc = start(tmp_path)
        while proc.poll() is None:  # wait until this launch has trained a step: the handler is installed
            lines = (
                (tmp_path / "metrics.jsonl").read_text().splitlines() if (tmp_path / "metrics.jsonl").exists() else []
            )
            if len(lines) > seen or (lines and seen == 0):
                break
            time.sleep(0.05)
        time.sleep(delay)
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()[-2000:]  # clean exit after a checkpoint
        terms += 1
    proc = start(tmp_path)
    assert proc.wait(timeout=600) == 0, proc.stderr.read().decode()[-2000:]
    assert terms >= 2 and final_sha(tmp_path) == reference


@pytest.mark.parametrize("point", ["checkpoint.before_marker", "checkpoint.before_rename"])
def test_crash_while_saving_never_loads_a_partial_checkpoint(tmp_path, reference, point):
    proc = start(tmp_path, GROUPWISE_FAULT=point)
    assert proc.wait(timeout=600) == -signal.SIGKILL
    assert list((tmp_path / "checkpoints").glob(".tmp_*")), "the crash left its temporary folder behind"
    assert not list((tmp_path / "checkpoints").glob("step_*")), "nothing was published"
    proc = start(tmp_path)
    assert proc.wait(timeout=600) == 0, proc.stderr.read().decode()[-2000:]
    assert final_sha(tmp_path) == reference


def test_ctrl_c_checkpoints_and_the_rerun_says_it_resumes(tmp_path):
    """SIGINT (Ctrl-C) does what SIGTERM does; the rerun of the same command names the step and the
    checkpoint it resumes from. Before: Ctrl-C raised KeyboardInterrupt mid-step and lost the steps
    since the last checkpoint (with checkpoint.every=0, the whole run)."""
    long_run = ("train.steps=200", "checkpoint.every=0")  # long enough to be interrupted mid-run
    proc = start(tmp_path, *long_run)
    while proc.poll() is None and not (
        (tmp_path / "metrics.jsonl").exists() and (tmp_path / "metrics.jsonl").read_text().count("\n") >= 2
    ):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0
    assert re.search(r"stopped by SIGINT at step (\d+)", proc.stderr.read().decode())
    stopped = checkpoint_step(tmp_path)
    assert 2 <= stopped < 200
    proc = start(tmp_path, *long_run, "train.max_seconds=3")
    assert proc.wait(timeout=600) == 2  # max_seconds differs from the stored run: refused, naming it
    assert re.search(r"train.max_seconds: 3600 -> 3\b", proc.stderr.read().decode())
    proc = start(tmp_path, *long_run)
    while proc.poll() is None and not (tmp_path / "metrics.jsonl").read_text().count("\n") > stopped:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    assert re.search(
        rf"resuming .* from step {stopped} \(checkpoint checkpoints/step_0*{stopped}\)", proc.stderr.read().decode()
    )
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(len(steps))) and len(steps) > stopped  # every step once, in order


def checkpoint_step(out):
    from groupwise import checkpoint

    return checkpoint.load(checkpoint.latest_intact(out))["step"]


def test_sigkill_with_keep_last_one(tmp_path, reference):
    """keep_last=1 keeps one checkpoint: killed at random moments (saves included) it must still
    resume, never restart from step 0. Before: the final save deleted the step's checkpoint before
    publishing its replacement."""
    rng = random.Random(20261203)
    kills = 0
    while True:
        proc = start(tmp_path, "checkpoint.keep_last=1")
        if kills < 6 and kill_at_random_moment(proc, tmp_path, rng):
            kills += 1
            continue
        assert proc.wait(timeout=600) == 0, proc.stderr.read().decode()[-2000:]
        if (tmp_path / "final" / "model.safetensors").exists():
            break
    print(f"keep_last=1: {kills} SIGKILLs survived")
    assert len(list((tmp_path / "checkpoints").glob("step_*"))) == 1
    assert final_sha(tmp_path) == reference


# (recipe and overrides, the final model files to compare, at most this many kills): a run with two trained models, one
# with phases before RL (an sft phase whose output is saved, then loaded on a rerun)
SETUPS = {
    "two_roles": (
        ["codistill", "rollout.prompts_per_step=8", "rollout.group_size=4"],
        ["model.safetensors", "teacher/model.safetensors"],
        6,
    ),
    "phases": (
        [
            "demo",
            "rollout.prompts_per_step=8",
            "rollout.group_size=4",
            'phases=[{name="sft", steps=40, batch_size=16}]',
        ],
        ["model.safetensors"],
        6,
    ),
    # multi-turn episodes in an environment: env tokens as loss-mask holes, per-episode seeds
    "env": (
        [
            "grow",
            "rollout.prompts_per_step=8",
            "rollout.group_size=4",
            'rollout.name="episodes"',
            "rollout.params={max_turns=16}",
            "train.max_seconds=0",
        ],
        ["model.safetensors"],
        6,
    ),
}


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_sigkill_with_roles_phases_and_environments(tmp_path, setup):
    """Every model of the run resumes bit for bit after SIGKILLs at random moments — also inside a
    phase before RL — (the checkpoint holds every role's model, optimiser and component states; a
    phase's output is saved as it completes and loaded, not redone, on a rerun)."""
    recipe, files, want_kills = SETUPS[setup]
    args = [
        "train",
        recipe[0],
        "train.steps=12",
        "checkpoint.every=1",
        "eval.size=0",
        "threads=1",
        f'model.path="{MODEL}"',
        *recipe[1:],
    ]

    def launch(out):
        return subprocess.Popen(
            [sys.executable, "-m", "groupwise", *args, f"out={out}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=ENV,
        )

    def shas(out):
        return [hashlib.sha256((out / "final" / f).read_bytes()).hexdigest() for f in files]

    t0 = time.monotonic()
    proc = launch(tmp_path / "straight")
    while proc.poll() is None and not (
        (tmp_path / "straight" / "metrics.jsonl").exists() and (tmp_path / "straight" / "metrics.jsonl").read_text()
    ):
        time.sleep(0.02)
    first = time.monotonic() - t0
    assert proc.wait(timeout=600) == 0, proc.stderr.read().decode()[-2000:]
    timing = {"first_step": first, "training": time.monotonic() - t0 - first}
    rng, kills, out = random.Random(20261204), 0, tmp_path / "killed"
    while True:
        proc = launch(out)
        if kills < want_kills and kill_at_random_moment(proc, out, rng, timing):
            kills += 1
            continue
        assert proc.wait(timeout=600) == 0, proc.stderr.read().decode()[-2000:]
        if (out / "final" / files[-1]).exists():
            break
    print(f"{setup}: {kills} SIGKILLs survived")
    assert kills >= 3, "the kills must land before the run ends"
    assert shas(out) == shas(tmp_path / "straight")
