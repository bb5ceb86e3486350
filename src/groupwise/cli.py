"""The ``groupwise`` command: train, cp, config, list, explain, paper, eval, warmstart, compare, claims, pipeline,
serve.

Imports stay light: torch and transformers load only for the commands that run a model.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys

DEFAULT_RECIPE = "demo"
_RUN_FOLDER = None  # the run folder of `groupwise train`, once known: a failure's traceback is kept there
ERROR_LOG = "error.log"  # in the run folder: the full traceback of the failure printed as one line


def _split_recipe(args: list[str]) -> tuple[str, list[str]]:
    """``groupwise train [RECIPE] [key=value ...]``: the recipe is the first word without '='."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return DEFAULT_RECIPE, args


TRAIN_HELP = """usage: groupwise train [RECIPE] [key=value ...] [--resume-allow KEY[,KEY]]

Train in the run folder `out` (default runs/<name>). RECIPE is a TOML file or a shipped recipe
({recipes}); each key=value overrides one config key (`rollout.group_size=4`,
`objective.terms.ppo_clip.eps_high=0.28`, `update={{name="sgd", lr=0.1}}`). Rerunning the same
command resumes from the last intact checkpoint; --resume-allow names the config keys (or
sections) that may differ from the stored run: each takes effect from the resumed step on (a new
update.lr included), and a key fixed when the run started (seed, model.path, the data, phases) is
refused. `groupwise list` shows the components, `groupwise explain NAME` one of them or a recipe;
docs/reliability.md what a run folder guarantees."""

EVAL_HELP = """usage: groupwise eval [MODEL | RUN] [key=value ...]

Held-out greedy accuracy of a model folder (default: the shipped `default` model) on the task of
`data.task` / `data.path` (key=value overrides as for train, e.g. data.task=countdown eval.size=500).
Given a run folder (runs/demo), its final model on the run's own data, reward and eval settings;
with eval.samples=n also mean@n and pass@k. An environment run's held-out rows are episodes played
closed-loop (eval.closed_loop): accuracy is the share of greedy episodes that succeed, return their
mean return."""


def _shipped_recipes() -> str:
    from groupwise.config import shipped_recipes

    return ", ".join(shipped_recipes())


def cmd_train(args: list[str]) -> int:
    if any(a in ("-h", "--help") for a in args):
        print(TRAIN_HELP.format(recipes=_shipped_recipes()))
        return 0
    from rich.console import Console

    from groupwise.config import changed_keys, load_config
    from groupwise.errors import ConfigError

    allow: list[str] = []
    rest = []
    items = iter(args)
    for item in items:  # --resume-allow KEY[,KEY] (repeatable) or --resume-allow=KEY[,KEY]
        if item == "--resume-allow" or item.startswith("--resume-allow="):
            value = item.partition("=")[2] if "=" in item else next(items, "")
            if not value:
                raise ConfigError(
                    "--resume-allow needs the config keys that may differ from "
                    "the stored run, e.g. --resume-allow train.steps,eval.every"
                )
            allow += [k.strip() for k in value.split(",") if k.strip()]
        else:
            rest.append(item)
    recipe, overrides = _split_recipe(rest)
    cfg, _ = load_config(recipe, overrides)
    if not cfg.out:
        cfg.out = f"runs/{cfg.name}"
    global _RUN_FOLDER
    _RUN_FOLDER = cfg.out_dir  # where a failure's traceback goes (main)
    console = Console(stderr=True)
    from groupwise.run import Run

    run = Run.from_config(cfg, console=console)
    if run.rank == 0:
        changed = [c for c in changed_keys(cfg, load_config(recipe)[0]) if not c.startswith("out=")]
        console.print(f"[bold]groupwise train[/] recipe={recipe} → {cfg.out_dir}")
        console.print(
            f"resolved config written to {cfg.out_dir / 'config.toml'}; "
            + (f"differs from the recipe in: {', '.join(changed)}" if changed else "the recipe's, unchanged"),
            markup=False,
            highlight=False,
            soft_wrap=True,  # one line, whatever the terminal's width
        )
    summary = run.train(resume_allow=allow)
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):  # everything is written: a late signal need not cut the exit short
        signal.signal(sig, signal.SIG_IGN)
    if run.rank == 0:
        shown = {k: v for k, v in summary.items() if k != "evals"}
        console.print_json(json.dumps(shown))
    from groupwise import dist

    dist.barrier()  # every rank done with its collectives before the group is torn down (gloo threads exit cleanly)
    ranks = dist.world_size()
    dist.shutdown()
    if ranks > 1:  # everything is written and flushed: skip the C++ static destructors, where a gloo thread
        # still joinable at exit aborts a rank now and then under load ("terminate called without an active exception")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _plugin_option(args: list[str]) -> list[str]:
    """Take ``--plugins M[,M]`` (repeatable, or ``--plugins=M``) out of ``args``, import those modules
    (``groupwise.plugins``: from the working directory too) and return the other arguments."""
    from groupwise.errors import ConfigError
    from groupwise.plugins import import_plugins

    modules, rest = [], []
    items = iter(args)
    for item in items:
        if item == "--plugins" or item.startswith("--plugins="):
            value = item.partition("=")[2] if "=" in item else next(items, "")
            if not value:
                raise ConfigError("--plugins needs the modules of your components, e.g. --plugins my_components")
            modules += [m.strip() for m in value.split(",") if m.strip()]
        else:
            rest.append(item)
    import_plugins(modules, "--plugins")
    return rest


def cmd_list(args: list[str]) -> int:
    """``groupwise list [STAGE] [--plugins M[,M]]``: the registered components (and those your modules register)."""
    from rich.console import Console
    from rich.table import Table

    from groupwise.plugins import is_plugin
    from groupwise.registry import STAGES, describe, entries

    args = _plugin_option(args)
    stage = args[0] if args else None
    if stage and stage not in STAGES:
        print(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}", file=sys.stderr)
        return 2
    table = Table(title="groupwise components", show_lines=False)
    for column in ("stage", "name", "description"):
        table.add_column(column)
    for st, name, cls in entries():
        if stage is None or st == stage:
            table.add_row(st, name, describe(cls) + (f"  (plug-in: {cls.__module__})" if is_plugin(cls) else ""))
    Console(width=200).print(table)
    return 0


def cmd_explain(args: list[str]) -> int:
    """``groupwise explain NAME [--plugins M[,M]]``: a component's documentation (every stage that has
    the name; ``module:Class`` for a plug-in class) and, when NAME is a shipped recipe or a recipe
    file, the recipe's components (one line each, its plug-ins included) and its file; a bare spec
    number is ``groupwise paper NN``."""
    from pathlib import Path

    from groupwise.config import shipped_recipes
    from groupwise.registry import entries

    args = _plugin_option(args)
    if not args:
        print(
            "usage: groupwise explain NAME [--plugins MODULES]  (a component, module:Class, a shipped recipe, a "
            "recipe file or a paper's spec number)",
            file=sys.stderr,
        )
        return 2
    if args[0].isdigit():
        return cmd_paper(args)
    if ":" in args[0] and not Path(args[0]).is_file():
        return _explain_plugin(args[0])
    if args[0].endswith(".toml") and Path(args[0]).is_file():
        _explain_recipe(args[0], Path(args[0]))
        return 0
    found = [(st, name, cls) for st, name, cls in entries() if name == args[0]]
    recipe = shipped_recipes().get(args[0])
    if not found and recipe is None:
        import difflib

        components = sorted({n for _, n, _ in entries()})
        recipes = list(shipped_recipes())
        close = [f"{n} (component)" for n in difflib.get_close_matches(args[0], components, n=3)]
        close += [f"{n} (recipe)" for n in difflib.get_close_matches(args[0], recipes, n=3)]
        print(
            f"no component or recipe named {args[0]!r}"
            + (f"; did you mean {', '.join(close)}?" if close else "")
            + " (`groupwise list` shows the components, `groupwise train --help` the recipes; a plug-in's name needs "
            "--plugins MODULE, or name it as module:Class)",
            file=sys.stderr,
        )
        return 2
    for st, name, cls in found:
        _explain_component(st, name, cls)
    if recipe is not None:
        _explain_recipe(args[0], recipe)
    return 0


def cmd_paper(args: list[str]) -> int:
    """``groupwise paper NN``: a paper's title, arXiv id, spec and page, and every file, component,
    recipe, claim and test of it (from its ``papers/NN_slug/paper.toml``)."""
    from groupwise.papers.index import paper_text

    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(
            "usage: groupwise paper NN   (a spec number: groupwise paper 27; docs/variants.md lists them)",
            file=sys.stderr if len(args) != 1 else sys.stdout,
        )
        return 0 if args[:1] in (["-h"], ["--help"]) else 2
    print(paper_text(args[0]))
    return 0


def _explain_plugin(spec: str) -> int:
    """``explain module:Class``: the class's documentation; registered by its module's ``@register``,
    under that stage and name, else with the stages whose contract it meets."""
    from groupwise.plugins import load_class, stages_fitting

    cls = load_class(spec, "explain")
    own = cls.__dict__.get("registry_name")
    if own is not None:
        _explain_component(cls.__dict__.get("stage", "?"), own, cls)
        return 0
    import dataclasses

    stages = stages_fitting(cls) if dataclasses.is_dataclass(cls) else []
    _explain_component("plug-in", spec, cls)
    if not dataclasses.is_dataclass(cls):
        print(f"{cls.__qualname__} is not a dataclass, so no stage can build it: decorate it with @dataclass")
        return 2
    print(
        f"not registered: name it as {spec!r} in a component entry of a stage whose contract it meets "
        f"({', '.join(stages) or 'none: it lacks the methods every stage requires'}; groupwise/components.py)"
    )
    return 0


def _explain_component(st: str, name: str, cls: type) -> None:
    import dataclasses

    from groupwise.registry import param_names

    module = sys.modules[cls.__module__]
    print(f"== {st} · {name}  ({cls.__module__}.{cls.__name__})\n")
    print(inspect.cleandoc(module.__doc__ or ""))
    print()
    print(inspect.cleandoc(cls.__doc__ or ""))
    if param_names(cls):
        print("\nparameters:")
        for f in dataclasses.fields(cls):
            if f.init:
                default = (
                    f.default
                    if f.default is not dataclasses.MISSING
                    else (f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)")
                )  # type: ignore[misc]
                print(f"  {f.name} = {default!r}")
    print()


def _explain_recipe(name: str, path) -> None:
    """The recipe's components (stage, name, where the config names it, the component's summary
    line and the parameters the recipe sets) and the recipe file itself."""
    from groupwise.config import component_entries, load_config
    from groupwise.plugins import is_plugin
    from groupwise.registry import describe, lookup

    cfg, _ = load_config(str(path))
    print(f"== recipe · {name}  ({path})\n")
    if cfg.plugins:
        print(f"plug-in modules: {', '.join(f'{m} ({sys.modules[m].__file__})' for m in cfg.plugins)}\n")
    print("components (`groupwise explain NAME` for one in full):")
    for stage, spec, where in component_entries(cfg):
        comp = spec if isinstance(spec, str) else spec["name"]
        params = {k: v for k, v in spec.items() if k not in ("name", "key")} if isinstance(spec, dict) else {}
        cls = lookup(stage, comp)
        origin = f"  (plug-in: {cls.__module__})" if is_plugin(cls) else ""
        print(f"  {stage} · {comp}  [{where}]  {describe(cls)}{origin}")
        if params:
            print("      " + ", ".join(f"{k} = {v!r}" for k, v in params.items()))
    print(f"\nconfig ({path.name}; the keys it leaves out take their defaults, `groupwise config` lists them):\n")
    print(path.read_text().rstrip())
    print()


def cmd_eval(args: list[str]) -> int:
    """``groupwise eval [MODEL | RUN] [key=value ...]``:
    held-out greedy accuracy of a model folder or a run's final model."""
    from groupwise.config import load_config
    from groupwise.errors import ConfigError

    if any(a in ("-h", "--help") for a in args):
        print(EVAL_HELP)
        return 0
    from pathlib import Path

    model = "default"
    if args and "=" not in args[0]:
        model, args = args[0], args[1:]
    run = Path(model)
    # a run folder: its own data, reward and eval settings, its final model
    if (run / "config.toml").exists() and (run / "final").is_dir():
        cfg, _ = load_config(
            str(run / "config.toml"),
            [f'model.path="{run / "final"}"', "model.lora={}", "roles={}", "train.steps=0", *args],
        )
        if cfg.model.policy != "lm":
            raise ConfigError(
                f"groupwise eval reads language-model folders; {run} trained a "
                f"{cfg.model.policy!r} policy (its summary.json has its accuracy)"
            )
    else:
        cfg, _ = load_config(None, [f'model.path="{model}"', "train.steps=0", *args])
    from groupwise.build import build
    from groupwise.heldout import HeldOut
    from groupwise.trainer import Trainer

    parts = build(cfg)
    heldout = HeldOut(Trainer(parts))
    detail = heldout.evaluate_detail()  # an env run's held-out episodes: greedy success and mean return
    result = {
        "model": model,
        "task": cfg.data.path or cfg.data.task,
        "eval_size": min(cfg.eval.size, len(parts.eval_rows)),
        **detail,
    }
    result.update(heldout.evaluate_sampled())  # mean@n, pass@k when eval.samples is set
    print(json.dumps(result))
    return 0


def cmd_warmstart(args: list[str]) -> int:
    from groupwise.models.warmstart import main as warmstart_main

    return warmstart_main(args) or 0


def cmd_compare(args: list[str]) -> int:
    """``groupwise compare RECIPE|LABEL=RECIPE ... [--seeds N] [--out DIR] [--target ACC] [key=value ...]``."""
    from groupwise.claims.commands import cmd_compare as run

    return run(args)


def cmd_claims(args: list[str]) -> int:
    """``groupwise claims [NAMES...] [--seeds N] [--out DIR]``: run claim files, rewrite docs/claims.md."""
    from groupwise.claims.commands import cmd_claims as run

    return run(args)


def cmd_config(args: list[str]) -> int:
    """``groupwise config``: every config section and key with its type, default and meaning."""
    from groupwise.config import reference_markdown

    print(reference_markdown())
    return 0


def cmd_cp(args: list[str]) -> int:
    """``groupwise cp RECIPE PATH [--force]``: copy a shipped recipe to edit."""
    import shutil
    from pathlib import Path

    from groupwise.config import shipped_recipes

    force = "--force" in args
    args = [a for a in args if a != "--force"]
    usage = f"usage: groupwise cp RECIPE PATH [--force]   (recipes: {_shipped_recipes()})"
    if args[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    if len(args) != 2:
        print(usage, file=sys.stderr)
        return 2
    source = shipped_recipes().get(args[0])
    if source is None:
        print(f"groupwise: no shipped recipe {args[0]!r}; shipped recipes: {_shipped_recipes()}", file=sys.stderr)
        return 2
    target = Path(args[1])
    if target.is_dir():
        target = target / source.name
    if target.exists() and not force:
        print(f"groupwise: {target} exists; add --force to overwrite it", file=sys.stderr)
        return 2
    shutil.copyfile(source, target)
    print(f"copied recipe {args[0]!r} to {target}; train with: groupwise train {target}")
    return 0


def cmd_pipeline(args: list[str]) -> int:
    """``groupwise pipeline FILE --out DIR [--seed S] [--stages DIR2] [key=value | STAGE:key=value ...]``."""
    from groupwise.pipeline import cmd_pipeline as run

    return run(args)


def cmd_serve(args: list[str]) -> int:
    from groupwise.serve import main as serve_main

    return serve_main(args)


COMMANDS = {
    "config": cmd_config,
    "cp": cmd_cp,
    "train": cmd_train,
    "list": cmd_list,
    "explain": cmd_explain,
    "paper": cmd_paper,
    "eval": cmd_eval,
    "warmstart": cmd_warmstart,
    "compare": cmd_compare,
    "claims": cmd_claims,
    "pipeline": cmd_pipeline,
    "serve": cmd_serve,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="groupwise", description="GRPO and its variants as composable components.")
    parser.add_argument(
        "command",
        choices=sorted(COMMANDS),
        help=(
            "train [RECIPE] [key=value ...] [--resume-allow KEYS] | cp RECIPE PATH | config | list "
            "[STAGE] [--plugins M] | explain NAME (component, module:Class, recipe or spec number) "
            "[--plugins M] | paper NN (a paper's files, components, recipes, claims, tests) | eval "
            "[MODEL] [key=value ...] | warmstart [...] | compare RECIPE|LABEL=RECIPE ... [--seeds N] "
            "[--out DIR] [--target ACC] [key=value ...] | claims [NAMES...] [--seeds N] [--out DIR] | "
            "pipeline FILE --out DIR [--seed S] [key=value | STAGE:key=value ...] | "
            "serve [MODEL] [--port P] [key=value ...]"
        ),
    )
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        parser.error(f"unknown command {command!r}")
    debug = "--debug" in rest  # a failure's full traceback instead of its one line
    rest = [a for a in rest if a != "--debug"]
    from groupwise.errors import ConfigError
    from groupwise.rewards._common import RewardError
    from groupwise.tasks.data import DataError

    try:
        return COMMANDS[command](rest)
    except (ConfigError, DataError, RewardError) as err:  # a bad recipe, data file or reward: one line
        if debug:
            raise
        if isinstance(err, ConfigError):
            print(f"groupwise: config error: {err}", file=sys.stderr)
        else:
            print(f"groupwise: {err}{_keep_traceback(err)}", file=sys.stderr)
        return 1 if isinstance(err, RewardError) else 2
    except BrokenPipeError:  # `groupwise explain X | head`: the reader left; not an error of ours
        # the interpreter's final flush must not fail too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except FileNotFoundError as err:  # a model, recipe or data file that is not there: one line, not a traceback
        print(f"groupwise: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # the run folder's refusals and a reward that exits: one line naming what to do
        from groupwise.checkpoint import CheckpointCorrupt
        from groupwise.rewards.score import RewardAborted
        from groupwise.runfolder import NoSpace, RunLocked

        if not isinstance(err, (RunLocked, CheckpointCorrupt, NoSpace, RewardAborted)):
            raise
        print(f"groupwise: {err}", file=sys.stderr)
        return 1


def _keep_traceback(err: BaseException) -> str:
    """Write ``err``'s traceback to the run folder's ``error.log`` (when the run folder exists) and
    say where it is, for the end of the one-line message."""
    import traceback

    text = "".join(traceback.format_exception(err))
    if _RUN_FOLDER is not None and _RUN_FOLDER.is_dir():
        try:
            (_RUN_FOLDER / ERROR_LOG).write_text(text)
            return f"  (traceback: {_RUN_FOLDER / ERROR_LOG}; --debug prints it)"
        except OSError:
            pass
    return "  (--debug prints the traceback)"


if __name__ == "__main__":
    sys.exit(main())
