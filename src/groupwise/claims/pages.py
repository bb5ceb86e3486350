"""The paper pages' claim sections, from ``docs/claims.md`` and its records.

Each paper page (``papers/NN_slug/README.md``) ends with "## Claim, as measured": a generated status
block (one line per claim: its confirmatory verdict, or its exploratory result marked as not
confirmed), the page's own summary (hand-written, kept), and one subsection per claim of the
manifest with the claim's reading copied from ``docs/claims.md`` (re-wrapped at 100 columns).
``groupwise claims`` rewrites them with the page when it writes the repository's own
``docs/claims.md``; ``tests/test_claims.py`` checks they are current.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from groupwise.claims.claimfile import Claim, load_claim
from groupwise.claims.compare import seed_text
from groupwise.claims.report import MECHANISM, detectable_text, load_records, readings, rejudge, shown_verdict

HEADING = "## Claim, as measured\n"
STATUS_OPEN = (
    "<!-- claims-status: generated from docs/claims.md by `groupwise claims` (edit the claim files, readings) -->"
)
STATUS_CLOSE = "<!-- /claims-status -->"
STATUS_RE = re.compile(re.escape(STATUS_OPEN) + r".*?" + re.escape(STATUS_CLOSE) + r"\n*", re.S)
WIDTH = 100


def wrap(text: str) -> str:
    """Each paragraph of ``text`` filled to ``WIDTH`` columns."""
    return "\n\n".join(
        textwrap.fill(re.sub(r" *\n *", " ", p.strip()), width=WIDTH, break_long_words=False, break_on_hyphens=False)
        for p in text.split("\n\n")
    )


def status_line(claim: Claim, confirmed: dict | None, explored: dict | None) -> str:
    """One bullet: the claim's verdict as ``docs/claims.md`` shows it."""
    how = {
        "superiority": "",
        "non_inferiority": f", non-inferiority margin {claim.margin:g}",
        "mechanism": f", a {MECHANISM}",
    }
    head = f"- `{claim.slug}` (`{claim.metric}`, {claim.direction}{how[claim.kind]})"
    record = confirmed or explored
    if record is None:
        return f"{head}: not run yet."
    phase = "confirmatory" if confirmed else "exploratory"
    seeds = record.get("seed_list") or list(range(record["seeds"]))
    parts = []
    for e in record["effects"]:
        word, _ = rejudge(e, claim.direction, claim.margin)
        detectable = detectable_text(e, claim.metric, claim.direction, claim.margin)
        shown = shown_verdict(claim.kind, phase, word, detectable)
        shown = shown.removeprefix("exploratory: ").removesuffix(", not confirmed")  # said once, at the end
        companions = "".join(f", read with `{c['metric']}` {c['effect_text']}" for c in e.get("companions", []))
        pair = f"`{e['claimed']}` − `{e.get('baseline', record['baseline'])}`"
        parts.append(f"{pair} {e['effect_text']}{companions}: {shown}")
    text = f"{head}, {phase} seeds {seed_text(seeds)}: " + "; ".join(parts) + "."
    if confirmed and explored:
        earlier = ", ".join(e["effect_text"] for e in explored["effects"])
        seeds = explored.get("seed_list") or list(range(explored["seeds"]))
        text += f" Exploratory seeds {seed_text(seeds)}: {earlier}."
    elif not confirmed:
        text += f" Not confirmed (`groupwise claims --confirm {claim.slug}`)."
    return textwrap.fill(text, width=WIDTH, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)


def claim_section(text: str, lines: list[str], kept: dict[str, str], slugs: list[str]) -> str:
    """``text`` (a paper page) with its claim section rebuilt: status ``lines``, the page's own
    summary, and the readings of ``slugs``."""
    start = text.index(HEADING) + len(HEADING)
    body = STATUS_RE.sub("", text[start:])
    first = re.search(r"^### ", body, re.M)
    summary = (body[: first.start()] if first else body).strip()
    out = [text[:start].rstrip("\n"), "", STATUS_OPEN, *lines, STATUS_CLOSE, ""]
    if summary:
        out += [summary, ""]
    for slug in slugs:
        out += [
            f"### {slug}",
            "",
            wrap(kept.get(slug, "")),
            "",
            f"Table and curves: [docs/claims.md](../../../../docs/claims.md#{slug}).",
            "",
        ]
    return "\n".join(out).rstrip() + "\n"


def paper_pages(docs: Path) -> dict[Path, str]:
    """Every paper page with a claim section, rebuilt from ``docs`` (the page and its records)."""
    from groupwise.papers import papers

    kept = readings(Path(docs).read_text()) if Path(docs).exists() else {}
    explored, confirmed = load_records(Path(docs))
    out = {}
    for manifest in papers():
        page = manifest.path.parent / "README.md"
        if not manifest.claims or not page.exists() or HEADING not in page.read_text():
            continue
        lines = []
        for slug in manifest.claims:
            claim = load_claim(manifest.path.parent / "claims" / f"{slug}.toml", check_configs=False)
            lines.append(status_line(claim, confirmed.get(slug), explored.get(slug)))
        out[page] = claim_section(page.read_text(), lines, kept, manifest.claims)
    return out


def write_paper_pages(docs: Path) -> list[Path]:
    """Rewrite the paper pages whose claim section changed; returns them."""
    changed = []
    for page, text in paper_pages(docs).items():
        if page.read_text() != text:
            page.write_text(text)
            changed.append(page)
    return changed
