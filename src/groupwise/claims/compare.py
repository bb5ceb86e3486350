"""``groupwise compare``: the same comparison over N seeds, each seed a normal run folder.

Every run goes through the normal trainer in a subprocess (``python -m groupwise train``), so a
crash is reported and the other runs go on. A run folder ``OUT/<label>/seed<k>`` that is finished
(its ``FINISHED`` marker vouches for ``final/`` and ``summary.json``) for the same resolved config
(``run.json`` holds it) is skipped, so an interrupted compare continues where it stopped; a folder
holding another config is replaced. The training child dies with the compare process (it gets
SIGTERM, checkpoints after its step and exits), and a rerun waits for a run folder still held by
such a child before it starts that run again.

**Per-run metrics** (from ``summary.json`` and ``metrics.jsonl``)

- ``final_accuracy``: ``accuracy_after``, the held-out greedy accuracy after training.
- ``final_reward_mean``: ``reward_mean_after``, the mean eval reward over the held-out rows after
  training (greedy, with ``eval.sampling``): the measure of a continuous reward.
- ``final_pass_at_k``: the unbiased pass@k after training for the largest k of ``eval.pass_at``
  (needs ``eval.samples``; ``summary.json``'s ``accuracy_after_sampled``).
- ``steps_to_target``: the first evaluated step count whose accuracy is >= target (the
  ``evals`` list: step 0 = before training); ``None`` = not reached.
- ``seconds_to_target``: ``Σ step_seconds`` of the steps before it (training time; evaluation
  time excluded, it depends only on ``eval.size``).
- ``reward_area``: mean of ``reward_mean`` over all logged steps.
- ``last_reward``: mean of ``reward_mean`` over the last 10 % of the steps (at least one).
- ``last:<key>``: the same for any key of ``metrics.jsonl`` (``last:reward/theater_steps``, a
  component's ``profil/flagged``): the mean of its finite values over the last 10 % of the steps
  that log it (at least one); ``None`` if no step logs it.
- ``std:<key>``: the standard deviation (n − 1) of a ``metrics.jsonl`` key's finite values over every
  step that logs it (``std:grad_norm``: how much the gradient norm varies from step to step);
  ``None`` with fewer than two values.
- ``cv:<key>``: its coefficient of variation, ``std:<key>`` / |mean| over the same steps (spread
  relative to size: a gradient norm that halves halves its std but keeps its cv); ``None`` with fewer
  than two values or a zero mean.
- ``after:<key>``: ``summary.json``'s ``<key>_after``, a value the final evaluation recorded (a
  rollout strategy's own held-out measure, ``after:best_of_16``; ``heldout.py``): what the policy
  does after its last step, also for a run of 0 training steps; ``None`` if the summary lacks it.

A run that never reached the target counts, in every statistic, as its budget (all its steps /
all its training seconds): a lower bound, printed with ``≥`` and the count reached.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from groupwise import runfolder
from groupwise.claims.intervals import Interval, mean_interval
from groupwise.errors import ConfigError

LOCK_WAIT_S = 600.0  # how long a rerun waits for a run folder still held by a dying child of a killed compare

METRICS = (
    "final_accuracy",
    "final_reward_mean",
    "final_pass_at_k",
    "steps_to_target",
    "seconds_to_target",
    "reward_area",
    "last_reward",
)
TARGET_METRICS = ("steps_to_target", "seconds_to_target")
LAST = "last:"  # prefix of a metric read from any metrics.jsonl key (module docstring)
STD = "std:"  # prefix of a metric's spread over the steps (module docstring)
CV = "cv:"  # prefix of a metric's spread relative to its mean (module docstring)
AFTER = "after:"  # prefix of a summary.json value <key>_after (module docstring)
KEYED = (LAST, STD, CV, AFTER)  # the prefixes of a metric named by a key
BUDGET = {"steps_to_target": "step_budget", "seconds_to_target": "seconds_budget"}
DIGITS = {
    "final_accuracy": 3,
    "final_reward_mean": 3,
    "final_pass_at_k": 3,
    "steps_to_target": 1,
    "seconds_to_target": 1,
    "reward_area": 3,
    "last_reward": 3,
    "wall_seconds": 1,
}
LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


@dataclass
class ConfigSpec:
    """One configuration of a comparison: a recipe (shipped name or path) plus its own overrides; or a
    pipeline (``groupwise pipeline``: shipped name or path, ``recipe`` empty) whose last stage takes
    ``overrides`` and whose stages take ``stage_overrides[stage]``."""

    label: str
    recipe: str
    overrides: list[str] = field(default_factory=list)
    pipeline: str = ""
    stage_overrides: dict[str, list[str]] = field(default_factory=dict)

    def describe(self) -> str:
        if self.pipeline:
            own = [f"{stage}:{o}" for stage, words in self.stage_overrides.items() for o in words]
            return " ".join([f"pipeline {self.pipeline}", *self.overrides, *own])
        return " ".join([self.recipe, *self.overrides])

    def entry(self) -> dict[str, Any]:
        """As a claim file's ``[[configs]]`` entry (a recipe config's keys as before pipelines existed)."""
        out: dict[str, Any] = {"label": self.label, "recipe": self.recipe, "overrides": list(self.overrides)}
        if self.pipeline:
            out.update(pipeline=self.pipeline, stage_overrides={k: list(v) for k, v in self.stage_overrides.items()})
        return out


def is_metric(name: object) -> bool:
    """One of ``METRICS``, or ``last:`` / ``std:`` / ``cv:`` + a metrics.jsonl key, or ``after:`` + a summary key."""
    return isinstance(name, str) and (
        name in METRICS or any(name.startswith(p) and bool(name[len(p) :].strip()) for p in KEYED)
    )


def last_of(rows: list[dict], key: str) -> float | None:
    """Mean of the finite values of ``key`` over the last 10 % (at least one) of the rows logging it."""
    values = [
        float(r[key])
        for r in sorted(rows, key=lambda r: r.get("step", 0))
        if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])
    ]
    if not values:
        return None
    tail = max(1, math.ceil(0.1 * len(values)))
    return sum(values[-tail:]) / tail


def std_of(rows: list[dict], key: str) -> float | None:
    """Standard deviation (n − 1) of the finite values of ``key`` over every row logging it;
    None with fewer than two."""
    values = [
        float(r[key])
        for r in rows
        if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])
    ]
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def cv_of(rows: list[dict], key: str) -> float | None:
    """``std_of`` / |mean| of the same values; None with fewer than two values or a zero mean."""
    std = std_of(rows, key)
    if std is None:
        return None
    values = [
        float(r[key])
        for r in rows
        if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])
    ]
    mean = sum(values) / len(values)
    return None if mean == 0 else std / abs(mean)


# ---------------------------------------------------------------------------------------------- arguments
def _config_keys() -> set[str]:
    from groupwise.config import Config

    return {f.name for f in dataclasses.fields(Config)}


def split_configs(words: list[str]) -> tuple[list[ConfigSpec], list[str]]:
    """``RECIPE`` / ``LABEL=RECIPE`` words → configs; ``key=value`` (a config key) → shared overrides."""
    keys, specs, shared = _config_keys(), [], []
    for word in words:
        head, sep, rest = word.partition("=")
        if sep and head.split(".")[0].strip() in keys:
            shared.append(word)
        elif sep:
            specs.append(ConfigSpec(head, rest))
        else:
            specs.append(ConfigSpec(Path(word).stem if word.endswith(".toml") else word, word))
    return specs, shared


def check_specs(specs: list[ConfigSpec], where: str = "compare") -> None:
    if not specs:
        raise ConfigError(f"{where}: no configuration given (RECIPE or LABEL=RECIPE)")
    seen: set[str] = set()
    for spec in specs:
        if not LABEL_RE.match(spec.label):
            raise ConfigError(f"{where}: label {spec.label!r} must be letters, digits and _ . + - (it names a folder)")
        if spec.label in seen:
            raise ConfigError(f"{where}: two configurations are labelled {spec.label!r}; name them LABEL=RECIPE")
        seen.add(spec.label)


def run_overrides(spec: ConfigSpec, shared: list[str], seed: int, folder: Path) -> list[str]:
    """Shared overrides, then the config's own (more specific wins), then seed and run folder."""
    from groupwise.config import toml_value

    return [*shared, *spec.overrides, f"seed={seed}", f"out={toml_value(str(folder))}"]


def pipeline_run(
    spec: ConfigSpec, shared: list[str], seed: int, folder: Path, stages: Path, where: str
) -> tuple[dict, list[str], Path]:
    """A pipeline config's run: (its key: the pipeline file and every stage's resolved config minus
    ``out``; the ``groupwise pipeline`` command; the last stage's run folder, whose metrics count).
    ``shared`` (a claim's ``common``) goes to every stage, the config's overrides to the last one, its
    ``stage_overrides[stage]`` to that stage; stage folders live in ``stages``
    (content-addressed, so a stage identical across configs runs once per seed)."""
    from groupwise.pipeline import load_pipeline, stage_plan

    try:
        pipeline = load_pipeline(spec.pipeline)
        last = pipeline.stages[-1].name
        own = {name: list(words) for name, words in spec.stage_overrides.items()}
        for name in own:
            pipeline.stage(name)  # refuses a stage the pipeline does not have, naming its stages
        own[last] = [*own.get(last, []), *spec.overrides]
        plan = stage_plan(pipeline, folder, seed, list(shared), own, stages)
    except ConfigError as err:
        raise ConfigError(f"{where}: config {spec.label!r} ({spec.describe()}): {err}") from None
    key = {
        "pipeline": str(pipeline.path.resolve()),
        "stages": [{"name": p["name"], "config_sha256": p["config_sha256"]} for p in plan],
        "config": {k: v for k, v in plan[-1]["config"].items() if k != "out"},
    }
    argv = [sys.executable, "-m", "groupwise", "pipeline", str(pipeline.path.resolve())]
    argv += ["--out", str(folder), "--seed", str(seed), "--stages", str(stages)]
    argv += [*shared, *[f"{name}:{word}" for name, words in own.items() for word in words]]
    return key, argv, Path(plan[-1]["folder"])


def resolved_key(spec: ConfigSpec, overrides: list[str], where: str) -> dict:
    """The resolved config (minus ``out``) that identifies a run folder's contents (a pipeline config:
    :func:`pipeline_run`'s key, resolved for seed 0 in a scratch folder: a check that it resolves)."""
    from groupwise.config import load_config, resolve_recipe, to_dict

    if spec.pipeline:
        scratch = Path(".pipeline-check")
        return pipeline_run(spec, overrides, 0, scratch, scratch / "_stages", where)[0]

    try:
        path = resolve_recipe(spec.recipe)
        cfg, _ = load_config(str(path), overrides)
    except ConfigError as err:
        raise ConfigError(f"{where}: config {spec.label!r} ({spec.describe()}): {err}") from None
    data = json.loads(json.dumps(to_dict(cfg), default=str))
    data.pop("out", None)
    return {"recipe": str(Path(path).resolve()), "config": data}


# ---------------------------------------------------------------------------------------------- one run
def run_state(folder: Path, key: dict, finished_in: Path | None = None) -> str:
    """``done`` (finished for this config: ``FINISHED`` vouches for its outputs; in ``finished_in``,
    a pipeline's last stage, when given), ``partial`` (this config, unfinished), ``stale`` or ``new``
    (nothing there but what a killed write left)."""
    marker = folder / "run.json"
    if not folder.exists():
        return "new"
    if marker.exists():
        try:
            same = json.loads(marker.read_text()).get("key") == key
        except json.JSONDecodeError:
            same = False
        if same:
            return "done" if runfolder.finished_step(finished_in or folder)[0] is not None else "partial"
        return "stale"
    if (folder / "config.toml").exists() or (folder / "summary.json").exists():
        return "stale"  # a run folder of unknown config
    ours = [p for p in folder.iterdir() if not runfolder.is_temporary(p.name) and p.name != runfolder.LOCK]
    if ours:  # (what a killed write left does not count)
        raise ConfigError(f"compare: {folder} exists and is not a run folder; move it or choose another --out")
    return "new"


def launch_subprocess(argv: list[str], log_path: Path) -> int:
    """Run one training child; it gets SIGTERM if this process dies (Linux ``PR_SET_PDEATHSIG``)."""
    with open(log_path, "w") as log:
        return subprocess.run(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=runfolder.parent_death_signal(),
        ).returncode


def read_run(folder: Path, target: float | None, metrics: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
    """The metrics of one finished run folder (see the module docstring); ``metrics`` adds ``last:<key>`` ones."""
    summary = json.loads((folder / "summary.json").read_text())
    rows = []
    if (folder / "metrics.jsonl").exists():
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
    evals = sorted((int(s), float(a)) for s, a in summary.get("evals", []) if a is not None)
    if not evals:  # an older summary without the list: rebuild it from the log
        evals = [(0, summary["accuracy_before"])] * ("accuracy_before" in summary)
        evals += [(int(r["step"]) + 1, r["eval_accuracy"]) for r in rows if r.get("eval_accuracy") is not None]
    tail = max(1, math.ceil(0.1 * len(rewards))) if rewards else 0
    step_seconds = [float(r.get("step_seconds") or 0.0) for r in sorted(rows, key=lambda r: r["step"])]
    out = {
        "accuracy_before": summary.get("accuracy_before"),
        "final_accuracy": summary.get("accuracy_after"),
        "final_reward_mean": summary.get("reward_mean_after"),
        "final_pass_at_k": max(
            (
                (int(k.split("@")[1]), v)
                for k, v in (summary.get("accuracy_after_sampled") or {}).items()
                if k.startswith("pass@")
            ),
            default=(0, None),
        )[1],
        "steps": summary.get("steps", len(rows)),
        "wall_seconds": summary.get("wall_seconds"),
        "reward_area": sum(rewards) / len(rewards) if rewards else None,
        "last_reward": sum(rewards[-tail:]) / tail if rewards else None,
        "step_budget": summary.get("steps", len(rows)),
        "seconds_budget": sum(step_seconds),
        "steps_to_target": None,
        "seconds_to_target": None,
        "evals": evals,
        "curve": [(int(r["step"]), r.get("reward_mean")) for r in rows],
    }
    for name in metrics:
        if name.startswith(LAST):
            out[name] = last_of(rows, name[len(LAST) :])
        elif name.startswith(STD):
            out[name] = std_of(rows, name[len(STD) :])
        elif name.startswith(CV):
            out[name] = cv_of(rows, name[len(CV) :])
        elif name.startswith(AFTER):
            value = summary.get(f"{name[len(AFTER) :]}_after")
            out[name] = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if target is not None:
        hit = next((s for s, a in evals if a >= target), None)
        if hit is not None:
            out["steps_to_target"] = hit
            out["seconds_to_target"] = sum(step_seconds[:hit])
    return out


def metric_values(runs: list[dict], metric: str) -> tuple[dict[int, float], set[int]]:
    """Per-seed values of ``metric`` over the finished runs, and the seeds whose value is censored
    (target never reached: the run's budget stands in, a lower bound)."""
    values, censored = {}, set()
    for run in runs:
        if run["status"] != "ok":
            continue
        value = run["metrics"].get(metric)
        if value is None and metric in BUDGET:
            value = run["metrics"][BUDGET[metric]]
            censored.add(run["seed"])
        if value is not None:
            values[run["seed"]] = float(value)
    return values, censored


def format_metric(metric: str, interval: Interval, censored: int = 0) -> str:
    digits = DIGITS.get(metric, 3)
    if metric in TARGET_METRICS:
        reached = interval.n - censored
        if interval.n and reached == 0:
            return f"not reached (0/{interval.n})"
        text = interval.format(digits)
        return f"≥ {text} (reached {reached}/{interval.n})" if censored else f"{text} ({reached}/{interval.n})"
    return interval.format(digits)


def summarise(runs: list[dict], target: float | None, metrics: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for metric in (*METRICS, *[m for m in metrics if m not in METRICS], "wall_seconds"):
        if metric in TARGET_METRICS and target is None:
            continue
        values, censored = metric_values(runs, metric)
        if metric == "final_pass_at_k" and not values:  # only runs with a sampled evaluation have it
            continue
        interval = mean_interval(list(values.values()))
        out[metric] = {
            **interval.to_dict(),
            "censored": len(censored),
            "text": format_metric(metric, interval, len(censored)),
        }
    return out


# ---------------------------------------------------------------------------------------------- the comparison
def seed_text(seeds: list[int]) -> str:
    """``0..4`` for a consecutive block, else the list: ``0, 2, 5``."""
    if len(seeds) > 1 and seeds == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"{seeds[0]}..{seeds[-1]}"
    return ", ".join(map(str, seeds))


def compare(
    specs: list[ConfigSpec],
    seeds: int | list[int],
    out: Path,
    shared: list[str] = (),
    target: float | None = None,
    console: Any = None,
    launch: Callable[[list[str], Path], int] = launch_subprocess,
    title: str | None = None,
    metrics: tuple[str, ...] | list[str] = (),
) -> dict[str, Any]:
    """Run every config × seed (resuming), then write ``compare.json``, ``compare.md``, ``curves.png``;
    ``seeds``: a count N (seeds 0..N-1) or the list of seeds; ``metrics``: extra ``last:<key>``
    metrics to read and summarise (a column each)."""
    from rich.console import Console
    from rich.markup import escape

    console = console or Console(stderr=True)
    check_specs(specs)
    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    if (
        not seed_list
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seed_list)
        or len(set(seed_list)) != len(seed_list)
    ):
        raise ConfigError(f"compare: seeds must be a count >= 1 or distinct integers >= 0, got {seeds!r}")
    if target is not None and not 0 < target <= 1:
        raise ConfigError(f"compare: --target is a held-out accuracy in (0, 1], got {target}")
    metrics = [m for m in metrics if m not in METRICS]
    for name in metrics:
        if not is_metric(name):
            raise ConfigError(
                f"compare: metric {name!r} is not a metric; valid: {', '.join(METRICS)}, "
                "or last:<a metrics.jsonl key>, std:<a metrics.jsonl key>, cv:<a metrics.jsonl key>"
            )
    out, shared = Path(out), list(shared)
    plan = []
    for seed in seed_list:  # seed-major: an interrupted compare still has paired seeds
        for spec in specs:
            folder = out / spec.label / f"seed{seed}"
            if spec.pipeline:  # its stages' run folders are shared by the configs of this compare
                key, argv, run_dir = pipeline_run(spec, shared, seed, folder, out / "_stages", "compare")
            else:
                overrides = run_overrides(spec, shared, seed, folder)
                key = resolved_key(spec, overrides, "compare")
                argv, run_dir = [sys.executable, "-m", "groupwise", "train", key["recipe"], *overrides], folder
            plan.append((spec, seed, folder, argv, key, run_dir))
    runs: dict[str, list[dict]] = {spec.label: [] for spec in specs}
    width = len(str(len(plan)))
    for i, (spec, seed, folder, argv, key, run_dir) in enumerate(plan, 1):
        tag = f"[{i:>{width}}/{len(plan)}] {spec.label} seed{seed}"
        state = run_state(folder, key, run_dir)
        record = {"seed": seed, "folder": str(folder), "status": "ok", "skipped": state == "done"}
        if state == "stale":
            console.print(f"{tag}: [yellow]folder holds another config, replacing it[/]", soft_wrap=True)
        if state != "done":
            if folder.exists() and not runfolder.wait_unlocked(folder, 0):
                with console.status(f"{tag} waiting for the process still holding {folder} (a killed compare's run)"):
                    runfolder.wait_unlocked(folder, LOCK_WAIT_S)  # still held after that: the run names the holder
            if state == "stale":
                shutil.rmtree(folder)
            folder.mkdir(parents=True, exist_ok=True)
            runfolder.write_atomic(folder / "run.json", json.dumps({"key": key, "argv": argv[1:]}, indent=1) + "\n")
            t0 = time.perf_counter()
            with console.status(f"{tag} running"):
                rc = launch(argv, folder / "train.log")
            elapsed = time.perf_counter() - t0
            meta = json.loads((folder / "run.json").read_text())
            meta.update(returncode=rc, process_seconds=elapsed)
            runfolder.write_atomic(folder / "run.json", json.dumps(meta, indent=1) + "\n")
            if rc != 0 or runfolder.finished_step(run_dir)[0] is None:
                record.update(status="failed", returncode=rc, error=_last_error(folder / "train.log"))
        meta = json.loads((folder / "run.json").read_text())
        record["process_seconds"] = meta.get("process_seconds")
        if record["status"] == "ok":
            record["metrics"] = read_run(run_dir, target, metrics)
            m = record["metrics"]
            planned = key["config"].get("train", {}).get("steps")
            if planned is not None and m["steps"] is not None and m["steps"] < planned:
                record["short"] = f"stopped at {m['steps']}/{planned} steps (train.max_seconds?)"
                console.print(
                    f"{tag}: [yellow]{record['short']}: its numbers are not those of the planned run[/]", soft_wrap=True
                )
            acc = f"acc {_fmt(m['accuracy_before'])}→{_fmt(m['final_accuracy'])}"
            hit = (
                ""
                if target is None
                else f", to {target}: "
                + (f"{m['steps_to_target']} steps" if m["steps_to_target"] is not None else "not reached")
            )
            how = "[dim]done before, skipped[/]" if record["skipped"] else f"{record['process_seconds']:.1f} s"
            console.print(
                f"{tag}: [green]ok[/] {acc}, reward area {_fmt(m['reward_area'])}{hit} · {how}", soft_wrap=True
            )
        else:
            console.print(
                f"{tag}: [red]FAILED[/] (exit {record.get('returncode')}): "
                f"{escape(record['error'])} · log {folder / 'train.log'}",
                highlight=False,
                soft_wrap=True,
            )
        runs[spec.label].append(record)
    result = {
        "title": title or " vs ".join(s.label for s in specs),
        "seeds": len(seed_list),
        "seed_list": seed_list,
        "shared": shared,
        "target": target,
        "metrics": metrics,
        "configs": [
            {
                **s.entry(),
                "runs": runs[s.label],
                "summary": summarise(runs[s.label], target, metrics),
            }
            for s in specs
        ],
    }
    write_outputs(result, out)
    return result


def _fmt(x: Any) -> str:
    return "–" if x is None else f"{x:.3f}"


def _last_error(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.exists() else []
    return lines[-1][:300] if lines else "no output"


def write_outputs(result: dict, out: Path) -> None:
    from groupwise.claims.plot import plot_curves

    out.mkdir(parents=True, exist_ok=True)
    slim = json.loads(json.dumps(result))
    for config in slim["configs"]:
        for run in config["runs"]:
            run.get("metrics", {}).pop("curve", None)  # the curves live in the run folders
    runfolder.write_atomic(out / "compare.json", json.dumps(slim, indent=1) + "\n")
    runfolder.write_atomic(out / "compare.md", compare_markdown(result))
    plot_curves(result, out / "curves.png")


def compare_markdown(result: dict) -> str:
    target = result["target"]
    head = ["config", "recipe + overrides", "runs ok", "final accuracy"]
    keys = ["final_accuracy"]
    if target is not None:
        head += [f"steps to {target}", f"seconds to {target}"]
        keys += list(TARGET_METRICS)
    head += ["reward area", "last reward", *[f"`{m}`" for m in result.get("metrics", [])], "wall s / run"]
    keys += ["reward_area", "last_reward", *result.get("metrics", []), "wall_seconds"]
    lines = [
        f"# compare: {result['title']}",
        "",
        f"Seeds {seed_text(result.get('seed_list') or list(range(result['seeds'])))}; "
        f"shared overrides: `{' '.join(result['shared']) or '(none)'}`"
        + ("" if target is None else f"; target held-out accuracy {target}")
        + ".",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for c in result["configs"]:
        ok = sum(r["status"] == "ok" for r in c["runs"])
        spec = ConfigSpec(
            **{k: c[k] for k in ("label", "recipe", "overrides", "pipeline", "stage_overrides") if k in c}
        )
        cells = [c["label"], "`" + spec.describe() + "`", f"{ok}/{len(c['runs'])}"]
        cells += [c["summary"][k]["text"] for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Mean ± 95 % Student-t interval over seeds (n − 1 degrees of freedom). Steps / seconds to "
        "target: a run that never reached it counts as its whole budget, so `≥` marks a lower bound. "
        "Reward area: mean batch reward over all steps; last reward: over the last 10 % of steps "
        "(`last:KEY`: the same for the metrics.jsonl key KEY; `std:KEY`: its standard deviation over the steps; "
        "`cv:KEY`: that standard deviation over its mean; `after:KEY`: summary.json's KEY_after, "
        "the final evaluation's). "
        "Seconds are training time (`step_seconds`), evaluation excluded.",
        "",
        "![curves](curves.png)",
        "",
        "## Runs",
        "",
        "| config | seed | status | acc before | acc after | steps to target | reward area | wall s | folder |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["configs"]:
        for r in c["runs"]:
            if r["status"] != "ok":
                lines.append(
                    f"| {c['label']} | {r['seed']} | FAILED (exit "
                    f"{r.get('returncode')}): {r['error']} | | | | | | `{r['folder']}` |"
                )
                continue
            m = r["metrics"]
            hit = (
                "–"
                if target is None
                else (str(m["steps_to_target"]) if m["steps_to_target"] is not None else "not reached")
            )
            wall = "–" if m["wall_seconds"] is None else f"{m['wall_seconds']:.1f}"
            status = (
                "ok"
                + (" (resumed: done before)" if r["skipped"] else "")
                + (f", **{r['short']}**" if r.get("short") else "")
            )
            lines.append(
                f"| {c['label']} | {r['seed']} | {status} | {_fmt(m['accuracy_before'])} | "
                f"{_fmt(m['final_accuracy'])} | {hit} | {_fmt(m['reward_area'])} | {wall} | `{r['folder']}` |"
            )
    return "\n".join(lines) + "\n"
