"""The manifest checks behind ``tests/test_papers.py``: every registry entry (tasks included) and
every source file of the package belongs to exactly one manifest (a paper's ``paper.toml`` or
``standard.toml``), every recipe and claim file to the manifest of its folder, everything a
manifest names exists, and no module outside a paper folder imports one (nor one paper another).

Each check returns a list of problems, one sentence each, naming the entry or file and the fix.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable
from pathlib import Path

from groupwise.papers import FOLDER_RE, PACKAGE, PAPERS, Manifest, folders, papers, standard

ROOT = PACKAGE.parents[1]  # the repository, in a source checkout (tests/ and claims/ live there)


def manifests() -> list[Manifest]:
    return [*papers(), standard()]


def registered() -> list[tuple[str, str, str]]:
    """(stage, name, module) of every registry entry and every task, all modules imported."""
    from groupwise.registry import entries
    from groupwise.tasks import TASKS, get_task

    get_task("arithmetic")  # imports the task modules (entries() already imported the paper folders)
    out = [(stage, name, cls.__module__) for stage, name, cls in entries()]
    for name, task in TASKS.items():
        rows = task.rows.func if isinstance(task.rows, functools.partial) else task.rows
        out.append(("task", name, getattr(rows, "__module__", "")))
    return out


def entry_problems(entries: Iterable[tuple[str, str, str]] | None = None) -> list[str]:
    """Each entry registered by a module of the package is owned by exactly one manifest; each
    owned or used name is registered; a manifest does not list what it owns under ``uses``.
    Entries of modules outside the package (a user's plug-ins, a test's) need no manifest."""
    entries = registered() if entries is None else list(entries)
    known = {(stage, name) for stage, name, _ in entries}
    owners: dict[tuple[str, str], list[str]] = {}
    problems = []
    for m in manifests():
        for key in m.owned():
            owners.setdefault(key, []).append(m.name)
            if key not in known:
                problems.append(
                    f"{m.path}: [components] {key[0]} {key[1]!r} is not registered; remove it or register it"
                )
        for stage, names in m.uses.items():
            for name in names:
                if (stage, name) not in known:
                    problems.append(f"{m.path}: [uses] {stage} {name!r} is not registered")
                elif (stage, name) in m.owned():
                    problems.append(
                        f"{m.path}: {stage} {name!r} is both owned and in [uses]; keep it under [components]"
                    )
    for stage, name, module in entries:
        if not module.startswith("groupwise."):
            continue
        who = owners.get((stage, name), [])
        if not who:
            problems.append(
                f"{stage} {name!r} ({module}) belongs to no manifest: list it under [components] "
                "of its paper's paper.toml, or of papers/standard.toml if it is a standard algorithm"
            )
        elif len(who) > 1:
            problems.append(
                f"{stage} {name!r} is owned by {' and '.join(who)}: own it once, list it under [uses] elsewhere"
            )
    return problems


def _paper_folder(rel: Path) -> str | None:
    """The paper folder a package-relative path lies in (``papers/27_alphagrpo/yes_no.py``), or None."""
    parts = rel.parts
    return parts[1] if len(parts) > 2 and parts[0] == "papers" and FOLDER_RE.match(parts[1]) else None


def _matches(pattern: str) -> list[Path]:
    return sorted(p for p in PACKAGE.glob(pattern) if p.is_file())


def source_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def file_problems(files: Iterable[Path] | None = None) -> list[str]:
    """Each source file is in a paper folder or named (path or glob) by exactly one manifest's
    ``files`` / ``core``; each name and ``data`` path of a manifest exists; no paper lists a file
    of its own folder (the folder already says it)."""
    files = source_files() if files is None else list(files)
    owners: dict[Path, list[str]] = {}
    problems = []
    for m in manifests():
        for pattern in [*m.files, *m.core]:
            found = _matches(pattern)
            if not found:
                problems.append(f"{m.path}: files/core entry {pattern!r} names no file under {PACKAGE}")
            for path in found:
                if m.name not in owners.setdefault(path, []):
                    owners[path].append(m.name)
        for path in m.data:
            if not (PACKAGE / path).exists():
                problems.append(f"{m.path}: data {path!r} does not exist under {PACKAGE}")
    for path in files:
        rel = path.relative_to(PACKAGE)
        folder = _paper_folder(rel)
        who = owners.get(path, [])
        if folder and who:
            problems.append(
                f"{rel} is in paper folder {folder} and also named by {', '.join(who)}: "
                "remove it from those files lists"
            )
        elif not folder and not who:
            problems.append(
                f"{rel} belongs to no manifest: move it into its paper's folder, or add it to `files` "
                "of its paper's paper.toml (or to `files` / `core` of papers/standard.toml)"
            )
        elif len(who) > 1:
            problems.append(f"{rel} is named by {' and '.join(who)}: one manifest owns a file")
    return problems


def _stems(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.toml")) if folder.is_dir() else []


def recipe_and_claim_problems() -> list[str]:
    """Recipes, pipelines and claim files: a paper folder's own are exactly its manifest's; ``recipes/``,
    ``pipelines/`` and a
    repository's ``claims/`` are exactly ``standard.toml``'s; every tests path exists."""
    from groupwise.config import RECIPES
    from groupwise.pipeline import PIPELINES

    problems = []
    pairs = [(standard(), RECIPES, ROOT / "claims" if (ROOT / "claims").is_dir() else None)]
    pairs += [(m, m.path.parent / "recipes", m.path.parent / "claims") for m in papers()]
    for m, recipes, claims in pairs:
        if _stems(recipes) != sorted(m.recipes):
            problems.append(f"{m.path}: recipes = {sorted(m.recipes)} but {recipes} holds {_stems(recipes)}")
        pipelines = PIPELINES if m.name == "standard" else m.path.parent / "pipelines"
        if _stems(pipelines) != sorted(m.pipelines):
            problems.append(f"{m.path}: pipelines = {sorted(m.pipelines)} but {pipelines} holds {_stems(pipelines)}")
        if claims is not None and _stems(claims) != sorted(m.claims):
            problems.append(f"{m.path}: claims = {sorted(m.claims)} but {claims} holds {_stems(claims)}")
        if (ROOT / "tests").is_dir():  # a source checkout
            problems += [f"{m.path}: test {t!r} does not exist" for t in m.tests if not (ROOT / t).is_file()]
    return problems


def _imported(path: Path, text: str) -> list[str]:
    """The absolute module names a file imports (relative imports resolved; import_module("...") too)."""
    package = list(path.relative_to(PACKAGE.parent).parts[:-1])  # a module's package, an __init__'s own
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            out += [module] + [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            out += [a.value for a in node.args[:1] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return out


def import_problems(sources: Iterable[tuple[Path, str]] | None = None) -> list[str]:
    """No module outside a paper folder imports from one (the stage folders and the core never run
    back up into a paper), and no paper folder imports another's. ``sources``: (path, text) pairs,
    by default every source file of the package."""
    problems = []
    for path, text in ((p, p.read_text()) for p in source_files()) if sources is None else sources:
        rel = path.relative_to(PACKAGE)
        own = _paper_folder(rel)
        for module in _imported(path, text):
            parts = module.split(".")  # groupwise.papers.NN_slug[.module] -> NN_slug
            target = _paper_folder(Path(*parts[1:], "x")) if parts[0] == "groupwise" else None
            if target is None or target == own:
                continue
            why = (
                "a paper folder imports no other paper's; move the shared part into its stage folder"
                if own
                else "a stage or core module never imports a paper folder; move the shared part out of the paper folder"
            )
            problems.append(f"{rel} imports {module}: {why}")
    return problems


def folder_problems() -> list[str]:
    """Folder names, spec numbers and the package's own files: one folder per spec number."""
    problems, seen = [], {}
    for m in papers():
        for n in m.numbers:
            if n in seen:
                problems.append(f"spec {n} is claimed by {seen[n]} and {m.name}")
            seen[n] = m.name
        if not (m.path.parent / "README.md").is_file():
            problems.append(f"{m.path.parent} has no README.md (the paper page)")
    stray = [p.name for p in PAPERS.iterdir() if p.is_dir() and p.name != "__pycache__" and not FOLDER_RE.match(p.name)]
    problems += [f"papers/{name} is not named NN_slug (two-digit spec number, a lower-case slug)" for name in stray]
    problems += [f"{f} has no paper.toml" for f in folders() if not (f / "paper.toml").is_file()]
    return problems


def all_problems() -> list[str]:
    return [*folder_problems(), *entry_problems(), *file_problems(), *recipe_and_claim_problems(), *import_problems()]
