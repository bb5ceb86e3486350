"""``docs/variants.md`` (one short row per paper, generated) and ``groupwise paper NN``, both from
the manifests. Regenerate the page with ``python -m groupwise.papers.index > docs/variants.md``;
``tests/test_papers.py`` checks it is current.
"""

from __future__ import annotations

import sys
from pathlib import Path

from groupwise.papers import PACKAGE, Manifest, find, papers, standard

HEADER = """\
# Variants

<!-- Generated from src/groupwise/papers/*/paper.toml and papers/standard.toml by
`python -m groupwise.papers.index > docs/variants.md`; tests/test_papers.py checks it is current. -->

Every paper implemented so far, one row each: the stages it changes, the components it adds (by
stage), its files (the modules in its own folder, then those in the stage folders), its recipes and
its claims. Each paper has a folder, `src/groupwise/papers/NN_slug/` (also
`papers/` at the repository root): its page `README.md` (what it changes, what had to be
reconstructed — `[INFERRED]`, each an option —, the claim as measured by `make claims` and its
reading), its manifest `paper.toml`, and its own toy tasks, recipes and claim files.
`groupwise paper NN` lists every file, component, recipe, claim and test of paper NN;
`groupwise explain NAME` prints any component's docstring with the maths and the source of every
default; `docs/claims.md` has every claim's table and curves.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _components(m: Manifest) -> str:
    return "; ".join(f"{stage} " + ", ".join(f"`{name}`" for name in names) for stage, names in m.components.items())


def index_markdown() -> str:
    """The whole of ``docs/variants.md``."""
    std = standard()
    out = [HEADER, "## Standard algorithms", "", "| algorithm | stage | components | recipe |", "|---|---|---|---|"]
    out += [f"| {row['name']} | {row['stage']} | {row['components']} | {row['recipe']} |" for row in std.algorithms]
    out += [
        "",
        "## Papers",
        "",
        "| spec | paper | stage | components | files | recipes | claims |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in papers():
        folder = m.path.parent  # the paper's own modules (toy tasks, envs, scaffolding), then its stage-folder files
        own = sorted(p.name for p in folder.glob("*.py") if p.name != "__init__.py")
        files = ", ".join([*(f"`{name}`" for name in own), *(f"`{f}`" for f in m.files)]) or "—"
        spec = "/".join(f"{n:02d}" for n in m.numbers)
        link = f"[{_cell(m.title)}](../src/groupwise/papers/{m.name}/README.md)"
        recipes = ", ".join(f"`{r}`" for r in m.recipes) or "—"
        claims = ", ".join(f"`{c}`" for c in m.claims) or "—"
        out.append(f"| {spec} | {link} | {_cell(m.stage)} | {_components(m)} | {files} | {recipes} | {claims} |")
    out += [
        "",
        "## Infrastructure (not variants)",
        "",
        "These modules carry no paper of their own (`papers/standard.toml` lists every such file as `core`).",
        "",
        "| module | what it is | tested in |",
        "|---|---|---|",
    ]
    out += [f"| {row['module']} | {_cell(row['what'])} | {row['tested']} |" for row in std.infrastructure]
    return "\n".join(out) + "\n"


def _where(path: Path) -> str:
    """A path as ``groupwise/...`` (the package), the same in a checkout and an installed copy."""
    return str(Path(path).resolve().relative_to(PACKAGE.parent))


def paper_text(number: int | str) -> str:
    """What ``groupwise paper NN`` prints."""
    from groupwise.config import shipped_recipes
    from groupwise.registry import describe, lookup
    from groupwise.tasks import get_task

    m = find(number)
    folder = m.path.parent

    def component(stage: str, name: str) -> str:
        if stage == "task":
            task = get_task(name)
            rows = getattr(task.rows, "func", task.rows)
            return f"{stage} · {name} — {task.description}  [{_where(sys.modules[rows.__module__].__file__)}]"
        cls = lookup(stage, name)
        return f"{stage} · {name} — {describe(cls)}  [{_where(sys.modules[cls.__module__].__file__)}]"

    owners = {key: other.name for other in (*papers(), standard()) for key in other.owned()}
    arxiv = ", ".join(f"{a} (https://arxiv.org/abs/{a})" for a in m.arxiv) or "—"
    lines = [
        f"{'/'.join(f'{n:02d}' for n in m.numbers)} · {m.title}",
        "",
        f"arXiv      {arxiv}",
        f"spec       specs/{m.spec_file}",
        f"page       {_where(folder / 'README.md')}",
        f"manifest   {_where(m.path)}",
        f"stage      {m.stage}",
        "",
        "components (stage · name — summary  [file]):",
    ]
    lines += [f"  {component(stage, name)}" for stage, name in m.owned()]
    used = [(stage, name) for stage, names in m.uses.items() for name in names]
    if used:
        lines += ["", "uses (owned by another manifest):"]
        lines += [f"  {component(stage, name)}  (owner: {owners.get((stage, name), '?')})" for stage, name in used]
    own = sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    lines += ["", "files in its folder:"] + [f"  {_where(p)}" for p in own]
    lines += ["", "files in the stage folders:"] + [f"  groupwise/{f}" for f in m.files]
    if m.data:
        lines += ["", "shipped data:"] + [f"  groupwise/{d}" for d in m.data]
    recipes = shipped_recipes()
    lines += ["", "recipes (groupwise train NAME · groupwise explain NAME):"]
    lines += [f"  {r}  [{_where(recipes[r])}]" for r in m.recipes] or ["  (none: see the README)"]
    if m.pipelines:
        lines += ["", "pipelines (groupwise pipeline NAME --out DIR):"]
        lines += [f"  {p}  [{_where(folder / 'pipelines' / f'{p}.toml')}]" for p in m.pipelines]
    lines += ["", "claims (groupwise claims NAME; results in docs/claims.md):"]
    lines += [f"  {c}  [{_where(folder / 'claims' / f'{c}.toml')}]" for c in m.claims] or ["  (none)"]
    lines += ["", "tests (in a source checkout):"] + [f"  {t}" for t in m.tests]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(index_markdown())
