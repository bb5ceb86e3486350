"""Issue 13: reward functions get TRL's ``log_extra`` / ``log_metric`` / ``completion_ids`` and may
be ``async def``. Hand values: the logged columns are the completions' own lengths and texts, the
metric is the mean of what was logged, async sleeps overlap."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch
from helpers import info_for, make_rollout, run_two_ranks
from test_trainer import make_trainer

from groupwise.logging import sample_rows
from groupwise.rewards import _async
from groupwise.rewards._hooks import accepts
from groupwise.rewards.exact import Exact
from groupwise.rewards.python import Python
from groupwise.rewards.score import RewardAborted, RewardError, score
from groupwise.rewards.stage import RewardStage
from groupwise.run import Run

P3, C3 = ["p", "q", "r"], ["a", "bb", "ccc"]

REWARD_FILE = """
def lens(prompts, completions, completion_ids, log_extra, log_metric, **kwargs):
    log_extra("len", [len(c) for c in completions])
    log_extra("text", list(completions))
    log_extra("ids", completion_ids)
    log_metric("m", 2.0)
    log_metric("m", 4.0)
    return [1.0 if c.strip().isdigit() else 0.0 for c in completions]
"""


# ---------------------------------------------------------------------------- end to end
def test_logged_columns_reach_samples_jsonl_and_metrics_are_averaged(tmp_path, monkeypatch):
    # matplotlib's import: 2 s of nothing tested here
    monkeypatch.setattr("groupwise.run.plot_rewards", lambda *args, **kwargs: None)
    (tmp_path / "rw.py").write_text(REWARD_FILE)
    run = tmp_path / "run"
    trainer = make_trainer(
        run,
        "train.steps=1",
        "eval.size=0",
        "log.samples=16",
        f'rewards=[{{name="python", fn="{tmp_path / "rw.py"}:lens"}}]',
    )
    Run(trainer).train()
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 16  # 4 prompts × 4 rows, all logged
    for row in rows:  # each row carries its own completion's values, not a neighbour's
        assert row["extra"]["text"] == row["completion"]
        assert row["extra"]["len"] == len(row["completion"])  # e.g. "102" -> 3
    batch = trainer.last_batch
    for b in range(4):
        for g in range(4):  # completion_ids are the row's unmasked action tokens
            assert batch.info[b][g]["extra"]["ids"] == batch.actions[b, g][batch.mask[b, g]].tolist()
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["reward_metric/m"] == 3.0  # (2 + 4) / 2: a mean, not the last value (4) or the sum (6)


# ---------------------------------------------------------------------------- the stage
class _Policy:
    on_error, missing, timeout_s, max_error_rate = "raise", "exclude", 0.0, 0.1


def test_stage_puts_extras_on_scored_rows_only_and_pops_metrics_once():
    def fn(prompts, completions, log_extra, log_metric, **kwargs):
        log_extra("n", [10 * i for i in range(len(completions))])
        log_metric("calls", 1.0)
        return [0.0] * len(completions)

    stage = RewardStage([{"name": "python", "fn": fn}], _Policy(), lambda ro: ro.completions, max_new_tokens=3)
    ro = make_rollout(B=2, G=2, T=3, awkward=False)
    ro.group_valid[1, 1] = False  # a padding row of a ragged group: not scored, no extra
    ro.info, ro.meta = [], [{"prompt": "p0"}, {"prompt": "p1"}]
    stage.score_local(ro)
    # 3 scored rows (0,0) (0,1) (1,0) get 0, 10, 20 in order; (1,1) an empty dict
    assert [[r.get("extra", {}).get("n") for r in group] for group in ro.info] == [[0, 10], [20, None]]
    stage.score_local(ro)  # a second scoring call in the step (a refill round): 1 + 1 over 2 calls
    assert stage.pop_metrics() == {"reward_metric/calls": 1.0}
    assert stage.pop_metrics() == {}  # reset: nothing logged since


def test_trainer_state_carries_the_step_when_the_caller_gives_it():
    seen = []

    def fn(prompts, completions, trainer_state=None, **kwargs):
        seen.append(None if trainer_state is None else trainer_state.global_step)
        return [0.0] * len(completions)

    stage = RewardStage([{"name": "python", "fn": fn}], _Policy(), lambda ro: ro.completions, max_new_tokens=3)
    ro = make_rollout(B=1, G=2, T=3, awkward=False)
    ro.meta = [{"prompt": "p0"}]
    stage.score_local(ro, info_for(3, step=5))
    stage.score_local(ro)
    assert seen == [5, None]  # TRL's global_step = optimiser steps done = the 0-based step index


def test_sample_rows_write_extras_json_safe():
    ro = make_rollout(B=1, G=2, T=3, awkward=False)
    ro.info = [[{"extra": {"x": float("nan"), "t": torch.tensor([1, 2]), "o": object}}, {}]]
    rows = sample_rows(ro, 0, 2)
    assert rows[0]["extra"] == {"x": None, "t": [1, 2], "o": "<class 'object'>"}
    assert "extra" not in rows[1]  # a row without extras keeps the old keys only
    json.dumps(rows)


# ---------------------------------------------------------------------------- contracts
@pytest.mark.parametrize("on_error", ["raise", "exclude"])
def test_wrong_length_extra_is_an_error_naming_function_column_and_lengths(on_error):
    def short(prompts, completions, log_extra, **kwargs):
        try:  # even a function that swallows the error does not get past it
            log_extra("len", [1])
        except RewardError:
            pass
        return [0.0] * len(completions)

    with pytest.raises(
        RewardError,
        match=r"reward '.*short': log_extra\('len', values\) got 1 values for 3 completions \(expected 3, got 1\)",
    ):
        score([short], P3, C3, {}, on_error=on_error)


def test_metric_must_be_a_number_and_hooks_skip_builtins_and_plain_signatures():
    def bad(prompts, completions, log_metric, **kwargs):
        log_metric("m", "high")
        return [0.0] * 3

    with pytest.raises(RewardError, match=r"reward '.*bad': log_metric\('m', value\) needs a real number, got 'high'"):
        score([bad], P3, C3, {})
    plain = lambda prompts, completions, answer: [1.0, 2.0, 3.0]  # noqa: E731 - no **kwargs: called exactly as before
    res = score([plain, Exact()], P3, C3, {"answer": ["a", "x", "ccc"]})
    assert res.total.tolist() == [2.0, 2.0, 4.0]  # 1+1, 2+0, 3+1
    assert not accepts(Exact(), "log_extra") and accepts(Python(fn=lambda **kw: kw), "log_metric")


def test_a_failed_call_logs_nothing():
    def logs_then_fails(prompts, completions, log_extra, log_metric, **kwargs):
        log_extra("len", [1, 2, 3])
        log_metric("m", 1.0)
        raise ValueError("late")

    res = score([logs_then_fails], P3, C3, {}, on_error="exclude")
    assert (
        res.extra == {}
        and res.metrics == {}
        and res.counts[f"{__name__}.test_a_failed_call_logs_nothing.<locals>.logs_then_fails/error"] == 3
    )


# ---------------------------------------------------------------------------- async rewards
async def nap_a(prompts, completions, **kwargs):
    await asyncio.sleep(0.3)
    return [1.0] * len(completions)


async def nap_b(prompts, completions, log_extra, **kwargs):
    await asyncio.sleep(0.3)
    log_extra("len", [len(c) for c in completions])
    return [0.5] * len(completions)


def test_async_rewards_run_concurrently_on_one_daemon_loop():
    score([Python(fn=nap_a)], P3, C3, {})  # the loop is started (once) before timing
    start = time.perf_counter()
    res = score([Python(fn=nap_a), Python(fn=nap_b), Exact()], P3, C3, {"answer": C3}, timeout_s=5.0)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5  # 0.3 s each, together; one after the other would be ≥ 0.6 s
    assert res.total.tolist() == [2.5, 2.5, 2.5]  # 1 + 0.5 + 1 (exact match)
    assert res.extra == {"len": [1, 2, 3]}
    loops = [t for t in threading.enumerate() if t.name == "groupwise-reward-loop"]
    assert len(loops) == 1 and loops[0].daemon  # one persistent loop, not one per call


def test_async_timeout_is_the_sync_timeout_error():
    async def sleepy(prompts, completions, **kwargs):
        await asyncio.sleep(5)
        return [1.0] * 3

    start = time.perf_counter()
    with pytest.raises(RewardError, match=r"reward '.*sleepy' did not return within timeout_s=0.2 s") as info:
        score([Python(fn=sleepy)], P3, C3, {}, timeout_s=0.2)
    assert time.perf_counter() - start < 2.0 and isinstance(info.value.__cause__, TimeoutError)
    res = score([Python(fn=sleepy), Exact()], P3, C3, {"answer": C3}, timeout_s=0.2, on_error="exclude")
    assert res.excluded.tolist() == [True, True, True]


def test_async_blocking_the_loop_times_out_and_a_fresh_loop_serves_the_next_call(monkeypatch):
    monkeypatch.setattr(_async, "_LOOP_GRACE_S", 0.2)

    async def blocks(prompts, completions, **kwargs):
        time.sleep(0.8)  # synchronous work on the loop thread: cannot be cancelled
        return [1.0] * 3

    with pytest.raises(
        RewardError, match=r"reward '.*blocks' did not return within timeout_s=0.2 s \(the event loop was blocked"
    ):
        score([Python(fn=blocks)], P3, C3, {}, timeout_s=0.2)
    assert "thread" not in _async._state  # retired: the next call starts a fresh loop
    assert score([Python(fn=nap_a)], P3, C3, {}, timeout_s=2.0).total.tolist() == [1.0, 1.0, 1.0]
    fresh = _async._state["thread"]
    old = [t for t in threading.enumerate() if t.name == "groupwise-reward-loop" and t is not fresh]
    for thread in old:  # the blocked loop's thread ends once its coroutine returns (0.8 s): none left behind
        thread.join(2.0)
        assert not thread.is_alive()


def test_async_exception_and_exit():
    async def broken(prompts, completions, **kwargs):
        raise ValueError("boom")

    async def quits(prompts, completions, **kwargs):
        raise SystemExit(0)

    with pytest.raises(RewardError, match=r"reward '.*broken' raised ValueError: boom") as info:
        score([Python(fn=broken)], P3, C3, {})
    assert isinstance(info.value.__cause__, ValueError)
    res = score([Python(fn=broken), Exact()], P3, C3, {"answer": C3}, on_error="exclude")
    assert res.excluded.tolist() == [True, True, True]
    with pytest.raises(RewardAborted, match=r"reward '.*quits' raised SystemExit\(0\)"):
        score([Python(fn=quits)], P3, C3, {}, on_error="exclude")
    assert score([Python(fn=nap_a)], P3, C3, {}).total.tolist() == [1.0, 1.0, 1.0]  # the loop survived the exit


# ---------------------------------------------------------------------------- two ranks
DRIVER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from groupwise import dist
from groupwise.rewards.stage import RewardStage
from helpers import info_for, make_rollout

rank, world = dist.init()

class Policy:
    on_error, missing, timeout_s, max_error_rate = "raise", "exclude", 0.0, 0.1

def fn(prompts, completions, log_extra, log_metric, **kwargs):
    log_metric("both", 2.0 * (rank + 1))
    if rank == 1:  # a name only one rank logs must not hang the other
        log_metric("both", 4.0)
        log_metric("only1", 7.0)
    log_extra("rank", [rank] * len(completions))
    return [0.0] * len(completions)

stage = RewardStage([{"name": "python", "fn": fn}], Policy(), lambda ro: ro.completions, 3)
ro = make_rollout(B=1, G=2, T=3, awkward=False)
ro.info, ro.meta = [], [{"prompt": "p"}]
stage.score_local(ro)
batch = dist.gather_rollout(ro)
with open(f"{sys.argv[2]}/rank{rank}.json", "w") as fh:  # a file each: printed lines of two ranks interleave
    json.dump([stage.pop_metrics(), [[r["extra"]["rank"] for r in g] for g in batch.info]], fh)
dist.shutdown()
"""


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_average_metrics_and_gather_extras(tmp_path):
    got = run_two_ranks(DRIVER, tmp_path)
    # both: rank 0 logs 2, rank 1 logs 4 and 4 -> (2 + 4 + 4) / 3 = 10/3; rows gathered in rank order
    want = [{"reward_metric/both": pytest.approx(10 / 3), "reward_metric/only1": 7.0}, [[0, 0], [1, 1]]]
    assert got == [want, want]
