"""Claim files ``<NN-slug>.toml`` (in ``papers/NN_slug/claims/``, or a repository's ``claims/``): a
seeded comparison plus the direction the paper claims.

Keys (see ``docs/claims.md``): ``paper``, ``claim``, ``metric`` (one of ``METRICS``, or
``last:<metrics.jsonl key>`` or ``std:<metrics.jsonl key>``), ``target`` (required for ``*_to_target``), ``direction`` (greater |
less), ``margin`` (optional, >= 0: a non-inferiority margin for a claim of parity — held when the
effect's interval lies above −margin for "greater", below +margin for "less"), ``seeds`` (default 3), ``baseline`` (a config label, or a list of them: every claimed config
is judged against each), ``claimed`` (optional: one label, or a list; default every config but the
baselines), ``common`` (overrides for every config), ``[[configs]]`` (``label``, ``recipe``,
``overrides``). Every error names the file and the bad key.
"""

from __future__ import annotations

import difflib
import hashlib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from groupwise.claims.compare import LABEL_RE, METRICS, TARGET_METRICS, ConfigSpec, is_metric, resolved_key
from groupwise.errors import ConfigError

KEYS = ("paper", "claim", "metric", "target", "direction", "margin", "seeds", "baseline", "claimed", "common", "configs")
CONFIG_KEYS = ("label", "recipe", "overrides")
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
    seeds: int = 3
    common: list[str] = field(default_factory=list)
    sha: str = ""
    baselines: list[str] = field(default_factory=list)  # every baseline; ``baseline`` is the first
    margin: float = 0.0  # non-inferiority margin (0: the plain direction test)

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
        raise ClaimError(f"{where}: metric = {metric!r} is not a metric" + (f" (did you mean {close[0]!r}?)" if close else "")
                         + f"; valid: {', '.join(METRICS)}, or last:<a metrics.jsonl key> (its mean over the last 10 % of the steps), std:<a metrics.jsonl key> (its std over the steps)")
    if data["direction"] not in ("greater", "less"):
        raise ClaimError(f"{where}: direction = {data['direction']!r} must be 'greater' or 'less'")
    target = data.get("target")
    if metric in TARGET_METRICS and target is None:
        raise ClaimError(f"{where}: metric {metric!r} needs key 'target' (the held-out accuracy to reach)")
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target <= 1):
        raise ClaimError(f"{where}: target = {target!r} must be a held-out accuracy in (0, 1]")
    margin = data.get("margin", 0.0)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin < 0:
        raise ClaimError(f"{where}: margin = {margin!r} must be a number >= 0 (the non-inferiority margin, in the metric's units)")
    seeds = data.get("seeds", 3)
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ClaimError(f"{where}: seeds = {seeds!r} must be an integer >= 1")
    common = _overrides(where, "common", data.get("common", []))
    if not isinstance(data["configs"], list) or len(data["configs"]) < 2:
        raise ClaimError(f"{where}: configs must be at least two [[configs]] tables (a baseline and a claimed one)")
    configs: list[ConfigSpec] = []
    for i, entry in enumerate(data["configs"]):
        at = f"{where}: configs[{i}]"
        if not isinstance(entry, dict):
            raise ClaimError(f"{at} must be a table")
        _unknown(at, list(entry), CONFIG_KEYS)
        for key in ("label", "recipe"):
            if not isinstance(entry.get(key), str) or not entry[key]:
                raise ClaimError(f"{at}: missing or empty {key!r}")
        if not LABEL_RE.match(entry["label"]):
            raise ClaimError(f"{at}: label {entry['label']!r} must be letters, digits and _ . + - (it names a folder)")
        if any(c.label == entry["label"] for c in configs):
            raise ClaimError(f"{at}: label {entry['label']!r} is used twice")
        configs.append(ConfigSpec(entry["label"], entry["recipe"], _overrides(at, "overrides", entry.get("overrides", []))))
    labels = [c.label for c in configs]
    baselines = [data["baseline"]] if isinstance(data["baseline"], str) else data["baseline"]
    if not isinstance(baselines, list) or not baselines or len(set(map(str, baselines))) != len(baselines):
        raise ClaimError(f"{where}: baseline must be a config label or a list of distinct labels, got {data['baseline']!r}")
    for label in baselines:
        if label not in labels:
            raise ClaimError(f"{where}: baseline = {label!r} is not a config label; labels: {', '.join(labels)}")
    claimed = data.get("claimed", [c for c in labels if c not in baselines])
    claimed = [claimed] if isinstance(claimed, str) else claimed
    if not isinstance(claimed, list) or not claimed:
        raise ClaimError(f"{where}: claimed must be a config label or a list of them")
    for label in claimed:
        if label not in labels or label in baselines:
            raise ClaimError(f"{where}: claimed label {label!r} is not a non-baseline config label; labels: {', '.join(labels)}")
    claim = Claim(path.stem, path, data["paper"], data["claim"], metric, data["direction"], baselines[0], configs,
                  list(claimed), None if target is None else float(target), seeds, common, hashlib.sha256(path.read_bytes()).hexdigest()[:16], baselines,
                  float(margin))
    if check_configs:
        for spec in configs:
            try:
                key = resolved_key(spec, [*common, *spec.overrides], where)
            except ConfigError as err:
                raise ClaimError(str(err)) from None
            if metric in TARGET_METRICS and not key["config"]["eval"]["every"]:
                raise ClaimError(f"{where}: metric {metric!r} needs held-out evaluations during training: set 'eval.every' (in common or in config {spec.label!r})")
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
