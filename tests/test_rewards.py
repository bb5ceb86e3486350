"""Rewards: exact, format, overlong, python, and score(): hand-worked values and every bad input.

The math reward (worker process, real data) is tested in test_rewards_math.py.
"""

from __future__ import annotations

import math
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch

from groupwise.errors import ConfigError
from groupwise.registry import build, names, param_names
from groupwise.rewards import RewardError, ScoreResult, reward_label, score
from groupwise.rewards.exact import Exact
from groupwise.rewards.format import Format
from groupwise.rewards.overlong import Overlong
from groupwise.rewards.python import Python
from groupwise.rewards.score import score_parts

NAN = float("nan")


def same(a: torch.Tensor, b: list[float]) -> bool:
    """Equal, with NaN == NaN."""
    return torch.equal(a.isnan(), torch.tensor([math.isnan(x) for x in b])) and torch.allclose(
        a.nan_to_num(0.0), torch.tensor(b, dtype=a.dtype).nan_to_num(0.0)
    )


# ----------------------------------------------------------------------------- registry


def test_all_rewards_registered_with_weight():
    for name in ("exact", "math", "format", "overlong", "python"):
        assert name in names("reward")
    for name, params in [
        ("exact", {}),
        ("format", {"pattern": "x"}),
        ("overlong", {}),
        ("python", {"fn": "os.path:basename"}),
    ]:
        reward = build("reward", name, **params)
        assert "weight" in param_names(type(reward)) and reward.weight == 1.0


def test_score_is_the_function_however_imported():
    import groupwise.rewards
    from groupwise.rewards.score import score as from_module

    assert from_module is score and groupwise.rewards.score is score and callable(score)


def test_build_rejects_unknown_parameter():
    with pytest.raises(ConfigError, match="did you mean 'column'"):
        build("reward", "exact", colum="answer")


# ----------------------------------------------------------------------------- exact


def test_exact_hand_values():
    r = Exact()
    # "82" == "82" -> 1; " 82\n".strip() == "82" -> 1; "83" != "82" -> 0; "8 2" != "82" -> 0
    assert r(["p"] * 4, ["82", " 82\n", "83", "8 2"], answer=["82", "82", "82", "82"]) == [1.0, 1.0, 0.0, 0.0]


def test_exact_stop_strip_and_non_string_gold():
    r = Exact(stop="\n")
    # "82\nmore text" cut at "\n" -> "82" == "82"; int gold 7 compared as "7"
    assert r(["p", "p"], ["82\nmore text", "7"], answer=["82", 7]) == [1.0, 1.0]
    no_strip = Exact(strip=False)
    # " 82" != "82" without stripping; None gold -> no verdict
    assert no_strip(["p", "p"], [" 82", "82"], answer=["82", None]) == [0.0, None]


def test_exact_other_column():
    r = Exact(column="target")
    assert r(["p"], ["yes"], target=["yes"]) == [1.0]


def test_exact_missing_column_names_it():
    with pytest.raises(RewardError, match=r"'exact' needs the dataset column 'answer'.*columns: solution"):
        Exact()(["p"], ["1"], solution=["1"])


def test_exact_column_wrong_length_names_it():
    with pytest.raises(RewardError, match=r"column 'answer' must hold one value per completion \(2\), got 1 values"):
        Exact()(["p", "p"], ["1", "2"], answer=["1"])


# ----------------------------------------------------------------------------- format


THINK = r"<think>.*?</think>\s*<answer>.*?</answer>"


def test_format_fullmatch_and_search():
    r = Format(pattern=THINK)
    completions = [
        "<think>a\nb</think>\n<answer>3</answer>",  # DOTALL lets . cross the newline -> 1
        "<think>a</think><answer>3</answer> trailing",  # fullmatch fails on " trailing" -> 0
        "no tags",  # -> 0
    ]
    assert r(["p"] * 3, completions) == [1.0, 0.0, 0.0]
    # search=True only needs the pattern somewhere: the trailing text no longer matters
    assert Format(pattern=THINK, search=True)(["p"] * 3, completions) == [1.0, 1.0, 0.0]


def test_format_needs_pattern():
    with pytest.raises(ConfigError, match="'format' needs `pattern`"):
        build("reward", "format")


def test_format_invalid_regex_names_pattern():
    with pytest.raises(ConfigError, match=r"pattern '<think>\(' is not a valid regular expression"):
        Format(pattern="<think>(")


# ----------------------------------------------------------------------------- overlong


def test_overlong_hand_values():
    # L_max = 16 (max_new_tokens), L_cache = 4 -> no penalty up to 12 tokens, then (12 - len) / 4:
    #   10 -> 0, 12 -> 0, 13 -> -1/4, 14 -> -2/4, 15 -> -3/4, 16 -> -4/4, 17 (> L_max) -> -1
    r = Overlong(overlong_buffer=4)
    lengths = [10, 12, 13, 14, 15, 16, 17]
    out = r(["p"] * 7, ["c"] * 7, completion_lengths=lengths, max_new_tokens=16)
    assert out == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]


def test_overlong_dapo_setting():
    # DAPO: L_max = 20480, L_cache = 4096 -> expected length 16384.
    #   18000 -> (16384 - 18000) / 4096 = -1616 / 4096 = -0.39453125; 16384 -> 0; 20480 -> -1
    r = Overlong(overlong_buffer=4096)
    out = r(["p"] * 3, ["c"] * 3, completion_lengths=[18000, 16384, 20480], max_new_tokens=20480)
    assert out == [-0.39453125, 0.0, -1.0]


def test_overlong_max_length_override_and_zero_buffer():
    # max_length=10 overrides max_new_tokens=100: 9 -> (8-9)/2 = -0.5, 10 -> -1, 11 -> -1
    r = Overlong(overlong_buffer=2, max_length=10)
    assert r(["p"] * 3, ["c"] * 3, completion_lengths=[9, 10, 11], max_new_tokens=100) == [-0.5, -1.0, -1.0]
    # buffer 0: a hard cliff, 0 up to L_max, -1 beyond
    assert Overlong(overlong_buffer=0)(["p"] * 2, ["c"] * 2, completion_lengths=[8, 9], max_new_tokens=8) == [0.0, -1.0]


def test_overlong_bad_inputs():
    with pytest.raises(ConfigError, match="overlong_buffer must be >= 0"):
        Overlong(overlong_buffer=-1)
    with pytest.raises(RewardError, match="'overlong' needs the dataset column 'completion_lengths'"):
        Overlong()(["p"], ["c"], max_new_tokens=8)
    with pytest.raises(RewardError, match="'overlong' needs 'max_new_tokens'"):
        Overlong()(["p"], ["c"], completion_lengths=[3])
    with pytest.raises(RewardError, match="overlong_buffer=4 exceeds the length budget L_max=3"):
        Overlong()(["p"], ["c"], completion_lengths=[3], max_new_tokens=3)


# ----------------------------------------------------------------------------- python


USER_FILE = '''
def length_reward(prompts, completions, answer, **kwargs):
    """TRL-style: one float per completion; None where there is no gold answer."""
    return [None if a is None else -abs(len(c) - len(a)) / 10 for c, a in zip(completions, answer)]

def broken(prompts, completions, **kwargs):
    raise ZeroDivisionError("user bug")

def too_short(prompts, completions, **kwargs):
    return [1.0] * (len(completions) - 1)

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_user_rewards.py").write_text(textwrap.dedent(USER_FILE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "my_user_rewards.py"


def test_python_module_and_file_paths(user_module):
    cols = {"answer": ["abc", "abc", None]}
    completions = ["abc", "abcdefg", "x"]
    # |3-3|/10 = 0 -> -0.0; |7-3|/10 = 0.4 -> -0.4; no gold -> None
    expected = [-0.0, -0.4, None]
    by_module = build("reward", "python", fn="my_user_rewards:length_reward")
    by_file = build("reward", "python", fn=f"{user_module}:length_reward")
    assert by_module(["p"] * 3, completions, **cols) == expected
    assert by_file(["p"] * 3, completions, **cols) == expected
    assert by_module.label == "my_user_rewards.length_reward"
    assert by_file.label == f"{user_module}:length_reward"


def test_python_bad_specs(user_module):
    with pytest.raises(ConfigError, match="'python' needs `fn`"):
        build("reward", "python")
    with pytest.raises(ConfigError, match="fn='my_user_rewards' must look like 'package.module:function'"):
        Python(fn="my_user_rewards")
    with pytest.raises(ConfigError, match="cannot import 'no_such_module_xyz'.*ModuleNotFoundError"):
        Python(fn="no_such_module_xyz:f")
    with pytest.raises(ConfigError, match="'my_user_rewards' has no attribute 'nope'"):
        Python(fn="my_user_rewards:nope")
    with pytest.raises(ConfigError, match="is a int, not a callable"):
        Python(fn="my_user_rewards:NOT_A_FUNCTION")
    with pytest.raises(ConfigError, match="does not exist"):
        Python(fn="/no/such/file.py:f")


def test_trl_function_through_python_and_score(user_module):
    """A user function written for TRL runs unchanged through `python` and `score`, with weights."""
    user = Python(fn="my_user_rewards:length_reward", weight=2.0)
    exact = Exact()
    prompts = ["p"] * 3
    completions = ["abc", "abcdefg", "x"]
    cols = {
        "answer": ["abc", "abc", None],
        "completion_lengths": [3, 7, 1],
        "truncated": [False] * 3,
        "max_new_tokens": 8,
    }
    res = score([exact, user], prompts, completions, cols)
    # parts: exact [1, 0, None->NaN], user [-0.0, -0.4, NaN]
    # total = 1*exact + 2*user: [1 + 0, 0 - 0.8, NaN (excluded: a function gave no verdict)]
    assert isinstance(res, ScoreResult)
    assert same(res.parts[:, 0], [1.0, 0.0, NAN]) and same(res.parts[:, 1], [0.0, -0.4, NAN])
    assert same(res.total, [1.0, -0.8, NAN])
    assert res.total.dtype == torch.float32 and res.parts.dtype == torch.float32 and res.parts.shape == (3, 2)
    assert res.excluded.tolist() == [False, False, True]
    assert res.counts == {
        "excluded": 1,
        "exact/missing": 1,
        "exact/error": 0,
        "my_user_rewards.length_reward/missing": 1,
        "my_user_rewards.length_reward/error": 0,
    }


# ----------------------------------------------------------------------------- score


def const(values, name="const_reward"):
    """A plain TRL-style function returning fixed values."""

    def fn(prompts, completions, **kwargs):
        return values

    fn.__qualname__ = name
    fn.__module__ = "tests"
    return fn


P3, C3 = ["p"] * 3, ["a", "b", "c"]


def test_score_weights_hand_values():
    a = Exact(weight=0.5)  # [1, 0, 1]
    b = Format(pattern="[ab]", weight=-2.0)  # [1, 1, 0]
    res = score([a, b], P3, C3, {"answer": ["a", "x", "c"]})
    # total = 0.5*[1,0,1] - 2*[1,1,0] = [0.5-2, 0-2, 0.5-0] = [-1.5, -2, 0.5]
    assert same(res.total, [-1.5, -2.0, 0.5])
    assert res.excluded.tolist() == [False, False, False] and res.counts["excluded"] == 0


def test_score_missing_exclude_vs_zero():
    f = const([1.0, None, float("nan")], "f")
    g = const([2.0, 3.0, float("inf")], "g")  # inf is no verdict too
    res = score([f, g], P3, C3, {})
    # exclude (default): row 0 = 1 + 2 = 3; rows 1 (None) and 2 (NaN, inf) excluded -> NaN
    assert same(res.total, [3.0, NAN, NAN])
    assert res.excluded.tolist() == [False, True, True]
    assert res.counts == {
        "excluded": 2,
        "tests.f/missing": 2,
        "tests.f/error": 0,
        "tests.g/missing": 1,
        "tests.g/error": 0,
    }
    zero = score([f, g], P3, C3, {}, missing="zero")
    # zero (TRL's nansum): row 1 = 0 + 3 = 3; row 2 = 0 + 0 = 0; nothing excluded, still counted
    assert same(zero.total, [3.0, 3.0, 0.0])
    assert zero.excluded.tolist() == [False, False, False]
    assert zero.counts["tests.f/missing"] == 2 and zero.counts["tests.g/missing"] == 1
    assert same(zero.parts[:, 0], [1.0, NAN, NAN])  # parts keep the missing verdicts visible


def test_score_accepts_tuples_ints_bools():
    res = score([const((1, True, 0.5))], P3, C3, {})
    assert same(res.total, [1.0, 1.0, 0.5])


def test_score_raising_function_named_and_chained(user_module):
    broken = Python(fn="my_user_rewards:broken")
    with pytest.raises(
        RewardError, match=r"reward 'my_user_rewards.broken' raised ZeroDivisionError: user bug"
    ) as info:
        score([Exact(), broken], P3, C3, {"answer": C3})
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_score_on_error_exclude(user_module):
    broken = Python(fn="my_user_rewards:broken")
    res = score([Exact(), broken], P3, C3, {"answer": C3}, on_error="exclude")
    # every sample loses its verdict from `broken` -> all excluded, counted per function
    assert res.excluded.tolist() == [True, True, True] and res.total.isnan().all()
    assert same(res.parts[:, 0], [1.0, 1.0, 1.0]) and res.parts[:, 1].isnan().all()
    assert res.counts["excluded"] == 3 and res.counts["my_user_rewards.broken/error"] == 3
    # and even with missing="zero" a failed function is never scored 0
    assert score([Exact(), broken], P3, C3, {"answer": C3}, on_error="exclude", missing="zero").excluded.all()


def test_score_component_error_is_named():
    with pytest.raises(
        RewardError, match=r"reward 'exact' raised RewardError: reward 'exact' needs the dataset column 'answer'"
    ):
        score([Exact()], P3, C3, {})


def test_score_wrong_length_named(user_module):
    with pytest.raises(
        RewardError,
        match=r"reward 'my_user_rewards.too_short' returned 2 values for 3 completions \(expected 3, got 2\)",
    ):
        score([Python(fn="my_user_rewards:too_short")], P3, C3, {})
    # never broadcast: a single value for three completions is an error too
    with pytest.raises(RewardError, match=r"reward 'tests.one' returned 1 values for 3 completions"):
        score([const([1.0], "one")], P3, C3, {})


@pytest.mark.parametrize(
    "bad, pattern",
    [
        (1.0, r"reward 'tests.bad' returned a float; expected a list of 3 floats"),
        (torch.ones(3), r"reward 'tests.bad' returned a Tensor"),
        ("abc", r"reward 'tests.bad' returned a str"),
        ([1.0, "1.0", 0.0], r"reward 'tests.bad' returned '1.0' \(str\) at index 1; expected a float or None"),
        ([1.0, [1.0], 0.0], r"returned \[1.0\] \(list\) at index 1"),
    ],
)
def test_score_wrong_type_named(bad, pattern):
    with pytest.raises(RewardError, match=pattern):
        score([const(bad, "bad")], P3, C3, {})


def test_score_timeout_names_function():
    def slow(prompts, completions, **kwargs):
        time.sleep(1.0)
        return [1.0] * len(completions)

    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"reward '.*slow' did not return within timeout_s=0.2 s") as info:
        score([slow], P3, C3, {}, timeout_s=0.2)
    assert time.monotonic() - t0 < 0.9
    assert isinstance(info.value.__cause__, TimeoutError)
    res = score([Exact(), slow], P3, C3, {"answer": C3}, timeout_s=0.2, on_error="exclude")
    assert res.excluded.all() and res.counts[f"{reward_label(slow)}/error"] == 3
    # a function that finishes in time is unaffected by the thread
    assert same(score([Exact()], P3, C3, {"answer": C3}, timeout_s=5.0).total, [1.0, 1.0, 1.0])


def test_score_input_validation():
    with pytest.raises(ValueError, match="at least one reward function"):
        score([], P3, C3, {})
    with pytest.raises(ValueError, match="2 prompts for 3 completions"):
        score([Exact()], ["p", "p"], C3, {"answer": C3})
    with pytest.raises(ValueError, match="column 'answer' has 2 values for 3 completions"):
        score([Exact()], P3, C3, {"answer": ["a", "b"]})
    with pytest.raises(ValueError, match="on_error must be"):
        score([Exact()], P3, C3, {"answer": C3}, on_error="ignore")
    with pytest.raises(ValueError, match="missing must be"):
        score([Exact()], P3, C3, {"answer": C3}, missing="nan")


def test_score_empty_batch_and_duplicate_labels():
    res = score([Exact(), Exact(column="other")], [], [], {"answer": [], "other": []})
    assert res.total.shape == (0,) and res.parts.shape == (0, 2) and res.excluded.shape == (0,)
    # the second `exact` is told apart in counts
    assert set(res.counts) == {"excluded", "exact/missing", "exact/error", "exact[1]/missing", "exact[1]/error"}


# ----------------------------------------------------------------------------- exits (issue #12 item 11)


def _exits(exc, name):
    def fn(prompts, completions, **kwargs):
        raise exc

    fn.__qualname__, fn.__module__ = name, "tests"
    return fn


EXITS = [
    (SystemExit(0), r"SystemExit\(0\)"),  # sys.exit(0): before, the trainer ended with status 0
    (SystemExit(None), r"SystemExit\(None\)"),  # bare sys.exit()
    (SystemExit(3), r"SystemExit\(3\)"),
    (SystemExit("bye"), r"SystemExit\('bye'\)"),
    (KeyboardInterrupt(), r"KeyboardInterrupt"),
]


@pytest.mark.parametrize("timeout_s", [None, 5.0], ids=["direct", "thread"])
@pytest.mark.parametrize("on_error", ["raise", "exclude"])
@pytest.mark.parametrize("exc, what", EXITS, ids=["exit0", "exitNone", "exit3", "exitstr", "ctrlc"])
def test_score_reward_exit_stops_the_run_naming_it(exc, what, on_error, timeout_s):
    from groupwise.rewards.score import RewardAborted, score_parts

    quitter = _exits(exc, "quitter")
    with pytest.raises(RewardAborted, match=rf"reward 'tests.quitter' raised {what}; .*run is stopped") as info:
        score_parts([Exact(), quitter], P3, C3, {"answer": C3}, on_error=on_error, timeout_s=timeout_s)
    assert info.value.__cause__ is exc
    # a RuntimeError, never a RewardError: on_error="exclude" must not turn it into excluded samples
    assert isinstance(info.value, RuntimeError) and not isinstance(info.value, RewardError)
    with pytest.raises(RewardAborted, match="tests.quitter"):
        score([quitter], P3, C3, {}, on_error=on_error, timeout_s=timeout_s)


def test_rollout_scorer_exit_stops_the_run_naming_it():
    from helpers import info_for, make_rollout

    from groupwise.rewards.score import RewardAborted
    from groupwise.rewards.stage import RewardStage

    class Quits:
        weight = 1.0

        def score_rollout(self, rollout, info):
            raise SystemExit(0)

    stage = RewardStage([], SimpleNamespace(missing="exclude"), None, max_new_tokens=3)
    stage.tensor = [Quits()]
    ro = make_rollout(B=1, G=2, T=3, awkward=False)
    ro.reward_parts = torch.zeros(1, 2, 0, dtype=torch.float64)
    ro.set_extra("reward_failed", torch.zeros(1, 2, dtype=torch.bool), "row")
    with pytest.raises(RewardAborted, match=r"reward '.*Quits' raised SystemExit\(0\)"):
        stage.finish(ro, info_for(3))


def test_reward_exit_zero_gives_nonzero_status_in_a_process():
    import subprocess
    import sys

    script = textwrap.dedent("""
        import sys
        from groupwise.rewards import score
        def quitter(prompts, completions, **kw):
            sys.exit(0)
        score([quitter], ["p"], ["c"], {}, on_error="exclude")
        print("scored")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "scored" not in proc.stdout
    assert "RewardAborted: reward '__main__.quitter' raised SystemExit(0)" in proc.stderr


def test_the_timeout_keeps_the_reward_on_the_main_thread():
    """With the default reward.timeout_s, TRL-style rewards that use math-verify (whose own timeout
    is a signal.alarm, main thread only) still work; a Python loop that never returns is cut at
    the deadline. Before: every timed call ran in a thread, where math-verify refuses to run."""
    import math_verify

    def accuracy(prompts, completions, **kwargs):
        return [float(math_verify.verify(math_verify.parse("$4$"), math_verify.parse(c))) for c in completions]

    parts, failed, _ = score_parts([accuracy], ["p", "q"], ["$4$", "$5$"], {}, timeout_s=30.0)
    assert parts[:, 0].tolist() == [1.0, 0.0] and not failed.any()

    def spin(prompts, completions, **kwargs):
        while True:
            pass

    t0 = time.monotonic()
    with pytest.raises(RewardError, match="did not return within timeout_s=0.3"):
        score_parts([spin], ["p"], ["x"], {}, timeout_s=0.3)
    assert time.monotonic() - t0 < 2.0
