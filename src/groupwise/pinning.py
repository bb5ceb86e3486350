"""Pinned inputs: the sha256 of every model a run loads (design §6 rule 2).

A run records ``models`` in its ``summary.json`` (``model.path`` and each ``roles.NAME.model.path``:
the folder's files hashed in sorted order); ``groupwise pipeline`` records the same per stage in
``pipeline.json``, with the final weights' sha256 by :func:`tree_sha`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from groupwise import runfolder


def file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_sha(path: Path) -> str:
    """sha256 of a file, or of a folder: of its files' relative paths and sha256s, in sorted order."""
    path = Path(path)
    if path.is_file():
        return file_sha(path)
    lines = [
        f"{p.relative_to(path).as_posix()} {file_sha(p)}"
        for p in sorted(path.rglob("*"))
        if p.is_file() and not runfolder.is_temporary(p.name)
    ]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def loaded_models(config: dict, substituted: list[str]) -> dict[str, str | None]:
    """``{where: sha256}`` of every model a stage loads: ``model.path``, ``roles.NAME.model.path`` and each
    path an override took from an earlier stage. A shipped model name is its folder; a toy kind's
    ``default`` (fresh weights) and a hub id are recorded as ``None``."""
    from groupwise.policy.lm import resolve_model_path

    wanted: dict[str, tuple[str, str]] = {}  # where -> (path, policy kind)
    model = config.get("model", {})
    wanted["model.path"] = (str(model.get("path", "")), str(model.get("policy", "lm")))
    for name, role in (config.get("roles") or {}).items():
        own = role.get("model", {})
        wanted[f"roles.{name}.model.path"] = (str(own.get("path", "")), str(own.get("policy", "lm")))
    for path in substituted:
        wanted.setdefault(path, (path, ""))
    out: dict[str, str | None] = {}
    for where, (value, kind) in wanted.items():
        resolved = resolve_model_path(value) if value and kind == "lm" else value  # a toy kind's "default": fresh
        out[where] = tree_sha(Path(resolved)) if resolved and Path(resolved).exists() else None
    return out
