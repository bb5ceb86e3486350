"""Exact resume across process deaths: SIGKILL at seeded random moments, SIGTERM (preemption) and a
crash in the middle of a checkpoint write all end with final weights bit-identical (sha256) to an
uninterrupted run. Slow (many process starts): `make test-slow`."""

import hashlib
import os
import random
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

MODEL = os.environ.get("GROUPWISE_TEST_MODEL", "default")
ARGS = ["train", "demo", "train.steps=12", "checkpoint.every=1", "eval.size=20", "rollout.prompts_per_step=16", "threads=1", f'model.path="{MODEL}"']
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def start(out, **env):
    return subprocess.Popen([sys.executable, "-m", "groupwise", *ARGS, f"out={out}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**ENV, **env})


def final_sha(out):
    return hashlib.sha256((out / "final" / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    proc = start(out)
    assert proc.wait(timeout=600) == 0, proc.stderr.read().decode()[-2000:]
    return final_sha(out)


def test_sigkill_at_random_moments(tmp_path, reference):
    rng = random.Random(20261202)
    kills, launches = 0, 0
    while True:
        proc = start(tmp_path)
        launches += 1
        if kills < 10:
            delay = rng.uniform(3.0, 9.0)  # past start-up (imports), into generation / backward / checkpointing
            try:
                proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
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
        seen = len((tmp_path / "metrics.jsonl").read_text().splitlines()) if (tmp_path / "metrics.jsonl").exists() else 0
        proc = start(tmp_path)
        while proc.poll() is None:  # wait until this launch has trained a step: the handler is installed
            lines = (tmp_path / "metrics.jsonl").read_text().splitlines() if (tmp_path / "metrics.jsonl").exists() else []
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
