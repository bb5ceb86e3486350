"""Data parallel stops (issue 12, item 12): `train.max_seconds` and SIGTERM are decided by all ranks
together, so every rank stops at the same step and the checkpoint is written; a killed launcher
leaves no worker running. Before: each rank read its own clock and its own signal flag, so one
rank left the loop while the other waited in a collective for ever (5 of 10 runs on the time
limit, 3 of 16 on SIGTERM). Slow: many two-process runs (`make test-slow`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from groupwise import checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.dist]

MODEL = os.environ.get("GROUPWISE_TEST_MODEL", "default")
ARGS = [
    "train",
    "demo",
    "train.steps=400",
    "eval.size=0",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "threads=1",
    f'model.path="{MODEL}"',
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "groupwise"]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*TORCHRUN, *ARGS, f"out={out}", *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=ENV,
        start_new_session=True,
    )


def _wait_for_steps(out: Path, n: int, proc: subprocess.Popen, limit: float = 120.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit and proc.poll() is None:
        log = out / "metrics.jsonl"
        if log.exists() and len(log.read_text().splitlines()) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"no {n} steps logged in {limit} s")


def test_time_limit_stops_every_rank_at_the_same_step(tmp_path):
    clean = 0
    for attempt in range(5):
        out = tmp_path / f"run{attempt}"
        proc = _start(out, f"train.max_seconds={1.0 + 0.37 * attempt}")
        try:
            code = proc.wait(timeout=240)
        except subprocess.TimeoutExpired:  # a hang: one rank left, the other waits in a collective
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = "hang"
        if code == 0 and checkpoint.latest_intact(out) is not None and (out / "final").exists():
            clean += 1
    print(f"time limit: {clean} of 5 two-rank runs ended cleanly with a checkpoint")
    assert clean == 5


def test_sigterm_to_one_rank_stops_all_with_a_checkpoint(tmp_path):
    clean = 0
    for attempt in range(4):
        out = tmp_path / f"run{attempt}"
        proc = _start(out)
        _wait_for_steps(out, 2 + attempt, proc)
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[attempt % 2], signal.SIGTERM)  # pre-emption reaches one rank only
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = "hang"
        latest = checkpoint.latest_intact(out)
        if code == 0 and latest is not None and checkpoint.load(latest)["step"] >= 2:
            clean += 1
    print(f"SIGTERM to one rank: {clean} of 4 two-rank runs stopped cleanly with a checkpoint")
    assert clean == 4


def test_a_killed_launcher_leaves_no_worker_running(tmp_path):
    out = tmp_path / "run"
    proc = _start(out)
    _wait_for_steps(out, 1, proc)
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    os.kill(proc.pid, signal.SIGKILL)  # the launcher dies without forwarding anything
    proc.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(_alive(w) for w in workers):
        time.sleep(0.2)
    left = [w for w in workers if _alive(w)]
    for w in left:
        os.kill(w, signal.SIGKILL)
    assert not left, f"workers {left} outlived their launcher"
    assert checkpoint.latest_intact(out) is not None  # they stopped together and checkpointed on the way out
