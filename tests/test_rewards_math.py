"""The math reward: gold extraction on real GSM8K / MATH-500 rows, verification through the worker
process, and the hard per-item timeout on adversarial input (measured)."""

from __future__ import annotations

import copy
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from groupwise.errors import ConfigError
from groupwise.registry import build
from groupwise.rewards import RewardError, score
from groupwise.rewards.math import (
    Math,
    completion_answer_text,
    gold_answer,
    gsm8k_answer,
    last_boxed,
    verify_in_process,
)

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
GSM8K = DATA / "gsm8k" / "test.jsonl"
MATH500 = DATA / "math500" / "test.jsonl"
needs_data = pytest.mark.skipif(not (GSM8K.exists() and MATH500.exists()), reason="../shared/data not present")

ADVERSARIAL = r"The answer is $\boxed{9^{9^{9^{9}}}}$"  # SymPy would compute 9^(9^387420489)


def rows(path: Path, n: int | None = None) -> list[dict]:
    with open(path) as f:
        out = [json.loads(line) for line in f]
    return out[:n] if n else out


@pytest.fixture(scope="module")
def reward():
    r = Math()
    r._workers.start()  # cold start (imports SymPy) outside the timed tests
    yield r
    r.close()


# ----------------------------------------------------------------------------- extraction helpers


def test_last_boxed_hand_cases():
    assert last_boxed(r"so $\boxed{\frac{1}{2}}$.") == r"\frac{1}{2}"  # nested braces kept whole
    assert last_boxed(r"\boxed{1} then \boxed{2}") == "2"  # the last one wins
    assert last_boxed(r"\boxed {x^{2}}") == "x^{2}"  # space before the brace
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"\boxed{unbalanced") is None
    assert last_boxed("no box") is None


def test_gsm8k_answer_hand_cases():
    assert gsm8k_answer("work\n#### 18") == "18"
    assert gsm8k_answer("#### 1,450,000") == "1450000"  # thousands separators dropped
    assert gsm8k_answer("#### -3.5") == "-3.5"
    assert gsm8k_answer("#### 1, 2") == "1, 2"  # a comma not between digits is kept
    assert gsm8k_answer("no marker") is None


def test_gold_answer_formats():
    assert gold_answer("x = <<2+1=3>>3\n#### 3") == "3"  # GSM8K
    assert gold_answer(r"so $\boxed{\frac{\pi}{2}}$.The answer is: \frac{\pi}{2}") == r"\frac{\pi}{2}"  # MATH
    assert gold_answer("blah The answer is: 12") == "12"  # MetaMath-style tail without a box
    assert gold_answer("#### Step 1\nso $\\boxed{4}$") == "4"  # a box beats a Markdown heading
    assert gold_answer(" 82 ") == "82" and gold_answer(82) == "82"  # bare answer
    assert gold_answer(None) is None and gold_answer("   ") is None


def test_completion_answer_text():
    assert completion_answer_text("5 + 6 = 11 so\n#### 11") == " 11"
    assert completion_answer_text(r"$\boxed{3}$") == r"$\boxed{3}$"
    # a boxed answer before a later Markdown "####" heading is kept
    assert completion_answer_text("$\\boxed{3}$\n#### Check") == "$\\boxed{3}$\n#### Check"


@needs_data
def test_gold_extraction_on_real_rows():
    g = rows(GSM8K, 2)
    m = rows(MATH500, 1)
    # gsm8k test row 0 ends "#### 18", row 1 "#### 3"
    assert [gold_answer(r["answer"]) for r in g] == ["18", "3"]
    # math500 row 0: "... \boxed{\left( 3, \frac{\pi}{2} \right)}.The answer is: ..."
    assert gold_answer(m[0]["answer"]) == r"\left( 3, \frac{\pi}{2} \right)"
    # over all 500 MATH rows the last box equals the "The answer is:" tail (8 rows have >1 box)
    for r in rows(MATH500):
        assert last_boxed(r["answer"]).strip() == r["answer"].rsplit("The answer is:", 1)[1].strip()
    # GSM8K golds with separators: every one becomes a plain (possibly negative) integer
    for r in rows(GSM8K):
        assert gold_answer(r["answer"]).lstrip("-").isdigit(), r["answer"][-40:]


# ----------------------------------------------------------------------------- verification


def test_hand_cases(reward):
    completions = [
        "16 - 3 - 4 = 9 eggs, 9 * 2 = 18 dollars. The answer is 18.",  # plain number -> 1
        r"The answer is $\boxed{0.5}$",  # 0.5 == \frac{1}{2} -> 1
        r"The answer is $\boxed{\frac{1}{3}}$",  # != 1/2 -> 0
        "I don't know",  # no answer -> 0
        "#### 1,000",  # GSM8K marker + separators vs 1000 -> 1
        "anything",  # gold None -> no verdict
    ]
    golds = ["#### 18", r"\boxed{\frac{1}{2}}", r"\frac12", "7", "#### 1000", None]
    assert reward([""] * 6, completions, answer=golds) == [1.0, 1.0, 0.0, 0.0, 1.0, None]
    assert reward([], [], answer=[]) == []


def test_errors_and_config():
    with pytest.raises(RewardError, match="'math' needs the dataset column 'solution'"):
        Math(column="solution")(["p"], ["1"], answer=["1"])  # raised before any worker starts
    with pytest.raises(ConfigError, match="timeout_s must be > 0"):
        build("reward", "math", timeout_s=0)


@needs_data
@pytest.mark.parametrize(
    "path, equivalent",
    [
        (GSM8K, set()),
        # MATH-500 rows 22 and 23 answer "5" and "x=5": math-verify reads an equation "x=5" as its
        # right-hand side, so row 23's answer is right for row 22
        (MATH500, {22}),
    ],
    ids=["gsm8k", "math500"],
)
def test_real_rows_verify_against_own_gold(reward, path, equivalent):
    """First 50 rows: a completion ending in the row's own final answer scores 1.0; one ending in
    the next row's answer scores 0.0 (except where the two answers are equivalent)."""
    data = rows(path, 51)
    golds = [r["answer"] for r in data[:50]]
    finals = [gold_answer(r["answer"]) for r in data]
    right = [f"Let me work it out. The final answer is $\\boxed{{{a}}}$." for a in finals[:50]]
    wrong = [f"Let me work it out. The final answer is $\\boxed{{{a}}}$." for a in finals[1:51]]
    t0 = time.perf_counter()
    got = reward(["q"] * 100, right + wrong, answer=golds + golds)
    rate = 100 / (time.perf_counter() - t0)
    print(f"\n{path.parent.name}: {rate:.0f} items/s through the worker")
    assert got[:50] == [1.0] * 50
    assert got[50:] == [1.0 if i in equivalent else 0.0 for i in range(50)]


@needs_data
def test_gsm8k_reference_solutions_verify(reward):
    """The worked GSM8K solution itself (with <<calc>> annotations, ending '#### N') as completion."""
    data = rows(GSM8K, 50)
    golds = [r["answer"] for r in data]
    assert reward(["q"] * 50, golds, answer=golds) == [1.0] * 50


def test_in_process_helper_agrees():
    assert verify_in_process("#### 18", "so 18") == 1.0
    assert verify_in_process(r"\boxed{\frac{\pi}{2}}", r"$\frac{\pi}{2}$") == 1.0
    assert verify_in_process("#### 18", "so 19") == 0.0


# ----------------------------------------------------------------------------- never hangs


def test_adversarial_input_times_out_within_budget():
    timeout_s = 1.0
    r = Math(timeout_s=timeout_s)
    t0 = time.perf_counter()
    r._workers.start()  # warm: the measured time is the item's, not SymPy's import
    cold_start = time.perf_counter() - t0  # what a replacement worker costs on this machine, now
    t0 = time.perf_counter()
    out = r(["q"], [ADVERSARIAL], answer=["5"])
    elapsed = time.perf_counter() - t0
    print(f"\nadversarial item: {elapsed:.2f} s with timeout_s={timeout_s}")
    assert out == [None]  # no verdict, not 0.0
    assert timeout_s <= elapsed < timeout_s + 2.0
    assert r._timeouts == 1 and r._workers.restarts == 1
    # in the middle of a batch, through score(): the item is excluded and counted, the items after
    # it are resent to the restarted worker and scored
    t0 = time.perf_counter()
    res = score([r], ["q"] * 3, ["The answer is 4", ADVERSARIAL, "The answer is 6"], {"answer": ["4", "5", "7"]})
    elapsed = time.perf_counter() - t0
    assert res.parts[:, 0].tolist()[0::2] == [1.0, 0.0] and res.excluded.tolist() == [False, True, False]
    assert res.counts["math/missing"] == 1 and res.counts["excluded"] == 1
    # one timeout + at most one cold start of the replacement (measured above: a loaded machine is slower)
    assert elapsed < timeout_s + 2.0 + 2.0 * cold_start
    assert r._timeouts == 2
    r.close()


def test_works_off_the_main_thread(reward):
    """math-verify's signal.alarm fails off the main thread; the worker process does not care."""
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("v", reward(["q"], ["x = 7"], answer=["#### 7"])))
    thread.start()
    thread.join(30)
    assert out["v"] == [1.0]


def test_dead_worker_is_replaced(reward):
    (pid,) = reward._workers.worker_pids()
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.1)
    assert reward(["q"], ["The answer is 3"], answer=["3"]) == [1.0]  # the item is not blamed
    assert reward._workers.worker_pids() != [pid]


def test_two_workers_split_a_batch():
    r = Math(num_workers=2)
    # gold 1..6 against answers 1,0,3,0,5,0 -> alternate right / wrong across both workers' chunks
    out = r(["q"] * 6, ["1", "0", "3", "0", "5", "0"], answer=["1", "2", "3", "4", "5", "6"])
    assert out == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert len(set(r._workers.worker_pids())) == 2
    r.close()


def test_copy_and_pickle_do_not_share_workers(reward):
    clone = pickle.loads(pickle.dumps(reward))
    assert clone._pool is None and clone.timeout_s == reward.timeout_s
    assert copy.deepcopy(reward)._pool is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_worker_dies_with_its_parent():
    """A parent that dies without cleanup (os._exit skips finalizers) while its worker is stuck on
    the adversarial item leaves no worker running. (An idle worker would exit anyway on EOF.)"""
    code = (
        "import os, time; from groupwise.rewards._math_pool import MathVerifierPool\n"
        "p = MathVerifierPool(); p.start(); print(p.worker_pids()[0], flush=True)\n"
        f"p._workers[0].conn.send([(0, '5', {ADVERSARIAL!r})]); time.sleep(0.5); os._exit(0)"
    )
    helper = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = int(helper.stdout.readline())  # not communicate(): the worker shares this pipe
    helper.wait(timeout=60)
    helper.stdout.close()

    def running() -> bool:  # a zombie (State Z) waiting for a reaper is dead too
        try:
            with open(f"/proc/{pid}/status") as f:
                return not any(line.startswith("State:") and "Z" in line for line in f)
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 5
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    orphaned = running()
    if orphaned:
        os.kill(pid, signal.SIGKILL)
    assert not orphaned, "the worker outlived its parent"
