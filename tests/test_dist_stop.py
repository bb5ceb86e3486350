"""Data parallel stops (issue 12, item 12): `train.max_seconds` and SIGTERM are decided by all ranks
together, so every rank stops at the same step and the checkpoint is written; a killed launcher
leaves no worker running. Before: each rank read its own clock and its own signal flag, so one
rank left the loop while the other waited in a collective for ever (5 of 10 runs on the time
limit, 3 of 16 on SIGTERM). Slow: many two-process runs (`make test-slow`)."""

from __future__ import annotations

import json
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


def _start_nodes(out: Path, *extra: str) -> list[subprocess.Popen]:
    """Two torchrun launchers on this machine as two nodes of one process each (c10d rendezvous on localhost)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    return [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
            + ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "stop"]
            + ["-m", "groupwise", *ARGS, f"out={out}", *extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=ENV,
            start_new_session=True,
        )
        for _ in range(2)
    ]


def _finish(procs: list[subprocess.Popen], timeout: float) -> list:
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:  # a hang: one rank left, the other waits in a collective
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            codes.append("hang")
    return codes


def test_two_nodes_stop_together_on_the_time_limit_and_on_sigterm_to_one(tmp_path):
    """As on one node, over two launchers acting as two nodes and with sharded weights (each rank
    writes its own checkpoint shards): the time limit ends both nodes at the same step with a
    checkpoint and the outputs; SIGTERM to the worker of one node stops both with a checkpoint."""
    out = tmp_path / "time"
    codes = _finish(_start_nodes(out, "train.max_seconds=2", 'dist.shard="fsdp2"'), 300)
    assert codes == [0, 0], codes
    assert checkpoint.latest_intact(out) is not None and (out / "final" / "model.safetensors").exists()

    out = tmp_path / "term"
    procs = _start_nodes(out, 'dist.shard="fsdp2"')
    _wait_for_steps(out, 2, procs[0])
    workers = _children(procs[1].pid)
    assert len(workers) == 1, workers
    os.kill(workers[0], signal.SIGTERM)  # pre-emption reaches one node only
    assert _finish(procs, 180) == [0, 0]
    latest = checkpoint.latest_intact(out)
    assert latest is not None and checkpoint.load(latest)["step"] >= 2
    assert sum(name.endswith(".distcp") for name in json.loads((latest / "MANIFEST.json").read_text())["files"]) == 2
