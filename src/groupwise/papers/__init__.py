"""Papers: one folder per implemented paper, ``papers/NN_slug/``, and the manifest of the rest.

A paper folder holds ``paper.toml`` (its manifest), ``README.md`` (the paper page: what it changes,
the ``[INFERRED]`` choices, the claim and its reading) and the paper's own scaffolding: its toy
tasks with their rewards and environments, ``recipes/*.toml``, ``pipelines/*.toml`` and ``claims/*.toml``. Mechanism
another paper or a standard recipe can use (estimators, terms, weights, strategies, views,
providers, updaters, phases) stays in the stage folders; the manifest lists it by stage
(``[components]``) and by file (``files``, paths relative to ``src/groupwise``). ``standard.toml``
owns the standard algorithms and the core. Every registry entry and every source file of the
package belongs to exactly one manifest (``tests/test_papers.py``).

Discovery: ``registry.load_all`` (``discovery.import_components``) imports every module of every paper
folder that is a package
(:func:`module_names`); recipes are found in ``recipes/`` and ``papers/*/recipes/``
(:func:`named_files`), pipelines in ``pipelines/`` and ``papers/*/pipelines/``, claim files in a
repository's ``claims/`` and ``papers/*/claims/``.
A folder's name starts with the two-digit spec number, so its modules are reached through
``importlib.import_module("groupwise.papers.27_alphagrpo.number_attrs")``; inside a folder,
imports are relative. ``papers/index.py`` writes ``docs/variants.md`` and ``groupwise paper NN``.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from groupwise.errors import ConfigError
from groupwise.registry import STAGES

PAPERS = Path(__file__).resolve().parent
PACKAGE = PAPERS.parent  # manifest paths are relative to src/groupwise
STANDARD = PAPERS / "standard.toml"
FOLDER_RE = re.compile(r"^(?P<spec>\d\d)_[a-z0-9_]+$")
COMPONENT_KEYS = (*STAGES, "task")  # tasks are registered by name too (groupwise.tasks.register_task)
PAPER_KEYS = (
    "spec",
    "also",
    "title",
    "arxiv",
    "spec_file",
    "stage",
    "files",
    "data",
    "recipes",
    "pipelines",
    "claims",
    "tests",
    "components",
    "uses",
)
STANDARD_KEYS = (
    "title",
    "files",
    "core",
    "data",
    "recipes",
    "pipelines",
    "claims",
    "tests",
    "components",
    "algorithms",
    "infrastructure",
)
LIST_KEYS = ("files", "core", "data", "recipes", "pipelines", "claims", "tests", "arxiv")


@dataclass
class Manifest:
    """One ``paper.toml`` (or ``standard.toml``): what it owns, by stage and by file."""

    name: str  # the folder name ("27_alphagrpo"), or "standard"
    path: Path
    title: str
    spec: int | None = None
    also: list[int] = field(default_factory=list)  # further spec numbers the same folder carries (36 carries 43)
    arxiv: list[str] = field(default_factory=list)
    spec_file: str = ""
    stage: str = ""  # one short phrase: the stages the paper changes
    components: dict[str, list[str]] = field(default_factory=dict)  # stage (or "task") -> registry names it owns
    uses: dict[str, list[str]] = field(default_factory=dict)  # stage -> names owned elsewhere that it relies on
    files: list[str] = field(default_factory=list)  # source files outside the folder that belong to it
    core: list[str] = field(default_factory=list)  # standard.toml only: infrastructure files (globs)
    data: list[str] = field(default_factory=list)  # shipped data outside the folder (models, word lists)
    recipes: list[str] = field(default_factory=list)
    pipelines: list[str] = field(default_factory=list)  # pipeline files (groupwise pipeline NAME) of the folder
    claims: list[str] = field(default_factory=list)
    tests: list[str] = field(default_factory=list)  # paths relative to the repository root
    algorithms: list[dict] = field(default_factory=list)  # standard.toml only: rows of the standard table
    infrastructure: list[dict] = field(default_factory=list)  # standard.toml only

    @property
    def folder(self) -> Path | None:
        return None if self.name == "standard" else self.path.parent

    @property
    def numbers(self) -> list[int]:
        return ([self.spec] if self.spec is not None else []) + list(self.also)

    def owned(self) -> list[tuple[str, str]]:
        return [(stage, name) for stage, names in self.components.items() for name in names]


def _strings(where: str, key: str, value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: {key} must be a list of strings, got {value!r}")
    return list(value)


def _by_stage(where: str, key: str, value: object) -> dict[str, list[str]]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: [{key}] must be a table of stage = [names]")
    for stage in value:
        if stage not in COMPONENT_KEYS:
            raise ConfigError(f"{where}: [{key}] has no stage {stage!r}; stages: {', '.join(COMPONENT_KEYS)}")
    return {stage: _strings(where, f"{key}.{stage}", names) for stage, names in value.items()}


def load_manifest(path: Path) -> Manifest:
    """Read and check one manifest; every error names the file and the key."""
    where = str(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{where}: not valid TOML: {err}") from None
    standard = path.name == "standard.toml"
    valid = STANDARD_KEYS if standard else PAPER_KEYS
    for key in data:
        if key not in valid:
            raise ConfigError(f"{where}: unknown key {key!r}; valid keys: {', '.join(valid)}")
    if not isinstance(data.get("title"), str) or not data["title"]:
        raise ConfigError(f"{where}: 'title' must be a non-empty string")
    lists = {k: _strings(where, k, data.get(k, [])) for k in LIST_KEYS if k in valid}
    manifest = Manifest(
        "standard" if standard else path.parent.name,
        path,
        data["title"],
        components=_by_stage(where, "components", data.get("components", {})),
        uses=_by_stage(where, "uses", data.get("uses", {})),
        **lists,
    )
    if standard:
        manifest.algorithms = list(data.get("algorithms", []))
        manifest.infrastructure = list(data.get("infrastructure", []))
        return manifest
    match = FOLDER_RE.match(path.parent.name)
    if match is None or data.get("spec") != int(match["spec"]):
        raise ConfigError(
            f"{where}: 'spec' must be the folder's number ({path.parent.name[:2]}), got {data.get('spec')!r}"
        )
    manifest.spec = data["spec"]
    manifest.also = [int(n) for n in data.get("also", [])]
    for key in ("spec_file", "stage"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ConfigError(f"{where}: {key!r} must be a non-empty string")
        setattr(manifest, key, data[key])
    return manifest


def folders() -> list[Path]:
    """The paper folders, in spec order."""
    return sorted(p for p in PAPERS.iterdir() if p.is_dir() and FOLDER_RE.match(p.name))


@cache
def papers() -> tuple[Manifest, ...]:
    return tuple(load_manifest(folder / "paper.toml") for folder in folders())


@cache
def standard() -> Manifest:
    return load_manifest(STANDARD)


def find(number: int | str) -> Manifest:
    """The paper folder of spec ``number`` (``27``, ``"27"``, ``"07"``; 43 finds 36's folder)."""
    try:
        n = int(str(number))
    except ValueError:
        n = -1
    for manifest in papers():
        if n in manifest.numbers:
            return manifest
    known = ", ".join(f"{n:02d}" for n in sorted(n for m in papers() for n in m.numbers))
    raise ConfigError(f"no paper with spec number {number!r}; implemented: {known}")


def module_names() -> list[str]:
    """Every module of every paper folder that is a package (``_``-prefixed modules skipped)."""
    out = []
    for folder in folders():
        if (folder / "__init__.py").exists():
            modules = [p.stem for p in sorted(folder.glob("*.py")) if not p.name.startswith("_")]
            out += [f"groupwise.papers.{folder.name}.{module}" for module in modules]
    return out


def named_files(first: Path | None, sub: str) -> dict[str, Path]:
    """``{stem: path}`` of the ``*.toml`` files in ``first`` and in every ``papers/*/<sub>/``; a name
    found twice is an error naming both files."""
    found: dict[str, Path] = {}
    dirs = [first] if first is not None and first.is_dir() else []
    dirs += [f / sub for f in folders() if (f / sub).is_dir()]
    for folder in dirs:
        for path in sorted(folder.glob("*.toml")):
            if path.stem in found:
                raise ConfigError(
                    f"{sub[:-1]} {path.stem!r} is defined twice: {found[path.stem]} and {path}; rename one"
                )
            found[path.stem] = path
    return dict(sorted(found.items()))
