"""``groupwise claims``: run claim files, judge them, and regenerate ``docs/claims.md``.

A claim's result is kept as ``docs/claims/<slug>.json`` (and its curves as ``<slug>.png``), so
running one claim rewrites the whole page from every claim's latest result. The free-text
reading of each claim lives in ``docs/claims.md`` between ``<!-- reading:<slug> -->`` and
``<!-- /reading -->`` and is carried over on every regeneration.
"""

from __future__ import annotations

import datetime
import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable

from groupwise.claims.claimfile import Claim, ClaimError, claim_files, load_claim, shown_path
from groupwise.claims.compare import DIGITS, KEYED, compare, launch_subprocess, metric_values
from groupwise.claims.intervals import paired_differences, paired_effect, verdict

READING_RE = re.compile(r"<!-- reading:(?P<slug>[^ >]+) -->\n?(?P<text>.*?)\n?<!-- /reading -->", re.S)
PLACEHOLDER = "_No reading yet: write here what the result means (kept when the page is regenerated)._"

INTRO = """\
# Claims

Every paper implemented in groupwise registers one **claim**: a seeded comparison, in its folder's
`papers/NN_slug/claims/<NN-slug>.toml`, of the paper's method against its baseline on a built-in
task and the embedded tiny model, with the direction the paper says the difference goes. `make claims`
(`groupwise claims [NAMES...] [--seeds N] [--out DIR] [key=value ...]`) runs them through
`groupwise compare` and rewrites this page. Runs are resumable: a finished seed is not rerun.

How to read the table:

- **metric**: `final_accuracy` (held-out greedy accuracy after training), `final_pass_at_k` (unbiased
  pass@k of sampled completions after training, the largest k of `eval.pass_at`), `steps_to_target` /
  `seconds_to_target` (first evaluation at or above the target accuracy; training seconds, evaluation
  excluded; a run that never reaches it counts as its whole budget, shown `≥`, a lower bound),
  `reward_area` (mean batch reward over all steps), `last_reward` (mean batch reward over the last
  10 % of the steps), `last:KEY` (the same for any logged metric KEY of `metrics.jsonl`, e.g.
  `last:reward/theater_steps`), `std:KEY` (the standard deviation of KEY over the steps, e.g.
  `std:grad_norm`). A claim with several baselines has a row per claimed × baseline pair.
- **baseline / claimed**: mean over seeds ± the 95 % Student-t half-width (n − 1 degrees of freedom).
- **effect**: claimed − baseline, paired by seed (same seed = same prompts drawn and same
  initialisation), mean of the per-seed differences ± its 95 % t half-width.
- **verdict**: `held` if that interval excludes 0 on the claimed side, `contradicted` if it excludes 0
  on the other side, `inconclusive` otherwise (always with a single paired seed, or when runs that
  never reached the target could undo the sign). A claim of parity sets a non-inferiority `margin`
  m: then the interval is compared with −m (claimed `greater`) or +m (`less`) instead of 0, and
  `held` means "no worse than m".
- **minutes**: total process time of all the claim's runs.

These are toy-scale checks (a ~1M-parameter model, a minute per run on a CPU): a verdict says what
happened in this setting, not whether the paper's result holds at the paper's scale.
"""


def _signed(interval, digits: int) -> str:
    if interval.n == 0:
        return "no pairs"
    if interval.half is None:
        return f"{interval.mean:+.{digits}f} (n=1, no interval)"
    return f"{interval.mean:+.{digits}f} ± {interval.half:.{digits}f}"


def judge(claim: Claim, result: dict) -> list[dict[str, Any]]:
    """Paired effect and verdict of every claimed config against every baseline."""
    configs = {c["label"]: c for c in result["configs"]}
    effects = []
    for label, baseline in [(c, b) for c in claim.claimed for b in claim.baselines]:
        base_values, base_censored = metric_values(configs[baseline]["runs"], claim.metric)
        values, censored = metric_values(configs[label]["runs"], claim.metric)
        effect = paired_effect(values, base_values)
        pairs = paired_differences(values, base_values)
        word, reason = verdict(effect, claim.direction, len(censored & pairs.keys()), len(base_censored & pairs.keys()), claim.margin)
        effects.append({
            "claimed": label,
            "baseline": baseline,
            "baseline_text": configs[baseline]["summary"][claim.metric]["text"],
            "claimed_text": configs[label]["summary"][claim.metric]["text"],
            "effect": effect.to_dict(),
            "effect_text": _signed(effect, DIGITS.get(claim.metric, 3)),
            "pairs": {str(k): v for k, v in pairs.items()},
            "verdict": word,
            "reason": reason,
            "censored": {"claimed": sorted(censored), "baseline": sorted(base_censored)},
        })
    return effects


def run_claim(claim: Claim, out: Path, seeds: int | None = None, extra: list[str] = (), console: Any = None,
              launch: Callable = launch_subprocess) -> dict[str, Any]:
    """Run one claim's comparison (resuming) and return its record (not yet written to docs)."""
    seeds = seeds or claim.seeds
    folder = Path(out) / claim.slug
    configs = [type(c)(c.label, c.recipe, list(c.overrides)) for c in claim.configs]
    result = compare(configs, seeds, folder, [*claim.common, *extra], claim.target, console, launch, title=f"{claim.slug}: {claim.claim}",
                     metrics=[claim.metric])
    runs = [r for c in result["configs"] for r in c["runs"]]
    seconds = sum(r.get("process_seconds") or (r.get("metrics") or {}).get("wall_seconds") or 0.0 for r in runs)
    return {
        "slug": claim.slug, "paper": claim.paper, "claim": claim.claim, "metric": claim.metric, "target": claim.target,
        "direction": claim.direction, "margin": claim.margin, "baseline": claim.baseline, "baselines": claim.baselines, "seeds": seeds, "common": claim.common, "extra": list(extra),
        "configs": [{"label": c.label, "recipe": c.recipe, "overrides": c.overrides} for c in claim.configs],
        "claim_sha": claim.sha, "folder": str(folder), "minutes": seconds / 60.0,
        "failed": sum(r["status"] != "ok" for r in runs), "runs": len(runs), "short": sum(bool(r.get("short")) for r in runs),
        "date": datetime.date.today().isoformat(), "effects": judge(claim, result),
        "summaries": {c["label"]: {k: v["text"] for k, v in c["summary"].items()} for c in result["configs"]},
    }


def save_record(record: dict, docs: Path) -> None:
    """``docs/claims/<slug>.json`` and the curves PNG copied to ``docs/claims/<slug>.png``."""
    folder = docs.parent / "claims"
    folder.mkdir(parents=True, exist_ok=True)
    png = Path(record["folder"]) / "curves.png"
    if png.exists():
        shutil.copyfile(png, folder / f"{record['slug']}.png")
    (folder / f"{record['slug']}.json").write_text(json.dumps(record, indent=1) + "\n")


def readings(text: str) -> dict[str, str]:
    return {m["slug"]: m["text"].strip() for m in READING_RE.finditer(text)}


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(claims: list[Claim | tuple[str, str]], records: dict[str, dict], kept: dict[str, str]) -> str:
    """The page: intro, one table row per claimed comparison, one section per claim."""
    lines = [INTRO, "| paper | claim | metric | baseline | claimed | effect | verdict | seeds | minutes |", "|---|---|---|---|---|---|---|---|---|"]
    sections = []
    for item in claims:
        if isinstance(item, tuple):  # a claim file that does not load
            slug, error = item
            lines.append(f"| [{slug}](#{slug}) | invalid claim file: {_cell(error)} | | | | | | | |")
            sections += [f"## {slug}", "", f"The claim file does not load: `{_cell(error)}`", ""]
            record = None
        else:
            slug, record = item.slug, records.get(item.slug)
            metric = item.metric + (f" ≥ {item.target}" if item.target is not None and item.metric.endswith("_to_target") else "")
            if record is None:
                lines.append(f"| [{_cell(item.paper)}](#{slug}) | {_cell(item.claim)} | {metric} ({item.direction}) | | | | not run yet | | |")
            else:
                stale = " (claim file changed since this run)" if record.get("claim_sha") != item.sha else ""
                stale += f" (⚠ {record['short']} run(s) stopped before their planned steps)" if record.get("short") else ""
                stale += f" (⚠ {record['failed']} run(s) failed)" if record.get("failed") else ""
                for e in record["effects"]:
                    who = f" ({e['claimed']} vs {e.get('baseline', record['baseline'])})" if len(record["effects"]) > 1 else ""
                    lines.append(f"| [{_cell(item.paper)}](#{slug}) | {_cell(item.claim)}{who} | {metric} ({item.direction}) | {e['baseline_text']} | "
                                 f"{e['claimed_text']} | {e['effect_text']} | **{e['verdict']}**{stale} | {record['seeds']} | {record['minutes']:.1f} |")
            sections += _section(item, record)
        sections += ["### Reading", "", f"<!-- reading:{slug} -->", kept.get(slug) or PLACEHOLDER, "<!-- /reading -->", ""]
    return "\n".join([*lines, "", *sections]).rstrip() + "\n"


def _section(claim: Claim, record: dict | None) -> list[str]:
    out = [f'<a id="{claim.slug}"></a>', f"## {claim.slug}", "", f"**{claim.paper}**: {claim.claim}", "",
           f"File `{shown_path(claim.path)}`; metric `{claim.metric}`"
           + (f", target {claim.target}" if claim.target is not None else "")
           + f", claimed direction `{claim.direction}`" + (f" within a non-inferiority margin of {claim.margin:g}" if claim.margin else "") + f" against `{'`, `'.join(claim.baselines)}`; common overrides `{' '.join(claim.common) or '(none)'}`.", "",
           "| config | recipe + overrides |", "|---|---|"]
    out += [f"| {c.label}{' (baseline)' if c.label in claim.baselines else ''} | `{_cell(' '.join([c.recipe, *c.overrides]))}` |" for c in claim.configs]
    out.append("")
    if record is None:
        return out + ["Not run yet: `groupwise claims " + claim.slug + "`.", ""]
    extra = f" with extra overrides `{' '.join(record['extra'])}`" if record.get("extra") else ""
    out += [f"Run {record['date']}{extra}: {record['runs']} runs ({record['failed']} failed), {record['minutes']:.1f} min, folder `{record['folder']}` "
            "(`compare.md` there has every run).", ""]
    names = [k for k in ("final_accuracy", "final_pass_at_k", "steps_to_target", "seconds_to_target", "reward_area", "last_reward", "wall_seconds")
             if any(k in v for v in record["summaries"].values())]
    names[-1:-1] = [k for k in dict.fromkeys(k for v in record["summaries"].values() for k in v) if k.startswith(KEYED)]  # last:KEY / std:KEY before wall seconds
    out += ["| config | " + " | ".join(f"`{n}`" if n.startswith(KEYED) else n.replace("_", " ") for n in names) + " |", "|---|" + "---|" * len(names)]
    out += [f"| {label} | " + " | ".join(_cell(texts.get(n, "")) for n in names) + " |" for label, texts in record["summaries"].items()]
    out.append("")
    for e in record["effects"]:
        pairs = ", ".join(f"seed {k}: {v:+.4g}" for k, v in e["pairs"].items())
        out += [f"- `{e['claimed']}` − `{e.get('baseline', record['baseline'])}`: {e['effect_text']} → **{e['verdict']}** ({e['reason']}). Per seed: {pairs or 'none'}."]
    out += ["", f"![{claim.slug} curves](claims/{claim.slug}.png)", ""]
    return out


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
    records = {}
    for path in sorted((docs.parent / "claims").glob("*.json")):
        record = json.loads(path.read_text())
        records[record["slug"]] = record
    text = render(items, records, kept)
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(text)
    return text
