"""Claim files ``<NN-slug>.toml`` (in ``papers/NN_slug/claims/``, or a repository's ``claims/``): a
seeded comparison plus the direction the paper claims.

Keys (see ``docs/claims.md``): ``paper``, ``claim``, ``metric`` (one of ``METRICS``, or
``last:`` / ``std:`` / ``cv:`` + a metrics.jsonl key, or ``after:`` + a summary key), ``target``
(required for ``*_to_target``),
``direction`` (greater | less), ``kind`` (``superiority``, the default; ``non_inferiority``, a claim
of parity — "at least", "preserves", "no worse" —, which needs ``margin`` > 0: held when the effect's
interval lies above −margin for "greater", below +margin for "less"; ``mechanism``, a claim true by
construction once the code works, never shown as held), ``margin``, ``companions`` (metrics the main
one must be read with, shown beside it, not judged), ``exploratory_seeds`` (N: seeds 0..N-1, free to
look at; default 3), ``confirmatory_seeds`` (N: seeds 1000..1000+N-1, drawn only by
``groupwise claims --confirm``), ``baseline`` (a config label, or a list of them: every claimed config
is judged against each), ``claimed`` (optional: one label, or a list; default every config but the
baselines), ``common`` (overrides for every config), ``[[configs]]`` (``label``, ``recipe``,
``overrides``; or ``pipeline`` instead of ``recipe``, a pipeline of runs: ``common`` goes to every stage,
``overrides`` to the last one, which gives the metrics, ``stage_overrides = {stage = [...]}`` to a named one; a
stage that several configs resolve identically runs once per seed). Every error names the file and the
bad key.

**Fixed in advance** (``fixed_fields``): everything that defines the comparison and its reading —
kind, metric, target, direction, margin, companions, baselines, claimed, common (run length,
thresholds), configs and the number of confirmatory seeds. A confirmatory record stores them;
afterwards ``check_fixed`` refuses a claim file whose fixed fields differ (the claim needs a new id,
and the old file and record stay). The claim sentence, the paper title and comments may change.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from groupwise.claims.compare import LABEL_RE, METRICS, TARGET_METRICS, ConfigSpec, is_metric, resolved_key
from groupwise.errors import ConfigError

KEYS = (
    "paper",
    "claim",
    "metric",
    "target",
    "direction",
    "kind",
    "margin",
    "companions",
    "exploratory_seeds",
    "confirmatory_seeds",
    "baseline",
    "claimed",
    "common",
    "configs",
)
KINDS = ("superiority", "non_inferiority", "mechanism")
CONFIRM_BASE = 1000  # confirmatory seeds are CONFIRM_BASE.. (the same block for every claim)
CONFIRM_BLOCK = 1000  # [CONFIRM_BASE, CONFIRM_BASE + CONFIRM_BLOCK): no exploratory or replication seed in it
# words of a parity / non-inferiority claim: judged against a margin > 0, never against 0
PARITY_RE = re.compile(r"\b(at least|preserv\w*|no worse|not worse|as good as|matches|unchanged|comparable)\b", re.I)
CONFIG_KEYS = ("label", "recipe", "overrides", "pipeline", "stage_overrides")
REQUIRED = ("paper", "claim", "metric", "direction", "baseline", "configs")


class ClaimError(ConfigError):
    """A claim file that cannot run; the message names the file and the key."""


@dataclass
class Claim:
    slug: str
    path: Path
    paper: str
    claim: str
    metric: str
    direction: str
    baseline: str
    configs: list[ConfigSpec]
    claimed: list[str]
    target: float | None = None
    exploratory_seeds: int = 3  # seeds 0..N-1, free to look at
    common: list[str] = field(default_factory=list)
    sha: str = ""
    baselines: list[str] = field(default_factory=list)  # every baseline; ``baseline`` is the first
    margin: float = 0.0  # non-inferiority margin (0: the plain direction test)
    kind: str = "superiority"  # superiority | non_inferiority | mechanism
    companions: list[str] = field(default_factory=list)  # metrics shown beside the main one, not judged
    confirmatory_seeds: int | None = None  # seeds CONFIRM_BASE.. drawn by --confirm (None: not confirmable yet)

    def __post_init__(self) -> None:
        self.baselines = list(self.baselines) or [self.baseline]

    def spec(self, label: str) -> ConfigSpec:
        return next(c for c in self.configs if c.label == label)


def _unknown(where: str, keys: list[str], valid: tuple[str, ...]) -> None:
    for key in keys:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ClaimError(f"{where}: unknown key {key!r}{hint}; valid keys: {', '.join(valid)}")


def _overrides(where: str, key: str, value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and "=" in v for v in value):
        raise ClaimError(f"{where}: {key} must be a list of 'key=value' strings, got {value!r}")
    return list(value)


def load_claim(path: str | Path, check_configs: bool = True) -> Claim:
    """Parse and validate a claim file; ``check_configs`` also resolves every config (no training)."""
    path = Path(path)
    where = str(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ClaimError(f"{where}: not valid TOML: {err}") from None
    if "seeds" in data:
        raise ClaimError(
            f"{where}: key 'seeds' is now 'exploratory_seeds' (seeds 0..N-1, free to look at); "
            "the verdict shown is that of 'confirmatory_seeds' (groupwise claims --confirm)"
        )
    _unknown(where, list(data), KEYS)
    for key in REQUIRED:
        if key not in data:
            raise ClaimError(f"{where}: missing required key {key!r}")
    for key in ("paper", "claim"):
        if not isinstance(data[key], str) or not data[key].strip():
            raise ClaimError(f"{where}: {key} must be a non-empty string")
    metric = data["metric"]
    if not is_metric(metric):
        close = difflib.get_close_matches(str(metric), METRICS, n=1)
        raise ClaimError(
            f"{where}: metric = {metric!r} is not a metric"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; valid: {', '.join(METRICS)}, or last:<a metrics.jsonl key> (its mean over the last 10 % "
            "of the steps), std:<a metrics.jsonl key> (its std over the steps), cv:<a metrics.jsonl key> "
            "(that std over its mean), after:<key> (summary.json's <key>_after)"
        )
    if data["direction"] not in ("greater", "less"):
        raise ClaimError(f"{where}: direction = {data['direction']!r} must be 'greater' or 'less'")
    target = data.get("target")
    if metric in TARGET_METRICS and target is None:
        raise ClaimError(f"{where}: metric {metric!r} needs key 'target' (the held-out accuracy to reach)")
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target <= 1):
        raise ClaimError(f"{where}: target = {target!r} must be a held-out accuracy in (0, 1]")
    margin = data.get("margin", 0.0)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin < 0:
        raise ClaimError(
            f"{where}: margin = {margin!r} must be a number >= 0 (the non-inferiority margin, in the metric's units)"
        )
    kind = data.get("kind", "non_inferiority" if margin > 0 else "superiority")
    if kind not in KINDS:
        raise ClaimError(f"{where}: kind = {kind!r} must be one of {', '.join(KINDS)}")
    if kind == "non_inferiority" and margin <= 0:
        raise ClaimError(
            f"{where}: kind = 'non_inferiority' needs margin > 0 (how much worse still counts as "
            "'no worse', in the metric's units, fixed before the confirmatory run)"
        )
    if kind != "non_inferiority" and margin > 0:
        raise ClaimError(
            f"{where}: margin = {margin!r} is a non-inferiority margin: set kind = 'non_inferiority' "
            f"(or remove the margin for a {kind} claim)"
        )
    parity = PARITY_RE.search(data["claim"])
    if parity and kind == "superiority":
        raise ClaimError(
            f"{where}: the claim says {parity.group(0)!r}, a parity / non-inferiority claim, but "
            "is judged against 0: set kind = 'non_inferiority' and margin = M > 0 (in the metric's "
            "units, fixed before its confirmatory run), or reword the claim as a strict improvement"
        )
    seeds = data.get("exploratory_seeds", 3)
    if isinstance(seeds, bool) or not isinstance(seeds, int) or not 1 <= seeds <= CONFIRM_BASE:
        raise ClaimError(
            f"{where}: exploratory_seeds = {seeds!r} must be an integer in 1..{CONFIRM_BASE} "
            f"(seeds {CONFIRM_BASE}.. are the confirmatory block)"
        )
    confirm = data.get("confirmatory_seeds")
    bad_count = isinstance(confirm, bool) or not isinstance(confirm, int) or not 2 <= confirm <= CONFIRM_BLOCK
    if confirm is not None and bad_count:
        raise ClaimError(
            f"{where}: confirmatory_seeds = {confirm!r} must be an integer in 2..{CONFIRM_BLOCK} "
            "(one seed gives no interval)"
        )
    companions = data.get("companions", [])
    companions = [companions] if isinstance(companions, str) else companions
    if (
        not isinstance(companions, list)
        or not all(is_metric(m) and m != metric for m in companions)
        or len(set(companions)) != len(companions)
    ):
        raise ClaimError(
            f"{where}: companions = {data.get('companions')!r} must be a list of distinct metrics other "
            f"than the claim's ({', '.join(METRICS)}, or last:/std:/cv: + a metrics.jsonl key, after: + a summary key)"
        )
    timed = [m for m in companions if m in TARGET_METRICS]
    if timed and target is None:
        raise ClaimError(f"{where}: companion {timed[0]!r} needs key 'target'")
    common = _overrides(where, "common", data.get("common", []))
    if not isinstance(data["configs"], list) or len(data["configs"]) < 2:
        raise ClaimError(f"{where}: configs must be at least two [[configs]] tables (a baseline and a claimed one)")
    configs: list[ConfigSpec] = []
    for i, entry in enumerate(data["configs"]):
        at = f"{where}: configs[{i}]"
        if not isinstance(entry, dict):
            raise ClaimError(f"{at} must be a table")
        _unknown(at, list(entry), CONFIG_KEYS)
        if ("recipe" in entry) == ("pipeline" in entry):
            raise ClaimError(f"{at}: give exactly one of 'recipe' (a run) and 'pipeline' (a pipeline of runs)")
        for key in ("label", "pipeline" if "pipeline" in entry else "recipe"):
            if not isinstance(entry.get(key), str) or not entry[key]:
                raise ClaimError(f"{at}: missing or empty {key!r}")
        stage_overrides = entry.get("stage_overrides", {})
        if "stage_overrides" in entry and "pipeline" not in entry:
            raise ClaimError(f'{at}: stage_overrides belongs to a pipeline config (pipeline = "NAME")')
        if not isinstance(stage_overrides, dict):
            raise ClaimError(f"{at}: stage_overrides must be a table {{stage = ['key=value', ...]}}")
        stage_overrides = {k: _overrides(at, f"stage_overrides.{k}", v) for k, v in stage_overrides.items()}
        if not LABEL_RE.match(entry["label"]):
            raise ClaimError(f"{at}: label {entry['label']!r} must be letters, digits and _ . + - (it names a folder)")
        if any(c.label == entry["label"] for c in configs):
            raise ClaimError(f"{at}: label {entry['label']!r} is used twice")
        configs.append(
            ConfigSpec(
                entry["label"],
                entry.get("recipe", ""),
                _overrides(at, "overrides", entry.get("overrides", [])),
                entry.get("pipeline", ""),
                stage_overrides,
            )
        )
    labels = [c.label for c in configs]
    baselines = [data["baseline"]] if isinstance(data["baseline"], str) else data["baseline"]
    if not isinstance(baselines, list) or not baselines or len(set(map(str, baselines))) != len(baselines):
        raise ClaimError(
            f"{where}: baseline must be a config label or a list of distinct labels, got {data['baseline']!r}"
        )
    for label in baselines:
        if label not in labels:
            raise ClaimError(f"{where}: baseline = {label!r} is not a config label; labels: {', '.join(labels)}")
    claimed = data.get("claimed", [c for c in labels if c not in baselines])
    claimed = [claimed] if isinstance(claimed, str) else claimed
    if not isinstance(claimed, list) or not claimed:
        raise ClaimError(f"{where}: claimed must be a config label or a list of them")
    for label in claimed:
        if label not in labels or label in baselines:
            raise ClaimError(
                f"{where}: claimed label {label!r} is not a non-baseline config label; labels: {', '.join(labels)}"
            )
    sha = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    claim = Claim(
        path.stem,
        path,
        data["paper"],
        data["claim"],
        metric,
        data["direction"],
        baselines[0],
        configs,
        list(claimed),
        None if target is None else float(target),
        seeds,
        common,
        sha,
        baselines,
        float(margin),
        kind,
        list(companions),
        confirm,
    )
    if check_configs:
        for spec in configs:
            try:
                key = resolved_key(spec, [*common, *spec.overrides], where)
            except ConfigError as err:
                raise ClaimError(str(err)) from None
            if metric in TARGET_METRICS and not key["config"]["eval"]["every"]:
                raise ClaimError(
                    f"{where}: metric {metric!r} needs held-out evaluations during "
                    f"training: set 'eval.every' (in common or in config {spec.label!r})"
                )
    return claim


def claim_files(folder: Path | None = None) -> list[Path]:
    """The claim files of ``folder``; by default those of ``claims/`` (a repository's own claims,
    when there is one) and of every paper folder (``papers/NN_slug/claims/``), by name. A name
    found twice is an error naming both files."""
    if folder is not None:
        return sorted(Path(folder).glob("*.toml"))
    from groupwise.papers import named_files

    return sorted(named_files(Path("claims"), "claims").values(), key=lambda p: p.name)  # file-name order


def shown_path(path: Path) -> str:
    """A claim file's path as the docs show it: ``papers/NN_slug/claims/NAME.toml`` for a paper's
    (the repository's ``papers`` link), else ``claims/NAME.toml``."""
    from groupwise.papers import PAPERS

    try:
        return str(Path("papers") / Path(path).resolve().relative_to(PAPERS))
    except ValueError:
        return f"claims/{Path(path).name}"


def find_claims(names: list[str], folder: Path | None = None) -> list[Path]:
    """Claim files by name (``48-sign``), number prefix (``48``) or path; all of them when none
    (``claim_files``: ``folder``, or by default ``claims/`` and ``papers/*/claims/``)."""
    available = claim_files(folder)
    where = f"{folder}/" if folder is not None else "claims/ or papers/*/claims/"
    if not names:
        return available
    found = []
    for name in names:
        path = Path(name)
        if path.suffix == ".toml" and path.exists():
            found.append(path)
            continue
        matches = [p for p in available if p.stem == name] or [p for p in available if p.stem.startswith(f"{name}-")]
        if len(matches) != 1:
            what = "no claim file" if not matches else "several claim files"
            names = ", ".join(p.stem for p in available) or "(none)"
            raise ClaimError(f"claims: {what} named {name!r} in {where}; available: {names}")
        found.append(matches[0])
    return found


# ---------------------------------------------------------------------------------------------- seeds and fixed fields
PHASES = ("exploratory", "confirmatory", "replication")


def claim_seeds(
    claim: Claim, phase: str = "exploratory", count: int | None = None, offset: int | None = None
) -> list[int]:
    """The seeds a run of ``claim`` draws: ``exploratory`` 0..N-1 (N = ``count`` or the file's
    ``exploratory_seeds``), ``confirmatory`` CONFIRM_BASE..CONFIRM_BASE+M-1 (M = ``confirmatory_seeds``,
    nothing else allowed), ``replication`` offset..offset+N-1 (anyone's own seeds; never in the
    confirmatory block, so a claim not yet confirmed keeps its confirmatory seeds unseen)."""
    where = f"claims {claim.slug}"
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ClaimError(f"{where}: --seeds must be an integer >= 1, got {count!r}")
    if phase == "confirmatory":
        if count is not None or offset is not None:
            raise ClaimError(
                f"{where}: --confirm draws the claim file's confirmatory_seeds from seed {CONFIRM_BASE}; "
                "--seeds and --seed-offset cannot change them (a confirmatory verdict has a fixed n: "
                "no seeds are added after a look)"
            )
        if claim.confirmatory_seeds is None:
            raise ClaimError(
                f"{where}: {claim.path} has no confirmatory_seeds: add confirmatory_seeds = N (N >= 5 for "
                "the table) before its first confirmatory run"
            )
        return list(range(CONFIRM_BASE, CONFIRM_BASE + claim.confirmatory_seeds))
    n = claim.exploratory_seeds if count is None else count
    if phase == "exploratory":
        if offset is not None:
            raise ClaimError(f"{where}: internal: an exploratory run has no seed offset")
        if n > CONFIRM_BASE:
            raise ClaimError(
                f"{where}: --seeds {n} would reach the confirmatory block (seeds {CONFIRM_BASE}..); "
                f"exploratory seeds are 0..{CONFIRM_BASE - 1}"
            )
        return list(range(n))
    if phase != "replication":
        raise ValueError(f"claim_seeds: phase must be one of {', '.join(PHASES)}, got {phase!r}")
    if offset is None or isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ClaimError(f"{where}: --seed-offset must be an integer >= 0, got {offset!r}")
    seeds = list(range(offset, offset + n))
    if seeds[0] < CONFIRM_BASE + CONFIRM_BLOCK and seeds[-1] >= CONFIRM_BASE:
        raise ClaimError(
            f"{where}: seeds {seeds[0]}..{seeds[-1]} overlap the confirmatory block "
            f"{CONFIRM_BASE}..{CONFIRM_BASE + CONFIRM_BLOCK - 1} (kept unseen for --confirm); "
            f"pick an offset below {CONFIRM_BASE - n + 1} or from {CONFIRM_BASE + CONFIRM_BLOCK}"
        )
    return seeds


def fixed_fields(claim: Claim) -> dict:
    """What a confirmatory run fixes (module docstring), as plain JSON-able data."""
    return {
        "kind": claim.kind,
        "metric": claim.metric,
        "target": claim.target,
        "direction": claim.direction,
        "margin": claim.margin,
        "companions": list(claim.companions),
        "baselines": list(claim.baselines),
        "claimed": list(claim.claimed),
        "common": list(claim.common),
        "configs": [c.entry() for c in claim.configs],
        "confirmatory_seeds": claim.confirmatory_seeds,
    }


def fixed_sha(fixed: dict) -> str:
    return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:16]


def fixed_changes(claim: Claim, record: dict) -> list[str]:
    """``key (was → now)`` for each fixed field of ``claim`` that differs from the confirmatory ``record``'s."""
    now, then = fixed_fields(claim), record.get("fixed", {})
    return [f"{key} ({then.get(key)!r} → {now[key]!r})" for key in now if then.get(key) != now[key]]


def confirmatory_record_path(docs: Path, slug: str) -> Path:
    """``docs/claims/<slug>.confirm.json`` next to ``docs`` (the page)."""
    return Path(docs).parent / "claims" / f"{slug}.confirm.json"


def check_fixed(claim: Claim, docs: Path) -> None:
    """Refuse a claim file whose fixed fields changed after its confirmatory run (its record in the
    folder ``claims/`` next to ``docs``)."""
    path = confirmatory_record_path(docs, claim.slug)
    if not path.exists():
        return
    record = json.loads(path.read_text())
    changes = fixed_changes(claim, record)
    if changes:
        raise ClaimError(
            f"{claim.path}: changed after its confirmatory run ({path}, {record.get('date', '?')}): "
            f"{'; '.join(changes)}. A confirmed claim's fixed fields cannot change: restore them, or "
            f"copy the file under a new id (e.g. {claim.slug}-2.toml, also listed in its paper.toml) and "
            "change that one; the old file and its record stay"
        )
