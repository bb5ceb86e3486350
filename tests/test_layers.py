"""The import graph of ``src/groupwise`` keeps its layers (``docs/architecture.md``, "Layers").

Every module is parsed (``ast``); its imports are read at module level and inside functions (an
``importlib.import_module("groupwise....")`` with a literal name counts; ``if TYPE_CHECKING:`` imports
do not run and do not count). Importing ``groupwise.a.b`` also runs the package ``groupwise.a``, so
that is an edge too, except from inside the package. Checked: every module is in exactly one layer
of ``LAYERS``; the module-level graph has no cycle; every import from a lower layer into a higher one
is in ``UPWARD`` with its reason (and every entry there is such an import); and with those few edges
taken out, the whole graph (function-level imports too) has no cycle. Each check is also shown to
report a violation on a small made-up graph.
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import groupwise

PACKAGE = Path(groupwise.__file__).resolve().parent

# Lowest first. A module belongs to the first layer with a pattern that matches its dotted name (fnmatch),
# so an exact name listed in a lower layer takes a module out of a wildcard of a higher one.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "ground",
        (
            "groupwise.errors",
            "groupwise.validate",
            "groupwise.types",
            "groupwise.masked",
            "groupwise.seeds",
            "groupwise.dist",
            "groupwise.stats",
            "groupwise.evaluation",
            "groupwise.influence",
            "groupwise.rubric_bank",
            "groupwise.runfolder",
            "groupwise.checkpoint",
            "groupwise.logging",
            "groupwise.tracking",
            "groupwise.sandbox",
            "groupwise.sandbox.*",
            "groupwise.models",
            "groupwise.models.build",
            "groupwise.policy",
            "groupwise.tokens",
        ),
    ),
    ("registry", ("groupwise.registry",)),
    (
        "contract",
        ("groupwise.components", "groupwise.plugins", "groupwise.papers", "groupwise.hooks", "groupwise.textspans"),
    ),
    # what components of several stages share: bases, contexts, the reward call machinery, task loading
    (
        "helpers",
        (
            "groupwise.rewards",
            "groupwise.rewards._*",
            "groupwise.rewards.score",
            "groupwise.losses",
            "groupwise.losses._common",
            "groupwise.updates",
            "groupwise.updates._*",
            "groupwise.rollout",
            "groupwise.rollout.context",
            "groupwise.views",
            "groupwise.schedules",
            "groupwise.providers",
            "groupwise.advantages",
            "groupwise.weights",
            "groupwise.sampling",
            "groupwise.tasks",
            "groupwise.tasks.data",
            "groupwise.modalities",
            # the maths of the policies that components read: the packed forward, the flow toy's SDE step
            "groupwise.policy.forward",
            "groupwise.policy.functional",
            "groupwise.policy.precision",
            "groupwise.modalities.flow_sde",
            "groupwise.modalities.gauss",
        ),
    ),
    (
        "stages",
        (
            "groupwise.sampling.*",
            "groupwise.rollout.*",
            "groupwise.rewards.*",
            "groupwise.advantages.*",
            "groupwise.weights.*",
            "groupwise.losses.*",
            "groupwise.updates.*",
            "groupwise.schedules.*",
            "groupwise.views.*",
            "groupwise.providers.*",
            "groupwise.kl_estimators",
            "groupwise.tasks.*",
            "groupwise.modalities.flow_toy",
        ),
    ),
    ("paper folders", ("groupwise.papers.[0-9]*",)),
    ("policies", ("groupwise.policy", "groupwise.policy.*", "groupwise.modalities.*")),
    (
        "composition parts",
        (
            "groupwise.needs",
            "groupwise.objective",
            "groupwise.roles",
            "groupwise.pinning",
            "groupwise.phases",
            "groupwise.phases.*",
            "groupwise.config",
        ),
    ),
    ("build", ("groupwise.build",)),
    ("trainer", ("groupwise.trainer",)),
    ("held-out and run", ("groupwise.heldout", "groupwise.run")),
    (
        "entry points",
        (
            "groupwise",
            "groupwise.discovery",
            "groupwise.__main__",
            "groupwise.cli",
            "groupwise.pipeline",
            "groupwise.serve",
            "groupwise.claims",
            "groupwise.claims.*",
            "groupwise.models.warmstart",
            "groupwise.models.chatstart",
            "groupwise.models.mdlm_fit",
            "groupwise.papers.check",
            "groupwise.papers.index",
        ),
    ),
]

# (importer, imported): why the import runs up the layers. Each is a function-level import, made when called.
UPWARD: dict[tuple[str, str], str] = {}


# ---------------------------------------------------------------------------------------------- the graph
def module_names(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, from its ``__init__.py``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _targets(node: ast.AST, package: str) -> list[str]:
    """The dotted names an import statement (or ``importlib.import_module("...")``) brings in."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            here = package.split(".")
            base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
        return [f"{base}.{a.name}" for a in node.names] + [base]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def imports(source: str, package: str) -> list[tuple[str, bool]]:
    """``(dotted name, at module level)`` of every import in ``source`` (``package``: for relative imports)."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # type-only: never runs
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            found.extend((name, inner) for name in _targets(child, package))
            visit(child, inner)

    visit(ast.parse(source), True)
    return found


def graph(modules: dict[str, str], root: str = "groupwise") -> dict[str, dict[str, bool]]:
    """``{importer: {imported: at module level}}`` over ``modules`` (name -> source). Importing a module
    also runs its enclosing packages; the importer's own enclosing packages are never an edge."""
    edges: dict[str, dict[str, bool]] = {name: {} for name in modules}
    for name, source in modules.items():
        is_package = any(other.startswith(name + ".") for other in modules)
        own = {name.rsplit(".", k)[0] for k in range(name.count(".") + 1)}  # itself and its enclosing packages
        for target, top in imports(source, name if is_package else name.rpartition(".")[0]):
            if not (target == root or target.startswith(root + ".")):
                continue
            while target and target not in modules:  # `from pkg import name` names an attribute, not a module
                target = target.rpartition(".")[0]
            if not target:
                continue
            hit = [target] + [target.rsplit(".", k)[0] for k in range(1, target.count(".") + 1)]
            for t in hit:
                if t in modules and t not in own:
                    edges[name][t] = edges[name].get(t, False) or top
    return edges


def layer_of(name: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> int | None:
    for index, (_, patterns) in enumerate(layers):
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return index
    return None


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return found


Layers = list[tuple[str, tuple[str, ...]]]


def upward(edges: dict[str, dict[str, bool]], layers: Layers = LAYERS) -> set[tuple[str, str]]:
    """The imports from a module into a module of a higher layer (modules in no layer are reported elsewhere)."""
    level = {name: layer_of(name, layers) for name in {*edges, *(b for targets in edges.values() for b in targets)}}
    return {
        (a, b)
        for a, targets in edges.items()
        for b in targets
        if level[a] is not None and level[b] is not None and level[b] > level[a]
    }


def _package_graph() -> dict[str, dict[str, bool]]:
    return graph({name: path.read_text() for name, path in module_names().items()})


# ---------------------------------------------------------------------------------------------- the tests
def test_every_module_is_in_a_layer():
    unplaced = [name for name in module_names() if layer_of(name) is None]
    assert unplaced == [], f"modules in no layer of LAYERS (tests/test_layers.py): {unplaced}"


def test_no_cycle_at_module_level():
    edges = _package_graph()
    top = {a: {b for b, at_top in targets.items() if at_top} for a, targets in edges.items()}
    assert cycles(top) == []


def test_every_import_up_the_layers_is_listed_with_its_reason():
    edges = _package_graph()
    found = upward(edges)
    unlisted = sorted(found - set(UPWARD))
    named = [(a, b, LAYERS[layer_of(a)][0], LAYERS[layer_of(b)][0]) for a, b in unlisted]
    assert unlisted == [], (
        "imports from a lower layer into a higher one (move the shared piece down, or list it in "
        f"UPWARD with a reason): {named}"
    )
    stale = sorted(set(UPWARD) - found)
    assert stale == [], f"UPWARD lists imports that do not run up the layers (any more): {stale}"
    assert all(reason.strip() for reason in UPWARD.values())
    assert not any(edges[a][b] for a, b in UPWARD), "an upward import at module level would run on import: make it late"


def test_no_cycle_but_through_the_listed_late_imports():
    edges = _package_graph()
    rest = {a: {b for b in targets if (a, b) not in UPWARD} for a, targets in edges.items()}
    assert cycles(rest) == []


def test_the_architecture_page_shows_these_layers_in_order():
    page = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    section = page.split("## Layers (`tests/test_layers.py`)", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1:] == [name for name, _ in LAYERS], "docs/architecture.md's Layers table and LAYERS disagree"


def test_config_error_comes_from_the_ground_floor_only():
    """``ConfigError`` lives in ``errors.py``; no module, test, bench or example imports it from anywhere
    else (the registry uses it but does not re-export it)."""
    repo = Path(__file__).resolve().parents[1]
    outside = [p for folder in ("tests", "bench", "examples") for p in (repo / folder).rglob("*.py")]
    files = [*module_names().values(), *outside]
    wrong = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and any(a.name == "ConfigError" for a in node.names)
                and node.module != "groupwise.errors"
            ):
                wrong.append((str(path), node.module))
    assert wrong == []


def test_the_checks_report_violations():
    """On a made-up package: a module-level cycle, an upward import (and its package), a function-level
    cycle, a type-only import ignored, a relative import resolved."""
    modules = {
        "pkg": "",
        "pkg.low": "from pkg.high import thing\n",  # up, at module level
        "pkg.high": "def f():\n    from pkg import low\n",  # down, late: closes a cycle through a late import
        "pkg.sub": "",
        "pkg.sub.a": "from . import b\nimport importlib\nimportlib.import_module('pkg.low')\n",
        "pkg.sub.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import x\n",
        "pkg.other": "from pkg.sub.b import y\n",
    }
    edges = graph(modules, root="pkg")
    assert edges["pkg.low"] == {"pkg.high": True}
    assert edges["pkg.high"] == {"pkg.low": False}
    assert edges["pkg.sub.a"] == {"pkg.sub.b": True, "pkg.low": True}  # its own package is not an edge
    assert edges["pkg.sub.b"] == {}  # type-only
    assert edges["pkg.other"] == {"pkg.sub.b": True, "pkg.sub": True}  # importing a module runs its package
    layers = [("one", ("pkg.low", "pkg.sub*", "pkg.other")), ("two", ("pkg.high",))]
    assert upward(edges, layers) == {("pkg.low", "pkg.high")}
    assert cycles({a: set(t) for a, t in edges.items()}) == [["pkg.high", "pkg.low"]]
    assert cycles({a: {b for b, top in t.items() if top} for a, t in edges.items()}) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("pkg.nowhere", layers) is None
