"""Pipelines of runs (M8): ``groupwise pipeline FILE --out DIR --seed S`` runs the ``[[stages]]`` of a
pipeline file in order, each a normal resumable run folder ``DIR/<stage>/`` (``run.py``).

A pipeline file (``pipelines/NAME.toml`` beside the recipes, a paper's ``papers/NN_slug/pipelines/``,
or any path) lists stages, each with a ``name``, a ``recipe`` (a shipped name or a file) and
``overrides`` (``key=value`` strings as for ``groupwise train``). A stage's overrides may write
``${stage}`` for an earlier stage's run folder, e.g. ``'roles.teacher.model.path="${teacher_rl}/final"'``.

Each stage is recorded twice: ``<run folder>/stage.json`` (its own record, written when it starts and
again when it finishes) and ``DIR/pipeline.json`` (every stage's record, in order). A record holds the
resolved config and its sha256 (``out`` left out), the run folder, the sha256 of its final weights
(:func:`tree_sha` of ``final/``), the sha256 of every model the stage loads (``model.path``,
``roles.NAME.model.path``, and every config value substituted from an earlier stage), and the **label
ledger** (:func:`ledger`). A rerun skips a stage whose record has the same config sha256, whose
``FINISHED`` marker holds and whose final weights still have the recorded sha256; any other stage
goes to its run, which resumes from its last checkpoint (or only writes its outputs, or refuses a
folder holding another config, naming the keys). A stage whose loaded models changed since it
started (an earlier stage was rerun) is refused, naming the folder to remove.

The trainer knows nothing of pipelines: a stage is ``Run.from_config(cfg).train()``.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from groupwise import runfolder
from groupwise.errors import ConfigError
from groupwise.pinning import ledger, loaded_models, tree_sha

PIPELINES = Path(__file__).resolve().parent / "pipelines"  # the standard ones; a paper's: papers/NN_slug/pipelines/
FILE_KEYS = ("description", "stages")
STAGE_KEYS = ("name", "recipe", "overrides")
NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
REF_RE = re.compile(r"\$\{([^}]*)\}")
RECORD = "stage.json"  # in each stage's run folder
PIPELINE_JSON = "pipeline.json"  # in the pipeline's folder


class PipelineError(ConfigError):
    """A pipeline file or folder that cannot run; the message names the file, stage or folder and the fix."""


class PipelineStopped(RuntimeError):
    """A stage was stopped (SIGTERM / Ctrl-C) after checkpointing: rerunning the same command resumes it."""


@dataclass
class Stage:
    name: str
    recipe: str
    overrides: list[str] = field(default_factory=list)


@dataclass
class Pipeline:
    name: str
    path: Path
    stages: list[Stage]
    description: str = ""

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise PipelineError(f"{self.path}: no stage {name!r}; stages: {', '.join(s.name for s in self.stages)}")


def shipped_pipelines() -> dict[str, Path]:
    """``{name: path}`` of ``pipelines/`` and every paper folder's ``pipelines/``."""
    from groupwise.papers import named_files

    return named_files(PIPELINES, "pipelines")


def load_pipeline(name_or_path: str | Path) -> Pipeline:
    """A pipeline file (path or shipped name), checked: keys, stage names, recipes, and every
    ``${stage}`` naming an earlier stage."""
    path = Path(name_or_path)
    if not path.is_file():
        shipped = shipped_pipelines()
        if str(name_or_path) not in shipped:
            raise PipelineError(
                f"no pipeline file or shipped pipeline named {str(name_or_path)!r}; shipped pipelines: "
                f"{', '.join(shipped) or '(none)'}"
            )
        path = shipped[str(name_or_path)]
    where = str(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise PipelineError(f"{where}: not valid TOML: {err}") from None
    for key in data:
        if key not in FILE_KEYS:
            raise PipelineError(f"{where}: unknown key {key!r}; valid keys: {', '.join(FILE_KEYS)}")
    entries = data.get("stages")
    if not isinstance(entries, list) or not entries:
        raise PipelineError(f"{where}: needs at least one [[stages]] table (name, recipe, overrides)")
    stages: list[Stage] = []
    for i, entry in enumerate(entries):
        at = f"{where}: stages[{i}]"
        if not isinstance(entry, dict):
            raise PipelineError(f"{at} must be a table")
        for key in entry:
            if key not in STAGE_KEYS:
                raise PipelineError(f"{at}: unknown key {key!r}; valid keys: {', '.join(STAGE_KEYS)}")
        name, recipe = entry.get("name"), entry.get("recipe")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise PipelineError(f"{at}: name {name!r} must be a letter then letters, digits or _ (it names a folder)")
        if any(s.name == name for s in stages):
            raise PipelineError(f"{at}: stage name {name!r} is used twice")
        if not isinstance(recipe, str) or not recipe:
            raise PipelineError(f"{at} ({name}): missing or empty 'recipe' (a shipped recipe or a file)")
        overrides = entry.get("overrides", [])
        if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o for o in overrides):
            raise PipelineError(f"{at} ({name}): overrides must be a list of 'key=value' strings, got {overrides!r}")
        earlier = [s.name for s in stages]
        for text in overrides:
            check_refs(text, earlier, f"{at} ({name})")
        stages.append(Stage(name, recipe, list(overrides)))
    description = data.get("description", "")
    return Pipeline(path.stem, path, stages, description if isinstance(description, str) else "")


def check_refs(text: str, earlier: list[str], where: str) -> None:
    """Every ``${x}`` in ``text`` names one of the ``earlier`` stages."""
    for ref in REF_RE.findall(text):
        if ref not in earlier:
            raise PipelineError(
                f"{where}: {text!r} refers to ${{{ref}}}, which is not an earlier stage "
                f"(earlier stages: {', '.join(earlier) or 'none'}); a stage can only read the run folder of a "
                "stage listed before it"
            )


def substitute(text: str, folders: dict[str, Path]) -> str:
    """``${stage}`` -> that stage's run folder (absolute)."""
    return REF_RE.sub(lambda m: str(Path(folders[m.group(1)]).resolve()), text)


def split_overrides(words: list[str], stages: list[str], where: str) -> tuple[list[str], dict[str, list[str]]]:
    """``key=value`` (every stage) and ``STAGE:key=value`` (that stage) words."""
    common: list[str] = []
    own: dict[str, list[str]] = {}
    for word in words:
        head, _, rest = word.partition("=")
        if ":" in head:
            stage, _, key = word.partition(":")
            if stage not in stages:
                raise PipelineError(f"{where}: {word!r} names stage {stage!r}; stages: {', '.join(stages)}")
            own.setdefault(stage, []).append(key)
        elif "=" in word:
            common.append(word)
        else:
            raise PipelineError(f"{where}: {word!r} is neither key=value (every stage) nor STAGE:key=value")
    return common, own


# ---------------------------------------------------------------------------------------------- hashes
def config_sha(config: dict) -> str:
    """sha256 of a resolved config (as JSON, sorted keys) without ``out``."""
    data = {k: v for k, v in config.items() if k != "out"}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def substituted_paths(overrides: list[str], folders: dict[str, Path]) -> list[str]:
    """The paths the overrides take from earlier stages (``${stage}/final`` -> its absolute path)."""
    out = []
    for text in overrides:
        for match in re.finditer(r"\$\{([^}]*)\}([^\"',\]\s]*)", text):
            out.append(str(Path(folders[match.group(1)]).resolve()) + match.group(2))
    return out


# ---------------------------------------------------------------------------------------------- running
def _say(console: Any, text: str) -> None:
    if console is None:
        import sys

        print(text, file=sys.stderr)
    else:
        console.print(text, soft_wrap=True, markup=False, highlight=False)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def stage_plan(
    pipeline: Pipeline,
    out: Path,
    seed: int,
    common: list[str] | tuple[str, ...] = (),
    own: dict[str, list[str]] | None = None,
    stage_root: Path | None = None,
) -> list[dict[str, Any]]:
    """Every stage resolved in order (no training): its overrides (the file's, then ``common``, then its
    own ``own[stage]``, then seed and out), config, config sha256 and run folder. With ``stage_root`` a
    stage's folder is ``stage_root/<stage>-<sha[:12]>`` (content-addressed: identical stages share it),
    else ``out/<stage>``."""
    from groupwise.config import load_config, to_dict, toml_value

    own = own or {}
    folders: dict[str, Path] = {}
    plan = []
    for stage in pipeline.stages:
        words = [*stage.overrides, *common, *own.get(stage.name, [])]
        check_refs(" ".join(words), list(folders), f"{pipeline.path}: stage {stage.name!r}")
        resolved = [substitute(w, folders) for w in words] + [f"seed={seed}"]
        try:
            cfg, _ = load_config(stage.recipe, resolved)
        except ConfigError as err:
            raise PipelineError(f"{pipeline.path}: stage {stage.name!r} ({stage.recipe}): {err}") from None
        config = json.loads(json.dumps(to_dict(cfg), default=str))
        sha = config_sha(config)
        folder = (stage_root / f"{stage.name}-{sha[:12]}") if stage_root is not None else Path(out) / stage.name
        cfg, _ = load_config(stage.recipe, [*resolved, f"out={toml_value(str(folder))}"])
        config["out"] = str(folder)
        plan.append(
            {
                "name": stage.name,
                "recipe": stage.recipe,
                "overrides": resolved,
                "cfg": cfg,
                "config": config,
                "config_sha256": sha,
                "folder": folder,
                "inputs": substituted_paths(words, folders),
            }
        )
        folders[stage.name] = folder
    return plan


def run_pipeline(
    pipeline: Pipeline | str | Path,
    out: str | Path,
    seed: int,
    common: list[str] | tuple[str, ...] = (),
    own: dict[str, list[str]] | None = None,
    stage_root: Path | None = None,
    console: Any = None,
) -> dict[str, Any]:
    """Run every stage in order (module docstring); returns what ``DIR/pipeline.json`` holds. Raises
    :class:`PipelineStopped` when a stage was stopped by a signal (rerun to resume)."""
    from groupwise.run import Run

    pipeline = pipeline if isinstance(pipeline, Pipeline) else load_pipeline(pipeline)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plan = stage_plan(pipeline, out, seed, list(common), own, stage_root)
    result: dict[str, Any] = {"pipeline": str(pipeline.path), "name": pipeline.name, "seed": seed, "stages": []}
    for i, item in enumerate(plan, 1):
        name, folder = item["name"], item["folder"]
        tag = f"[{i}/{len(plan)}] stage {name}"
        loaded = loaded_models(item["config"], item["inputs"])
        record = _read(folder / RECORD) or {}
        same = record.get("config_sha256") == item["config_sha256"]
        if same and record.get("loaded") != loaded:
            changed = [k for k in loaded if record.get("loaded", {}).get(k) != loaded[k]]
            raise PipelineError(
                f"{tag}: {folder} was trained from other inputs than today's ({', '.join(changed)} changed since: "
                f"an earlier stage was rerun); remove {folder} to run this stage again"
            )
        finished = runfolder.finished_step(folder)[0] is not None if folder.exists() else False
        if same and finished and record.get("final_sha256") and tree_sha(folder / "final") == record["final_sha256"]:
            _say(console, f"{tag}: finished before ({folder}, final sha256 {record['final_sha256'][:12]}), skipped")
            result["stages"].append(record)
            _write(out, result)
            continue
        _say(console, f"{tag}: recipe {item['recipe']} → {folder}")
        record = {
            "name": name,
            "recipe": item["recipe"],
            "overrides": item["overrides"],
            "folder": str(folder),
            "config_sha256": item["config_sha256"],
            "config": item["config"],
            "loaded": loaded,
            "status": "running",
        }
        folder.mkdir(parents=True, exist_ok=True)
        runfolder.write_atomic(folder / RECORD, json.dumps(record, indent=1) + "\n")
        t0 = time.perf_counter()
        run = Run.from_config(item["cfg"], console=console)
        summary = run.train()
        if runfolder.finished_step(folder)[0] is None:
            record["status"] = "stopped"
            result["stages"].append(record)
            _write(out, result)
            raise PipelineStopped(
                f"{tag} stopped at step {run.trainer.step} (checkpointed in {folder}); rerun the same command to "
                "resume it and the stages after it"
            )
        record.update(
            status="finished",
            steps=summary.get("steps"),
            final_sha256=tree_sha(folder / "final"),
            ledger=ledger(run),
            accuracy_after=summary.get("accuracy_after"),
        )
        runfolder.write_atomic(folder / RECORD, json.dumps(record, indent=1) + "\n")
        result["stages"].append(record)
        _write(out, result)
        acc = summary.get("accuracy_after")
        _say(
            console,
            f"{tag}: finished in {time.perf_counter() - t0:.1f} s, final sha256 {record['final_sha256'][:12]}"
            + (f", held-out accuracy {acc:.3f}" if isinstance(acc, float) else ""),
        )
    result["final"] = str(Path(plan[-1]["folder"]) / "final")
    result["final_sha256"] = result["stages"][-1]["final_sha256"]
    _write(out, result)
    return result


def _write(out: Path, result: dict) -> None:
    runfolder.write_atomic(out / PIPELINE_JSON, json.dumps(result, indent=1, allow_nan=False, default=str) + "\n")


PIPELINE_HELP = """usage: groupwise pipeline FILE --out DIR [--seed S] [--stages DIR2] [key=value | STAGE:key=value ...]

Run the [[stages]] of a pipeline (a file, or a shipped one: {pipelines}) in order, each a normal
resumable run folder DIR/<stage>/ (with --stages DIR2: DIR2/<stage>-<config sha>/, shared by every
pipeline whose stage resolves to the same config). key=value overrides every stage's config,
STAGE:key=value one stage's. A stage finished before with the same config and final weights is
skipped; an interrupted one resumes; DIR/pipeline.json records per stage the resolved config, run
folder, sha256 of its final weights and of every model it loaded, and the label ledger."""


def cmd_pipeline(args: list[str]) -> int:
    """``groupwise pipeline FILE --out DIR [--seed S] [--stages DIR2] [key=value | STAGE:key=value ...]``."""
    if not args or any(a in ("-h", "--help") for a in args):
        print(PIPELINE_HELP.format(pipelines=", ".join(shipped_pipelines()) or "(none)"))
        return 0 if args else 2
    options: dict[str, str] = {}
    words: list[str] = []
    items = iter(args)
    for item in items:
        flag, eq, value = item.partition("=")
        if flag in ("--out", "--seed", "--stages"):
            value = value if eq else next(items, "")
            if not value:
                raise PipelineError(f"pipeline: {flag} needs a value")
            options[flag] = value
        elif item.startswith("--"):
            raise PipelineError(f"pipeline: unknown option {item!r} (options: --out DIR, --seed S, --stages DIR2)")
        else:
            words.append(item)
    if not words:
        raise PipelineError("pipeline: name the pipeline file (or a shipped pipeline) first")
    if "--out" not in options:
        raise PipelineError("pipeline: --out DIR is required (the folder of the stages' run folders and pipeline.json)")
    try:
        seed = int(options.get("--seed", "0"))
    except ValueError:
        raise PipelineError(f"pipeline: --seed must be an integer, got {options['--seed']!r}") from None
    pipeline = load_pipeline(words[0])
    common, own = split_overrides(words[1:], [s.name for s in pipeline.stages], f"pipeline {pipeline.name}")
    from rich.console import Console

    console = Console(stderr=True)
    stages = Path(options["--stages"]) if "--stages" in options else None
    try:
        result = run_pipeline(pipeline, options["--out"], seed, common, own, stages, console)
    except PipelineStopped as err:
        _say(console, str(err))
        return 1
    print(json.dumps({"pipeline": result["name"], "final": result["final"], "final_sha256": result["final_sha256"]}))
    return 0
