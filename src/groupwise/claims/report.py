"""``groupwise claims``: run claim files, judge them, and regenerate ``docs/claims.md``.

A claim has up to two records: ``docs/claims/<slug>.json`` (exploratory: seeds 0..N-1, free to look
at) and ``docs/claims/<slug>.confirm.json`` (confirmatory: seeds 1000.., drawn once by
``groupwise claims --confirm`` with the claim's fixed fields stored), each with its curves
(``.png``). The table shows the confirmatory verdict; a claim without one is shown as exploratory,
never as held or contradicted. Every verdict on the page is re-derived from the record's per-seed
pairs under the claim file's direction, kind and margin. The free-text reading of each claim lives
in ``docs/claims.md`` between ``<!-- reading:<slug> -->`` and ``<!-- /reading -->`` and is carried
over on every regeneration.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from groupwise.claims.claimfile import (
    Claim,
    ClaimError,
    check_fixed,
    claim_files,
    claim_seeds,
    fixed_fields,
    fixed_sha,
    load_claim,
    shown_path,
)
from groupwise.claims.compare import DIGITS, KEYED, compare, launch_subprocess, metric_values, seed_text
from groupwise.claims.intervals import (
    ONE_SIDED_LEVEL,
    Interval,
    detectable_effect,
    expected_false_held,
    mean_interval,
    paired_differences,
    paired_effect,
    verdict,
)
from groupwise.claims.provenance import describe, provenance

READING_RE = re.compile(r"<!-- reading:(?P<slug>[^ >]+) -->\n?(?P<text>.*?)\n?<!-- /reading -->", re.S)
PLACEHOLDER = "_No reading yet: write here what the result means (kept when the page is regenerated)._"
MIN_CONFIRM_SEEDS = 5  # a confirmatory verdict over fewer seeds is shown, but flagged
MECHANISM = "mechanism (true by construction)"

INTRO = """\
# Claims

Every paper implemented in groupwise registers one **claim**: a seeded comparison, in its folder's
`papers/NN_slug/claims/<NN-slug>.toml`, of the paper's method against its baseline on a built-in
task and the embedded tiny model, with the direction the paper says the difference goes. `make claims`
(`groupwise claims [NAMES...] [--seeds N] [--out DIR] [key=value ...]`) runs them through
`groupwise compare` on their exploratory seeds, `groupwise claims --confirm NAMES...` on their
confirmatory seeds, and both rewrite this page and the paper pages' claim sections. Runs are
resumable: a finished seed is not rerun.

**Exploratory and confirmatory seeds.** A claim file names its `exploratory_seeds` N (seeds
0..N-1, free to look at while the claim is built: `groupwise claims NAME`) and its
`confirmatory_seeds` M (seeds 1000..1000+M-1, the same block for every claim, drawn only by
`groupwise claims --confirm NAME`). No exploratory seed reaches 1000, so a confirmatory seed is one no
exploration has seen. The verdict in the table is the confirmatory one (M ≥ 5); a claim not yet
confirmed is shown as **exploratory**, never as held or contradicted. `--seed-offset K` runs the
claim on your own seeds K.. (not in 1000..1999) to replicate it: its record stays in its run folder.

**Fixed in advance.** A confirmatory record stores the claim file's hash and its fixed fields:
kind, metric, target, direction, margin, companions, baselines, claimed, common (run length,
thresholds), configs and the number of confirmatory seeds. After that, `groupwise claims` refuses a
claim file whose fixed fields changed: the changed claim needs a new id (a new file), and the old file
and record stay. No seeds are added to a confirmatory verdict (fixed n, no sequential design).

**Pipelines.** A config may be a pipeline of runs (`pipeline = "NAME"` instead of `recipe`,
`docs/pipelines.md`): `common` goes to every stage, the config's `overrides` to the last stage,
whose run folder gives the metrics, and `stage_overrides = {stage = [...]}` to a named one. A stage
that several configs resolve to the same config runs once per seed (`<claim folder>/_stages/`), and
each stage's `stage.json` pins every model it loaded by sha256 with its label ledger.

How to read the table:

- **metric**: `final_accuracy` (held-out greedy accuracy after training), `final_pass_at_k` (unbiased
  pass@k of sampled completions after training, the largest k of `eval.pass_at`), `steps_to_target` /
  `seconds_to_target` (first evaluation at or above the target accuracy; training seconds, evaluation
  excluded; a run that never reaches it counts as its whole budget, shown `≥`, a lower bound),
  `reward_area` (mean batch reward over all steps), `last_reward` (mean batch reward over the last
  10 % of the steps), `last:KEY` (the same for any logged metric KEY of `metrics.jsonl`, e.g.
  `last:reward/theater_steps`), `std:KEY` (the standard deviation of KEY over the steps, e.g.
  `std:grad_norm`), `cv:KEY` (that standard deviation over KEY's mean). A claim with several
  baselines has a row per claimed × baseline pair.
- **baseline / claimed**: mean over seeds ± the 95 % Student-t half-width (n − 1 degrees of freedom).
- **effect**: claimed − baseline, paired by seed (same seed = same prompts drawn and same
  initialisation), mean of the per-seed differences ± its 95 % t half-width. A claim whose metric can
  improve for a trivial reason names `companions`: their paired effects follow "read with" (shown, not
  judged).
- **verdict**: `held` if that interval excludes 0 on the claimed side, `contradicted` if it excludes 0
  on the other side, `inconclusive` otherwise (always with a single paired seed, or when runs that
  never reached the target could undo the sign). A claim of parity ("at least", "preserves", "no
  worse") is `kind = "non_inferiority"` with a `margin` m > 0 fixed in advance: the interval is
  compared with −m (claimed `greater`) or +m (`less`) instead of 0, and `held` means "no worse than
  m". A `mechanism` claim (true by construction once the code works: a reward that gives a signal
  where the binary one gives none, a gate that plays fewer steps) is shown as such: it checks the
  code, not the paper's hypothesis. An inconclusive verdict gives the **smallest detectable effect**
  at its seed count, (t₀.₉₇₅(n − 1) + t₀.₈₀(n − 1)) · s / √n with s the standard deviation of the
  per-seed differences: a true effect that large (from 0, or from the margin's bound) would be held
  with about 80 % probability; smaller ones would usually be missed.
- **seeds**: how many paired seeds, and which; **minutes**: total process time of all the runs.
- The held-out set is the task's first `eval.size` test prompts, the same for every seed, so an
  interval covers training noise, not the sampling of held-out prompts. `data.resample_eval=true`
  (in a claim's `common`) draws a seed's own `eval.size` prompts from the test split (the same for
  both arms of a pair), so the interval covers held-out sampling too; off in every claim so far.

These are toy-scale checks (a ~1M-parameter model, a minute per run on a CPU): a verdict says what
happened in this setting, not whether the paper's result holds at the paper's scale. Every record
states its provenance (commit, torch and transformers versions, CPU model, threads): a result may not
reproduce to the digit on another machine.
"""


def _signed(interval: Interval, digits: int) -> str:
    if interval.n == 0:
        return "no pairs"
    if interval.half is None:
        return f"{interval.mean:+.{digits}f} (n=1, no interval)"
    return f"{interval.mean:+.{digits}f} ± {interval.half:.{digits}f}"


def _effect_of(configs: dict, claim_label: str, baseline: str, metric: str) -> dict[str, Any]:
    """The paired effect of ``metric`` (claimed − baseline) with the texts the page shows."""
    base_values, base_censored = metric_values(configs[baseline]["runs"], metric)
    values, censored = metric_values(configs[claim_label]["runs"], metric)
    effect = paired_effect(values, base_values)
    pairs = paired_differences(values, base_values)
    base_summary, summary = configs[baseline]["summary"], configs[claim_label]["summary"]
    return {
        "baseline_text": base_summary[metric]["text"] if metric in base_summary else "no runs",
        "claimed_text": summary[metric]["text"] if metric in summary else "no runs",
        "effect": effect.to_dict(),
        "effect_text": _signed(effect, DIGITS.get(metric, 3)),
        "pairs": {str(k): v for k, v in pairs.items()},
        "censored": {"claimed": sorted(censored), "baseline": sorted(base_censored)},
    }


def judge(claim: Claim, result: dict) -> list[dict[str, Any]]:
    """Paired effect and verdict of every claimed config against every baseline, with the
    companions' paired effects (not judged)."""
    configs = {c["label"]: c for c in result["configs"]}
    effects = []
    for label, baseline in [(c, b) for c in claim.claimed for b in claim.baselines]:
        main = _effect_of(configs, label, baseline, claim.metric)
        word, reason = rejudge(main, claim.direction, claim.margin)
        companions = [{"metric": m, **_effect_of(configs, label, baseline, m)} for m in claim.companions]
        effects.append(
            {
                "claimed": label,
                "baseline": baseline,
                **main,
                "verdict": word,
                "reason": reason,
                "companions": companions,
            }
        )
    return effects


def rejudge(effect: dict, direction: str, margin: float) -> tuple[str, str]:
    """A stored effect's verdict, re-derived from its per-seed pairs (and censored seeds)."""
    pairs = effect["pairs"]
    interval = mean_interval(list(pairs.values()))
    censored = effect.get("censored", {})
    claimed = sum(str(s) in pairs for s in censored.get("claimed", []))
    baseline = sum(str(s) in pairs for s in censored.get("baseline", []))
    return verdict(interval, direction, claimed, baseline, margin)


def run_folder(claim: Claim, out: Path, phase: str, seeds: list[int]) -> Path:
    """``OUT/<slug>`` (exploratory), ``OUT/confirm/<slug>``, ``OUT/replicate/<slug>-from<K>``."""
    if phase == "confirmatory":
        return Path(out) / "confirm" / claim.slug
    if phase == "replication":
        return Path(out) / "replicate" / f"{claim.slug}-from{seeds[0]}"
    return Path(out) / claim.slug


def run_claim(
    claim: Claim,
    out: Path,
    seeds: int | None = None,
    extra: list[str] = (),
    console: Any = None,
    launch: Callable = launch_subprocess,
    phase: str = "exploratory",
    seed_offset: int | None = None,
) -> dict[str, Any]:
    """Run one claim's comparison (resuming) and return its record (not yet written to docs).

    ``phase``: ``exploratory`` (seeds 0..N-1, ``seeds`` overrides N), ``confirmatory`` (the file's
    confirmatory seeds from 1000; no ``seeds``, offset or ``extra`` overrides), ``replication``
    (``seed_offset``.., never recorded as the claim's verdict)."""
    seed_list = claim_seeds(claim, phase, seeds, seed_offset)
    if phase == "confirmatory" and extra:
        raise ClaimError(
            f"claims {claim.slug}: --confirm runs the claim file as it is; extra overrides "
            f"{' '.join(extra)} would make it another comparison (put them in the file before its "
            "confirmatory run)"
        )
    folder = run_folder(claim, out, phase, seed_list)
    configs = [dataclasses.replace(c, overrides=list(c.overrides)) for c in claim.configs]
    result = compare(
        configs,
        seed_list,
        folder,
        [*claim.common, *extra],
        claim.target,
        console,
        launch,
        title=f"{claim.slug} ({phase}): {claim.claim}",
        metrics=[claim.metric, *claim.companions],
    )
    runs = [r for c in result["configs"] for r in c["runs"]]
    seconds = sum(r.get("process_seconds") or (r.get("metrics") or {}).get("wall_seconds") or 0.0 for r in runs)
    threads = []
    for run in runs:
        try:
            key = json.loads((Path(run["folder"]) / "run.json").read_text())["key"]
            threads.append(int(key["config"]["threads"]))
        except (OSError, KeyError, ValueError, TypeError):
            pass
    fixed = fixed_fields(claim)
    return {
        "slug": claim.slug,
        "paper": claim.paper,
        "claim": claim.claim,
        "phase": phase,
        "kind": claim.kind,
        "metric": claim.metric,
        "target": claim.target,
        "companions": list(claim.companions),
        "direction": claim.direction,
        "margin": claim.margin,
        "baseline": claim.baseline,
        "baselines": claim.baselines,
        "seeds": len(seed_list),
        "seed_list": seed_list,
        "common": claim.common,
        "extra": list(extra),
        "configs": [c.entry() for c in claim.configs],
        "claim_sha": claim.sha,
        "fixed": fixed,
        "fixed_sha": fixed_sha(fixed),
        "folder": str(folder),
        "minutes": seconds / 60.0,
        "failed": sum(r["status"] != "ok" for r in runs),
        "runs": len(runs),
        "short": sum(bool(r.get("short")) for r in runs),
        "resumed": sum(bool(r.get("skipped")) for r in runs),
        "date": datetime.date.today().isoformat(),
        "provenance": provenance(threads),
        "effects": judge(claim, result),
        "summaries": {c["label"]: {k: v["text"] for k, v in c["summary"].items()} for c in result["configs"]},
    }


def record_name(record: dict) -> str:
    return f"{record['slug']}.confirm" if record.get("phase") == "confirmatory" else record["slug"]


def save_record(record: dict, docs: Path) -> Path:
    """``docs/claims/<slug>.json`` (exploratory) or ``<slug>.confirm.json`` (confirmatory) and the
    curves PNG beside it; a replication is written to its run folder (``record.json``) only."""
    png = Path(record["folder"]) / "curves.png"
    if record.get("phase") == "replication":
        path = Path(record["folder"]) / "record.json"
    else:
        folder = docs.parent / "claims"
        folder.mkdir(parents=True, exist_ok=True)
        if png.exists():
            shutil.copyfile(png, folder / f"{record_name(record)}.png")
        path = folder / f"{record_name(record)}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def readings(text: str) -> dict[str, str]:
    return {m["slug"]: m["text"].strip() for m in READING_RE.finditer(text)}


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------------------------------------- what a row shows
def detectable_text(effect: dict, metric: str, direction: str, margin: float) -> str:
    """``smallest detectable effect X`` of a stored effect (its n and spread); from the margin's bound
    for a non-inferiority claim."""
    iv = effect["effect"]
    mde = detectable_effect(iv.get("sd"), iv.get("n") or 0)
    if mde is None:
        return "no spread to size it (n < 2)"
    digits = DIGITS.get(metric, 3)
    if mde == 0:
        return "smallest detectable effect 0 (every seed gave the same difference)"
    if margin:
        bound = -margin if direction == "greater" else margin
        return f"smallest detectable effect {mde:.{digits}f} beyond the bound {bound:+g} at n={iv['n']}"
    return f"smallest detectable effect ±{mde:.{digits}f} at n={iv['n']}"


def shown_verdict(kind: str, phase: str, word: str, detectable: str) -> str:
    """The verdict cell: a confirmatory verdict in bold; an exploratory one never reads held or
    contradicted; a mechanism claim never reads held."""
    if kind == "mechanism":
        what = "works as built" if word == "held" else f"**not shown** ({word})"
        return f"{MECHANISM}: {what}" + ("" if phase == "confirmatory" else ", exploratory seeds only")
    if phase == "confirmatory":
        return f"**{word}**" + (f"; {detectable}" if word == "inconclusive" else "")
    lean = {
        "held": "interval on the claimed side, not confirmed",
        "contradicted": "interval on the other side, not confirmed",
        "inconclusive": f"inconclusive; {detectable}",
    }[word]
    return f"exploratory: {lean}"


def _companions_text(effect: dict, claim: Claim) -> str:
    if not claim.companions:
        return ""
    stored = {c["metric"]: c for c in effect.get("companions", [])}
    parts = [
        f"`{m}` {stored[m]['effect_text']}" if m in stored else f"`{m}` not in this record" for m in claim.companions
    ]
    return "; read with " + ", ".join(parts)


def run_defining(data: dict) -> dict:
    """The fields that decide what was run (an exploratory record is stale when they changed)."""
    configs = [
        {"label": c["label"], "recipe": c["recipe"], "overrides": list(c["overrides"])}
        | {k: c[k] for k in ("pipeline", "stage_overrides") if k in c}
        for c in data.get("configs", [])
    ]
    return {
        "metric": data.get("metric"),
        "target": data.get("target"),
        "common": list(data.get("common", [])),
        "configs": configs,
    }


def _fixed_error(claim: Claim, docs: Path | None) -> str | None:
    if docs is None:
        return None
    try:
        check_fixed(claim, docs)
    except ClaimError as err:
        return str(err)
    return None


def counts(claims: list, shown: dict[str, dict]) -> dict[str, int]:
    """How many judged comparisons (mechanism claims excluded) the page shows, by phase and verdict."""
    out = {"confirmatory": 0, "exploratory": 0, "held": 0, "contradicted": 0, "inconclusive": 0, "mechanism": 0}
    for claim in claims:
        record = shown.get(claim.slug) if isinstance(claim, Claim) else None
        if record is None:
            continue
        for e in record["effects"]:
            if claim.kind == "mechanism":
                out["mechanism"] += 1
                continue
            phase = record.get("phase", "exploratory")
            out[phase] += 1
            if phase == "confirmatory":
                out[rejudge(e, claim.direction, claim.margin)[0]] += 1
    return out


def power_paragraph(n: dict[str, int]) -> str:
    total = n["confirmatory"] + n["exploratory"]
    confirmed = n["confirmatory"]
    return (
        f"**Error rates.** The table judges {total} comparisons ({n['mechanism']} mechanism checks not "
        f"counted): {confirmed} confirmatory ({n['held']} held, {n['contradicted']} contradicted, "
        f"{n['inconclusive']} inconclusive) and {n['exploratory']} exploratory. Each verdict's side is a "
        f"one-sided test at {ONE_SIDED_LEVEL} (half of the two-sided 95 % interval), so if no effect were real "
        "(every true effect at 0, or exactly at the margin's bound for a non-inferiority claim) about "
        f"{ONE_SIDED_LEVEL} × {confirmed} = {expected_false_held(confirmed):.3g} of the confirmatory "
        f"comparisons would read held by chance, and as many contradicted ({ONE_SIDED_LEVEL} × {total} = "
        f"{expected_false_held(total):.3g} over all {total}). No correction for the number of comparisons is "
        "applied: read a single held verdict with that in mind.\n"
    )


def render(
    claims: list[Claim | tuple[str, str]],
    records: dict[str, dict],
    kept: dict[str, str],
    confirmed: dict[str, dict] | None = None,
    docs: Path | None = None,
) -> str:
    """The page: intro, one table row per claimed comparison, one section per claim. ``records``:
    exploratory records by slug; ``confirmed``: confirmatory ones; ``docs``: the page (to check
    each claim file's fixed fields against its confirmatory record)."""
    confirmed = confirmed or {}
    shown = {}
    errors: dict[str, str] = {}
    for item in claims:
        if isinstance(item, Claim):
            error = _fixed_error(item, docs) if item.slug in confirmed else None
            if error:
                errors[item.slug] = error
            elif confirmed.get(item.slug) or records.get(item.slug):
                shown[item.slug] = confirmed.get(item.slug) or records[item.slug]
    lines = [
        INTRO,
        power_paragraph(counts(claims, shown)),
        "| paper | claim | metric | baseline | claimed | effect | verdict | seeds | minutes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    sections = []
    for item in claims:
        if isinstance(item, tuple) or item.slug in errors:  # a file that does not load, or changed after confirmation
            slug, error = item if isinstance(item, tuple) else (item.slug, errors[item.slug])
            what = (
                "invalid claim file"
                if isinstance(item, tuple)
                else "refused: claim file edited after its confirmatory run"
            )
            lines.append(f"| [{slug}](#{slug}) | {what}: {_cell(error)} | | | | | | | |")
            sections += [f'<a id="{slug}"></a>', f"## {slug}", "", f"{what[0].upper()}{what[1:]}: `{_cell(error)}`", ""]
        else:
            slug, record = item.slug, shown.get(item.slug)
            timed = item.target is not None and item.metric.endswith("_to_target")
            metric = item.metric + (f" ≥ {item.target}" if timed else "")
            if record is None:
                lines.append(
                    f"| [{_cell(item.paper)}](#{slug}) | {_cell(item.claim)} | {metric} ({item.direction}) "
                    "| | | | not run yet | | |"
                )
            else:
                lines += _rows(item, record, metric)
            sections += _section(item, confirmed.get(slug), records.get(slug))
        sections += [
            "### Reading",
            "",
            f"<!-- reading:{slug} -->",
            kept.get(slug) or PLACEHOLDER,
            "<!-- /reading -->",
            "",
        ]
    slugs = {item.slug if isinstance(item, Claim) else item[0] for item in claims}
    retired = [r for s, r in sorted(confirmed.items()) if s not in slugs]
    if retired:
        sections += [
            "## Retired claims",
            "",
            "Confirmatory records whose claim file is gone (kept: a changed claim gets a new id).",
            "",
        ]
        for r in retired:
            effects = "; ".join(
                f"{e['claimed']} − {e.get('baseline', r['baseline'])} {e['effect_text']} → {e['verdict']}"
                for e in r["effects"]
            )
            sections.append(f"- `{r['slug']}` ({r['date']}): {effects}")
        sections.append("")
    return "\n".join([*lines, "", *sections]).rstrip() + "\n"


def _rows(claim: Claim, record: dict, metric: str) -> list[str]:
    phase = record.get("phase", "exploratory")
    stale = ""
    if phase != "confirmatory" and run_defining(record) != run_defining(fixed_fields(claim)):
        stale = " (claim file changed what is run since this record)"
    stale += f" (⚠ {record['short']} run(s) stopped before their planned steps)" if record.get("short") else ""
    stale += f" (⚠ {record['failed']} run(s) failed)" if record.get("failed") else ""
    if phase == "confirmatory" and record["seeds"] < MIN_CONFIRM_SEEDS:
        stale += f" (⚠ fewer than {MIN_CONFIRM_SEEDS} confirmatory seeds)"
    seeds = record.get("seed_list") or list(range(record["seeds"]))
    rows = []
    for e in record["effects"]:
        word, _ = rejudge(e, claim.direction, claim.margin)
        cell = shown_verdict(claim.kind, phase, word, detectable_text(e, claim.metric, claim.direction, claim.margin))
        who = f" ({e['claimed']} vs {e.get('baseline', record['baseline'])})" if len(record["effects"]) > 1 else ""
        effect = e["effect_text"] + _cell(_companions_text(e, claim))
        rows.append(
            f"| [{_cell(claim.paper)}](#{claim.slug}) | {_cell(claim.claim)}{who} | {metric} "
            f"({claim.direction}) | {e['baseline_text']} | {e['claimed_text']} | {effect} | {cell}{stale} "
            f"| {len(seeds)} ({seed_text(seeds)}) | {record['minutes']:.1f} |"
        )
    return rows


def _section(claim: Claim, confirmed: dict | None, explored: dict | None) -> list[str]:
    judged = {
        "superiority": "",
        "non_inferiority": f" within a non-inferiority margin of {claim.margin:g}",
        "mechanism": f", a {MECHANISM}",
    }[claim.kind]
    confirm = (
        f"confirmatory seeds {seed_text(claim_seeds(claim, 'confirmatory'))}."
        if claim.confirmatory_seeds
        else "no confirmatory seeds set."
    )
    out = [
        f'<a id="{claim.slug}"></a>',
        f"## {claim.slug}",
        "",
        f"**{claim.paper}**: {claim.claim}",
        "",
        f"File `{shown_path(claim.path)}`; metric `{claim.metric}`"
        + (f", target {claim.target}" if claim.target is not None else "")
        + (f", read with `{'`, `'.join(claim.companions)}`" if claim.companions else "")
        + f", claimed direction `{claim.direction}`{judged} against `{'`, `'.join(claim.baselines)}`; "
        f"common overrides `{' '.join(claim.common) or '(none)'}`; exploratory seeds "
        f"{seed_text(list(range(claim.exploratory_seeds)))}, {confirm}",
        "",
        "| config | recipe + overrides |",
        "|---|---|",
    ]
    out += [
        f"| {c.label}{' (baseline)' if c.label in claim.baselines else ''} | `{_cell(c.describe())}` |"
        for c in claim.configs
    ]
    out.append("")
    if confirmed is None and explored is None:
        return out + ["Not run yet: `groupwise claims " + claim.slug + "`.", ""]
    if confirmed is None:
        out += [
            f"Not confirmed yet: `groupwise claims --confirm {claim.slug}` runs its confirmatory seeds; until then "
            "the table shows the exploratory run below, which is not a verdict.",
            "",
        ]
    for title, record in (("Confirmatory run", confirmed), ("Exploratory run", explored)):
        if record is not None:
            out += _record_block(claim, record, title)
    return out


def _record_block(claim: Claim, record: dict, title: str) -> list[str]:
    seeds = record.get("seed_list") or list(range(record["seeds"]))
    extra = f" with extra overrides `{' '.join(record['extra'])}`" if record.get("extra") else ""
    resumed = f", {record['resumed']} of them resumed from an earlier process" if record.get("resumed") else ""
    out = [
        f"### {title}",
        "",
        f"Run {record['date']}{extra}, seeds {seed_text(seeds)}: {record['runs']} runs ({record['failed']} "
        f"failed{resumed}), {record['minutes']:.1f} min, folder `{record['folder']}` (`compare.md` there has every "
        f"run). {describe(record.get('provenance'))}",
        "",
    ]
    names = [
        k
        for k in (
            "final_accuracy",
            "final_pass_at_k",
            "steps_to_target",
            "seconds_to_target",
            "reward_area",
            "last_reward",
            "wall_seconds",
        )
        if any(k in v for v in record["summaries"].values())
    ]
    keyed = dict.fromkeys(k for v in record["summaries"].values() for k in v if k.startswith(KEYED))
    names[-1:-1] = list(keyed)  # keyed metrics before wall seconds
    out += [
        "| config | " + " | ".join(f"`{n}`" if n.startswith(KEYED) else n.replace("_", " ") for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    out += [
        f"| {label} | " + " | ".join(_cell(texts.get(n, "")) for n in names) + " |"
        for label, texts in record["summaries"].items()
    ]
    out.append("")
    for e in record["effects"]:
        word, reason = rejudge(e, claim.direction, claim.margin)
        pairs = ", ".join(f"seed {k}: {v:+.4g}" for k, v in e["pairs"].items())
        detectable = detectable_text(e, claim.metric, claim.direction, claim.margin)
        shown = shown_verdict(claim.kind, record.get("phase", "exploratory"), word, detectable)
        out += [
            f"- `{e['claimed']}` − `{e.get('baseline', record['baseline'])}`: {e['effect_text']} → {shown} "
            f"({reason}). Per seed: {pairs or 'none'}."
        ]
        for c in e.get("companions", []):
            pairs = ", ".join(f"seed {k}: {v:+.4g}" for k, v in c["pairs"].items())
            out += [
                f"  - read with `{c['metric']}`: {c['baseline_text']} → {c['claimed_text']}, {c['effect_text']} "
                f"(shown, not judged). Per seed: {pairs or 'none'}."
            ]
    image = f"{record_name(record)}.png"
    out += ["", f"![{claim.slug} {title.lower()} curves](claims/{image})", ""]
    return out


def load_records(docs: Path) -> tuple[dict[str, dict], dict[str, dict]]:
    """(exploratory records, confirmatory records) by slug from the folder ``claims/`` next to ``docs``."""
    explored, confirmed = {}, {}
    for path in sorted((docs.parent / "claims").glob("*.json")):
        record = json.loads(path.read_text())
        (confirmed if record.get("phase") == "confirmatory" else explored)[record["slug"]] = record
    return explored, confirmed


def regenerate(claims_dir: Path | None, docs: Path) -> str:
    """Rewrite ``docs`` from every claim file (of ``claims_dir``, or by default ``claim_files()``)
    and every saved record, keeping the readings."""
    kept = readings(docs.read_text()) if docs.exists() else {}
    items: list[Claim | tuple[str, str]] = []
    for path in claim_files(claims_dir):
        try:
            items.append(load_claim(path, check_configs=False))
        except ClaimError as err:
            items.append((path.stem, str(err)))
    explored, confirmed = load_records(docs)
    text = render(items, explored, kept, confirmed, docs)
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(text)
    return text
