"""The ``compare`` and ``claims`` sub-commands (argument parsing; the work is in compare/report)."""

from __future__ import annotations

import argparse
from pathlib import Path

COMPARE_USAGE = "groupwise compare RECIPE|LABEL=RECIPE ... [--seeds N] [--out DIR] [--target ACC] [--metric last:KEY ...] [key=value ...]"
CLAIMS_USAGE = "groupwise claims [NAMES...] [--seeds N] [--out DIR] [--claims-dir DIR] [--docs FILE] [--docs-only] [key=value ...]"


def cmd_compare(args: list[str]) -> int:
    from rich.console import Console

    from groupwise.claims.compare import compare, split_configs

    parser = argparse.ArgumentParser(prog="groupwise compare", usage=COMPARE_USAGE,
                                     description="Run each configuration over N seeds (resumable) and write compare.md, compare.json, curves.png.")
    parser.add_argument("words", nargs="*", help="RECIPE (shipped name or path), LABEL=RECIPE, or key=value overrides shared by every run")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    parser.add_argument("--out", default="runs/compare", help="output folder (default runs/compare)")
    parser.add_argument("--target", type=float, default=None, help="held-out accuracy for steps/seconds to target")
    parser.add_argument("--metric", action="append", default=[], help="also summarise last:KEY (a metrics.jsonl key over the last 10 %% of steps); repeatable")
    ns = parser.parse_intermixed_args(args)
    specs, shared = split_configs(ns.words)
    console = Console(stderr=True)
    compare(specs, ns.seeds, Path(ns.out), shared, ns.target, console, metrics=ns.metric)
    console.print(f"wrote {Path(ns.out) / 'compare.md'}, compare.json, curves.png")
    print((Path(ns.out) / "compare.md").read_text())
    return 0


def cmd_claims(args: list[str]) -> int:
    from rich.console import Console

    from groupwise.claims.claimfile import find_claims, load_claim
    from groupwise.claims.report import regenerate, run_claim, save_record

    parser = argparse.ArgumentParser(prog="groupwise claims", usage=CLAIMS_USAGE,
                                     description="Run claim files (all of papers/*/claims/ and claims/, or the named "
                                                 "ones) and rewrite docs/claims.md.")
    parser.add_argument("words", nargs="*", help="claim names (48-sign, 48, or a path); key=value overrides added to every run")
    parser.add_argument("--seeds", type=int, default=None, help="override every claim's seeds")
    parser.add_argument("--out", default="runs/claims", help="run folders go to OUT/<slug>/ (default runs/claims)")
    parser.add_argument("--claims-dir", default=None,
                        help="folder of claim files (default: papers/*/claims/ and claims/)")
    parser.add_argument("--docs", default="docs/claims.md", help="page to regenerate (default docs/claims.md)")
    parser.add_argument("--docs-only", action="store_true", help="only regenerate the page from the saved results")
    ns = parser.parse_intermixed_args(args)
    names = [w for w in ns.words if "=" not in w]
    extra = [w for w in ns.words if "=" in w]
    console, docs = Console(stderr=True), Path(ns.docs)
    if not ns.docs_only:
        paths = find_claims(names, Path(ns.claims_dir) if ns.claims_dir else None)
        claims = [load_claim(p) for p in paths]  # every file is checked before anything runs
        for claim in claims:
            console.rule(f"[bold]{claim.slug}[/]: {claim.claim}")
            record = run_claim(claim, Path(ns.out), ns.seeds, extra, console)
            save_record(record, docs)
            for e in record["effects"]:
                console.print(f"[bold]{claim.slug}[/] {claim.metric}: {e['claimed']} − {e['baseline']} = {e['effect_text']} → [bold]{e['verdict']}[/] ({e['reason']})", soft_wrap=True)
    regenerate(Path(ns.claims_dir) if ns.claims_dir else None, docs)
    console.print(f"wrote {docs}")
    return 0
