"""User data: load prompt/answer rows from a local file, a saved ``datasets`` folder, or a
``datasets`` hub name that is already in the local cache.

Example::

    result = load_rows("gsm8k/train.jsonl", columns={"prompt": "question"}, on_bad_row="skip")
    result.rows[0]  # {"prompt": "Natalia sold clips ...", "answer": "Natalia sold 48/2 = ..."}
    result.skipped, result.problems  # 0, []

Sources (``source`` is tried in this order):

* a ``.jsonl`` file (one JSON object per line; blank lines are ignored);
* a ``.json`` file: a JSON array of objects, an object whose ``split`` key holds such an array,
  or JSON lines (what ``Dataset.to_json`` writes);
* a ``.parquet`` file (read with ``pyarrow``);
* a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (read with
  ``datasets.load_from_disk``; a ``DatasetDict`` gives its ``split``);
* a folder holding ``<split>.jsonl``, ``<split>.json`` or ``<split>.parquet``;
* any other folder, or a hub name like ``"openai/gsm8k"``, handed to ``datasets.load_dataset``
  with the network switched off: it loads only what is already on this machine, and a source that
  would need a download is a :class:`DataError` saying so. Nothing is ever downloaded.

``split`` only matters for the sources that have splits (dataset dicts, split folders, JSON
objects keyed by split, hub names); a plain file is taken whole. ``datasets`` and ``pyarrow`` are
imported only when a source needs them.

Columns: ``columns`` maps our names to the source's, e.g. ``{"prompt": "question"}``; each mapped
column is available under our name (if the source also has a column with our name, the mapped one
wins) AND under its own, so a TRL reward function reading ``kwargs["target"]`` works unchanged
with ``columns = {answer = "target"}``; unmapped names map to themselves, every other column is kept.
Result rows always have ``prompt`` (a non-empty string, or a conversation: a list of
``{"role", "content"}`` messages that the tokenizer's chat template renders) and ``answer`` (a string; an int or float
gold answer is converted with ``str``; ``None`` when ``require_answer=False`` and the row has none).

Bad rows (unparseable JSON line, bad UTF-8, not an object, missing prompt/answer column, prompt
not a string, empty prompt, prompt longer than ``max_prompt_chars``, answer of another type) are
reported with the source, the row number (the 1-based line for JSON lines, the 1-based position
otherwise) and the column. ``on_bad_row="raise"`` raises :class:`DataError` at the first one;
``"skip"`` drops them, counts them in ``LoadResult.skipped`` and lists the messages in
``LoadResult.problems``. Problems with the source as a whole (missing file, unknown format,
unreadable parquet, no usable rows at all) always raise.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from groupwise.errors import ConfigError

ON_BAD_ROW = ("raise", "skip")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


class DataError(ValueError):
    """A data source is missing, unreadable, or has a bad row."""


@dataclass
class LoadResult:
    """Rows that passed validation, how many were skipped, and why (one message per skipped row)."""

    rows: list[dict] = field(default_factory=list)
    skipped: int = 0
    problems: list[str] = field(default_factory=list)


class _BadRow(Exception):
    """A row-level problem; ``load_rows`` turns it into a DataError or a skipped row."""


# A raw record: (where, row) where ``where`` names the source and row ("data.jsonl, line 3") and
# ``row`` is the decoded record, or a _BadRow describing why it could not be decoded.
_Record = tuple[str, Any]


# ---------------------------------------------------------------- readers
def _read_jsonl_bytes(data: bytes, label: str) -> Iterator[_Record]:
    """Records of JSON-lines ``data``; each line is decoded and parsed on its own."""
    if data.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte-order mark
        data = data[3:]
    for number, raw in enumerate(data.split(b"\n"), start=1):
        where = f"{label}, line {number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            yield where, _BadRow(f"{where}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1})")
            continue
        if not text.strip():
            continue
        try:
            yield where, json.loads(text)
        except json.JSONDecodeError as err:
            yield where, _BadRow(f"{where}: not valid JSON ({err.msg} at column {err.colno})")


def _read_json(path: Path, split: str) -> Iterator[_Record]:
    """Records of a ``.json`` file: an array, ``{split: array}``, or JSON lines."""
    data = path.read_bytes()
    try:
        whole = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        # Not one JSON document: read it as JSON lines, which reports bad lines one by one.
        yield from _read_jsonl_bytes(data, str(path))
        return
    if isinstance(whole, dict):
        if isinstance(whole.get(split), list):
            items, label = whole[split], f"{path} [{split!r}]"
        elif len(data.strip().splitlines()) == 1:
            items, label = [whole], str(path)  # JSON lines holding a single row
        else:
            arrays = [k for k, v in whole.items() if isinstance(v, list)]
            hint = f"; its list-valued keys are {', '.join(map(repr, arrays))}" if arrays else ""
            raise DataError(
                f"{path}: a JSON object with no {split!r} list of rows{hint}; expected an array of row objects"
            )
    elif isinstance(whole, list):
        items, label = whole, str(path)
    else:
        raise DataError(f"{path}: expected a JSON array of row objects, got a {type(whole).__name__}")
    for number, item in enumerate(items, start=1):
        yield f"{label}, item {number}", item


def _read_parquet(path: Path) -> Iterator[_Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install 'groupwise[data]')") from err
    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for corrupt or non-parquet files
        raise DataError(f"{path}: not a readable parquet file ({err})") from err
    for number, row in enumerate(table.to_pylist(), start=1):
        yield f"{path}, row {number}", row


def _import_datasets(what: str):
    try:
        import datasets
    except ImportError as err:
        raise DataError(f"{what} needs the `datasets` package (pip install 'groupwise[data]')") from err
    return datasets


def _dataset_records(ds: Any, label: str) -> Iterator[_Record]:
    for number, row in enumerate(ds, start=1):
        yield f"{label}, row {number}", row


def _pick_split(obj: Any, split: str, label: str) -> tuple[Any, str]:
    """The ``split`` of a DatasetDict (a dict of splits), or a single Dataset as it is."""
    if isinstance(obj, dict):
        if split not in obj:
            raise DataError(f"{label} has no split {split!r}; its splits are {', '.join(map(repr, obj))}")
        return obj[split], f"{label} [{split!r}]"
    return obj, label


def _read_saved_dataset(path: Path, split: str) -> Iterator[_Record]:
    datasets = _import_datasets(f"{path} (a `datasets` save_to_disk folder)")
    try:
        obj = datasets.load_from_disk(str(path))
    except Exception as err:
        raise DataError(f"{path}: could not be read with datasets.load_from_disk ({err})") from err
    ds, label = _pick_split(obj, split, str(path))
    yield from _dataset_records(ds, label)


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Switch ``datasets`` and ``huggingface_hub`` to offline mode for the duration."""
    import datasets.config as ds_config
    import huggingface_hub.constants as hub_constants

    saved = (ds_config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE"))
    ds_config.HF_HUB_OFFLINE = True
    hub_constants.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        ds_config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved[0], saved[1]
        if saved[2] is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved[2]


def _read_with_load_dataset(source: str, split: str, is_folder: bool) -> Iterator[_Record]:
    kind = f"folder {source}" if is_folder else f"{source!r}"
    datasets = _import_datasets(f"{kind} (not a .jsonl/.json/.parquet file)")
    try:
        with _offline():
            obj = datasets.load_dataset(source)
    except Exception as err:
        if is_folder:
            raise DataError(
                f"folder {source}: not a `datasets` save_to_disk folder, has no {split}.jsonl/.json/.parquet, "
                f"and datasets.load_dataset could not read it offline ({type(err).__name__}: {err})"
            ) from err
        raise DataError(
            f"{source!r} is not a local file or folder, and the `datasets` package cannot load it from "
            f"this machine without the network (groupwise never downloads data). Download it yourself, "
            f"e.g. datasets.load_dataset({source!r}).save_to_disk('some/folder'), and pass the folder. "
            f"({type(err).__name__}: {err})"
        ) from err
    ds, label = _pick_split(obj, split, source if is_folder else f"dataset {source!r}")
    yield from _dataset_records(ds, label)


def _looks_like_path(source: str) -> bool:
    """True when a missing ``source`` was meant as a path rather than a hub name (``owner/name``)."""
    return (
        Path(source).suffix.lower() in FILE_SUFFIXES
        or source.startswith((".", "/", "~", "\\"))
        or source.count("/") > 1
        or "\\" in source
        or source.endswith("/")
    )


def _records(source: str, split: str) -> Iterator[_Record]:
    """Dispatch ``source`` to its reader."""
    path = Path(source).expanduser()
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            return _read_jsonl_bytes(path.read_bytes(), str(path))
        if suffix == ".json":
            return _read_json(path, split)
        if suffix == ".parquet":
            return _read_parquet(path)
        raise DataError(f"{path}: unsupported file type {suffix or '(no suffix)'!r}; use {', '.join(FILE_SUFFIXES)}")
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return _read_saved_dataset(path, split)
        for suffix in FILE_SUFFIXES:
            candidate = path / f"{split}{suffix}"
            if candidate.is_file():
                return _records(str(candidate), split)
        return _read_with_load_dataset(str(path), split, is_folder=True)
    if _looks_like_path(source):
        raise DataError(f"{source}: no such file or folder")
    return _read_with_load_dataset(source, split, is_folder=False)


# ---------------------------------------------------------------- validation
def _check_row(
    where: str,
    row: Any,
    columns: dict[str, str],
    require_answer: bool,
    max_prompt_chars: int | None,
    answer_needed_by: str = "",
) -> dict:
    """The row with our column names, or raise _BadRow with a message naming ``where`` and the column."""
    if isinstance(row, _BadRow):
        raise row
    if not isinstance(row, dict):
        raise _BadRow(f"{where}: expected an object with named columns, got a {type(row).__name__}")

    def describe(ours: str) -> str:
        theirs = columns[ours]
        return repr(ours) if theirs == ours else f"{theirs!r} (mapped to {ours!r})"

    def missing(ours: str) -> _BadRow:
        present = ", ".join(map(repr, row)) or "none"
        hint = f"; map one with columns={{{ours!r}: ...}}" if columns[ours] == ours else ""
        return _BadRow(f"{where}: no column {describe(ours)}; columns present: {present}{hint}")

    if columns["prompt"] not in row:
        raise missing("prompt")
    prompt = row[columns["prompt"]]
    if isinstance(prompt, list):  # a conversation: [{"role": ..., "content": ...}, ...], rendered by the chat template
        if not prompt or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        ):
            raise _BadRow(
                f"{where}: column {describe('prompt')} is a list but not of {{'role': str, 'content': str}} messages"
            )
        text = "".join(m["content"] for m in prompt)
    elif isinstance(prompt, str):
        text = prompt
    else:
        raise _BadRow(
            f"{where}: column {describe('prompt')} is {type(prompt).__name__}, "
            "expected a string or a list of chat messages"
        )
    if not text.strip():
        raise _BadRow(f"{where}: column {describe('prompt')} is empty")
    if max_prompt_chars is not None and len(text) > max_prompt_chars:
        raise _BadRow(
            f"{where}: column {describe('prompt')} has {len(text)} "
            f"characters, more than max_prompt_chars={max_prompt_chars}"
        )

    if columns["answer"] in row and row[columns["answer"]] is not None:
        answer = row[columns["answer"]]
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        elif not isinstance(answer, str):
            raise _BadRow(
                f"{where}: column {describe('answer')} is {type(answer).__name__}, expected a string or number"
            )
    elif require_answer:
        why = f"; {answer_needed_by}" if answer_needed_by else ""
        if columns["answer"] in row:
            raise _BadRow(
                f"{where}: column {describe('answer')} is null"
                + (why or " (pass require_answer=False to allow rows without one)")
            )
        raise _BadRow(str(missing("answer")) + why)
    else:
        answer = None

    out = dict(row)  # the source's own names stay: reward functions written for the dataset read them
    for ours, theirs in columns.items():
        if theirs in row:
            out[ours] = row[theirs]
    out["prompt"], out["answer"] = prompt, answer
    return out


def _normalise_columns(columns: dict[str, str] | None) -> dict[str, str]:
    if columns is None:
        columns = {}
    if not isinstance(columns, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in columns.items()):
        raise ConfigError(
            f"columns must map our column names to the source's, e.g. {{'prompt': 'question'}}; got {columns!r}"
        )
    return {"prompt": "prompt", "answer": "answer", **columns}


def load_rows(
    source: str | os.PathLike,
    *,
    split: str = "train",
    columns: dict[str, str] | None = None,
    on_bad_row: str = "raise",
    max_prompt_chars: int | None = None,
    require_answer: bool = True,
    answer_needed_by: str = "",
) -> LoadResult:
    """Load and validate rows from ``source``; see the module docstring for sources and rules.

    Raises :class:`DataError` for an unusable source, for the first bad row when
    ``on_bad_row="raise"``, and when no row survives; :class:`~groupwise.errors.ConfigError`
    for bad arguments. ``answer_needed_by`` says, in a missing-answer error, what needs the
    answer and which setting makes it unnecessary.
    """
    if on_bad_row not in ON_BAD_ROW:
        raise ConfigError(f"on_bad_row must be one of {', '.join(map(repr, ON_BAD_ROW))}, not {on_bad_row!r}")
    if max_prompt_chars is not None and (
        isinstance(max_prompt_chars, bool) or not isinstance(max_prompt_chars, int) or max_prompt_chars <= 0
    ):
        raise ConfigError(f"max_prompt_chars must be a positive integer or None, not {max_prompt_chars!r}")
    mapping = _normalise_columns(columns)
    source = os.fspath(source)

    result = LoadResult()
    for where, row in _records(source, split):
        try:
            result.rows.append(_check_row(where, row, mapping, require_answer, max_prompt_chars, answer_needed_by))
        except _BadRow as bad:
            if on_bad_row == "raise":
                raise DataError(str(bad)) from None
            result.skipped += 1
            result.problems.append(str(bad))
    if not result.rows:
        detail = f"; all {result.skipped} rows were bad, the first: {result.problems[0]}" if result.skipped else ""
        raise DataError(f"{source}: no usable rows{detail}")
    return result
