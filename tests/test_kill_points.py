"""Every kill point of a run's end and of a phase's output (issue 33, items 1, 3 and 5): a run killed
at each write of its end — inside the final checkpoint's save (keep_last 1 and 2), inside each file
of ``final/``, after ``final/``, ``reward.png``, ``summary.json`` and the ``FINISHED`` marker — or at
each write of a phase's output, then rerun, ends with the uninterrupted run's ``final/`` (sha256 of
every file) and ``summary.json`` (minus its wall-clock fields), and ``FINISHED`` vouching for them.

The fast tests kill in-process (``tests/killpoints.py`` raises at the write; a fresh ``Trainer``
is the rerun); the slow ones SIGKILL a ``groupwise train`` process at the same points. Before:
the run saved its checkpoint marked finished before writing ``final/`` and ``summary.json``, so a
kill in between made every rerun say "finished ... nothing to do" with neither there; a kill
between ``phases/sft.pt`` and its digest made every rerun fail."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from killpoints import CHECKPOINT_WHENS, arm
from test_trainer import MODEL, make_trainer

from groupwise import runfolder
from groupwise.run import Run

END = ["train.steps=2", "checkpoint.every=1", "eval.size=4"]
SFT = ['phases=[{name="sft", steps=3, batch_size=8}]', "train.steps=1", "checkpoint.every=1", "eval.size=4"]
FINAL_FILES = 5  # config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json
END_POINTS = (
    [f"checkpoint:{w}" for w in CHECKPOINT_WHENS]
    + [f"final:{k}" for k in range(FINAL_FILES)]
    + ["final:published"]
    + [f"{name}:{when}" for name in ("reward.png", "summary.json", runfolder.FINISHED) for when in ("torn", "after")]
)
PHASE_POINTS = ["sft.pt:before", "sft.pt:torn", "sft.pt:after", "sft.sha256:torn", "sft.sha256:after"]


class Killed(BaseException):
    """In-process stand-in for SIGKILL: no ``except Exception`` handler catches it."""


def die():
    raise Killed


# wall-clock fields (summary.json: the run's, a phase's; compare.json: a run's process and step seconds):
# they differ from run to run
CLOCK = {"wall_seconds", "seconds", "process_seconds", "seconds_budget", "seconds_to_target"}


def without_clock(value):
    if isinstance(value, dict):
        return {k: without_clock(v) for k, v in value.items() if k not in CLOCK}
    if isinstance(value, list):
        return [without_clock(v) for v in value]
    return value


def outcome(run: Path) -> tuple[dict, dict]:
    """sha256 of every file of final/ and summary.json without its wall-clock fields; FINISHED must vouch for both."""
    there = sorted(p.name for p in run.iterdir())
    assert (run / "final").is_dir() and (run / "summary.json").exists(), f"outputs missing in {run}: {there}"
    final = {
        str(p.relative_to(run / "final")): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((run / "final").rglob("*"))
        if p.is_file()
    }
    summary = without_clock(json.loads((run / "summary.json").read_text()))
    step, why = runfolder.finished_step(run)
    assert step == summary["steps"], why
    return final, summary


def leftovers(run: Path) -> list[str]:
    folders = [f for f in (run, run / "checkpoints", run / "phases") if f.is_dir()]
    return sorted(p.name for folder in folders for p in folder.iterdir() if runfolder.is_temporary(p.name))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    runs = {}
    for name, setup in (("end", END), ("end_keep1", [*END, "checkpoint.keep_last=1"]), ("sft", SFT)):
        out = tmp_path_factory.mktemp(name)
        Run(make_trainer(out, *setup)).train()
        runs[name] = outcome(out)
    assert len(runs["end"][0]) == FINAL_FILES, sorted(runs["end"][0])
    return runs


def killed_then_rerun(run: Path, setup: list[str], point: str, monkeypatch, capsys) -> str:
    with monkeypatch.context() as patch:
        arm(point, die, patch.setattr)
        with pytest.raises(Killed):
            Run(make_trainer(run, *setup)).train()
    capsys.readouterr()
    Run(make_trainer(run, *setup)).train()
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("point", "keep_last"), [(p, 2) for p in END_POINTS] + [(f"checkpoint:{w}", 1) for w in CHECKPOINT_WHENS]
)
def test_a_kill_at_each_write_of_the_end_is_completed_by_the_rerun(
    tmp_path, straight, point, keep_last, monkeypatch, capsys
):
    setup = END if keep_last == 2 else [*END, "checkpoint.keep_last=1"]
    said = killed_then_rerun(tmp_path, setup, point, monkeypatch, capsys)
    assert outcome(tmp_path) == straight["end" if keep_last == 2 else "end_keep1"]
    assert leftovers(tmp_path) == []
    if point == f"{runfolder.FINISHED}:after":  # everything was written: nothing to do
        assert "finished at step 2 already" in said
    elif point not in ("checkpoint:before_marker", "checkpoint:before_rename"):  # the final checkpoint is there
        assert "finished training at step 2, but its outputs were not all written" in said, said
    again = make_trainer(tmp_path, *setup)
    Run(again).train()
    assert "nothing to do" in capsys.readouterr().err
    assert outcome(tmp_path) == straight["end" if keep_last == 2 else "end_keep1"]


@pytest.mark.parametrize("point", PHASE_POINTS)
def test_a_kill_at_each_write_of_a_phase_output(tmp_path, straight, point, monkeypatch, capsys):
    said = killed_then_rerun(tmp_path, SFT, point, monkeypatch, capsys)
    assert outcome(tmp_path) == straight["sft"]
    if point == "sft.sha256:after":
        assert "phase 'sft': done already" in said
    else:  # never finished (no digest): run again, not an error
        assert "phase 'sft' (sft) ..." in said
    assert leftovers(tmp_path) == []


def test_outputs_lost_after_a_finished_checkpoint_are_written_again(tmp_path, straight, capsys):
    """The shape of the real kills of the issue: final/ (or summary.json) gone after the final
    checkpoint. Before: 'nothing to do', exit 0, with the output missing for good."""
    Run(make_trainer(tmp_path, *END)).train()
    for lost in ("final", "summary.json"):
        path = tmp_path / lost
        path.unlink() if path.is_file() else __import__("shutil").rmtree(path)
        Run(make_trainer(tmp_path, *END)).train()
        assert "its outputs were not all written" in capsys.readouterr().err
        assert outcome(tmp_path) == straight["end"]


# ---------------------------------------------------------------------------------------------- real SIGKILLs (slow)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
KILLPOINTS = str(Path(__file__).with_name("killpoints.py"))
DEMO = [
    "train",
    "demo",
    "rollout.prompts_per_step=8",
    "rollout.group_size=4",
    "checkpoint.every=1",
    "eval.size=8",
    "threads=1",
    f'model.path="{MODEL}"',
]
OFFLINE = 'phases=[{name="lora_placement_probe", probes=2, prompts=8, group_size=4, max_new_tokens=6}]'
# setup -> (the run's arguments, its kill points, a file final/ must hold)
SLOW_SETUPS = {
    "end": ([*DEMO, "train.steps=3"], END_POINTS, "model.safetensors"),
    "end_keep1": (
        [*DEMO, "train.steps=3", "checkpoint.keep_last=1"],
        [f"checkpoint:{w}" for w in CHECKPOINT_WHENS],
        "model.safetensors",
    ),
    "two_roles": (
        ["train", "codistill", *DEMO[2:], "train.steps=2"],
        [f"final:{k}" for k in range(2 * FINAL_FILES)] + ["final:published"],
        "teacher/model.safetensors",
    ),
    "sft": (
        [*DEMO, 'phases=[{name="sft", steps=6, batch_size=8}]', "train.steps=2"],
        PHASE_POINTS,
        "model.safetensors",
    ),
    "offline": (
        ["train", "lora_placement", *DEMO[2:], OFFLINE, "train.steps=2"],
        [f"placement.{s}:{w}" for s in ("pt", "sha256") for w in ("before", "torn", "after")],
        "model.safetensors",
    ),
}
TALLY: dict[str, list[int]] = {}  # setup -> [survived, tried]


def _args(setup: str, out: Path) -> list[str]:
    return [*SLOW_SETUPS[setup][0], f"out={out}"]


def _train(args: list[str], point: str | None = None) -> subprocess.CompletedProcess:
    head = [sys.executable, KILLPOINTS, point] if point else [sys.executable, "-m", "groupwise"]
    return subprocess.run([*head, *args], capture_output=True, text=True, env=ENV, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("setup", sorted(SLOW_SETUPS))
def test_sigkill_at_every_write_of_the_end_and_of_phase_outputs(tmp_path, setup):
    """One `groupwise train` SIGKILLed at each point (a fresh folder per point), then the same
    command again: the final/ files' sha256 and summary.json equal the uninterrupted run's."""
    _, points, last_file = SLOW_SETUPS[setup]
    proc = _train(_args(setup, tmp_path / "straight"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = outcome(tmp_path / "straight")
    assert last_file in want[0]
    survived = []
    for i, point in enumerate(points):
        out = tmp_path / f"k{i}"
        killed = _train(_args(setup, out), point)
        assert killed.returncode == -9, f"{point}: not killed (exit {killed.returncode}): {killed.stderr[-1500:]}"
        rerun = _train(_args(setup, out))
        assert rerun.returncode == 0, f"{point}: {rerun.stderr[-2000:]}"
        if outcome(out) == want and leftovers(out) == []:
            survived.append(point)
    TALLY[setup] = [len(survived), len(points)]
    print(f"{setup}: {len(survived)}/{len(points)} kills survived")
    assert survived == points, f"not survived: {sorted(set(points) - set(survived))}"


# ---------------------------------------------------------------------------------------------- a compare run (slow)
COMPARE = [
    "compare",
    "a=demo",
    "--seeds",
    "1",
    "train.steps=3",
    "checkpoint.every=1",
    "eval.size=8",
    "rollout.prompts_per_step=8",
    "rollout.group_size=4",
    "threads=1",
    f'model.path="{MODEL}"',
]
COMPARE_POINTS = [
    "compare:child",
    "run.json:torn",
    "run.json:after",
    "run.json:torn#2",
    "compare.json:torn",
    "compare.json:after",
]


def _compare(out: Path, point: str | None = None, **env) -> subprocess.CompletedProcess:
    head = [sys.executable, KILLPOINTS, point] if point else [sys.executable, "-m", "groupwise"]
    return subprocess.run(
        [*head, *COMPARE, "--out", str(out)], capture_output=True, text=True, env={**ENV, **env}, timeout=600
    )


def _compared(out: Path) -> dict:
    """compare.json's per-seed results and summary without clock fields, and the seed's run folder's outcome."""
    config = json.loads((out / "compare.json").read_text())["configs"][0]
    runs = [{k: v for k, v in r.items() if k not in ("skipped", "folder")} for r in config["runs"]]
    return {
        "runs": without_clock(runs),
        "summary": without_clock(config["summary"]),
        "seed0": outcome(out / "a" / "seed0"),
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z" if Path(f"/proc/{pid}/stat").exists() else False


@pytest.mark.slow
def test_sigkill_at_every_write_of_a_compare_run(tmp_path):
    """`groupwise compare` SIGKILLed while its child trains (the child must stop with it), and at
    each write of run.json and compare.json; rerun: the same per-seed results and run folder.
    Before: the child kept training after its parent died, and the rerun's child hit its run lock."""
    proc = _compare(tmp_path / "straight")
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = _compared(tmp_path / "straight")
    survived = []
    for i, point in enumerate(COMPARE_POINTS):
        out, pidfile = tmp_path / f"k{i}", tmp_path / f"child{i}.pid"
        killed = _compare(out, point, KILLPOINTS_PIDFILE=str(pidfile))
        assert killed.returncode == -9, f"{point}: exit {killed.returncode}: {killed.stderr[-1500:]}"
        if point == "compare:child":
            child = int(pidfile.read_text())
            deadline = time.monotonic() + 120
            while _alive(child) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _alive(child), "the training child outlived the killed compare"
        rerun = _compare(out)
        assert rerun.returncode == 0, f"{point}: {rerun.stderr[-2000:]}"
        if _compared(out) == want and "FAILED" not in rerun.stderr:
            survived.append(point)
    TALLY["compare"] = [len(survived), len(COMPARE_POINTS)]
    print(f"compare: {len(survived)}/{len(COMPARE_POINTS)} kills survived")
    assert survived == COMPARE_POINTS, f"not survived: {sorted(set(COMPARE_POINTS) - set(survived))}"
