"""Built-in tasks: disjoint deterministic splits, correct answers, and the countdown verifier."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from groupwise.errors import ConfigError
from groupwise.tasks import get_task
from groupwise.tasks.countdown import CountdownReward, check_countdown
from groupwise.tasks.countdown import format_row as countdown_row
from groupwise.tasks.sorting import format_row as sorting_row

TASK_NAMES = ("arithmetic", "countdown", "sorting", "evidence")


# ---------------------------------------------------------------- every task
@pytest.mark.parametrize("name", TASK_NAMES)
def test_splits_are_disjoint_over_the_full_sets(name):
    task = get_task(name)
    train = {r["prompt"] for r in task.rows("train", 0, 0)}
    test = {r["prompt"] for r in task.rows("test", 0, 0)}
    assert train and test
    assert not train & test


@pytest.mark.parametrize("name", TASK_NAMES)
def test_rows_are_deterministic_for_a_seed(name):
    task = get_task(name)
    assert task.rows("train", 50, 7) == task.rows("train", 50, 7)
    assert task.rows("train", 50, 7) != task.rows("train", 50, 8)
    assert len(task.rows("train", 50, 7)) == 50
    # the held-out split does not depend on the seed
    assert task.rows("test", 20, 1) == task.rows("test", 20, 2)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_unknown_split_is_an_error(name):
    with pytest.raises(ValueError, match="validation"):
        get_task(name).rows("validation", 5, 0)


def test_default_rewards():
    assert get_task("countdown").reward == "countdown"
    assert get_task("sorting").reward == "exact"


def test_unknown_task_lists_the_built_in_ones():
    with pytest.raises(ConfigError, match="countdown.*sorting"):
        get_task("sortting")


# ---------------------------------------------------------------- countdown
def test_countdown_row_format():
    assert countdown_row([3, 5, 7], 22, "3*5+7") == {
        "prompt": "3 5 7 -> 22:",
        "answer": "3*5+7",
        "nums": [3, 5, 7],
        "target": 22,
    }


def test_countdown_every_reference_answer_verifies():
    task = get_task("countdown")
    for split in ("train", "test"):
        for row in task.rows(split, 0, 0):
            assert len(row["nums"]) == 3 and all(1 <= x <= 9 for x in row["nums"])
            assert row["target"] > 0
            assert row["prompt"] == f"{row['nums'][0]} {row['nums'][1]} {row['nums'][2]} -> {row['target']}:"
            assert check_countdown(row["answer"], row["nums"], row["target"]) == 1.0, row


def test_countdown_problems_are_unique_up_to_number_order():
    task = get_task("countdown")
    every = task.rows("train", 0, 0) + task.rows("test", 0, 0)
    keys = [(tuple(sorted(r["nums"])), r["target"]) for r in every]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize(
    "completion, nums, target, expected",
    [
        ("3*5+7", [3, 5, 7], 22, 1.0),  # 15 + 7
        ("(3+5)*7", [3, 5, 7], 56, 1.0),  # 8 * 7
        ("7 - (5 - 3)", [3, 5, 7], 5, 1.0),  # spaces and brackets: 7 - 2
        (" 3*5+7\nbecause 3*5 is 15", [3, 5, 7], 22, 1.0),  # only the first line counts
        ("3*5+7 = 22", [3, 5, 7], 22, 1.0),  # a trailing '= target' is allowed
        ("5*4+4", [4, 4, 5], 24, 1.0),  # a number listed twice may be used twice
        ("3+5+7", [3, 5, 7], 22, 0.0),  # valid expression, wrong value (15)
        ("3*5+7 = 23", [3, 5, 7], 22, 0.0),  # claims the wrong result
        ("5*5-3", [3, 5, 7], 22, 0.0),  # 22, but reuses 5 and drops 7
        ("3*5+7", [3, 5, 6], 22, 0.0),  # 7 is not given
        ("5*7", [2, 5, 7], 35, 0.0),  # leaves 2 unused: every number exactly once
        ("6/3+7", [3, 6, 7], 9, 0.0),  # no division
        ("-3+5*5", [3, 5, 5], 22, 0.0),  # no unary minus
        ("3**2+5", [2, 3, 5], 14, 0.0),  # no powers
        ("35-13", [3, 5, 1], 22, 0.0),  # no concatenated digits (35 and 13 are not given)
        ("", [3, 5, 7], 22, 0.0),
        ("\n\n", [3, 5, 7], 22, 0.0),
        ("(" * 5000 + "3" + ")" * 5000, [3], 3, 0.0),  # absurdly long input is rejected, not parsed
        ("3*5+", [3, 5, 7], 22, 0.0),  # syntax error
    ],
)
def test_check_countdown_hand_cases(completion, nums, target, expected):
    assert check_countdown(completion, nums, target) == expected


def test_check_countdown_at_most_once_mode():
    assert check_countdown("5*7", [2, 5, 7], 35, use_all=False) == 1.0  # 2 may stay unused
    assert check_countdown("5*5-3", [3, 5, 7], 22, use_all=False) == 0.0  # 5 still only once


def test_check_countdown_never_executes_the_completion(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    attacks = [
        f"__import__('os').system('touch {marker}')",
        f"3*5+7 or __import__('os').system('touch {marker}')",
        f"[open('{marker}', 'w') for _ in (1,)]",
        "(lambda: 22)()",
        "().__class__.__mro__",
    ]

    def no_eval(*args, **kwargs):
        raise AssertionError("eval/exec must not be called")

    monkeypatch.setattr("builtins.eval", no_eval)
    monkeypatch.setattr("builtins.exec", no_eval)
    for attack in attacks:
        assert check_countdown(attack, [3, 5, 7], 22) == 0.0
    assert not marker.exists()


def test_countdown_reward_component():
    assert CountdownReward.stage == "reward" and CountdownReward.registry_name == "countdown"
    reward = CountdownReward()
    assert reward.weight == 1.0
    scores = reward(
        ["3 5 7 -> 22:", "3 5 7 -> 22:", "2 5 7 -> 35:", "? -> ?:"],
        ["3*5+7", "3+5+7", [{"role": "assistant", "content": "5*7"}], "1"],
        nums=[[3, 5, 7], "3 5 7", [2, 5, 7], None],
        target=[22, "22", 35, 1],
    )
    # correct; wrong value (nums given as a string); leaves 2 unused (chat form); unreadable row
    assert scores == [1.0, 0.0, 0.0, None]
    assert CountdownReward(use_all=False)(["p"], ["5*7"], nums=[[2, 5, 7]], target=[35]) == [1.0]


def test_countdown_reward_needs_its_columns():
    with pytest.raises(ValueError, match="'target'"):
        CountdownReward()(["3 5 7 -> 22:"], ["3*5+7"], nums=[[3, 5, 7]])


# ---------------------------------------------------------------- sorting
def test_sorting_row_format():
    assert sorting_row([5, 2, 9]) == {"prompt": "sort 5 2 9:", "answer": "2 5 9", "nums": [5, 2, 9]}
    assert sorting_row([3, 0, 3, 1])["answer"] == "0 1 3 3"


def test_sorting_answers_are_the_sorted_numbers():
    task = get_task("sorting")
    pattern = re.compile(r"sort( [0-9]){3,5}:")
    for split in ("train", "test"):
        for row in task.rows(split, 0, 0):
            assert pattern.fullmatch(row["prompt"]), row["prompt"]
            shown = [int(x) for x in row["prompt"][len("sort ") : -1].split()]
            assert shown == row["nums"]
            assert row["answer"] == " ".join(str(x) for x in sorted(shown))


def test_sorting_split_sizes_and_balance():
    task = get_task("sorting")
    test = task.rows("test", 0, 0)
    train = task.rows("train", 0, 0)
    # every digit sequence of length 3, 4 or 5 is in exactly one split
    assert len(test) + len(train) == 10**3 + 10**4 + 10**5
    assert Counter(len(r["nums"]) for r in test) == {3: 100, 4: 100, 5: 100}
    assert [len(r["nums"]) for r in task.rows("train", 6, 3)] == [3, 4, 5, 3, 4, 5]
