"""What produced a claim record: the commit, the library versions, the CPU and the thread counts.

A verdict on a ~1M-parameter model can move with the machine (float summation order, thread
count, a library's kernels), so every record says where it came from. ``commit`` is
``git rev-parse HEAD`` of the checkout the ``groupwise`` package was imported from ("unknown" for an
installed copy or without git); ``source_modified`` says whether tracked files of that package
differed from the commit (None when unknown).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import groupwise

PACKAGE = Path(groupwise.__file__).resolve().parent


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(PACKAGE), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first ``model name`` of ``/proc/cpuinfo`` (Linux), else ``platform.processor()`` or "unknown"."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def provenance(threads: list[int]) -> dict:
    """The record's ``provenance``; ``threads``: the runs' ``threads`` settings (0 = torch's default,
    which is ``cpu_count`` here)."""
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".")
    return {
        "commit": _git("rev-parse", "HEAD") or "unknown",
        "source_modified": None if status is None else bool(status),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": sorted(set(threads)),
        "platform": platform.platform(),
    }


def describe(prov: dict | None) -> str:
    """One sentence for the page."""
    if not prov:
        return "Provenance: not recorded (a record from before records stored it)."
    threads = ", ".join(
        f"{t}" if t else f"0 (torch default, {prov.get('cpu_count')} cores)" for t in prov.get("threads", [])
    )
    commit = prov.get("commit", "unknown")
    modified = {True: " with modified sources", False: "", None: ""}[prov.get("source_modified")]
    return (
        f"Provenance: commit `{commit[:12]}`{modified}, torch {prov.get('torch')}, transformers "
        f"{prov.get('transformers')}, Python {prov.get('python')}, CPU {prov.get('cpu')} "
        f"({prov.get('cpu_count')} cores), threads {threads or '?'}."
    )
