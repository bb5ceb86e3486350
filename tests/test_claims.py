"""The claims runner: t intervals, paired effects and verdicts, run metrics, claim files, docs,
and the resume logic of ``groupwise compare``, all without training (a fake launcher writes run
folders); one real end-to-end compare is ``slow``.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from groupwise import runfolder
from groupwise.claims.claimfile import ClaimError, check_fixed, claim_seeds, find_claims, load_claim
from groupwise.claims.compare import ConfigSpec, compare, is_metric, metric_values, read_run, run_state, split_configs
from groupwise.claims.intervals import (
    T80,
    T975,
    Interval,
    detectable_effect,
    expected_false_held,
    mean_interval,
    paired_effect,
    t80,
    t975,
    verdict,
)
from groupwise.claims.provenance import cpu_model
from groupwise.claims.report import (
    PLACEHOLDER,
    detectable_text,
    readings,
    regenerate,
    run_claim,
    save_record,
    shown_verdict,
)
from groupwise.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- t quantiles
@pytest.mark.parametrize(
    "dof,expected",
    [
        (1, 12.706),
        (2, 4.303),
        (3, 3.182),
        (5, 2.571),
        (10, 2.228),
        (20, 2.086),
        (30, 2.042),
        (40, 2.021),
        (60, 2.000),
        (120, 1.980),
    ],
)
def test_t975_known_values(dof, expected):
    # printed t-tables, 0.975 column (two-sided 95 %); ν > 30 comes from the Cornish–Fisher expansion
    assert t975(dof) == pytest.approx(expected, abs=6e-4)


def test_t975_tends_to_the_normal_quantile_and_decreases():
    values = [t975(v) for v in range(1, 400)]
    assert all(a > b for a, b in zip(values, values[1:]))
    assert t975(10**6) == pytest.approx(1.959964, abs=1e-5)


@pytest.mark.parametrize("dof", range(1, 31))
def test_t975_table_is_the_quantile_of_the_t_density(dof):
    # ∫_0^q f_ν(x) dx must be 0.475 (f symmetric); Simpson's rule on 4000 intervals
    q, n = T975[dof - 1], 4000
    c = math.gamma((dof + 1) / 2) / (math.sqrt(dof * math.pi) * math.gamma(dof / 2))
    f = lambda x: c * (1 + x * x / dof) ** (-(dof + 1) / 2)  # noqa: E731
    h = q / n
    area = h / 3 * (f(0) + f(q) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, n)))
    assert area == pytest.approx(0.475, abs=2e-6)


@pytest.mark.parametrize("dof", [0, -1, 2.5])
def test_t975_rejects_bad_dof(dof):
    with pytest.raises(ValueError, match="degrees of freedom"):
        t975(dof)


# ---------------------------------------------------------------------------------------------- intervals
def test_mean_interval_by_hand():
    # [0.5, 0.6, 0.7]: mean 0.6; s² = (0.01 + 0 + 0.01) / 2 = 0.01 → s = 0.1; t(2) = 4.303
    # half = 4.302653 · 0.1 / √3 = 0.24841
    iv = mean_interval([0.5, 0.6, 0.7])
    assert iv.mean == pytest.approx(0.6)
    assert iv.sd == pytest.approx(0.1)
    assert iv.half == pytest.approx(0.24841, abs=1e-5)
    assert (iv.low, iv.high) == (pytest.approx(0.35159, abs=1e-5), pytest.approx(0.84841, abs=1e-5))
    assert iv.format() == "0.600 ± 0.248"


def test_mean_interval_one_and_zero_values():
    one = mean_interval([0.42])
    assert (one.mean, one.half, one.n) == (0.42, None, 1)
    assert one.format() == "0.420 (n=1, no interval)"
    assert mean_interval([]).format() == "no runs"
    with pytest.raises(ValueError, match="non-finite"):
        mean_interval([0.1, float("nan")])


def test_paired_effect_by_hand():
    # pairs by seed, not by position; seed 3 has no baseline and is dropped
    baseline = {0: 0.5, 1: 0.6, 2: 0.7}
    claimed = {2: 0.9, 0: 0.6, 1: 0.8, 3: 0.1}
    # d = [0.1, 0.2, 0.2]: mean 0.16667; s² = (0.06667² + 2·0.03333²) / 2 = 0.0033333 → s = 0.057735
    # half = 4.302653 · 0.057735 / √3 = 0.14342
    eff = paired_effect(claimed, baseline)
    assert eff.n == 3
    assert eff.mean == pytest.approx(1 / 6)
    assert eff.sd == pytest.approx(0.057735, abs=1e-6)
    assert eff.half == pytest.approx(0.14342, abs=1e-5)
    # unpaired, the same numbers would have a far wider spread: pairing removes the seed effect
    assert mean_interval([0.6, 0.8, 0.9]).half > eff.half


def _iv(low, high, n=3):
    return Interval((low + high) / 2, (high - low) / 2, n)


@pytest.mark.parametrize(
    "low,high,direction,expected",
    [
        (0.01, 0.2, "greater", "held"),
        (-0.2, -0.01, "greater", "contradicted"),
        (-0.2, -0.01, "less", "held"),
        (0.01, 0.2, "less", "contradicted"),
        (-0.1, 0.2, "greater", "inconclusive"),
        (-0.1, 0.2, "less", "inconclusive"),
        (0.0, 0.2, "greater", "inconclusive"),  # touching 0 does not exclude it
    ],
)
def test_verdict_branches(low, high, direction, expected):
    assert verdict(_iv(low, high), direction)[0] == expected


def test_verdict_single_pair_and_bad_direction():
    word, reason = verdict(Interval(0.3, None, 1), "greater")
    assert word == "inconclusive" and "n=1" in reason
    with pytest.raises(ValueError, match="direction"):
        verdict(_iv(0.1, 0.2), "bigger")


def test_verdict_non_inferiority_margin():
    worse_a_little = _iv(-0.04, 0.01)  # the claimed config is at most 0.04 worse
    assert verdict(worse_a_little, "greater")[0] == "inconclusive"
    word, reason = verdict(worse_a_little, "greater", margin=0.05)
    assert word == "held" and "-0.05" in reason and "margin 0.05" in reason
    assert verdict(_iv(-0.2, -0.06), "greater", margin=0.05)[0] == "contradicted"  # worse by more than the margin
    assert verdict(_iv(-0.07, -0.01), "greater", margin=0.05)[0] == "inconclusive"  # the interval straddles -0.05
    assert verdict(_iv(-0.01, 0.04), "less", margin=0.05)[0] == "held"  # at most 0.04 slower, within +0.05
    assert verdict(_iv(0.06, 0.1), "less", margin=0.05)[0] == "contradicted"
    with pytest.raises(ValueError, match="margin"):
        verdict(worse_a_little, "greater", margin=-1)


def test_verdict_censoring_downgrades_only_the_undoable_side():
    fast = _iv(-30.0, -10.0)  # claimed reaches the target 10..30 steps sooner
    assert verdict(fast, "less", baseline_censored=2)[0] == "held"  # true baseline even later: still held
    word, reason = verdict(fast, "less", claimed_censored=1)
    assert word == "inconclusive" and "claimed" in reason  # true claimed value may be larger
    slow = _iv(10.0, 30.0)
    assert verdict(slow, "less", claimed_censored=1)[0] == "contradicted"
    assert verdict(slow, "less", baseline_censored=1)[0] == "inconclusive"


# ---------------------------------------------------------------------------------------------- run folders
def _write_run(folder: Path, evals, rewards, step_seconds=0.5, wall=20.0):
    folder.mkdir(parents=True, exist_ok=True)
    summary = {
        "accuracy_before": evals[0][1],
        "evals": evals,
        "accuracy_after": evals[-1][1],
        "steps": len(rewards),
        "wall_seconds": wall,
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    rows = []
    for step, r in enumerate(rewards):
        row = {"step": step, "reward_mean": r, "step_seconds": step_seconds}
        acc = [a for s, a in evals if s == step + 1]
        if acc:
            row["eval_accuracy"] = acc[0]
        rows.append(json.dumps(row))
    (folder / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    runfolder.mark_finished(folder, len(rewards), [folder / "summary.json"])  # a finished run's last write


def test_steps_and_seconds_to_target(tmp_path):
    evals = [(0, 0.2), (10, 0.5), (20, 0.7), (30, 0.65)]
    _write_run(tmp_path, evals, [0.1] * 10 + [0.3] * 10 + [0.5] * 10)
    m = read_run(tmp_path, target=0.6)
    # first evaluation ≥ 0.6 is after 20 steps; 20 steps × 0.5 s = 10 s of training
    assert (m["steps_to_target"], m["seconds_to_target"]) == (20, 10.0)
    assert m["final_accuracy"] == 0.65
    # reward area: (10·0.1 + 10·0.3 + 10·0.5) / 30 = 0.3; last 10 % = the last 3 steps = 0.5
    assert m["reward_area"] == pytest.approx(0.3)
    assert m["last_reward"] == pytest.approx(0.5)
    assert read_run(tmp_path, target=0.2)["steps_to_target"] == 0  # already there before training
    never = read_run(tmp_path, target=0.9)
    assert never["steps_to_target"] is None and never["seconds_to_target"] is None
    assert (never["step_budget"], never["seconds_budget"]) == (30, 15.0)


def test_to_target_falls_back_to_the_metrics_log(tmp_path):
    _write_run(tmp_path, [(0, 0.2), (2, 0.4), (4, 0.8)], [0.1, 0.2, 0.3, 0.4])
    summary = json.loads((tmp_path / "summary.json").read_text())
    del summary["evals"]  # an older summary: rebuild from eval_accuracy in metrics.jsonl
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    m = read_run(tmp_path, target=0.7)
    assert (m["steps_to_target"], m["seconds_to_target"]) == (4, 2.0)


def test_not_reached_counts_as_the_budget():
    runs = [
        {"seed": 0, "status": "ok", "metrics": {"steps_to_target": 10, "step_budget": 30}},
        {"seed": 1, "status": "ok", "metrics": {"steps_to_target": None, "step_budget": 30}},
        {"seed": 2, "status": "failed"},
    ]
    values, censored = metric_values(runs, "steps_to_target")
    assert values == {0: 10.0, 1: 30.0} and censored == {1}


def test_split_configs_tells_labels_from_overrides():
    specs, shared = split_configs(["demo", "fast=sign", "x/y.toml", "train.steps=3", "seed=1", "threads=1"])
    assert [(s.label, s.recipe) for s in specs] == [("demo", "demo"), ("fast", "sign"), ("y", "x/y.toml")]
    assert shared == ["train.steps=3", "seed=1", "threads=1"]


# ----------------------------------------------------------------------------------------- compare, with a fake trainer
class FakeTrainer:
    """Stands in for ``python -m groupwise train``: writes a run folder whose numbers depend on
    the label and seed; ``fail`` names (label, seed) pairs that crash."""

    def __init__(self, fail=()):
        self.calls: list[tuple[str, int]] = []
        self.fail = set(fail)

    def __call__(self, argv, log_path):
        folder = log_path.parent
        label, seed = folder.parent.name, int(folder.name.removeprefix("seed"))
        assert f"seed={seed}" in argv and argv[1:4] == ["-m", "groupwise", "train"]
        self.calls.append((label, seed))
        if (label, seed) in self.fail:
            log_path.write_text("Traceback ...\nRuntimeError: boom\n")
            return 1
        bonus = 0.1 if label == "better" else 0.0
        acc = 0.3 + bonus + 0.01 * seed
        _write_run(folder, [(0, 0.3), (2, acc), (4, acc + 0.05)], [0.2 + bonus, 0.3 + bonus, 0.4 + bonus, 0.5 + bonus])
        log_path.write_text("ok\n")
        return 0


def _quiet():
    from rich.console import Console

    return Console(file=open("/dev/null", "w"))


SPECS = [ConfigSpec("base", "demo"), ConfigSpec("better", "demo", ["update.lr=3e-4"])]


def test_compare_writes_reports(tmp_path):
    fake = FakeTrainer()
    result = compare(SPECS, 2, tmp_path, ["train.steps=4"], 0.34, _quiet(), fake)
    assert fake.calls == [("base", 0), ("better", 0), ("base", 1), ("better", 1)]  # seed-major
    better = result["configs"][1]["summary"]
    assert better["final_accuracy"]["mean"] == pytest.approx(0.455)  # (0.45 + 0.46) / 2
    # base reaches 0.34 only at step 4 (0.35, 0.36); better at step 2
    assert result["configs"][0]["summary"]["steps_to_target"]["mean"] == 4
    assert better["steps_to_target"]["mean"] == 2
    for name in ("compare.md", "compare.json", "curves.png"):
        assert (tmp_path / name).stat().st_size > 0
    md = (tmp_path / "compare.md").read_text()
    assert "| better | `demo update.lr=3e-4` | 2/2 | 0.455 ± 0.064 |" in md  # s = 0.00707, t(1)·s/√2 = 0.0635
    data = json.loads((tmp_path / "compare.json").read_text())
    assert data["configs"][0]["runs"][0]["metrics"]["final_accuracy"] == pytest.approx(0.35)


def test_compare_resumes_skips_and_replaces(tmp_path):
    fake = FakeTrainer(fail={("better", 1)})
    result = compare(SPECS, 2, tmp_path, ["train.steps=4"], None, _quiet(), fake)
    failed = result["configs"][1]["runs"][1]
    assert failed["status"] == "failed" and "boom" in failed["error"]  # reported, the other runs went on
    assert len(fake.calls) == 4
    assert "FAILED (exit 1): RuntimeError: boom" in (tmp_path / "compare.md").read_text()
    # second call: the three finished seeds are skipped, the crashed one is run again
    fake2 = FakeTrainer()
    again = compare(SPECS, 2, tmp_path, ["train.steps=4"], None, _quiet(), fake2)
    assert fake2.calls == [("better", 1)]
    assert all(r["status"] == "ok" for c in again["configs"] for r in c["runs"])
    assert again["configs"][0]["runs"][0]["skipped"]
    # a changed shared override is another config: every folder is replaced and rerun
    fake3 = FakeTrainer()
    compare(SPECS, 2, tmp_path, ["train.steps=5"], None, _quiet(), fake3)
    assert len(fake3.calls) == 4


def test_compare_flags_runs_cut_short(tmp_path):
    # the fake trainer always stops after 4 steps: planned 10 (as train.max_seconds would do)
    result = compare(SPECS[:1], 1, tmp_path, ["train.steps=10"], None, _quiet(), FakeTrainer())
    assert result["configs"][0]["runs"][0]["short"] == "stopped at 4/10 steps (train.max_seconds?)"
    assert "**stopped at 4/10 steps" in (tmp_path / "compare.md").read_text()


def test_run_state(tmp_path):
    key = {"recipe": "/r/demo.toml", "config": {"seed": 0}}
    folder = tmp_path / "a" / "seed0"
    assert run_state(folder, key) == "new"
    folder.mkdir(parents=True)
    (folder / ".run.json.tmp4242").write_text('{"ke')  # a compare killed while writing run.json: nothing there yet
    assert run_state(folder, key) == "new"
    (folder / "run.json").write_text(json.dumps({"key": key}))
    assert run_state(folder, key) == "partial"  # interrupted: the trainer resumes from its checkpoint
    (folder / "summary.json").write_text("{}")
    assert run_state(folder, key) == "partial"  # killed before FINISHED: the rerun completes the outputs
    runfolder.mark_finished(folder, 4, [folder / "summary.json"])
    assert run_state(folder, key) == "done"
    (folder / "summary.json").write_text('{"steps": 3}')
    assert run_state(folder, key) == "partial"  # an output that differs from what FINISHED recorded
    assert run_state(folder, {**key, "config": {"seed": 1}}) == "stale"
    other = tmp_path / "b"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a run folder"):
        run_state(other, key)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_a_training_child_dies_with_its_compare(tmp_path):
    """Issue 33, item 4: a compare process SIGKILLed while its child runs. Before: the child went on
    (and a quick rerun's child hit its run lock); now it gets SIGTERM (a training child checkpoints)."""
    import os
    import signal
    import time

    pidfile = tmp_path / "child.pid"
    child = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    parent = (
        "import sys; from pathlib import Path; from groupwise.claims.compare import launch_subprocess; "
        f"launch_subprocess([sys.executable, '-c', {child!r}], Path({str(tmp_path / 'train.log')!r}))"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent])
    deadline = time.monotonic() + 60
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.02)
    pid = int(pidfile.read_text())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10

    def exited():  # gone, or a zombie (its parent dead, it waits for init to reap it)
        stat = Path(f"/proc/{pid}/stat")
        return not stat.exists() or stat.read_text().split()[2] == "Z"

    while not exited() and time.monotonic() < deadline:
        time.sleep(0.02)
    gone = exited()
    if not gone:
        os.kill(pid, signal.SIGKILL)
    assert gone, "the child outlived its compare"


@pytest.mark.filterwarnings("ignore:No artists with labels")
def test_a_rerun_waits_for_a_run_folder_still_held(tmp_path):
    """A killed compare's child still stopping holds its run folder: the rerun waits for the lock
    instead of starting a run that is refused (reported as a failed seed). Before: FAILED."""
    import threading
    import time

    from groupwise import runfolder as rf

    class LockingTrainer(FakeTrainer):  # the real trainer takes the run lock first
        def __call__(self, argv, log_path):
            try:
                lock = rf.RunLock(log_path.parent).acquire()
            except rf.RunLocked as err:
                log_path.write_text(f"groupwise: {err}\n")
                return 1
            try:
                self.started = time.monotonic()
                return super().__call__(argv, log_path)
            finally:
                lock.release()

    compare(SPECS[:1], 1, tmp_path, ["train.steps=4"], None, _quiet(), FakeTrainer(fail={("base", 0)}))  # a run.json
    folder = tmp_path / "base" / "seed0"
    holder = rf.RunLock(folder).acquire()
    released = {}

    def release_later():
        time.sleep(0.6)
        released["at"] = time.monotonic()
        holder.release()

    threading.Thread(target=release_later).start()
    fake = LockingTrainer()
    result = compare(SPECS[:1], 1, tmp_path, ["train.steps=4"], None, _quiet(), fake)
    assert result["configs"][0]["runs"][0]["status"] == "ok" and fake.started >= released["at"]
    assert rf.wait_unlocked(folder, 0)


def test_compare_rejects_duplicate_labels_and_bad_configs(tmp_path):
    with pytest.raises(ConfigError, match="two configurations are labelled 'demo'"):
        compare(
            [ConfigSpec("demo", "demo"), ConfigSpec("demo", "sign")],
            1,
            tmp_path,
            console=_quiet(),
            launch=FakeTrainer(),
        )
    with pytest.raises(ConfigError, match="config 'b'.*trian"):
        compare(
            [ConfigSpec("a", "demo"), ConfigSpec("b", "demo", ["trian.steps=3"])],
            1,
            tmp_path,
            console=_quiet(),
            launch=FakeTrainer(),
        )


# ---------------------------------------------------------------------------------------------- claim files
GOOD = """\
paper = "99 Test — a paper"
claim = "better beats base"
metric = "final_accuracy"
direction = "greater"
exploratory_seeds = 2
baseline = "base"
common = ["train.steps=4", "eval.every=2"]
[[configs]]
label = "base"
recipe = "demo"
[[configs]]
label = "better"
recipe = "demo"
overrides = ["update.lr=3e-4"]
"""


def _claim(tmp_path, text, name="99-test.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_claim_file_loads(tmp_path):
    claim = load_claim(_claim(tmp_path, GOOD))
    assert (claim.slug, claim.metric, claim.baseline) == ("99-test", "final_accuracy", "base")
    assert claim.claimed == ["better"]
    assert claim.exploratory_seeds == 2 and claim.confirmatory_seeds is None and claim.kind == "superiority"
    assert claim.spec("better").overrides == ["update.lr=3e-4"]
    with_margin = GOOD.replace("exploratory_seeds = 2", "exploratory_seeds = 2\nmargin = 0.05")
    assert claim.margin == 0.0 and load_claim(_claim(tmp_path, with_margin)).margin == 0.05


@pytest.mark.parametrize(
    "edit,match",
    [
        (
            ('metric = "final_accuracy"', 'metric = "final_acc"'),
            r"metric = 'final_acc' is not a metric \(did you mean 'final_accuracy'\?\)",
        ),
        (('baseline = "base"', 'baseline = "grpo"'), r"baseline = 'grpo' is not a config label; labels: base, better"),
        (('metric = "final_accuracy"', 'metric = "steps_to_target"'), r"needs key 'target'"),
        (('metric = "final_accuracy"', 'metric = "seconds_to_target"\ntarget = 0.5'), None),
        (('direction = "greater"', 'direction = "up"'), r"direction = 'up'"),
        (("exploratory_seeds = 2", "exploratory_seeds = 0"), r"exploratory_seeds = 0"),
        (("exploratory_seeds = 2", "exploratory_seeds = 2\nmargin = -0.1"), r"margin = -0.1 must be a number >= 0"),
        (
            ("exploratory_seeds = 2", "exploratory_sedes = 2"),
            r"unknown key 'exploratory_sedes' \(did you mean 'exploratory_seeds'\?\)",
        ),
        (('overrides = ["update.lr=3e-4"]', "overides = []"), r"configs\[1\]: unknown key 'overides'"),
        (('label = "better"', 'label = "base"'), r"label 'base' is used twice"),
        (('label = "better"', 'label = "a b"'), r"label 'a b'"),
        (('"update.lr=3e-4"', '"update.lr"'), r"overrides must be a list of 'key=value'"),
        (('"update.lr=3e-4"', '"trian.steps=3"'), r"config 'better'.*unknown config key 'trian'"),
        (('recipe = "demo"\n[[configs]]', 'recipe = "no-such-recipe"\n[[configs]]'), r"no-such-recipe"),
        (('paper = "99 Test — a paper"\n', ""), r"missing required key 'paper'"),
    ],
)
def test_claim_file_errors_name_the_key(tmp_path, edit, match):
    old, new = edit
    assert old in GOOD
    path = _claim(tmp_path, GOOD.replace(old, new, 1))
    if match is None:  # eval.every is set in common: a valid *_to_target claim
        assert load_claim(path).target == 0.5
        return
    with pytest.raises(ClaimError, match=match):
        load_claim(path)


def test_to_target_claim_needs_eval_every(tmp_path):
    text = GOOD.replace('metric = "final_accuracy"', 'metric = "steps_to_target"\ntarget = 0.5').replace(
        ', "eval.every=2"', ""
    )
    with pytest.raises(ClaimError, match="eval.every"):
        load_claim(_claim(tmp_path, text))


def test_find_claims(tmp_path):
    for name in ("48-sign", "05-cgpo", "055-x"):
        (tmp_path / f"{name}.toml").write_text("")
    assert [p.stem for p in find_claims([], tmp_path)] == ["05-cgpo", "055-x", "48-sign"]
    assert [p.stem for p in find_claims(["48", "05-cgpo"], tmp_path)] == ["48-sign", "05-cgpo"]
    with pytest.raises(ClaimError, match="no claim file named '7'.*available: 05-cgpo"):
        find_claims(["7"], tmp_path)


SHIPPED_CLAIMS = sorted(
    [*ROOT.glob("claims/*.toml"), *ROOT.glob("src/groupwise/papers/*/claims/*.toml")], key=lambda p: p.stem
)


@pytest.mark.parametrize("path", SHIPPED_CLAIMS, ids=lambda p: p.stem)
def test_shipped_claim_files_are_valid(path):
    claim = load_claim(path)
    assert claim.slug[:2].isdigit(), "claim files are named NN-slug.toml"


# ---------------------------------------------------------------------------------------------- claims + docs
def test_run_claim_judges_and_docs_keep_readings(tmp_path):
    claims_dir, docs = tmp_path / "claims", tmp_path / "docs" / "claims.md"
    claims_dir.mkdir()
    claim = load_claim(_claim(claims_dir, GOOD))
    _claim(claims_dir, GOOD.replace("99 Test", "98 Other"), "98-other.toml")  # never run
    _claim(claims_dir, "paper = 1\n", "97-broken.toml")
    record = run_claim(claim, tmp_path / "runs", console=_quiet(), launch=FakeTrainer())
    (effect,) = record["effects"]
    # better − base per seed: 0.45 − 0.35 = 0.46 − 0.36 = 0.1 → s = 0, interval [0.1, 0.1] → held
    assert effect["effect"]["mean"] == pytest.approx(0.1)
    assert effect["verdict"] == "held"
    save_record(record, docs)
    assert (docs.parent / "claims" / "99-test.png").exists()
    text = regenerate(claims_dir, docs)
    # an exploratory record is never shown as a verdict
    assert (
        "| [99 Test — a paper](#99-test) | better beats base | final_accuracy (greater) | 0.355 ± 0.064 | "
        "0.455 ± 0.064 | +0.100 ± 0.000 | exploratory: interval on the claimed side, not confirmed | "
        "2 (0..1) |"
    ) in text
    assert "not run yet" in text and "invalid claim file" in text
    assert "![99-test exploratory run curves](claims/99-test.png)" in text
    assert text.count(PLACEHOLDER) == 3
    # a human writes a reading; regenerating (with a changed claim file) keeps it
    mine = "Held, but the two configs differ only by learning rate.\n\nSecond paragraph."
    docs.write_text(text.replace(f"<!-- reading:99-test -->\n{PLACEHOLDER}", f"<!-- reading:99-test -->\n{mine}"))
    (claims_dir / "99-test.toml").write_text(GOOD.replace("better beats base", "better beats base clearly"))
    again = regenerate(claims_dir, docs)
    assert readings(again)["99-test"] == mine
    assert again.count(PLACEHOLDER) == 2
    assert "claim file changed what is run" not in again  # the sentence is not what is run
    (claims_dir / "99-test.toml").write_text(GOOD.replace("train.steps=4", "train.steps=5"))
    assert "(claim file changed what is run since this record)" in regenerate(claims_dir, docs)


def test_judge_to_target_with_censoring(tmp_path):
    text = GOOD.replace('metric = "final_accuracy"', 'metric = "steps_to_target"\ntarget = 0.44').replace(
        'direction = "greater"', 'direction = "less"'
    )
    claim = load_claim(_claim(tmp_path, text))
    record = run_claim(claim, tmp_path / "runs", console=_quiet(), launch=FakeTrainer())
    (effect,) = record["effects"]
    # base never reaches 0.44 (0.35/0.36 at step 4): censored at its budget of 4 steps; better reaches
    # it at step 4 (seed 0: 0.45) and 2 (seed 1: 0.41 < 0.44 → step 4: 0.46) → d = [0, 0]
    assert effect["censored"] == {"claimed": [], "baseline": [0, 1]}
    assert effect["baseline_text"] == "not reached (0/2)"
    assert effect["verdict"] == "inconclusive"


# ---------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_compare_end_to_end(tmp_path):
    tiny = [
        "train.steps=3",
        "eval.size=16",
        "eval.every=2",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=6",
        "threads=1",
    ]
    # two shipped recipes (demo: GRPO; sign: A = 2r − 1, constant aggregation), shrunk by the shared overrides
    cmd = [
        sys.executable,
        "-m",
        "groupwise",
        "compare",
        "grpo=demo",
        "sign",
        "--seeds",
        "2",
        "--out",
        str(tmp_path),
        "--target",
        "0.3",
        *tiny,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "compare.json").read_text())
    assert [c["label"] for c in data["configs"]] == ["grpo", "sign"]
    for config in data["configs"]:
        assert [r["status"] for r in config["runs"]] == ["ok", "ok"]
        for run in config["runs"]:
            summary = json.loads((Path(run["folder"]) / "summary.json").read_text())
            assert run["metrics"]["final_accuracy"] == summary["accuracy_after"] and summary["steps"] == 3
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    # a rerun finds every seed done and runs nothing
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 0 and again.stderr.count("done before, skipped") == 4


# ---------------------------------------------------------------------------------- last:KEY metrics, several baselines
def _add_key(folder: Path, key: str, value) -> None:
    """Add ``key`` = value(step) to every row of a run folder's metrics.jsonl (None: leave the row without it)."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        v = value(r["step"])
        if v is not None:
            r[key] = v
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_last_key_metric_by_hand(tmp_path):
    _write_run(tmp_path, [(0, 0.2), (15, 0.3)], [0.1] * 15)
    _add_key(tmp_path, "x/share", lambda s: None if s == 5 else (float("nan") if s == 0 else s / 10))
    m = read_run(tmp_path, None, ["last:x/share", "last:absent"])
    # steps 0..14; step 5 does not log it, step 0 logs NaN (skipped): 13 finite values, the last
    # ceil(0.1 · 13) = 2 of them are steps 13 and 14 → (1.3 + 1.4) / 2 = 1.35
    assert m["last:x/share"] == pytest.approx(1.35)
    assert m["last:absent"] is None and m["last_reward"] == pytest.approx(0.1)
    assert "last:x/share" not in read_run(tmp_path, None)  # read only when asked for


def test_after_key_metric_reads_the_final_evaluations_summary_value(tmp_path):
    _write_run(tmp_path, [(0, 0.2)], [])  # a run of 0 training steps: no metrics.jsonl row to read last: from
    summary = json.loads((tmp_path / "summary.json").read_text())
    summary.update({"best_of_16_after": 0.75, "best_of_16_before": 0.5, "flag_after": True})
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    m = read_run(tmp_path, None, ["after:best_of_16", "after:absent", "after:flag"])
    assert m["after:best_of_16"] == 0.75 and m["after:absent"] is None and m["after:flag"] is None
    assert is_metric("after:best_of_16") and not is_metric("after:")


def test_std_key_metric_by_hand(tmp_path):
    _write_run(tmp_path, [(0, 0.2), (4, 0.3)], [0.1] * 4)
    _add_key(tmp_path, "grad_norm", lambda s: [1.0, 3.0, float("nan"), 5.0][s])
    # steps 0..3, NaN skipped: values 1, 3, 5 → mean 3, squared deviations 4 + 0 + 4 = 8, / (3 − 1) → std 2
    m = read_run(tmp_path, None, ["std:grad_norm", "std:absent"])
    assert m["std:grad_norm"] == pytest.approx(2.0) and m["std:absent"] is None
    assert is_metric("std:grad_norm") and not is_metric("std:") and not is_metric("var:grad_norm")


class KeyTrainer(FakeTrainer):
    """FakeTrainer whose runs also log ``x/share``: base 0.5, better 0.3 + 0.01·seed, worse 0.6."""

    def __call__(self, argv, log_path):
        rc = super().__call__(argv, log_path)
        folder = log_path.parent
        label, seed = folder.parent.name, int(folder.name.removeprefix("seed"))
        share = {"base": 0.5, "better": 0.3 + 0.01 * seed, "worse": 0.6}[label]
        _add_key(folder, "x/share", lambda s: share)
        return rc


def test_claim_on_a_last_key_metric_against_two_baselines(tmp_path):
    text = GOOD.replace('metric = "final_accuracy"', 'metric = "last:x/share"').replace(
        'direction = "greater"', 'direction = "less"'
    )
    text = (
        text.replace('baseline = "base"', 'baseline = ["base", "worse"]')
        + '[[configs]]\nlabel = "worse"\nrecipe = "demo"\noverrides = ["update.lr=1e-4"]\n'
    )
    claims_dir, docs = tmp_path / "claims", tmp_path / "docs" / "claims.md"
    claims_dir.mkdir()
    claim = load_claim(_claim(claims_dir, text))
    assert (claim.metric, claim.baseline, claim.baselines, claim.claimed) == (
        "last:x/share",
        "base",
        ["base", "worse"],
        ["better"],
    )
    record = run_claim(claim, tmp_path / "runs", console=_quiet(), launch=KeyTrainer())
    # better − base per seed: 0.30 − 0.5, 0.31 − 0.5 → −0.195 ± 12.706 · 0.00707 / √2 = ± 0.0635 → held (less)
    # better − worse: 0.30 − 0.6, 0.31 − 0.6 → −0.295 ± 0.0635 → held
    assert [(e["claimed"], e["baseline"]) for e in record["effects"]] == [("better", "base"), ("better", "worse")]
    assert [e["effect"]["mean"] for e in record["effects"]] == [pytest.approx(-0.195), pytest.approx(-0.295)]
    assert [e["verdict"] for e in record["effects"]] == ["held", "held"]
    assert record["summaries"]["base"]["last:x/share"] == "0.500 ± 0.000"
    assert "`last:x/share`" in (tmp_path / "runs" / "99-test" / "compare.md").read_text()
    save_record(record, docs)
    page = regenerate(claims_dir, docs)
    assert (
        "better beats base (better vs base) | last:x/share (less) | 0.500 ± 0.000 | 0.305 ± 0.064 | "
        "-0.195 ± 0.064 | exploratory: interval on the claimed side, not confirmed |"
    ) in page
    assert "better beats base (better vs worse) | last:x/share (less) | 0.600 ± 0.000 |" in page
    assert (
        "against `base`, `worse`" in page
        and "| worse (baseline) |" in page
        and "| config | final accuracy | reward area | last reward | `last:x/share` | wall seconds |" in page
    )
    for old, new, match in [
        (
            'metric = "last:x/share"',
            'metric = "last:"',
            r"metric = 'last:' is not a metric.*last:<a metrics.jsonl key>",
        ),
        ('baseline = ["base", "worse"]', 'baseline = ["base", "nope"]', r"baseline = 'nope' is not a config label"),
        ('baseline = ["base", "worse"]', 'baseline = ["base", "base"]', r"list of distinct labels"),
        (
            'baseline = ["base", "worse"]',
            'baseline = ["base", "worse"]\nclaimed = "worse"',
            r"claimed label 'worse' is not a non-baseline",
        ),
    ]:
        with pytest.raises(ClaimError, match=match):
            load_claim(_claim(tmp_path, text.replace(old, new), "96-bad.toml"))


def test_the_claims_page_has_one_section_and_one_clean_reading_per_claim_file():
    """docs/claims.md as committed: every claim file has its section once, and no reading swallowed
    another section (a merge that kept both sides of a conflict can do that silently)."""
    from groupwise.claims.report import readings

    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "claims.md").read_text()
    slugs = sorted(p.stem for p in SHIPPED_CLAIMS)
    headers = [line[3:] for line in page.splitlines() if line.startswith("## ")]
    assert sorted(h for h in headers if h in slugs) == slugs
    kept = readings(page)
    assert sorted(kept) == slugs
    assert [s for s, text in kept.items() if "<a id=" in text or "\n## " in f"\n{text}"] == []


# ---------------------------------------------------------------------------------------------- issue 35
# exploratory / confirmatory seeds, fixed fields, honest labels, provenance, power
CONFIRMABLE = GOOD.replace("exploratory_seeds = 2", "exploratory_seeds = 2\nconfirmatory_seeds = 2")


def test_a_confirmatory_run_never_draws_an_exploratory_seed(tmp_path):
    claim = load_claim(_claim(tmp_path, CONFIRMABLE))
    explore, confirm = FakeTrainer(), FakeTrainer()
    explored = run_claim(claim, tmp_path / "runs", console=_quiet(), launch=explore)
    confirmed = run_claim(claim, tmp_path / "runs", console=_quiet(), launch=confirm, phase="confirmatory")
    # exploratory: seeds 0, 1; confirmatory: the block from 1000 (CONFIRM_BASE), nothing else
    assert sorted({seed for _, seed in explore.calls}) == [0, 1]
    assert sorted({seed for _, seed in confirm.calls}) == [1000, 1001]
    assert (explored["seed_list"], confirmed["seed_list"]) == ([0, 1], [1000, 1001])
    assert confirmed["folder"] == str(tmp_path / "runs" / "confirm" / "99-test")  # its own folder: no run is shared
    # no exploratory count reaches the block, and a confirmatory run takes no other seeds
    with pytest.raises(ClaimError, match=r"exploratory_seeds = 1001 must be an integer in 1..1000"):
        too_many = CONFIRMABLE.replace("exploratory_seeds = 2", "exploratory_seeds = 1001")
        load_claim(_claim(tmp_path, too_many, "98-x.toml"))
    with pytest.raises(ClaimError, match=r"--seeds 1001 would reach the confirmatory block"):
        claim_seeds(claim, "exploratory", 1001)
    for count, offset in ((3, None), (None, 5)):
        with pytest.raises(ClaimError, match="--confirm draws the claim file's confirmatory_seeds"):
            claim_seeds(claim, "confirmatory", count, offset)
    with pytest.raises(ClaimError, match="no confirmatory_seeds"):
        claim_seeds(load_claim(_claim(tmp_path, GOOD, "97-y.toml")), "confirmatory")
    with pytest.raises(ClaimError, match="extra overrides"):
        run_claim(
            claim,
            tmp_path / "runs",
            extra=["train.steps=9"],
            console=_quiet(),
            launch=FakeTrainer(),
            phase="confirmatory",
        )
    # replication: anyone's own seeds, never in 1000..1999 (a block a claim not yet confirmed keeps unseen)
    assert claim_seeds(claim, "replication", None, 100) == [100, 101]
    assert claim_seeds(claim, "replication", 3, 2000) == [2000, 2001, 2002]
    for offset in (999, 1500):  # 999..1000 and 1500..1501 touch the block
        with pytest.raises(ClaimError, match="overlap the confirmatory block 1000..1999"):
            claim_seeds(claim, "replication", None, offset)


def _confirmed(tmp_path, text=CONFIRMABLE):
    """A claim file with a confirmatory record: (claims folder, page path, claim)."""
    claims_dir, docs = tmp_path / "claims", tmp_path / "docs" / "claims.md"
    claims_dir.mkdir(parents=True, exist_ok=True)
    claim = load_claim(_claim(claims_dir, text))
    save_record(run_claim(claim, tmp_path / "runs", console=_quiet(), launch=FakeTrainer(), phase="confirmatory"), docs)
    return claims_dir, docs, claim


@pytest.mark.parametrize(
    "old,new,change",
    [
        ("confirmatory_seeds = 2", "confirmatory_seeds = 3", "confirmatory_seeds (2 → 3)"),
        ('direction = "greater"', 'direction = "greater"\nmargin = 0.05', "margin (0.0 → 0.05)"),
        ("train.steps=4", "train.steps=8", "common ("),  # the run length
        ('metric = "final_accuracy"', 'metric = "last_reward"', "metric ('final_accuracy' → 'last_reward')"),
        ('"update.lr=3e-4"', '"update.lr=1e-3"', "configs ("),
    ],
)
def test_a_claim_file_edited_after_its_confirmatory_run_is_refused(tmp_path, monkeypatch, old, new, change):
    claims_dir, docs, claim = _confirmed(tmp_path)
    record = json.loads((docs.parent / "claims" / "99-test.confirm.json").read_text())
    assert record["fixed"]["confirmatory_seeds"] == 2 and record["claim_sha"] == claim.sha
    check_fixed(claim, docs)  # unchanged: accepted
    reworded = _claim(claims_dir, CONFIRMABLE.replace("better beats base", "better beats base, reworded"))
    check_fixed(load_claim(reworded), docs)  # the sentence is not a fixed field
    assert CONFIRMABLE.count(old) == 1
    edited = load_claim(_claim(claims_dir, CONFIRMABLE.replace(old, new)))
    with pytest.raises(ClaimError, match=re.escape(change) + r".*copy the file under a new id \(e.g. 99-test-2.toml"):
        check_fixed(edited, docs)
    # the command refuses before running anything; the page shows the refusal; the record is kept
    monkeypatch.chdir(tmp_path)
    from groupwise import cli

    for mode in (["--confirm"], []):
        argv = [
            "claims",
            *mode,
            "99-test",
            "--claims-dir",
            str(claims_dir),
            "--docs",
            str(docs),
            "--out",
            str(tmp_path / "r2"),
        ]
        assert cli.main(argv) != 0
    assert not (tmp_path / "r2").exists()
    page = regenerate(claims_dir, docs)
    assert "| [99-test](#99-test) | refused: claim file edited after its confirmatory run: " in page
    assert (docs.parent / "claims" / "99-test.confirm.json").read_text() == json.dumps(record, indent=1) + "\n"


def test_a_mechanism_claim_is_never_shown_as_held(tmp_path):
    mechanism = CONFIRMABLE.replace('direction = "greater"', 'direction = "greater"\nkind = "mechanism"')
    claims_dir, docs, claim = _confirmed(tmp_path, mechanism)
    assert claim.kind == "mechanism"
    record = json.loads((docs.parent / "claims" / "99-test.confirm.json").read_text())
    assert record["effects"][0]["verdict"] == "held"  # the statistics: d = +0.1 on both seeds
    page = regenerate(claims_dir, docs)
    (row,) = [line for line in page.splitlines() if line.startswith("| [99 Test")]
    assert (
        "| mechanism (true by construction): works as built (⚠ fewer than 5 confirmatory seeds) "
        "| 2 (1000..1001) |" in row
    )
    assert "held" not in row
    assert "**held**" not in page
    # a mechanism that does not work is said so
    failed = shown_verdict("mechanism", "confirmatory", "inconclusive", "")
    assert failed == "mechanism (true by construction): **not shown** (inconclusive)"
    # the same runs under a superiority claim: the confirmatory verdict is the bold one (the kind is fixed:
    # this is another claim, confirmed on its own)
    other_dir, other_docs, _ = _confirmed(tmp_path / "superiority")
    page = regenerate(other_dir, other_docs)
    assert "| +0.100 ± 0.000 | **held** (⚠ fewer than 5 confirmatory seeds) | 2 (1000..1001) |" in page


def test_parity_wording_needs_a_non_inferiority_margin(tmp_path):
    at_least = GOOD.replace("better beats base", "better is at least as good as base")
    with pytest.raises(ClaimError, match=r"the claim says 'at least'.*set kind = 'non_inferiority' and margin = M > 0"):
        load_claim(_claim(tmp_path, at_least))

    def add(text, lines):
        return text.replace('direction = "greater"', 'direction = "greater"\n' + lines)

    with pytest.raises(ClaimError, match=r"kind = 'non_inferiority' needs margin > 0"):
        load_claim(_claim(tmp_path, add(at_least, 'kind = "non_inferiority"')))
    with pytest.raises(ClaimError, match=r"margin = 0.05 is a non-inferiority margin: set kind = 'non_inferiority'"):
        load_claim(_claim(tmp_path, add(GOOD, 'kind = "superiority"\nmargin = 0.05')))
    claim = load_claim(_claim(tmp_path, add(at_least, "margin = 0.05")))
    assert (claim.kind, claim.margin) == ("non_inferiority", 0.05)  # a margin makes it non-inferiority
    for text in (add(GOOD, 'kind = "superior"'), GOOD.replace("exploratory_seeds = 2", "seeds = 2")):
        with pytest.raises(ClaimError, match=r"kind = 'superior' must be one of|'seeds' is now 'exploratory_seeds'"):
            load_claim(_claim(tmp_path, text))


def test_companions_are_shown_beside_the_metric(tmp_path):
    companions = 'direction = "greater"\ncompanions = ["cv:x/share", "last_reward"]'
    text = CONFIRMABLE.replace('direction = "greater"', companions)
    claims_dir, docs, claim = _confirmed(tmp_path, text)
    record = json.loads((docs.parent / "claims" / "99-test.confirm.json").read_text())
    (effect,) = record["effects"]
    # last_reward: the last 10 % (1 step) of [0.2, 0.3, 0.4, 0.5] + bonus → better − base = 0.6 − 0.5 = +0.1
    # on both seeds
    companions = {c["metric"]: c for c in effect["companions"]}
    assert companions["last_reward"]["effect"]["mean"] == pytest.approx(0.1)
    assert companions["cv:x/share"]["effect_text"] == "no pairs"  # FakeTrainer logs no x/share
    page = regenerate(claims_dir, docs)
    assert "| +0.100 ± 0.000; read with `cv:x/share` no pairs, `last_reward` +0.100 ± 0.000 | **held** (⚠" in page
    for bad in ('["final_accuracy"]', '["bogus"]', '["last_reward", "last_reward"]'):
        text = GOOD.replace('direction = "greater"', f'direction = "greater"\ncompanions = {bad}')
        with pytest.raises(ClaimError, match="companions = .* must be a list of distinct metrics other than"):
            load_claim(_claim(tmp_path, text, "96-c.toml"))


def test_cv_key_metric_by_hand(tmp_path):
    _write_run(tmp_path, [(0, 0.2), (4, 0.3)], [0.1] * 4)
    _add_key(tmp_path, "grad_norm", lambda s: [1.0, 3.0, float("nan"), 5.0][s])
    # values 1, 3, 5: std 2 (test_std_key_metric_by_hand), mean 3 → cv = 2 / 3
    m = read_run(tmp_path, None, ["cv:grad_norm"])
    assert m["cv:grad_norm"] == pytest.approx(2 / 3)
    _add_key(tmp_path, "zero", lambda s: [1.0, -1.0, 1.0, -1.0][s])  # mean 0: no cv
    assert read_run(tmp_path, None, ["cv:zero"])["cv:zero"] is None and is_metric("cv:grad_norm")


def test_provenance_is_stored(tmp_path):
    claim = load_claim(_claim(tmp_path, CONFIRMABLE.replace('"eval.every=2"', '"eval.every=2", "threads=1"')))
    record = run_claim(claim, tmp_path / "runs", console=_quiet(), launch=FakeTrainer(), phase="confirmatory")
    prov = record["provenance"]
    import torch
    import transformers

    assert prov["torch"] == torch.__version__ and prov["transformers"] == transformers.__version__
    assert prov["threads"] == [1] and prov["cpu_count"] == os.cpu_count() and prov["cpu"] == cpu_model()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert prov["commit"] == (head.stdout.strip() if head.returncode == 0 else "unknown")
    assert record["fixed_sha"] and record["claim_sha"] == claim.sha and record["phase"] == "confirmatory"
    # the CPU model is /proc/cpuinfo's first "model name"
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: X\nmodel name\t: Test CPU 9000 @ 3.0GHz\n\nprocessor\t: 1\nmodel name\t: other\n"
    )
    assert cpu_model(info) == "Test CPU 9000 @ 3.0GHz"
    regenerate(tmp_path, tmp_path / "docs" / "claims.md")  # (no record saved: just that the page builds)
    save_record(record, tmp_path / "docs" / "claims.md")
    page = regenerate(tmp_path, tmp_path / "docs" / "claims.md")
    assert f"Provenance: commit `{prov['commit'][:12]}`" in page and f"torch {torch.__version__}" in page
    assert "threads 1." in page


@pytest.mark.parametrize("dof", range(1, 31))
def test_t80_table_is_the_quantile_of_the_t_density(dof):
    # ∫_0^q f_ν(x) dx must be 0.30 (0.80 − 0.5); Simpson's rule on 2000 intervals
    q, n = T80[dof - 1], 2000
    c = math.gamma((dof + 1) / 2) / (math.sqrt(dof * math.pi) * math.gamma(dof / 2))
    f = lambda x: c * (1 + x * x / dof) ** (-(dof + 1) / 2)  # noqa: E731
    h = q / n
    area = h / 3 * (f(0) + f(q) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, n)))
    assert area == pytest.approx(0.30, abs=2e-6)
    assert t80(10**6) == pytest.approx(0.841621, abs=1e-5) and t80(40) == pytest.approx(0.850700, abs=1e-4)


def test_detectable_effect_by_hand():
    # n = 5, s = 0.1: (t975(4) + t80(4)) · s / √n = (2.776445 + 0.940965) · 0.1 / 2.236068 = 0.166248
    assert detectable_effect(0.1, 5) == pytest.approx(0.166248, abs=1e-6)
    # n = 3, s = 0.0236 (05-cgpo's exploratory pairs): (4.302653 + 1.060660) · 0.0236 / 1.732051 = 0.073078
    assert detectable_effect(0.0236, 3) == pytest.approx(0.073078, abs=1e-6)
    assert detectable_effect(None, 1) is None and detectable_effect(0.1, 1) is None
    effect = {"effect": {"sd": 0.1, "n": 5}}
    assert detectable_text(effect, "final_accuracy", "greater", 0.0) == "smallest detectable effect ±0.166 at n=5"
    beyond = detectable_text(effect, "final_accuracy", "greater", 0.05)
    assert beyond == "smallest detectable effect 0.166 beyond the bound -0.05 at n=5"


def test_expected_false_held_by_hand(tmp_path):
    # one-sided 0.025 per comparison: 74 comparisons → 1.85; 5 → 0.125
    assert expected_false_held(74) == pytest.approx(1.85) and expected_false_held(5) == pytest.approx(0.125)
    # a page with one confirmatory comparison (held) and two exploratory ones (claimed vs base and vs worse)
    claims_dir, docs, _ = _confirmed(tmp_path)
    worse = '[[configs]]\nlabel = "worse"\nrecipe = "demo"\n'
    two = GOOD.replace('baseline = "base"', 'baseline = ["base", "worse"]') + worse
    other = load_claim(_claim(claims_dir, two.replace("99 Test", "98 Other"), "98-other.toml"))
    save_record(run_claim(other, tmp_path / "runs", console=_quiet(), launch=FakeTrainer()), docs)
    page = regenerate(claims_dir, docs)
    assert (
        "The table judges 3 comparisons (0 mechanism checks not counted): 1 confirmatory (1 held, 0 contradicted, "
        "0 inconclusive) and 2 exploratory."
    ) in page
    assert "about 0.025 × 1 = 0.025 of the confirmatory comparisons" in page
    assert "(0.025 × 3 = 0.075 over all 3)" in page


def test_resample_eval_draws_each_seed_its_own_held_out_prompts():
    from groupwise.config import DataCfg
    from groupwise.tasks import load_splits

    fixed = load_splits(DataCfg(), 7)[1]
    assert load_splits(DataCfg(), 8)[1] == fixed  # default: the same test split, in the same order, for every seed
    seven, again, eight = (load_splits(DataCfg(resample_eval=True), seed)[1] for seed in (7, 7, 8))
    assert seven == again  # the same seed (both arms of a pair) scores the same prompts
    key = lambda rows: sorted(r["prompt"] for r in rows)  # noqa: E731
    assert key(seven) == key(fixed) and len(fixed) == 500  # a reordering of the whole split (arithmetic: 500)
    # the first eval.size = 200 differ between seeds and from the fixed set
    assert key(seven[:200]) != key(fixed[:200]) and key(seven[:200]) != key(eight[:200])


def test_every_held_or_contradicted_verdict_on_the_page_is_confirmatory():
    """docs/claims.md as committed: a bold held / contradicted is a confirmatory record over >= 5
    seeds from 1000 with its provenance, and no confirmed claim file changed its fixed fields."""
    page = (ROOT / "docs" / "claims.md").read_text()
    for line in page.splitlines():
        if line.startswith("| [") and ("**held**" in line or "**contradicted**" in line):
            slug = re.search(r"\]\(#([^)]+)\)", line).group(1)
            record = json.loads((ROOT / "docs" / "claims" / f"{slug}.confirm.json").read_text())
            assert record["phase"] == "confirmatory" and record["seeds"] >= 5 and min(record["seed_list"]) >= 1000, slug
            assert record["provenance"]["commit"] != "unknown" and record["provenance"]["cpu"], slug
    for path in SHIPPED_CLAIMS:
        check_fixed(load_claim(path, check_configs=False), ROOT / "docs" / "claims.md")


def test_paper_pages_show_the_verdicts_of_docs_claims():
    """Each paper page's claim section is what ``groupwise claims`` writes from docs/claims.md (its
    status lines and the readings), so a page never shows a verdict the records do not have."""
    from groupwise.claims.pages import paper_pages

    pages = paper_pages(ROOT / "docs" / "claims.md")
    assert len(pages) >= 40
    stale = [str(page.relative_to(ROOT)) for page, text in pages.items() if page.read_text() != text]
    assert stale == [], "regenerate: groupwise claims --docs-only (from the repository root)"


def test_status_line_by_hand(tmp_path):
    from groupwise.claims.pages import claim_section, status_line

    claims_dir, docs, claim = _confirmed(tmp_path)
    record = json.loads((docs.parent / "claims" / "99-test.confirm.json").read_text())
    line = status_line(claim, record, None)
    assert line.startswith("- `99-test` (`final_accuracy`, greater), confirmatory seeds 1000..1001: `better`")
    assert "**held**" in line
    explored = run_claim(claim, tmp_path / "runs", console=_quiet(), launch=FakeTrainer())
    assert "Exploratory seeds 0..1: +0.100 ± 0.000." in status_line(claim, record, explored)
    alone = status_line(claim, None, explored)
    assert "held" not in alone and "interval on the claimed side. Not confirmed" in alone
    page = "# 99\n\n## Claim, as measured\n\nMy summary.\n\n### 99-test\n\nold reading\n\nTable and curves: x\n"
    rebuilt = claim_section(page, [line], {"99-test": "New\nreading."}, ["99-test"])
    assert rebuilt.startswith("# 99\n\n## Claim, as measured\n\n<!-- claims-status:")
    assert "\n<!-- /claims-status -->\n\nMy summary.\n\n### 99-test\n\nNew reading.\n\nTable and curves: " in rebuilt
    assert claim_section(rebuilt, [line], {"99-test": "New\nreading."}, ["99-test"]) == rebuilt  # idempotent


def test_a_replication_is_never_recorded_as_the_verdict(tmp_path):
    claims_dir, docs = tmp_path / "claims", tmp_path / "docs" / "claims.md"
    claims_dir.mkdir()
    claim = load_claim(_claim(claims_dir, CONFIRMABLE))
    fake = FakeTrainer()
    record = run_claim(claim, tmp_path / "runs", console=_quiet(), launch=fake, phase="replication", seed_offset=100)
    assert sorted({seed for _, seed in fake.calls}) == [100, 101] and record["phase"] == "replication"
    where = save_record(record, docs)
    assert where == tmp_path / "runs" / "replicate" / "99-test-from100" / "record.json"
    assert not (docs.parent / "claims").exists()  # nothing in docs/claims/
    assert "| not run yet |" in regenerate(claims_dir, docs)
