"""User data loading: formats, column mapping, per-row validation with file and row numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from groupwise.errors import ConfigError
from groupwise.tasks.data import DataError, LoadResult, load_rows

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
GSM8K = SHARED / "gsm8k"
MATH500 = SHARED / "math500"
needs_shared = pytest.mark.skipif(not GSM8K.is_dir(), reason="shared data sets not present")


def write_lines(path: Path, lines: list[str | bytes]) -> Path:
    """Write JSON-lines; str items are JSON-encoded objects or raw text, bytes go in unchanged."""
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode("utf-8") for x in lines) + b"\n")
    return path


# ---------------------------------------------------------------- formats
@needs_shared
def test_gsm8k_jsonl_with_column_mapping():
    path = GSM8K / "test.jsonl"
    first = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
    result = load_rows(str(path), columns={"prompt": "question"})
    assert isinstance(result, LoadResult)
    assert len(result.rows) == 1319 and result.skipped == 0 and result.problems == []
    row = result.rows[0]
    assert set(row) == {"prompt", "answer", "question"}  # 'question' is mapped to 'prompt' and kept under its own name
    assert row["prompt"] == first["question"]
    assert row["prompt"].startswith("Janet’s ducks lay 16 eggs per day.")
    assert row["answer"].endswith("#### 18")


@needs_shared
def test_folder_of_split_files_picks_the_split():
    train = load_rows(GSM8K, split="train", columns={"prompt": "question"})
    test = load_rows(GSM8K, split="test", columns={"prompt": "question"})
    assert (len(train.rows), len(test.rows)) == (7473, 1319)


@needs_shared
def test_math500_answer_column_mapping():
    result = load_rows(MATH500 / "test.jsonl", columns={"prompt": "question", "answer": "answer"})
    assert len(result.rows) == 500
    assert all("\\boxed" in r["answer"] or "The answer is" in r["answer"] for r in result.rows)


def test_mapping_keeps_other_columns_and_converts_numeric_answers(tmp_path):
    path = write_lines(
        tmp_path / "d.jsonl",
        [
            json.dumps({"q": "2+2=", "gold": 4, "id": 7, "tags": ["easy"]}),
            json.dumps({"q": "1+0.5=", "gold": 1.5, "id": 8, "tags": []}),
        ],
    )
    result = load_rows(path, columns={"prompt": "q", "answer": "gold", "uid": "id"})
    assert result.rows == [
        {
            "prompt": "2+2=",
            "answer": "4",
            "uid": 7,
            "tags": ["easy"],
            "q": "2+2=",
            "gold": 4,
            "id": 7,
        },  # the source's names stay too
        {"prompt": "1+0.5=", "answer": "1.5", "uid": 8, "tags": [], "q": "1+0.5=", "gold": 1.5, "id": 8},
    ]


def test_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    original = [
        {"question": "sort 5 2 9:", "answer": "2 5 9", "nums": [5, 2, 9]},
        {"question": "3 5 7 -> 22:", "answer": "3*5+7", "nums": [3, 5, 7]},
    ]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(original), path)
    result = load_rows(str(path), columns={"prompt": "question"})
    assert result.rows == [
        {"prompt": "sort 5 2 9:", "answer": "2 5 9", "nums": [5, 2, 9], "question": "sort 5 2 9:"},
        {"prompt": "3 5 7 -> 22:", "answer": "3*5+7", "nums": [3, 5, 7], "question": "3 5 7 -> 22:"},
    ]


def test_parquet_bad_row_names_file_and_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "ok", "answer": "1"}, {"prompt": "", "answer": "2"}]), path)
    with pytest.raises(DataError) as err:
        load_rows(path)
    assert str(path) in str(err.value) and "row 2" in str(err.value) and "'prompt'" in str(err.value)


def test_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"question": "1+1=", "answer": "2", "level": 1}, {"question": "2+3=", "answer": "5", "level": 2}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    result = load_rows(tmp_path / "ds", columns={"prompt": "question"})
    assert result.rows == [
        {"prompt": "1+1=", "answer": "2", "level": 1, "question": "1+1="},
        {"prompt": "2+3=", "answer": "5", "level": 2, "question": "2+3="},
    ]


def test_datasets_dict_folder_picks_the_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict(
        train=datasets.Dataset.from_list([{"prompt": "a", "answer": "1"}]),
        test=datasets.Dataset.from_list([{"prompt": "b", "answer": "2"}, {"prompt": None, "answer": "3"}]),
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    assert load_rows(tmp_path / "dd", split="train").rows == [{"prompt": "a", "answer": "1"}]
    with pytest.raises(DataError) as err:
        load_rows(tmp_path / "dd", split="test")
    assert str(tmp_path / "dd") in str(err.value) and "row 2" in str(err.value) and "NoneType" in str(err.value)
    with pytest.raises(DataError, match="no split 'validation'.*'train', 'test'"):
        load_rows(tmp_path / "dd", split="validation")


def test_json_array_and_split_object(tmp_path):
    array = tmp_path / "a.json"
    array.write_text(json.dumps([{"prompt": "p1", "answer": "a1"}, {"prompt": "p2", "answer": "a2"}]))
    assert [r["prompt"] for r in load_rows(array).rows] == ["p1", "p2"]
    by_split = tmp_path / "s.json"
    by_split.write_text(
        json.dumps({"train": [{"prompt": "t", "answer": "1"}], "test": [{"prompt": "e", "answer": "2"}]})
    )
    assert load_rows(by_split, split="test").rows == [{"prompt": "e", "answer": "2"}]
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps([{"prompt": "p1", "answer": "a1"}, {"prompt": 3, "answer": "a2"}]))
    with pytest.raises(DataError, match=r"b\.json, item 2: column 'prompt' is int"):
        load_rows(bad)


def test_json_file_holding_json_lines(tmp_path):
    # Dataset.to_json writes JSON lines into a .json file
    path = write_lines(
        tmp_path / "l.json", [json.dumps({"prompt": "p1", "answer": "a"}), json.dumps({"prompt": "p2", "answer": "b"})]
    )
    assert [r["prompt"] for r in load_rows(path).rows] == ["p1", "p2"]


def test_byte_order_mark_and_crlf_are_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "p1", "answer": "a"}\r\n{"prompt": "p2", "answer": "b"}\r\n')
    assert [r["prompt"] for r in load_rows(path).rows] == ["p1", "p2"]


# ---------------------------------------------------------------- bad rows
GOOD = json.dumps({"prompt": "fine", "answer": "1"})


@pytest.mark.parametrize(
    "bad_line, kwargs, fragments",
    [
        ('{"prompt": "cut off', {}, ["not valid JSON"]),
        (b'{"prompt": "caf\xe9", "answer": "1"}', {}, ["not valid UTF-8", "0xe9"]),
        ("[1, 2]", {}, ["expected an object", "list"]),
        (
            json.dumps({"question": "q", "answer": "1"}),
            {},
            ["no column 'prompt'", "columns present: 'question', 'answer'"],
        ),
        (
            json.dumps({"question": "q", "answer": "1"}),
            {"columns": {"prompt": "query"}},
            ["no column 'query' (mapped to 'prompt')"],
        ),
        (json.dumps({"prompt": "q"}), {}, ["no column 'answer'", "columns present: 'prompt'"]),
        (json.dumps({"prompt": "q", "answer": None}), {}, ["'answer' is null"]),
        (json.dumps({"prompt": "q", "answer": ["1", "2"]}), {}, ["'answer' is list"]),
        (json.dumps({"prompt": "  \n", "answer": "1"}), {}, ["'prompt' is empty"]),
        (json.dumps({"prompt": 12, "answer": "1"}), {}, ["'prompt' is int, expected a string"]),
        (
            json.dumps({"prompt": [{"role": "user"}], "answer": "1"}),
            {},
            ["'prompt' is a list but not of"],
        ),  # chat messages need role and content
        (
            json.dumps({"prompt": "x" * 11, "answer": "1"}),
            {"max_prompt_chars": 10},
            ["'prompt' has 11 characters", "max_prompt_chars=10"],
        ),
    ],
)
def test_each_bad_row_raises_naming_file_and_line(tmp_path, bad_line, kwargs, fragments):
    # line 1 good, line 2 blank (still counted), line 3 bad, line 4 good
    path = write_lines(tmp_path / "bad.jsonl", [GOOD, "", bad_line, GOOD])
    if "columns" in kwargs:
        # keep the good rows valid under the mapping
        path = write_lines(tmp_path / "bad.jsonl", [json.dumps({"query": "ok", "answer": "1"}), "", bad_line])
    with pytest.raises(DataError) as err:
        load_rows(path, **kwargs)
    message = str(err.value)
    assert message.startswith(f"{path}, line 3: "), message
    for fragment in fragments:
        assert fragment in message, message


def test_skip_mode_counts_and_reports(tmp_path):
    path = write_lines(
        tmp_path / "mixed.jsonl",
        [
            json.dumps({"question": "good 1", "answer": "1"}),
            "not json",
            json.dumps({"question": "", "answer": "2"}),
            json.dumps({"question": "good 2", "answer": "3"}),
            b"\xff\xfe",
            json.dumps({"answer": "4"}),
        ],
    )
    result = load_rows(path, columns={"prompt": "question"}, on_bad_row="skip")
    assert [r["prompt"] for r in result.rows] == ["good 1", "good 2"]
    assert result.skipped == 4
    assert [p.split(":")[0] for p in result.problems] == [f"{path}, line {n}" for n in (2, 3, 5, 6)]


def test_require_answer_false_allows_rows_without_answer(tmp_path):
    path = write_lines(
        tmp_path / "p.jsonl", [json.dumps({"prompt": "tell a joke"}), json.dumps({"prompt": "hi", "answer": "hello"})]
    )
    assert load_rows(path, require_answer=False).rows == [
        {"prompt": "tell a joke", "answer": None},
        {"prompt": "hi", "answer": "hello"},
    ]
    with pytest.raises(DataError, match="line 1: no column 'answer'"):
        load_rows(path)


def test_no_usable_rows_is_an_error(tmp_path):
    path = write_lines(tmp_path / "all_bad.jsonl", ["{", "["])
    with pytest.raises(DataError, match="no usable rows; all 2 rows were bad"):
        load_rows(path, on_bad_row="skip")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="no usable rows"):
        load_rows(empty)


# ---------------------------------------------------------------- arguments and sources
def test_bad_arguments(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [GOOD])
    with pytest.raises(ConfigError, match="'raise', 'skip'"):
        load_rows(path, on_bad_row="ignore")
    with pytest.raises(ConfigError, match="columns"):
        load_rows(path, columns=["question"])
    with pytest.raises(ConfigError, match="max_prompt_chars"):
        load_rows(path, max_prompt_chars=0)


def test_missing_file_and_unknown_suffix(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_rows(str(tmp_path / "missing.jsonl"))
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        load_rows(csv)


def test_hub_name_is_never_downloaded():
    pytest.importorskip("datasets")
    import huggingface_hub.constants as hub_constants

    before = (hub_constants.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE"))
    with pytest.raises(DataError, match="without the network"):
        load_rows("groupwise-tests/definitely-not-cached")
    assert (hub_constants.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE")) == before  # offline mode is undone


def test_jsonl_does_not_import_datasets_or_pyarrow(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [GOOD])
    code = (
        "import sys; from groupwise.tasks.data import load_rows; "
        f"assert load_rows({str(path)!r}).rows; "
        "assert 'datasets' not in sys.modules and 'pyarrow' not in sys.modules, 'eager import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_trl_reward_reads_the_datasets_own_column_names(tmp_path):
    """Before: with columns = {answer = "target"} the row had only 'answer', and a TRL reward reading
    kwargs["target"] raised KeyError."""
    from groupwise.rewards.score import score

    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"question": "1+1=", "target": "2"})])
    rows = load_rows(path, columns={"prompt": "question", "answer": "target"}).rows

    def by_target(prompts, completions, target, **kwargs):
        return [float(c.strip() == t) for c, t in zip(completions, target)]

    columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
    assert score([by_target], [rows[0]["prompt"]], ["2"], columns).total.tolist() == [1.0]
    assert rows[0]["answer"] == "2" and rows[0]["target"] == "2"


def test_conversational_prompts_load_and_bad_messages_are_named(tmp_path):
    chat = [{"role": "user", "content": "1+1="}]
    path = write_lines(
        tmp_path / "c.jsonl",
        [json.dumps({"prompt": chat, "answer": "2"}), json.dumps({"prompt": [{"role": "user"}], "answer": "3"})],
    )
    result = load_rows(path, on_bad_row="skip")
    assert result.rows[0]["prompt"] == chat and result.skipped == 1
    assert "line 2" in result.problems[0] and "messages" in result.problems[0]
