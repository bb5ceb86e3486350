"""What a run read: the sha256 of every model it loads and the label ledger (design §6 rules 2, 3).

A run records ``models`` in its ``summary.json`` (``model.path`` and each ``roles.NAME.model.path``:
the folder's files hashed in sorted order); ``groupwise pipeline`` records the same per stage in
``pipeline.json``, with the final weights' sha256 by :func:`tree_sha`, and each stage's label ledger
(:func:`ledger`: which train rows its rewards read with a label, by index and content key).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

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


def row_key(row: dict) -> str:
    """A row's content key (sha256 of its JSON, first 16 hex digits): the same row in two splits has the same key."""
    return hashlib.sha256(json.dumps(row, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------- the ledger
def ledger(run: Any) -> dict[str, Any]:
    """The label ledger of a finished (or resumed-finished) run: which train rows its rewards read with
    a label and which prompts it drew without one, by index into the train split and by content key.

    - drawn prompts: the prompts of every scored group (the run's prompt statistics: a group whose
      every reward was invalid is not recorded);
    - ``labelled``: the drawn prompts when a reward of non-zero weight scored them, plus every train row
      when a phase that reads labels ran (a phase reads its rows unless it declares ``reads_labels = False``);
    - ``unlabelled``: the drawn prompts when every reward weighs 0 (rewards for logging only), plus every
      train row a label-free phase may read;
    - ``held_out_overlap``: how many of those keys are held-out rows' keys (0 for an honest stage)."""
    trainer, parts = run.trainer, run.parts
    rows = trainer.train_rows
    drawn = sorted(trainer.prompt_stats.prompts())
    stage = parts.reward_stage
    weights = [float(getattr(s, "weight", 1.0)) for s in (*stage.text, *stage.tensor)]
    rewarded = any(w != 0 for w in weights)
    labelled = set(drawn) if rewarded else set()
    unlabelled = set() if rewarded else set(drawn)
    for phase in parts.phases:
        (labelled if getattr(phase, "reads_labels", True) else unlabelled).update(range(len(rows)))
    unlabelled -= labelled
    held = {row_key(r) for r in parts.eval_rows}

    def part(indices: set[int]) -> dict[str, Any]:
        keys = [row_key(rows[i]) for i in sorted(indices)]
        return {"rows": len(keys), "indices": sorted(indices), "keys": keys}

    out = {
        "train_rows": len(rows),
        "reward_weights": weights,
        "labelled": part(labelled),
        "unlabelled": part(unlabelled),
        "held_out_rows": len(parts.eval_rows),
    }
    out["held_out_overlap"] = len(held & {*out["labelled"]["keys"], *out["unlabelled"]["keys"]})
    return out
