"""The ``compare`` and ``claims`` sub-commands (argument parsing; the work is in compare/report)."""

from __future__ import annotations

import argparse
from pathlib import Path

COMPARE_USAGE = (
    "groupwise compare RECIPE|LABEL=RECIPE ... [--seeds N] [--out "
    "DIR] [--target ACC] [--metric last:KEY ...] [key=value ...]"
)
CLAIMS_USAGE = (
    "groupwise claims [NAMES...] [--confirm | --seed-offset K] [--seeds N] [--out DIR] [--claims-dir DIR] "
    "[--docs FILE] [--docs-only] [key=value ...]"
)


def cmd_compare(args: list[str]) -> int:
    from rich.console import Console

    from groupwise.claims.compare import compare, split_configs

    parser = argparse.ArgumentParser(
        prog="groupwise compare",
        usage=COMPARE_USAGE,
        description="Run each configuration over N seeds (resumable) and write compare.md, compare.json, curves.png.",
    )
    parser.add_argument(
        "words",
        nargs="*",
        help="RECIPE (shipped name or path), LABEL=RECIPE, or key=value overrides shared by every run",
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    parser.add_argument("--out", default="runs/compare", help="output folder (default runs/compare)")
    parser.add_argument("--target", type=float, default=None, help="held-out accuracy for steps/seconds to target")
    parser.add_argument(
        "--metric",
        action="append",
        default=[],
        help="also summarise last:KEY (a metrics.jsonl key over the last 10 %% of steps); repeatable",
    )
    ns = parser.parse_intermixed_args(args)
    specs, shared = split_configs(ns.words)
    console = Console(stderr=True)
    compare(specs, ns.seeds, Path(ns.out), shared, ns.target, console, metrics=ns.metric)
    console.print(f"wrote {Path(ns.out) / 'compare.md'}, compare.json, curves.png")
    print((Path(ns.out) / "compare.md").read_text())
    return 0


def cmd_claims(args: list[str]) -> int:
    from rich.console import Console

    from groupwise.claims.claimfile import ClaimError, check_fixed, claim_seeds, find_claims, load_claim
    from groupwise.claims.report import regenerate, run_claim, save_record, shown_verdict

    parser = argparse.ArgumentParser(
        prog="groupwise claims",
        usage=CLAIMS_USAGE,
        description="Run claim files (all of papers/*/claims/ and claims/, or the named "
        "ones) and rewrite docs/claims.md. Without --confirm: the "
        "exploratory seeds 0..N-1 (free to look at); the table shows a "
        "claim's confirmatory verdict once --confirm has run it.",
    )
    parser.add_argument(
        "words",
        nargs="*",
        help="claim names (48-sign, 48, or a path); key=value overrides added to every run (not with --confirm)",
    )
    parser.add_argument(
        "--seeds", type=int, default=None, help="override the number of exploratory (or replication) seeds"
    )
    parser.add_argument(
        "--confirm",
        action="store_true",
        help="run the claim file's confirmatory_seeds (seeds 1000..) and record the verdict the table "
        "shows; its fixed fields cannot change afterwards",
    )
    parser.add_argument(
        "--seed-offset",
        type=int,
        default=None,
        metavar="K",
        help="replicate on your own seeds K..K+N-1 (not 1000..1999); the record stays in its run folder",
    )
    parser.add_argument(
        "--out",
        default="runs/claims",
        help="run folders: OUT/<slug>/, OUT/confirm/<slug>/, OUT/replicate/<slug>-from<K>/ (default runs/claims)",
    )
    parser.add_argument(
        "--claims-dir", default=None, help="folder of claim files (default: papers/*/claims/ and claims/)"
    )
    parser.add_argument("--docs", default="docs/claims.md", help="page to regenerate (default docs/claims.md)")
    parser.add_argument("--docs-only", action="store_true", help="only regenerate the page from the saved results")
    ns = parser.parse_intermixed_args(args)
    names = [w for w in ns.words if "=" not in w]
    extra = [w for w in ns.words if "=" in w]
    console, docs = Console(stderr=True), Path(ns.docs)
    if ns.confirm and ns.seed_offset is not None:
        raise ClaimError(
            "claims: --confirm and --seed-offset exclude each other (a replication is never the confirmatory verdict)"
        )
    phase = "confirmatory" if ns.confirm else "replication" if ns.seed_offset is not None else "exploratory"
    if not ns.docs_only:
        paths = find_claims(names, Path(ns.claims_dir) if ns.claims_dir else None)
        claims = [load_claim(p) for p in paths]  # every file is checked before anything runs
        for claim in claims:
            check_fixed(claim, docs)
            claim_seeds(claim, phase, ns.seeds, ns.seed_offset)
        for claim in claims:
            console.rule(f"[bold]{claim.slug}[/] ({phase}): {claim.claim}")
            record = run_claim(claim, Path(ns.out), ns.seeds, extra, console, phase=phase, seed_offset=ns.seed_offset)
            where = save_record(record, docs)
            for e in record["effects"]:
                shown = shown_verdict(claim.kind, phase, e["verdict"], "").replace("**", "").rstrip("; ")
                console.print(
                    f"[bold]{claim.slug}[/] {claim.metric}: {e['claimed']} − {e['baseline']} = "
                    f"{e['effect_text']} → {e['verdict']}, shown as {shown} ({e['reason']}); "
                    f"record {where}",
                    soft_wrap=True,
                )
    regenerate(Path(ns.claims_dir) if ns.claims_dir else None, docs)
    console.print(f"wrote {docs}")
    if ns.claims_dir is None and docs.resolve() == Path("docs/claims.md").resolve():  # the repository's own page
        from groupwise.claims.pages import write_paper_pages

        for page in write_paper_pages(docs):
            console.print(f"wrote {page}")
    return 0
