"""The run folder's promises (issue 12, items 1–11): checkpoints that prove themselves, no moment
without a complete checkpoint, a full disk, a metrics log that survives torn lines and kills,
refused mixed resumes, the lock, finished runs, atomic outputs, non-finite weights rolled back,
runs without finite rewards stopped, and rewards that exit. Each test failed on the code before
the change (the comment says how)."""

from __future__ import annotations

import collections
import errno
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from test_trainer import MODEL, make_trainer

from groupwise import checkpoint, runfolder
from groupwise.errors import ConfigError
from groupwise.logging import MetricsLog
from groupwise.run import Run

STATE = {"w": torch.arange(40_000, dtype=torch.float32), "step": 3}


# ---------------------------------------------------------------------------- 1. integrity
def _damage(path: Path, how: str) -> None:
    state = path / checkpoint.STATE
    data = bytearray(state.read_bytes())
    if how == "bit_flip":
        data[len(data) // 2] ^= 0x10
        state.write_bytes(bytes(data))
    elif how == "zeroed_page":
        start = len(data) // 3
        data[start : start + 4096] = bytes(4096)
        state.write_bytes(bytes(data))
    elif how == "truncated":
        state.write_bytes(bytes(data[: len(data) - 1000]))
    elif how == "edited_manifest":
        manifest = json.loads((path / checkpoint.MANIFEST).read_text())
        manifest["files"][checkpoint.STATE]["bytes"] += 1
        (path / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    elif how == "edited_step":
        manifest = json.loads((path / checkpoint.MANIFEST).read_text())
        manifest["step"] = 99
        (path / checkpoint.MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    elif how == "missing_manifest":
        (path / checkpoint.MANIFEST).unlink()


CORRUPTIONS = ["bit_flip", "zeroed_page", "truncated", "edited_manifest", "edited_step", "missing_manifest"]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_damaged_checkpoint_is_named_and_the_previous_one_used(tmp_path, how):
    """Before: no manifest; a bit flip loaded silently (or the unpickler crashed), with no fallback."""
    checkpoint.save(tmp_path, 1, {**STATE, "step": 1})
    newest = checkpoint.save(tmp_path, 2, {**STATE, "step": 2})
    _damage(newest, how)
    with pytest.raises(checkpoint.CheckpointCorrupt, match="step_000002"):
        checkpoint.verify(newest)
    with pytest.warns(RuntimeWarning, match="skipping damaged checkpoint"):
        intact = checkpoint.latest_intact(tmp_path)
    assert intact.name == "step_000001" and checkpoint.load(intact)["step"] == 1
    with pytest.raises(checkpoint.CheckpointCorrupt):
        checkpoint.load(newest)  # load verifies too: nothing damaged is unpickled


def test_every_checkpoint_damaged_is_an_error_naming_each(tmp_path):
    for step in (1, 2):
        _damage(checkpoint.save(tmp_path, step, STATE), "bit_flip")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(checkpoint.CheckpointCorrupt, match="no intact checkpoint.*step_000002.*step_000001"):
            checkpoint.latest_intact(tmp_path)


def test_each_named_failure_says_what_failed(tmp_path):
    path = checkpoint.save(tmp_path, 1, STATE)
    _damage(path, "truncated")
    with pytest.raises(checkpoint.CheckpointCorrupt, match=r"state\.pt: .* bytes, MANIFEST.json says .* \(truncated"):
        checkpoint.verify(path)
    path = checkpoint.save(tmp_path, 2, STATE)
    _damage(path, "bit_flip")
    with pytest.raises(checkpoint.CheckpointCorrupt, match=r"state\.pt: sha256 differs"):
        checkpoint.verify(path)
    path = checkpoint.save(tmp_path, 3, STATE)
    _damage(path, "edited_manifest")
    with pytest.raises(
        checkpoint.CheckpointCorrupt, match=r"MANIFEST.json: sha256 differs from the one recorded in COMPLETE"
    ):
        checkpoint.verify(path)


def test_trainer_resumes_from_the_previous_intact_checkpoint(tmp_path):
    run = tmp_path / "run"
    Run(make_trainer(run, "train.steps=2", "checkpoint.every=1", "eval.size=0")).train()
    newest = checkpoint.latest(run)
    _damage(newest, "zeroed_page")
    again = Run(make_trainer(run, "train.steps=2", "checkpoint.every=1", "eval.size=0"))
    with pytest.warns(RuntimeWarning, match="skipping damaged checkpoint"):
        again._resume([])
    assert again.trainer.step == 1  # keep_last=2 kept step 1 and the final save of step 2 (which superseded the loop's)


# ---------------------------------------------------------------------------- 2. never without a complete checkpoint
class _Killed(BaseException):
    """Stands for SIGKILL: nothing after the point runs (BaseException: no cleanup handler catches it)."""


def _kill_at(monkeypatch, target, name, nth):
    calls = [0]
    real = getattr(target, name)

    def fake(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            raise _Killed
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, fake)


@pytest.mark.parametrize("keep_last", [1, 2])
@pytest.mark.parametrize(
    "point", ["rename:1", "rmtree:1", "rmtree:2", "fault:checkpoint.before_rename", "fault:checkpoint.before_prune"]
)
def test_a_kill_anywhere_in_a_save_leaves_a_complete_checkpoint(tmp_path, monkeypatch, keep_last, point):
    """Before: saving step N again (the final save after the loop's) deleted step_N before renaming
    the new folder in: a kill in between left keep_last=1 runs with nothing, restarting at step 0."""
    checkpoint.save(tmp_path, 4, {**STATE, "step": 4}, keep_last=keep_last)
    kind, _, arg = point.partition(":")
    if kind == "fault":
        monkeypatch.setattr(checkpoint, "_fault", lambda p: (_ for _ in ()).throw(_Killed) if p == arg else None)
    else:
        _kill_at(monkeypatch, checkpoint.os if kind == "rename" else checkpoint.shutil, kind, int(arg))
    try:
        checkpoint.save(tmp_path, 4, {**STATE, "step": 4}, keep_last=keep_last)  # same step: the final save's case
    except _Killed:
        pass
    monkeypatch.undo()
    intact = checkpoint.latest_intact(tmp_path)
    assert intact is not None and checkpoint.load(intact)["step"] == 4


def test_a_later_save_prunes_superseded_revisions(tmp_path):
    checkpoint.save(tmp_path, 4, STATE, keep_last=1)
    checkpoint.save(tmp_path, 4, STATE, keep_last=1)
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step_000004_r1"]
    checkpoint.save(tmp_path, 5, STATE, keep_last=1)
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step_000005"]


# ---------------------------------------------------------------------------- 3. full disk
Usage = collections.namedtuple("Usage", "total used free")


def test_too_little_space_is_refused_before_writing(tmp_path, monkeypatch):
    """Before: torch.save failed half-way with 'unexpected pos 704 vs 598' and left the temporary folder."""
    checkpoint.save(tmp_path, 1, STATE)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(checkpoint.CheckpointSpace, match=r"needs about [\d,]+ bytes, 1,000 are free") as info:
        checkpoint.save(tmp_path, 2, STATE)
    assert info.value.errno == errno.ENOSPC and str(tmp_path / "checkpoints") in str(info.value)
    assert not list((tmp_path / "checkpoints").glob(".tmp_*"))
    assert checkpoint.load(checkpoint.latest_intact(tmp_path))["step"] == 3


def test_disk_filling_up_during_the_write_cleans_up_and_keeps_the_old(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 1, {**STATE, "step": 1})

    class Full(checkpoint._Writes):
        written = 0

        def write(self, data):
            Full.written += len(data)
            if Full.written > 50_000:  # the disk is full after 50 kB
                self.error = OSError(errno.ENOSPC, "No space left on device")
                raise self.error
            return self.fh.write(data)

    monkeypatch.setattr(checkpoint, "_Writes", Full)
    with pytest.raises(
        checkpoint.CheckpointSpace,
        match=r"disk full while writing the step-2 checkpoint to .*\.tmp_step_000002.*needs about [\d,]+ bytes",
    ):
        checkpoint.save(tmp_path, 2, {**STATE, "step": 2})
    monkeypatch.undo()
    assert not list((tmp_path / "checkpoints").glob(".tmp_*")), "the partial folder is removed"
    assert checkpoint.load(checkpoint.latest_intact(tmp_path))["step"] == 1
    checkpoint.save(tmp_path, 2, {**STATE, "step": 2})  # space again: the next run saves and resumes
    assert checkpoint.load(checkpoint.latest_intact(tmp_path))["step"] == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tiny tmpfs needs root")
def test_a_real_full_disk(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    if (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here")
    try:
        checkpoint.save(mount, 1, {"w": torch.zeros(10)})
        (mount / "filler").write_bytes(bytes(1_500_000))
        with pytest.raises(checkpoint.CheckpointSpace, match="needs about"):
            checkpoint.save(mount, 2, {"w": torch.zeros(200_000)})  # 800 kB: refused by the free-space check
        assert not list((mount / "checkpoints").glob(".tmp_*"))
        assert checkpoint.load(checkpoint.latest_intact(mount))["w"].shape == (10,)
    finally:
        subprocess.run(["umount", str(mount)])


# ---------------------------------------------------------------------------- 4. metrics.jsonl
def test_torn_last_line_and_repeated_steps_do_not_brick_a_resume(tmp_path):
    """Before: json.loads of a torn last line raised, and the run could never resume."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "v": s}) + "\n" for s in (0, 1, 2, 1, 2)) + '{"step": 3, "v"')
    log = MetricsLog(path, resume_step=1)
    assert [r["step"] for r in log.rows] == [0, 1]
    log.write({"step": 2, "v": 20.0})
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["v"] == 20.0


def test_a_kill_while_the_log_is_cut_back_loses_nothing(tmp_path, monkeypatch):
    """Before: the file was truncated and rewritten in place; a kill in between lost every step."""
    path = tmp_path / "metrics.jsonl"
    original = "".join(json.dumps({"step": s}) + "\n" for s in range(5))
    path.write_text(original)
    _kill_at(monkeypatch, runfolder.os, "replace", 1)
    with pytest.raises(_Killed):
        MetricsLog(path, resume_step=2)
    assert path.read_text() == original  # the old file, whole
    monkeypatch.undo()
    assert [r["step"] for r in MetricsLog(path, resume_step=2).rows] == [0, 1, 2]


class _FullDisk:
    """A file whose writes fail as a full disk does (ENOSPC), for ``open`` inside groupwise.logging."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_while_appending_metrics_says_what_and_how_much(tmp_path, monkeypatch):
    """Issue 33, item 4. Before: a bare "OSError: [Errno 28] No space left on device"."""
    from groupwise import logging as run_logging

    log = MetricsLog(tmp_path / "metrics.jsonl", None)
    monkeypatch.setattr(run_logging, "open", _FullDisk, raising=False)
    line = json.dumps({"step": 3, "loss": 0.5}) + "\n"  # 27 bytes
    said = (
        rf"disk full while writing step 3's metrics to {tmp_path}/metrics.jsonl: it needs about {len(line)} bytes, "
        r"[\d,]+ are free; free some space and rerun the same command to resume"
    )
    with pytest.raises(runfolder.NoSpace, match=said):
        log.write({"step": 3, "loss": 0.5})
    with pytest.raises(runfolder.NoSpace, match=r"disk full while writing 1 sample rows to .*samples.jsonl"):
        run_logging.append_jsonl(tmp_path / "samples.jsonl", [{"step": 0}])


def test_a_full_disk_stops_the_command_with_one_line(tmp_path, monkeypatch, capsys):
    from groupwise import cli
    from groupwise import logging as run_logging

    monkeypatch.setattr(run_logging, "open", _FullDisk, raising=False)
    code = cli.main(
        [
            "train",
            "demo",
            f"out={tmp_path}",
            "train.steps=2",
            "eval.size=0",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            f'model.path="{MODEL}"',
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    said = f"groupwise: [Errno 28] disk full while writing step 0's metrics to {tmp_path}/metrics.jsonl"
    assert code == 1 and err[-1].startswith(said)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tiny tmpfs needs root")
def test_a_real_full_disk_while_appending_metrics(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        log = MetricsLog(mount / "metrics.jsonl", None)
        log.write({"step": 0})
        filler = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)
        with pytest.raises(OSError):
            while True:
                os.write(filler, bytes(4096))
        os.close(filler)
        said = r"step 1's metrics to .*metrics.jsonl: it needs about [\d,]+ bytes, 0 are free"
        with pytest.raises(runfolder.NoSpace, match=said):
            log.write({"step": 1, "pad": "x" * 8192})
        said = r"writing metrics.jsonl to .*: it needs about 12 bytes, 0 are free; the previous metrics.jsonl is"
        with pytest.raises(runfolder.NoSpace, match=said):
            MetricsLog(mount / "metrics.jsonl", 0)  # a resume's atomic rewrite: {"step": 0} and a newline, 12 bytes
        (mount / "filler").unlink()  # space again: the resume drops the torn line the failed append may have left
        assert [r["step"] for r in MetricsLog(mount / "metrics.jsonl", 0).rows] == [0]
    finally:
        subprocess.run(["umount", str(mount)])


# ---------------------------------------------------------------------------- 4b. temporary files of killed runs
def test_temporary_files_of_killed_runs_are_removed_when_a_run_starts(tmp_path, capsys):
    """Before: .tmp_step_* (up to 10 MB each), .final.tmp*, .summary.json.tmp* stayed for good."""
    run = tmp_path / "run"
    for folder in (run / "checkpoints" / ".tmp_step_000003_4242", run / ".final.tmp4242", run / ".final.old4242"):
        folder.mkdir(parents=True)
        (folder / "state.pt").write_bytes(bytes(1000))
    (run / "phases").mkdir()
    for file in (run / ".summary.json.tmp4242", run / ".metrics.jsonl.tmp17", run / "phases" / ".sft.pt.tmp4242"):
        file.write_text("half")
    mine = [run / "notes.tmp", run / ".hidden", run / "phases" / "readme.txt"]  # not ours: kept
    for file in mine:
        file.write_text("keep")
    Run(make_trainer(run, "train.steps=1", "eval.size=0")).train()
    assert "removed 6 temporary file(s) a killed run left in" in capsys.readouterr().err
    left = sorted(
        p.name
        for folder in (run, run / "checkpoints", run / "phases")
        for p in folder.iterdir()
        if ".tmp" in p.name or ".old" in p.name
    )
    assert left == ["notes.tmp"] and all(p.exists() for p in mine)


# ---------------------------------------------------------------------------- 5. refused mixed resumes
def _stopped_run(run, *extra):
    trainer = make_trainer(run, "train.steps=2", "checkpoint.every=1", "eval.size=0", *extra)
    job = Run(trainer)
    step = trainer.run_step

    def preempted():  # SIGTERM arrives during the first step: it checkpoints after it and returns
        job._stop_requested = "SIGTERM"
        return step()

    trainer.run_step = preempted
    job.train()
    assert trainer.step == 1
    return job


def test_resume_with_another_configuration_is_refused_naming_each_key(tmp_path):
    """Before: a resumed run silently mixed two configurations and overwrote config.toml."""
    run = tmp_path / "run"
    _stopped_run(run)
    stored = (run / "config.toml").read_text()
    changed = make_trainer(
        run, "train.steps=2", "checkpoint.every=1", "eval.size=0", "update.lr=0.5", "rollout.temperature=0.7"
    )
    with pytest.raises(
        ConfigError,
        match=r"rollout.temperature: 1.0 -> 0.7; update.lr: 0.001 -> 0.5.*--resume-allow rollout.temperature,update.lr",
    ):
        Run(changed).train()
    assert (run / "config.toml").read_text() == stored
    allowed = make_trainer(
        run, "train.steps=2", "checkpoint.every=1", "eval.size=0", "update.lr=0.5", "rollout.temperature=0.7"
    )
    Run(allowed).train(resume_allow=["update", "rollout.temperature"])  # a section prefix allows its keys
    assert allowed.step == 2 and "temperature = 0.7" in (run / "config.toml").read_text()


def test_component_states_are_matched_by_name(tmp_path):
    """Before: states were restored by position, so another component set loaded the wrong states."""
    run = tmp_path / "run"
    _stopped_run(run)
    other = make_trainer(run, "train.steps=2", "checkpoint.every=1", "eval.size=0", 'sampling={name="dynamic"}')
    with pytest.raises(
        ConfigError, match=r"checkpoint holds the states of components .*sampling.uniform.*builds .*sampling.dynamic"
    ):
        Run(other).train(resume_allow=["sampling"])


# ---------------------------------------------------------------------------- 6. the lock
def test_a_second_process_on_the_run_folder_is_refused_with_the_holders_pid(tmp_path):
    """Before: two processes trained into one folder, interleaving checkpoints and logs."""
    run = tmp_path / "run"
    run.mkdir()
    holder = runfolder.RunLock(run).acquire()
    try:
        with pytest.raises(runfolder.RunLocked, match=f"in use by another groupwise process \\(pid {os.getpid()}\\)"):
            Run(make_trainer(run, "train.steps=1", "eval.size=0")).train()
        t0 = time.monotonic()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "groupwise",
                "train",
                "demo",
                f"out={run}",
                "train.steps=1",
                f'model.path="{MODEL}"',
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert proc.returncode == 1 and f"pid {os.getpid()}" in proc.stderr, proc.stderr[-2000:]
        assert time.monotonic() - t0 < 60  # refused at start-up, not after training
    finally:
        holder.release()
    runfolder.RunLock(run).acquire().release()  # free again once the holder let go


# ------------------------------------------------------------------------ 7, 8. finished runs, defaults, atomic outputs
def test_rerunning_a_finished_run_says_so_and_changes_nothing(tmp_path, capsys):
    """Before: a rerun evaluated again and appended to summary.json's evals each time."""
    run = tmp_path / "run"
    Run(make_trainer(run, "train.steps=1", "eval.size=4")).train()
    summary = (run / "summary.json").read_text()
    weights = (run / "final" / "model.safetensors").read_bytes()
    for _ in range(2):
        again = make_trainer(run, "train.steps=1", "eval.size=4")
        Run(again).train()
    assert "finished at step 1 already" in capsys.readouterr().err
    assert (run / "summary.json").read_text() == summary and len(json.loads(summary)["evals"]) == 2
    assert (run / "final" / "model.safetensors").read_bytes() == weights


def test_defaults_bound_what_an_interruption_or_a_hung_reward_costs():
    """Before: checkpoints only at the end, and reward.timeout_s=0 let a hung reward run forever."""
    from groupwise.config import CheckpointCfg, RewardCfg

    assert 0 < CheckpointCfg().minutes <= 10 and 0 < RewardCfg().timeout_s <= 600


def test_time_based_checkpoints(tmp_path, monkeypatch):
    saved = []
    trainer = make_trainer(
        tmp_path / "run", "train.steps=3", "eval.size=0", "checkpoint.every=0", "checkpoint.minutes=1e-9"
    )
    job = Run(trainer)
    real = job.save_checkpoint
    monkeypatch.setattr(job, "save_checkpoint", lambda: (saved.append(trainer.step), real()))
    job.train()
    assert saved == [1, 2, 3, 3]  # after every step (the minute has always passed), then the final save


def test_final_is_swapped_in_whole(tmp_path):
    final, staging = tmp_path / "final", tmp_path / ".final.tmp"
    final.mkdir()
    (final / "old.bin").write_bytes(b"old")
    staging.mkdir()
    (staging / "new.bin").write_bytes(b"new")
    runfolder.publish_dir(staging, final)
    assert sorted(p.name for p in final.iterdir()) == ["new.bin"] and not staging.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_in_row_counters_are_checkpointed(tmp_path):
    """Before: the consecutive-skipped counter restarted at 0 on resume, so a resumed run could skip forever."""
    run = tmp_path / "run"
    job = _stopped_run(run)
    state = checkpoint.load(checkpoint.latest_intact(run))
    assert state["in_row"] == {"skipped": job._skipped_in_row, "empty": job._empty_in_row}
    state["in_row"] = {"skipped": 3, "empty": 1}
    resumed = Run(make_trainer(run, "train.steps=2", "checkpoint.every=1", "eval.size=0"))
    resumed.load_state_dict(state)
    assert (resumed._skipped_in_row, resumed._empty_in_row) == (3, 1)


# ---------------------------------------------------------------------------- 9. non-finite weights
def test_an_update_that_makes_weights_non_finite_is_rolled_back(tmp_path):
    """Before: update.lr=1e39 wrote all-inf weights (then said it stopped before saving them)."""
    trainer = make_trainer(
        tmp_path / "run", "train.steps=3", "eval.size=0", "update.lr=1e39", "train.max_skipped_in_row=2"
    )
    before = {k: v.clone() for k, v in trainer.policy.module.state_dict().items()}
    with pytest.raises(RuntimeError, match="2 optimiser steps in a row .* rolled back"):
        Run(trainer).train()
    for key, value in trainer.policy.module.state_dict().items():
        assert torch.equal(value, before[key]), key  # exactly the weights before the steps
    assert trainer.updater.skipped == 2 and not list((tmp_path / "run").glob("checkpoints/step_*"))


@pytest.mark.parametrize("name", ["adamw", "sgd", "gxpo"])
def test_rollback_restores_weights_and_optimiser_state(name):
    from groupwise.registry import build

    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    updater = build("update", name, lr=0.1)
    updater.bind([w], 10)

    def closure():
        loss = (w**2).sum()
        loss.backward()
        return loss.detach()

    assert updater.step(closure)["skipped"] == 0.0
    weights = w.detach().clone()
    optimizer = updater.torch_optim()
    state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in optimizer.state[w].items()}
    for group in optimizer.param_groups:
        group["lr"] = 1e38 if name == "sgd" else 1e39  # finite gradients, non-finite result (sgd: 6 · 1e38 overflows)
    out = updater.step(closure)
    assert out["nonfinite"] == 1.0 and updater.skipped == 1
    assert out.get("rolled_back") == (None if name == "gxpo" else 1.0)  # gxpo's own probe check undoes it first
    assert torch.equal(w.detach(), weights)
    for key, value in optimizer.state[w].items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(state[key])), key


# ---------------------------------------------------------------------------- 10, 11. rewards that cannot train
def _with_reward(tmp_path, body):
    (tmp_path / "odd_reward.py").write_text(f"import sys, math\ndef odd(prompts, completions, **kw):\n    {body}\n")
    sys.path.insert(0, str(tmp_path))


def test_a_run_without_any_finite_reward_is_an_error(tmp_path):
    """Before: all-NaN rewards for the whole run ended as a 'successful' run that learned nothing."""
    _with_reward(tmp_path, "return [math.inf] * len(completions)")
    try:
        trainer = make_trainer(
            tmp_path / "run",
            "train.steps=10",
            "eval.size=0",
            'rewards=[{name="python", fn="odd_reward:odd"}]',
            "reward.max_empty_steps=2",
        )
        with pytest.raises(RuntimeError, match="2 steps in a row had no sample with a finite reward"):
            Run(trainer).train()
        assert trainer.step == 1 and trainer.reward_stage.excluded == 16  # every sample counted as excluded
    finally:
        sys.path.remove(str(tmp_path))


def test_a_reward_that_exits_stops_the_command_with_non_zero_status(tmp_path):
    """Before: sys.exit(0) inside a reward ended `groupwise train` with status 0."""
    _with_reward(tmp_path, "sys.exit(0)")
    sys.path.remove(str(tmp_path))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "groupwise",
            "train",
            "demo",
            f"out={tmp_path / 'run'}",
            "train.steps=1",
            "eval.size=0",
            f'model.path="{MODEL}"',
            'rewards=[{name="python", fn="odd_reward:odd"}]',
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1 and "odd_reward.odd" in proc.stderr and "SystemExit(0)" in proc.stderr, proc.stderr[
        -2000:
    ]


def test_no_held_out_split_writes_valid_json_saying_so(tmp_path):
    """Before: eval.size=0 wrote NaN into summary.json's evals (not JSON)."""
    run = tmp_path / "run"
    Run(make_trainer(run, "train.steps=1", "eval.size=0", "eval.every=1")).train()
    text = (run / "summary.json").read_text()
    summary = json.loads(text, parse_constant=lambda name: pytest.fail(f"summary.json holds {name}"))
    assert summary["accuracy_before"] is None and summary["accuracy_after"] is None and summary["evals"] == []
    assert summary["eval_note"].startswith("no held-out evaluation: eval.size=0 and ")


def test_a_run_cut_short_by_the_time_limit_says_so(tmp_path, capsys):
    """Before: the demo's train.max_seconds ended a longer run without a word."""
    trainer = make_trainer(tmp_path / "run", "train.steps=5", "eval.size=0", "train.max_seconds=1e-9")
    summary = Run(trainer).train()
    assert trainer.step == 1 and summary["stopped_early"] == "train.max_seconds=1e-09 reached after step 1 of 5"
    assert "raise train.max_seconds (0 = no limit) to train longer" in capsys.readouterr().err


def test_sample_completions_are_logged_and_cut_back_on_resume(tmp_path):
    run = tmp_path / "run"
    # stopped after step 0, checkpoint at step 1
    trainer = _stopped_run(run, "log.samples=3", "log.samples_every=1").trainer
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 0, 0] and set(rows[0]) == {
        "step",
        "prompt",
        "completion",
        "reward",
        "advantage",
    }
    assert all(isinstance(r["completion"], str) and r["prompt"].endswith("=") for r in rows)
    with open(run / "samples.jsonl", "a") as fh:  # a step logged by a run killed before its checkpoint
        fh.write(json.dumps({"step": 1, "prompt": "x"}) + "\n")
    Run(
        make_trainer(run, "train.steps=2", "checkpoint.every=1", "eval.size=0", "log.samples=3", "log.samples_every=1")
    ).train()
    steps = [json.loads(line)["step"] for line in (run / "samples.jsonl").read_text().splitlines()]
    assert steps == [0, 0, 0, 1, 1, 1] and trainer.step == 1
