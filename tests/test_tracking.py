"""Logging backends besides metrics.jsonl (issue 13): TensorBoard read back against metrics.jsonl,
purged on resume; wandb / trackio offline (with stand-in modules always, the real packages when
installed); the config errors; and the console table of sampled completions."""

from __future__ import annotations

import io
import json
import struct
import sys
import time
import types

import pytest
import torch
from rich.console import Console
from test_run_folder import _stopped_run
from test_trainer import make_trainer

from groupwise import tracking
from groupwise.config import load_config
from groupwise.errors import ConfigError
from groupwise.run import Run


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _tensorboard(run, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return acc, [(e.step, e.value) for e in acc.Scalars(tag)]


# ---------------------------------------------------------------------------- what is logged
def test_only_finite_numeric_scalars_are_logged():
    row = {
        "step": 3,
        "loss": 0.5,
        "n": 2,
        "ok": True,
        "kl": None,
        "name": "x",
        "bad": float("nan"),
        "big": float("inf"),
        "t": torch.tensor(0.25),
        "vec": torch.tensor([1.0, 2.0]),
    }
    # step is the x axis, not a value; True = 1.0; a 0-d tensor is a number, a vector is not
    assert tracking.scalars(row) == {"loss": 0.5, "n": 2.0, "ok": 1.0, "t": 0.25}


def test_unknown_backend_is_an_error_naming_the_allowed_ones():
    with pytest.raises(
        ConfigError, match=r"log.backends: unknown backend 'tensorbord'; allowed: tensorboard, trackio, wandb"
    ):
        load_config(None, ['log.backends=["tensorbord"]'])
    assert load_config(None, [])[0].log.backends == []  # default: metrics.jsonl only


@pytest.mark.parametrize("name", tracking.BACKENDS)
def test_a_backend_whose_package_is_missing_names_the_extra(monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: import fails, find_spec says absent
    with pytest.raises(
        ConfigError, match=rf"backend '{name}' needs the {name} package.*pip install 'groupwise\[{name}\]'"
    ):
        load_config(None, [f'log.backends=["{name}"]'])


# ---------------------------------------------------------------------------- TensorBoard
def test_tensorboard_scalars_equal_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    Run(make_trainer(run, "train.steps=2", "eval.size=0", 'log.backends=["tensorboard"]')).train()
    rows = _metrics(run)
    acc, reward = _tensorboard(run, "reward_mean")
    # float32 in the event file: equal to metrics.jsonl's float64 up to ~6e-8 relative
    assert reward == [(r["step"], pytest.approx(r["reward_mean"], rel=1e-6)) for r in rows] and [
        s for s, _ in reward
    ] == [0, 1]
    assert set(acc.Tags()["scalars"]) == set(tracking.scalars(rows[0])) | set(tracking.scalars(rows[1]))


def test_tensorboard_resume_purges_the_steps_after_the_checkpoint(tmp_path):
    """Without purge_step the re-run step 1 would read back twice: [(0, r0), (1, 99.0), (1, r1)]."""
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "run"
    _stopped_run(run, 'log.backends=["tensorboard"]')  # step 0 logged, checkpoint at step 1
    stale = SummaryWriter(str(run / "tensorboard"))  # a run killed after logging step 1, before its checkpoint
    stale.add_scalar("reward_mean", 99.0, 1)
    stale.close()
    Run(make_trainer(run, "train.steps=2", "checkpoint.every=1", "eval.size=0", 'log.backends=["tensorboard"]')).train()
    rows = _metrics(run)
    assert _tensorboard(run, "reward_mean")[1] == [(r["step"], pytest.approx(r["reward_mean"], rel=1e-6)) for r in rows]
    assert [r["step"] for r in rows] == [0, 1]


# ---------------------------------------------------------------------------- wandb / trackio
class _FakeRun:
    def __init__(self, **kwargs):
        self.kwargs, self.logged, self.finished = kwargs, [], False

    def log(self, row, step):
        self.logged.append((row, step))

    def finish(self):
        self.finished = True


def _fake_module(monkeypatch, name, seen_env=()):
    runs = []

    def init(**kwargs):
        runs.append(_FakeRun(**kwargs, env={k: tracking.os.environ.get(k) for k in seen_env}))
        return runs[-1]

    module = types.SimpleNamespace(init=init, finish=lambda: runs[-1].finish(), Settings=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, name, module)
    return runs


def test_wandb_is_offline_under_the_run_folder_and_keeps_its_id_on_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    runs = _fake_module(monkeypatch, "wandb")
    first = tracking.open_trackers(["wandb"], tmp_path, 0, {"seed": 0})
    first.log({"step": 0, "loss": 0.5, "name": "x", "kl": None}, 0)
    first.close()
    kw = runs[0].kwargs
    assert (
        tracking.os.environ["WANDB_MODE"] == "offline"
        and kw["mode"] == "offline"
        and kw["settings"]["mode"] == "offline"
    )
    assert kw["dir"] == str(tmp_path) and kw["resume"] == "allow" and kw["config"] == {"seed": 0}
    assert runs[0].logged == [({"loss": 0.5}, 0)] and runs[0].finished
    tracking.open_trackers(["wandb"], tmp_path, 5, {}).close()  # resumed at step 5: the same run
    tracking.open_trackers(["wandb"], tmp_path, 0, {}).close()  # started afresh: a new one
    ids = [r.kwargs["id"] for r in runs]
    assert ids[0] == ids[1] != ids[2] and (tmp_path / "tracking_id").read_text().strip() == ids[2]


def test_trackio_never_sees_a_space_or_server(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_SPACE_ID", "someone/space")
    runs = _fake_module(monkeypatch, "trackio", seen_env=("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"))
    trackers = tracking.open_trackers(["trackio"], tmp_path, 0, {})
    trackers.log({"step": 2, "reward_mean": 0.75}, 2)
    trackers.close()
    assert runs[0].kwargs["env"] == {"TRACKIO_SPACE_ID": None, "TRACKIO_SERVER_URL": None}
    assert tracking.os.environ["TRACKIO_SPACE_ID"] == "someone/space"  # put back after init
    assert (
        runs[0].logged == [({"reward_mean": 0.75}, 2)]
        and runs[0].finished
        and runs[0].kwargs["name"].startswith(tmp_path.name + "-")
    )


def _wandb_history(folder):
    """(step, {key: value}) of the history records of wandb's offline run files (a LevelDB-style
    log: a 7-byte header, then 32 KiB blocks of records with a 7-byte header each)."""
    from wandb.proto import wandb_internal_pb2

    out = []
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, chunk = path.read_bytes(), 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # block trailer
                pos += 32768 - pos % 32768
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if pos + 7 + length > len(data):  # still being written
                break
            chunk, pos = chunk + data[pos + 7 : pos + 7 + length], pos + 7 + length
            if kind in (1, 4):  # a full record, or the last piece of one
                record = wandb_internal_pb2.Record.FromString(chunk)
                chunk = b""
                if record.WhichOneof("record_type") == "history":
                    items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                    out.append((record.history.step.num, {k: v for k, v in items.items() if not k.startswith("_")}))
    return out


def test_real_wandb_writes_the_scalars_offline(tmp_path):
    pytest.importorskip("wandb")
    trackers = tracking.open_trackers(["wandb"], tmp_path, 0, {"seed": 0})
    for step in (0, 1):
        trackers.log({"step": step, "reward_mean": 0.25 + step, "note": "x"}, step)
    trackers.close()
    for _ in range(100):  # wandb's service may finish writing the file after finish() returned
        if len(_wandb_history(tmp_path)) == 2:
            break
        time.sleep(0.1)
    assert _wandb_history(tmp_path) == [(0, {"reward_mean": 0.25}), (1, {"reward_mean": 1.25})]


def test_real_trackio_writes_the_scalars_locally(tmp_path, monkeypatch):
    if "trackio" in sys.modules:
        pytest.skip("trackio was imported already: its TRACKIO_DIR is fixed at import")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "store"))
    pytest.importorskip("trackio")
    from trackio.sqlite_storage import SQLiteStorage

    trackers = tracking.open_trackers(["trackio"], tmp_path / "run", 0, {})
    for step in (0, 1):
        trackers.log({"step": step, "reward_mean": 0.25 + step}, step)
    name = trackers.trackers[0].run.name
    trackers.close()
    assert [(r["step"], r["reward_mean"]) for r in SQLiteStorage.get_logs("groupwise", name)] == [(0, 0.25), (1, 1.25)]


# ---------------------------------------------------------------------------- the table
def _render(table, width=160):
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(table)
    return console.file.getvalue()


def test_sample_table_formats_and_truncates():
    prompt = "Q" * 60 + "What is 2+3="
    rows = [
        {
            "step": 7,
            "prompt": prompt,
            "completion": "5[bold]\nok",
            "reward": 0.25,
            "advantage": -0.8660254,
            "extra": {"len": 3},
        },
        {"step": 7, "prompt": "1+1=", "completion": "2", "reward": None, "advantage": 0.8660254},
    ]
    text = _render(tracking.sample_table(rows, width=20))
    assert "samples at step 7" in text
    assert "0.250" in text and "-0.866" in text and "+0.866" in text  # reward .3f, advantage signed .3f
    assert "—" in text  # the missing reward; the missing extra too
    assert "…QQQQQQQWhat is 2+3=" in text and "Q" * 8 not in text  # the prompt's last 19 characters after …
    assert "5[bold]⏎ok" in text  # not markup; a newline shown as ⏎
    assert "len" in text and "3.000" in text


def test_the_run_prints_the_table_every_table_every_steps(tmp_path):
    trainer = make_trainer(tmp_path / "run", "train.steps=2", "eval.size=0", "log.samples=2", "log.table_every=1")
    job = Run(trainer, console=Console(file=io.StringIO(), width=200, color_system=None))
    job.train()
    text = job.console.file.getvalue()
    assert "samples at step 0" in text and "samples at step 1" in text
    first = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in first] == [0, 0]  # samples_every=10: the file has step 0 only
    for r in first:  # the table shows the logged rows' numbers
        assert format(r["reward"], ".3f") in text and format(r["advantage"], "+.3f") in text
