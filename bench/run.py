"""``make bench``: groupwise against TRL's ``GRPOTrainer`` on the same models, prompts, reward and settings.

    python bench/run.py                  # the full matrix + time to accuracy (< 20 min on 2 quiet cores)
    python bench/run.py --quick          # smoke run: 2 small cells, 2 timed steps, short time to accuracy
    python bench/run.py --cells tiny-4x8 --pairs 3 --skip-tta
    python bench/run.py --cells small:16x8:64:grpo:0.04:2   # an ad-hoc cell preset:BxG:L[:loss[:beta[:mu]]]
    python bench/run.py --ablation       # groupwise alone with each optimisation switched off in turn

Measurements run in fresh worker processes (``bench/worker.py``) that import one framework only, so
the memory they report is that framework's; one worker per framework and A/B round runs its cells one
after another (smaller models first, smallest footprint first; each cell's peak RSS is measured from
its own start). The two frameworks' workers alternate as A/B
pairs (groupwise, TRL, groupwise, TRL, ...): ``--pairs`` of them (default 2) for the three cheapest
cells, one for the others (per-cell caps, ``--no-cap``). Each cell runs ``warmup`` untimed steps then
``steps`` timed ones; we report medians and, per pair, ratio = TRL seconds per step / groupwise seconds per step
(> 1: groupwise is faster). See bench/README.md for the exact configuration mapping.

Outputs: ``bench/results.json`` (one entry per cell), ``bench/run_info.json`` (machine, GEMM
FLOP/s, time to accuracy) and the tables in ``docs/performance.md`` between the ``bench:*`` markers.
``--quick`` writes under ``bench/runs/quick/`` instead and leaves ``docs/`` alone.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bf16  # noqa: E402
from common import (
    BENCH,
    DOC,
    OFFLINE_ENV,
    RESULTS,
    ROOT,
    RUNS,
    TTA_TASKS,
    Cell,
    gemm_flops,
    machine,
    matrix,
    parse_cell,
    quick_matrix,
    select,
)  # noqa: E402
from floor import gemm_floors, prompt_tokens  # noqa: E402

DEFAULT_TTA_MODEL = ROOT / "src" / "groupwise" / "models" / "default"
WORKER = BENCH / "worker.py"
WORKER_TIMEOUT_S = 1800  # per cell in a worker

# Each ablation switches techniques off through groupwise's own `perf` / `update` settings (passed to
# the worker as extra overrides); the last row is the plain reference path with everything off.
ABLATIONS: list[tuple[str, dict[str, str]]] = [
    ("all optimisations (default)", {}),
    (
        "model's own HF forward (no functional decoder / training forward)",
        {"GW_BENCH_OVERRIDES": "perf.functional=false"},
    ),
    ("no shared prompt (prefill per row, no tree attention)", {"GW_BENCH_OVERRIDES": "perf.share_prefix=false"}),
    ("keep finished rows in the decode batch", {"GW_BENCH_OVERRIDES": "perf.drop_finished=false"}),
    ("padded training forward, not packed", {"GW_BENCH_OVERRIDES": "perf.packed=false"}),
    ("AdamW without the fused kernel", {"GW_BENCH_OVERRIDES": "update.fused=false"}),
    ("freed memory handed back to the OS (glibc defaults)", {"GW_BENCH_OVERRIDES": "perf.keep_freed_memory=false"}),
    (
        "gate|up recomputed in the backward (perf.recompute_mlp, off by default)",
        {"GW_BENCH_OVERRIDES": "perf.recompute_mlp=true"},
    ),
    (
        "recompute_mlp with glibc's default heap (the least memory)",
        {"GW_BENCH_OVERRIDES": "perf.recompute_mlp=true;perf.keep_freed_memory=false"},
    ),
    (
        "plain path: all of the above off",
        {
            "GW_BENCH_OVERRIDES": ";".join(
                [
                    "perf.functional=false",
                    "perf.share_prefix=false",
                    "perf.drop_finished=false",
                    "perf.packed=false",
                    "update.fused=false",
                    "perf.keep_freed_memory=false",
                ]
            )
        },
    ),
]
ABLATION_CELLS = "tiny-4x8-L16,tiny-64x8-L16,small-4x8-L128"


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ------------------------------------------------------------------------------------------------
# Workers
# ------------------------------------------------------------------------------------------------
def worker_env(threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GW_BENCH_")}
    env.update(OFFLINE_ENV)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"})
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH), src] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra or {})
    return env


def run_worker(
    argv: list[str],
    out: Path,
    logfile: Path,
    threads: int,
    extra_env: dict[str, str] | None = None,
    timeout: float = WORKER_TIMEOUT_S,
) -> Any:
    """Run ``worker.py argv`` in a fresh interpreter; its JSON result, or ``{"error": ...}``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    logfile.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.unlink()
    command = [sys.executable, str(WORKER), *argv, "--threads", str(threads), "--out", str(out)]
    started = time.perf_counter()
    with open(logfile, "w") as fh:
        fh.write(" ".join(command) + "\n")
        fh.flush()
        try:
            proc = subprocess.run(
                command,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=worker_env(threads, extra_env),
                cwd=str(ROOT),
                timeout=timeout,
            )
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    wall = time.perf_counter() - started
    if code != 0 or not out.exists():
        tail = logfile.read_text().splitlines()[-15:]
        log(f"worker failed ({code}); log {logfile}:\n    " + "\n    ".join(tail))
        return {"error": f"exit {code}", "log": str(logfile), "wall_seconds": wall}
    result = json.loads(out.read_text())
    if isinstance(result, dict):
        result["wall_seconds"] = wall
    return result


def footprint(cell: Cell) -> tuple[int, int, int]:
    """Order of cells of one model inside a worker: smallest memory first, so leftovers of an earlier cell
    stay below the next cell's own peak (tokens in flight, then the extra passes of KL and mu > 1)."""
    return (cell.prompts * cell.group * cell.length, int(cell.beta > 0) + cell.mu, cell.group)


def worker_groups(cells: list[Cell], pairs_of: dict[str, int]) -> list[tuple[int, list[Cell]]]:
    """(pair index, cells) per worker process: one process per framework for each A/B round, holding the
    cells that still need a pair, model by model in the order the models first appear in ``cells``
    (smaller models first in the matrix), smallest footprint first within a model."""
    groups = []
    for pair in range(max(pairs_of.values(), default=0)):
        wanted = [c for c in cells if pairs_of[c.name] > pair]
        presets = list(dict.fromkeys(c.preset for c in wanted))
        groups.append((pair, sorted(wanted, key=lambda c: (presets.index(c.preset), footprint(c)))))
    return groups


def measure_cells(
    cells: list[Cell],
    pairs_of: dict[str, int],
    threads: int,
    rundir: Path,
    frameworks=("groupwise", "trl"),
    extra_env: dict[str, str] | None = None,
    tag: str = "",
) -> dict[str, list[dict[str, dict]]]:
    """Rounds of A/B worker pairs (groupwise, TRL, groupwise, TRL, ...), each worker a fresh process that
    runs a group of cells (``worker_groups``); per cell name, one ``{framework: measurement}`` per pair."""
    rounds: dict[str, list[dict[str, dict]]] = {c.name: [] for c in cells}
    groups = worker_groups(cells, pairs_of)
    for g, (pair, group) in enumerate(groups, 1):
        log(f"worker group {g}/{len(groups)} (pair {pair + 1}): {', '.join(c.name for c in group)}")
        by_framework = {}
        for framework in frameworks:
            stem = f"round{pair}{tag}-{framework}"
            result = run_worker(
                [
                    "measure",
                    "--framework",
                    framework,
                    "--cells",
                    json.dumps([asdict(c) for c in group]),
                    "--models-dir",
                    str(BENCH / "models"),
                ],
                rundir / "raw" / f"{stem}.json",
                rundir / "logs" / f"{stem}.log",
                threads,
                extra_env,
                timeout=WORKER_TIMEOUT_S * len(group),
            )
            measured = result if isinstance(result, list) else [{"cell": c.name, **result} for c in group]
            by_framework[framework] = {m["cell"]: m for m in measured}
            for m in measured:
                if "error" not in m:
                    steps = ", ".join(f"{s:.3g}" for s in m["step_seconds"])
                    log(
                        f"  {m['cell']}{tag} pair {pair + 1} {framework:9s}: "
                        f"steps [{steps}] s, peak RSS {m['peak_rss_mb']:.0f} MB"
                    )
                else:
                    log(f"  {m['cell']}{tag} pair {pair + 1} {framework:9s}: FAILED {m['error']}")
        for cell in group:
            rounds[cell.name].append({fw: by_framework[fw].get(cell.name, {"error": "missing"}) for fw in frameworks})
    return rounds


# ------------------------------------------------------------------------------------------------
# Summaries
# ------------------------------------------------------------------------------------------------
def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(
    cell: Cell, rounds: list[dict[str, dict]], flops_per_s: float, threads: int, floor_s: float | None = None
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "cell": cell.name,
        **{k: v for k, v in asdict(cell).items() if k != "max_pairs"},
        "micro_groups": cell.micro,
        "pairs": len(rounds),
        "threads": threads,
        "gemm_flops": flops_per_s,
        "gemm_floor_s": floor_s,
    }
    per_fw: dict[str, dict[str, Any]] = {}
    for fw in ("groupwise", "trl"):
        ok = [r[fw] for r in rounds if fw in r and "error" not in r[fw]]
        errors = [r[fw]["error"] for r in rounds if fw in r and "error" in r[fw]]
        if errors:
            entry[f"{fw}_errors"] = errors
        if not ok:
            per_fw[fw] = {}
            continue
        pair_medians = [statistics.median(r["step_seconds"]) for r in ok]
        step = statistics.median(pair_medians)
        generated = statistics.median([t for r in ok for t in r["generated_tokens"]])
        trained = statistics.median([t for r in ok for t in r["trained_tokens"]])
        n = ok[0]["params_non_embedding"]
        entry.update(
            {
                f"{fw}_step_s": step,
                f"{fw}_steps_raw": [r["step_seconds"] for r in ok],
                f"{fw}_gen_tok_s": generated / step,
                f"{fw}_train_tok_s": trained / step,
                f"{fw}_rss_mb": statistics.median([r["peak_rss_mb"] for r in ok]),
                f"{fw}_flop_efficiency": (2 * n * generated + 6 * n * trained) / (step * flops_per_s),
                f"{fw}_completion_len": statistics.median([r["notes"]["mean_completion_len"] for r in ok]),
                f"{fw}_setup_s": statistics.median([r["setup_seconds"] for r in ok]),
                f"{fw}_warmup_s": [r.get("warmup_seconds", []) for r in ok],
            }
        )
        if fw == "groupwise":
            entry["groupwise_generation_s"] = _median([statistics.median(r["generation_seconds"]) for r in ok])
        else:
            entry["trl_step_s_inside_callbacks"] = _median(
                [statistics.median(r["notes"]["step_seconds_inside_callbacks"]) for r in ok]
            )
            entry["trl_resolved_config"] = ok[0]["notes"]["resolved"]
        entry["params_non_embedding"], entry["params_total"] = n, ok[0]["params_total"]
        entry["generated_tokens_per_step"], entry["trained_tokens_per_step"] = generated, trained
        per_fw[fw] = {"pair_medians": pair_medians}
    pair_ratios = []
    for r in rounds:
        if all(fw in r and "error" not in r[fw] for fw in ("groupwise", "trl")):
            pair_ratios.append(
                statistics.median(r["trl"]["step_seconds"]) / statistics.median(r["groupwise"]["step_seconds"])
            )
    entry["pair_ratios"] = pair_ratios
    entry["ratio"] = _median(pair_ratios)
    entry["flop_efficiency"] = entry.get("groupwise_flop_efficiency")
    if floor_s and entry.get("trl_step_s") and entry.get("groupwise_step_s"):
        entry["speedup_ceiling"] = entry["trl_step_s"] / floor_s  # no implementation on this BLAS can beat TRL by more
        entry["groupwise_gemm_share"] = floor_s / entry["groupwise_step_s"]
        entry["trl_gemm_share"] = floor_s / entry["trl_step_s"]
    return entry


# ------------------------------------------------------------------------------------------------
# Time to accuracy
# ------------------------------------------------------------------------------------------------
def recipe_threads(recipe: str) -> int:
    """The ``threads`` a shipped groupwise recipe asks for (0: none)."""
    import tomllib

    from groupwise.config import resolve_recipe

    with open(resolve_recipe(recipe), "rb") as fh:
        return int(tomllib.load(fh).get("threads", 0) or 0)


def first_reach(curve: list[list[float]], target: float) -> float | None:
    return next((t for t, _, acc in curve if acc >= target - 1e-9), None)


def time_to_accuracy(
    model: Path,
    seconds: float,
    eval_every: float,
    eval_size: int,
    threads: int,
    rundir: Path,
    task: str = "arithmetic",
    seed: int = 0,
    gw_eval_every: float | None = None,
) -> dict[str, Any]:
    """TRL trains for ``seconds``; its last held-out accuracy is the target groupwise then trains to (up to
    the same budget). ``gw_eval_every`` evaluates groupwise more often (default: as TRL) for a finer reach time."""
    common = [
        "--model",
        str(model),
        "--seconds",
        str(seconds),
        "--eval-size",
        str(eval_size),
        "--task",
        task,
        "--seed",
        str(seed),
    ]
    tag = "" if (task, seed) == ("arithmetic", 0) else f"-{task}-{seed}"
    log(
        f"time to accuracy ({task}, seed {seed}): TRL for {seconds:.0f} s "
        f"of training from {model}, {threads} torch thread(s) in both runs"
    )
    trl = run_worker(
        ["tta", "--framework", "trl", *common, "--eval-every", str(eval_every)],
        rundir / "raw" / f"tta-trl{tag}.json",
        rundir / "logs" / f"tta-trl{tag}.log",
        threads,
    )
    if "error" in trl:
        return {"error": "TRL time-to-accuracy run failed", "trl": trl}
    target = trl["curve"][-1][2]
    log(
        f"  TRL: accuracy {trl['curve'][0][2]:.3f} -> {target:.3f} in {trl['curve'][-1][0]:.0f} s "
        f"({trl['curve'][-1][1]} steps); groupwise runs until it reaches {target:.3f} (or {seconds:.0f} s)"
    )
    gw = run_worker(
        [
            "tta",
            "--framework",
            "groupwise",
            *common,
            "--eval-every",
            str(gw_eval_every or eval_every),
            "--target",
            str(target),
        ],
        rundir / "raw" / f"tta-groupwise{tag}.json",
        rundir / "logs" / f"tta-groupwise{tag}.log",
        threads,
    )
    if "error" in gw:
        return {"error": "groupwise time-to-accuracy run failed", "trl": trl, "groupwise": gw}
    trl_first, gw_first = first_reach(trl["curve"], target), first_reach(gw["curve"], target)
    result = {
        "model": str(model),
        "task": task,
        "seed": seed,
        "budget_seconds": seconds,
        "eval_every_seconds": eval_every,
        "groupwise_eval_every_seconds": gw_eval_every or eval_every,
        "eval_size": trl["eval_size"],
        "algorithm": trl["algorithm"],
        "target_accuracy": target,
        "trl_curve": trl["curve"],
        "groupwise_curve": gw["curve"],
        "trl_seconds": trl["curve"][-1][0],
        "trl_first_reach_seconds": trl_first,
        "groupwise_reach_seconds": gw_first,
        "groupwise_final_accuracy": gw["curve"][-1][2],
        "time_ratio": (trl["curve"][-1][0] / gw_first) if gw_first else None,
        "time_ratio_first_reach": (trl_first / gw_first) if (gw_first and trl_first) else None,
        "trl_rss_mb": trl["peak_rss_mb"],
        "groupwise_rss_mb": gw["peak_rss_mb"],
        "threads": threads,
        "trl_steps_per_s": trl["curve"][-1][1] / trl["curve"][-1][0] if trl["curve"][-1][0] else None,
        "groupwise_steps_per_s": gw["curve"][-1][1] / gw["curve"][-1][0] if gw["curve"][-1][0] else None,
    }
    reached = f"in {gw_first:.0f} s" if gw_first else f"not within {seconds:.0f} s (final {gw['curve'][-1][2]:.3f})"
    log(f"  groupwise: reached {target:.3f} {reached}")
    return result


def seeded_time_to_accuracy(
    model: Path,
    tasks: list[str],
    seeds: int,
    seconds: float,
    eval_every: float,
    gw_eval_every: float,
    eval_size: int,
    threads: int,
    rundir: Path,
) -> dict[str, Any]:
    """:func:`time_to_accuracy` for every task and seed (seed s seeds both frameworks), summarised per task
    with 95 % t intervals over seeds. A groupwise run that never reaches TRL's accuracy within the budget
    counts at the budget (ratio 1.0 at most, an upper bound for that seed) and is flagged."""
    import math

    from groupwise.claims.intervals import mean_interval

    runs: dict[str, list[dict[str, Any]]] = {}
    for task in tasks:
        for seed in range(seeds):
            got = time_to_accuracy(
                model,
                seconds,
                eval_every,
                eval_size,
                threads,
                rundir,
                task=task,
                seed=seed,
                gw_eval_every=gw_eval_every,
            )
            if "error" in got:
                return {"error": f"{task} seed {seed}: {got['error']}", "runs": runs}
            runs.setdefault(task, []).append(got)
    summary = {}
    for task, per_seed in runs.items():
        reach = [r["groupwise_reach_seconds"] or r["trl_seconds"] for r in per_seed]
        ratios = [r["trl_seconds"] / t for r, t in zip(per_seed, reach)]
        log_ratio = mean_interval([math.log(x) for x in ratios])
        summary[task] = {
            "trl_accuracy": asdict(mean_interval([r["target_accuracy"] for r in per_seed])),
            "trl_start_accuracy": per_seed[0]["trl_curve"][0][2],
            "groupwise_reach_seconds": asdict(mean_interval(reach)),
            "ratio_geomean": math.exp(log_ratio.mean),
            "ratio_interval": [
                math.exp(log_ratio.mean - (log_ratio.half or 0.0)),
                math.exp(log_ratio.mean + (log_ratio.half or 0.0)),
            ],
            "ratios": ratios,
            "not_reached": [r["seed"] for r in per_seed if r["groupwise_reach_seconds"] is None],
            "steps_per_s": {
                "groupwise": [r["groupwise_steps_per_s"] for r in per_seed],
                "trl": [r["trl_steps_per_s"] for r in per_seed],
            },
            "rss_mb": {
                "groupwise": [r["groupwise_rss_mb"] for r in per_seed],
                "trl": [r["trl_rss_mb"] for r in per_seed],
            },
        }
    first = next(iter(runs.values()))[0]
    return {
        "model": str(model),
        "tasks": tasks,
        "seeds": seeds,
        "budget_seconds": seconds,
        "eval_every_seconds": eval_every,
        "groupwise_eval_every_seconds": gw_eval_every,
        "threads": threads,
        "algorithm": first["algorithm"],
        "eval_sizes": {task: per_seed[0]["eval_size"] for task, per_seed in runs.items()},
        "summary": summary,
        "runs": runs,
    }


def learning_per_step(
    model: Path, steps: int, every: int, seeds: int, eval_size: int, threads: int, rundir: Path
) -> dict[str, Any]:
    """Held-out accuracy against optimiser steps for both frameworks over ``seeds`` seeds (the same
    algorithm, model and reward; each seed seeds both), so per-step learning is compared apart from speed."""
    common = [
        "--model",
        str(model),
        "--steps",
        str(steps),
        "--eval-every-steps",
        str(every),
        "--eval-size",
        str(eval_size),
    ]
    curves: dict[str, dict[int, list]] = {"groupwise": {}, "trl": {}}
    for seed in range(seeds):
        for fw in ("groupwise", "trl"):
            log(f"learning per step: {fw}, seed {seed}, {steps} optimiser steps")
            got = run_worker(
                ["tta", "--framework", fw, *common, "--seed", str(seed)],
                rundir / "raw" / f"per-step-{fw}-{seed}.json",
                rundir / "logs" / f"per-step-{fw}-{seed}.log",
                threads,
            )
            if "error" in got:
                return {"error": f"{fw} seed {seed} failed", "log": got.get("log")}
            curves[fw][seed] = got["curve"]
            algorithm = got["algorithm"]
    from dataclasses import asdict

    from groupwise.claims.intervals import mean_interval, paired_effect

    def at(fw: str, step: int) -> dict[int, float]:
        return {seed: next(acc for _, n, acc in curve if n == step) for seed, curve in curves[fw].items()}

    every_curve = [curve for per_seed in curves.values() for curve in per_seed.values()]
    # steps evaluated in every run
    points = sorted(set.intersection(*({n for _, n, _ in curve} for curve in every_curve)))
    rows = []
    for n in points:
        gw, trl = at("groupwise", n), at("trl", n)
        rows.append(
            {
                "step": n,
                "groupwise": asdict(mean_interval(list(gw.values()))),
                "trl": asdict(mean_interval(list(trl.values()))),
                "difference": asdict(paired_effect(gw, trl)),
            }
        )
    return {
        "model": str(model),
        "steps": steps,
        "every": every,
        "seeds": seeds,
        "eval_size": eval_size,
        "threads": threads,
        "algorithm": algorithm,
        "curves": curves,
        "rows": rows,
    }


GEN_PRESETS = ("tiny", "small")  # the ~1M and ~8M models
GEN_BATCHES = (8, 64, 512)


def generation_throughput(threads: int, rundir: Path, length: int = 64, reps: int = 3) -> dict[str, Any]:
    """Completion tokens/s of sampling alone, groupwise's engine vs Hugging Face ``generate``, per model and batch."""
    from build_models import build

    rows: list[dict[str, Any]] = []
    for preset in GEN_PRESETS:
        folder = build(preset)
        got = {}
        for fw in ("groupwise", "hf"):
            log(f"generation alone: {fw}, {preset}, batches {list(GEN_BATCHES)} x {length} tokens")
            got[fw] = run_worker(
                [
                    "gen",
                    "--framework",
                    fw,
                    "--model",
                    str(folder),
                    "--batches",
                    ",".join(map(str, GEN_BATCHES)),
                    "--length",
                    str(length),
                    "--reps",
                    str(reps),
                ],
                rundir / "raw" / f"gen-{fw}-{preset}.json",
                rundir / "logs" / f"gen-{fw}-{preset}.log",
                threads,
            )
            if isinstance(got[fw], dict) and "error" in got[fw]:
                return {"error": f"generation worker {fw} on {preset} failed", "log": got[fw].get("log")}
        for gw, hf in zip(got["groupwise"], got["hf"]):
            rows.append(
                {
                    "preset": preset,
                    "batch": gw["batch"],
                    "groupwise_tok_s": gw["tokens_per_s"],
                    "hf_tok_s": hf["tokens_per_s"],
                    "ratio": gw["tokens_per_s"] / hf["tokens_per_s"],
                }
            )
    return {"length": length, "reps": reps, "threads": threads, "rows": rows}


def generation_section(result: dict[str, Any]) -> str:
    if "error" in result:
        return f"_Generation throughput failed: {result['error']} (log {result.get('log')})._"
    lines = [
        f"Sampling alone (no scoring or training): rows of exactly {result['length']} completion tokens "
        "(the bench models cannot emit EOS), batch = prompts × G = 8, temperature 1 over the whole "
        f"vocabulary, median of {result['reps']} timed calls after one untimed; {result['threads']} torch "
        "thread(s). HF = `model.generate` (SDPA, KV cache) on the same prompts, each repeated G times.",
        "",
        "| model | batch (rows) | groupwise tok/s | HF generate tok/s | groupwise / HF |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['preset']} | {r['batch']} | {r['groupwise_tok_s']:,.0f} "
            f"| {r['hf_tok_s']:,.0f} | **{r['ratio']:.2f}×** |"
        )
    return "\n".join(lines)


def per_step_section(result: dict[str, Any]) -> str:
    if "error" in result:
        return f"_Learning per step failed: {result['error']} (log {result.get('log')})._"
    a = result["algorithm"]

    def cell(iv: dict[str, Any], signed: bool = False) -> str:
        mean = f"{iv['mean']:+.3f}" if signed else f"{iv['mean']:.3f}"
        return f"{mean} ± {iv['half']:.3f}" if iv.get("half") is not None else mean

    lines = [
        f"The `{a['recipe']}` recipe's algorithm on both ({a['prompts']} prompts × G = "
        f"{a['group']}, {a['length']} new tokens, lr {a['lr']:g}, loss `{a['loss']}`, μ = "
        f"{a['mu']}), {result['seeds']} seeds each (seed s seeds both frameworks), held-out greedy "
        f"accuracy on {result['eval_size'] or 500} test prompts every {result['every']} optimiser "
        "steps; mean ± 95 % t half-width over seeds; difference = groupwise − TRL, paired by seed.",
        "",
        "| optimiser steps | TRL | groupwise | groupwise − TRL |",
        "|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['step']} | {cell(row['trl'])} | {cell(row['groupwise'])} "
            f"| {cell(row['difference'], signed=True)} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def _f(value: Any, fmt: str = "{:.3g}") -> str:
    return "–" if value is None else fmt.format(value)


def results_table(entries: list[dict[str, Any]]) -> str:
    head = (
        "| cell | params (non-emb.) | groupwise s/step | TRL s/step | speed-up (TRL/gw) | per-pair | "
        "gen tok/s gw / TRL | trained tok/s gw / TRL | peak RSS MB gw / TRL | FLOP eff. gw / TRL | "
        "GEMM floor s | floor share of the step gw / TRL | ceiling TRL/floor |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for e in entries:
        pairs = ", ".join(f"{r:.2f}" for r in e.get("pair_ratios", [])) or "–"
        lines.append(
            f"| {e['cell']} | {_f(e.get('params_non_embedding'), '{:,}')} | {_f(e.get('groupwise_step_s'))} | "
            f"{_f(e.get('trl_step_s'))} | **{_f(e.get('ratio'), '{:.2f}×')}** | {pairs} | "
            f"{_f(e.get('groupwise_gen_tok_s'), '{:,.0f}')} / {_f(e.get('trl_gen_tok_s'), '{:,.0f}')} | "
            f"{_f(e.get('groupwise_train_tok_s'), '{:,.0f}')} / {_f(e.get('trl_train_tok_s'), '{:,.0f}')} | "
            f"{_f(e.get('groupwise_rss_mb'), '{:,.0f}')} / {_f(e.get('trl_rss_mb'), '{:,.0f}')} | "
            f"{_f(e.get('groupwise_flop_efficiency'), '{:.1%}')} / {_f(e.get('trl_flop_efficiency'), '{:.1%}')} "
            f"| {_f(e.get('gemm_floor_s'))} | {_f(e.get('groupwise_gemm_share'), '{:.0%}')} / "
            f"{_f(e.get('trl_gemm_share'), '{:.0%}')} | {_f(e.get('speedup_ceiling'), '{:.2f}×')} |"
        )
    return "\n".join(lines)


def tta_section(tta: dict[str, Any] | None) -> str:
    if not tta:
        return "_Time to accuracy was not run (`--skip-tta`, or no warm-started model)._"
    if "error" in tta:
        return f"_Time to accuracy failed: {tta['error']} (see the worker logs)._"
    a = tta["algorithm"]
    lines = [
        "Model "
        f"`{Path(tta['model']).relative_to(ROOT) if Path(tta['model']).is_relative_to(ROOT) else tta['model']}`; "
        f"the `{a['recipe']}` recipe's algorithm: {a['prompts']} prompts × G = {a['group']}, "
        f"{a['length']} new tokens, lr {a['lr']:g}, clip ε = {a['epsilon']:g}, loss `{a['loss']}`, β "
        f"= {a['beta']:g}, μ = {a['mu']}. Held-out greedy accuracy on {tta['eval_size']} test "
        f"prompts every {tta['eval_every_seconds']:g} s of training time (evaluation time excluded), "
        f"same evaluation code for both; {tta.get('threads', '?')} torch thread(s) in both runs.",
        "",
        f"- TRL: {tta['trl_curve'][0][2]:.3f} → **{tta['target_accuracy']:.3f}** "
        f"after {tta['trl_seconds']:.0f} s ({tta['trl_curve'][-1][1]} optimiser "
        f"steps); first reached at {_f(tta['trl_first_reach_seconds'], '{:.0f}')} s.",
        f"- groupwise: reached {tta['target_accuracy']:.3f} at **{_f(tta['groupwise_reach_seconds'], '{:.0f} s')}** "
        f"({tta['groupwise_curve'][-1][1]} optimiser steps; final accuracy {tta['groupwise_final_accuracy']:.3f}).",
        f"- Time ratio (TRL's {tta['trl_seconds']:.0f} s / groupwise's time to the same accuracy): "
        f"**{_f(tta['time_ratio'], '{:.2f}×')}**; first-reach ratio {_f(tta['time_ratio_first_reach'], '{:.2f}×')} "
        f"(accuracy curves are noisy: a single run each, evaluated every {tta['eval_every_seconds']:g} s).",
        "- Optimiser steps per training second: groupwise "
        f"{_f(tta.get('groupwise_steps_per_s'), '{:.2f}')}, TRL {_f(tta.get('trl_steps_per_s'), '{:.2f}')} "
        "(same batch; completions end at EOS here, unlike the fixed-length matrix).",
        "",
        "| training s (TRL) | steps | accuracy | | training s (groupwise) | steps | accuracy |",
        "|---:|---:|---:|---|---:|---:|---:|",
    ]
    trl, gw = tta["trl_curve"], tta["groupwise_curve"]
    for i in range(max(len(trl), len(gw))):
        left = f"{trl[i][0]:.0f} | {trl[i][1]} | {trl[i][2]:.3f}" if i < len(trl) else " | | "
        right = f"{gw[i][0]:.0f} | {gw[i][1]} | {gw[i][2]:.3f}" if i < len(gw) else " | | "
        lines.append(f"| {left} | | {right} |")
    return "\n".join(lines)


def tta_seeded_section(result: dict[str, Any]) -> str:
    if "error" in result:
        return f"_Seeded time to accuracy failed: {result['error']} (see the worker logs)._"
    a = result["algorithm"]
    lines = [
        f"The `demo` recipe's algorithm ({a['prompts']} prompts × G = {a['group']}, {a['length']} new "
        f"tokens, lr {a['lr']:g}, loss `{a['loss']}`, β = {a['beta']:g}, μ = {a['mu']}) on the embedded "
        f"model, {result['seeds']} seeds per task (seed s seeds both frameworks). Per seed, TRL trains "
        f"{result['budget_seconds']:.0f} s (evaluated every {result['eval_every_seconds']:g} s); its "
        "held-out greedy accuracy at the end is that seed's target, and groupwise trains until an "
        f"evaluation (every {result['groupwise_eval_every_seconds']:g} s of training time) reaches it. "
        f"Ratio = TRL's {result['budget_seconds']:.0f} s / groupwise's time to the target; geometric "
        "mean over seeds with a 95 % t interval on the log ratios. Evaluation time is excluded; "
        f"{result['threads']} torch thread(s) in both.",
        "",
        "| task | held-out prompts | start accuracy | TRL accuracy at the budget | groupwise "
        "time to it (s) | ratio (TRL/gw) | per seed | optimiser steps/s gw / TRL | ≥ 3× |",
        "|---|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for task, s in result["summary"].items():
        acc, reach = s["trl_accuracy"], s["groupwise_reach_seconds"]
        per_seed = ", ".join(f"{r:.2f}" + ("*" if i in s["not_reached"] else "") for i, r in enumerate(s["ratios"]))
        steps = f"{statistics.mean(s['steps_per_s']['groupwise']):.2f} / {statistics.mean(s['steps_per_s']['trl']):.2f}"
        lo, hi = s["ratio_interval"]
        met = "yes" if lo >= 3.0 else ("no" if hi < 3.0 else "not resolved")
        lines.append(
            f"| {task} | {result['eval_sizes'][task]} | {s['trl_start_accuracy']:.3f} | {acc['mean']:.3f} "
            f"± {_f(acc['half'], '{:.3f}')} | {reach['mean']:.0f} ± {_f(reach['half'], '{:.0f}')} | "
            f"**{s['ratio_geomean']:.2f}×** [{lo:.2f}, {hi:.2f}] | {per_seed} | {steps} | {met} |"
        )
    lines += [
        "",
        "Per seed (`*`: groupwise did not reach the target within the budget; counted at the budget):",
        "",
        "| task | seed | TRL accuracy at the budget | TRL first at it (s) | "
        "groupwise reach (s) | ratio | first-reach ratio | groupwise accuracy then |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for task, per_seed in result["runs"].items():
        for r in per_seed:
            lines.append(
                f"| {task} | {r['seed']} | {r['target_accuracy']:.3f} | {_f(r['trl_first_reach_seconds'], '{:.0f}')} | "
                f"{_f(r['groupwise_reach_seconds'], '{:.0f}')} | {_f(r['time_ratio'], '{:.2f}×')} | "
                f"{_f(r['time_ratio_first_reach'], '{:.2f}×')} | {r['groupwise_final_accuracy']:.3f} |"
            )
    return "\n".join(lines)


def machine_section(info: dict[str, Any], flops: dict[str, float], command: str, wall: float | None) -> str:
    load = info.get("load_average_at_start")
    return "\n".join(
        [
            f"- CPU: {info['cpu']} ({info['logical_cores']} logical "
            f"cores, {info['cores_available']} available to the run)",
            f"- torch {info['torch']} with **torch threads = {info['torch_threads']}** "
            f"in every worker; transformers {info['transformers']}, TRL {info['trl']}, "
            f"accelerate {info['accelerate']}, Python {info['python']}",
            f"- fp32 GEMM (1024³ matmul, best of repeats, threads = {info['torch_threads']}): "
            f"{flops['used'] / 1e9:.1f} GFLOP/s (before the matrix {flops['before'] / 1e9:.1f}, "
            f"after {flops['after'] / 1e9:.1f}; the larger is used)",
            *(
                [
                    f"- bf16 GEMM (512³, threads = {info['torch_threads']}): {flops['bf16'] / 1e9:.1f} GFLOP/s"
                    + (
                        " — slower than fp32 on this CPU (no bf16 matrix units), so every run here is fp32"
                        if flops["bf16"] < flops["used"]
                        else ""
                    )
                ]
                if flops.get("bf16")
                else []
            ),
            *(
                [
                    "- peak RSS of a bare process (the floor under both frameworks' RSS column): `import "
                    f"torch` {floor['torch']:,.0f} MB; with transformers' modeling code, which every "
                    f"Hugging Face model load imports, {floor['torch_transformers_modeling']:,.0f} MB"
                ]
                if len(floor := info.get("import_floor_rss_mb") or {}) == 2
                else []
            ),
            f"- load average at start: {', '.join(f'{x:.2f}' for x in load) if load else 'n/a'}; date {info['date']}",
            f"- command: `{command}`" + (f"; total wall time {wall / 60:.1f} min" if wall else ""),
        ]
    )


def replace_between(text: str, name: str, body: str) -> str:
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    if begin not in text or end not in text:
        return text.rstrip() + f"\n\n{begin}\n{body}\n{end}\n"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def write_doc(path: Path, sections: dict[str, str]) -> None:
    """Replace each ``bench:<name>`` marker block of ``path`` (a new file starts from docs/performance.md)."""
    text = path.read_text() if path.exists() else (DOC.read_text() if DOC.exists() else "# Performance\n")
    for name, body in sections.items():
        text = replace_between(text, name, body)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def ablation_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| cell | variant | groupwise s/step (median) | vs default | generation s | peak RSS MB |",
        "|---|---|---:|---:|---:|---:|",
    ]
    base: dict[str, float] = {}
    for r in rows:
        if r["variant"] == ABLATIONS[0][0] and r.get("step_s"):
            base[r["cell"]] = r["step_s"]
    for r in rows:
        rel = r["step_s"] / base[r["cell"]] if r.get("step_s") and r["cell"] in base else None
        lines.append(
            f"| {r['cell']} | {r['variant']} | {_f(r.get('step_s'))} | {_f(rel, '{:.2f}×')} | "
            f"{_f(r.get('generation_s'))} | {_f(r.get('rss_mb'), '{:,.0f}')} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 2 small cells, 1 warm-up + 2 timed steps, 1 pair, 30 s time to accuracy",
    )
    parser.add_argument(
        "--cells",
        default="all",
        help="comma list of name substrings of matrix cells (e.g. tiny-4x8,small-64x8-L16) "
        "or ad-hoc cells preset:BxG:L[:loss[:beta[:mu]]]",
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=None,
        help="A/B pairs per cell (default 2, --quick 1); cells with max_pairs "
        "(all but the short-step ones) are capped at it unless --no-cap",
    )
    parser.add_argument("--no-cap", action="store_true", help="ignore the per-cell pair caps")
    parser.add_argument("--steps", type=int, default=None, help="override the timed steps of every cell")
    parser.add_argument("--warmup", type=int, default=None, help="override the warm-up steps of every cell")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads in every worker (default 0: torch's own default, "
        "one per core, as a user gets; 1 is steadier on a machine shared with other jobs)",
    )
    parser.add_argument(
        "--tta-model", type=Path, default=DEFAULT_TTA_MODEL, help="warm-started model folder for time to accuracy"
    )
    parser.add_argument(
        "--tta-seconds", type=float, default=None, help="TRL's training time budget (default 300, --quick 30)"
    )
    parser.add_argument(
        "--tta-eval-every",
        type=float,
        default=None,
        help="training seconds between evaluations (default 15, --quick 10)",
    )
    parser.add_argument(
        "--tta-eval-size", type=int, default=0, help="held-out prompts per evaluation (0 = the whole test split, 500)"
    )
    parser.add_argument(
        "--tta-threads",
        type=int,
        default=None,
        help="torch threads for both time-to-accuracy runs "
        "(default: the demo recipe's `threads` if it sets one above 0, else the workers' thread count)",
    )
    parser.add_argument("--skip-tta", action="store_true")
    parser.add_argument(
        "--tta-seeded",
        action="store_true",
        help="only the seeded time to accuracy: --tta-seeds seeds on each of "
        "--tta-tasks (not part of the default run: ~9 min per seed and task on 2 cores; `make bench-tta`)",
    )
    parser.add_argument("--tta-seeds", type=int, default=3)
    parser.add_argument(
        "--tta-tasks",
        default=",".join(TTA_TASKS),
        help="built-in tasks for --tta-seeded (rows with an 'answer' column)",
    )
    parser.add_argument(
        "--tta-gw-eval-every",
        type=float,
        default=5.0,
        help="groupwise's training seconds between evaluations in "
        "--tta-seeded (finer than TRL's: its reach time is what is measured)",
    )
    parser.add_argument("--skip-generation", action="store_true", help="skip the generation-alone throughput table")
    parser.add_argument("--generation-only", action="store_true", help="only the generation-alone throughput table")
    parser.add_argument(
        "--per-step",
        action="store_true",
        help="only the learning-per-step comparison: accuracy against optimiser "
        "steps for both frameworks over --per-step-seeds seeds (not part of the default run: ~15 min on 2 cores)",
    )
    parser.add_argument("--per-step-steps", type=int, default=500)
    parser.add_argument("--per-step-every", type=int, default=50)
    parser.add_argument("--per-step-seeds", type=int, default=3)
    parser.add_argument("--skip-matrix", action="store_true")
    parser.add_argument(
        "--bf16-cells",
        default=bf16.BF16_CELLS,
        help="cells also run with bf16 matrix products (rows ending -bf16) "
        "where the GEMM probe measures bf16 >= 1.3x faster (name substrings; 'none': no bf16 row)",
    )
    parser.add_argument(
        "--ablation",
        action="store_true",
        help=f"groupwise-only ablation of its optimisations on {ABLATION_CELLS} (or --cells)",
    )
    parser.add_argument(
        "--out-dir", type=Path, default=None, help="where results go (default bench/, --quick bench/runs/quick/)"
    )
    parser.add_argument(
        "--doc", type=Path, default=None, help="markdown file to update (default docs/performance.md; --quick: none)"
    )
    args = parser.parse_args(argv)

    if args.threads < 0:
        parser.error(f"--threads must be 0 (torch's default) or more, got {args.threads}")
    started = time.perf_counter()
    pairs = args.pairs or (1 if args.quick else 2)
    out_dir = args.out_dir or (RUNS / "quick" if args.quick else BENCH)
    doc = args.doc if args.doc is not None else (None if args.quick else DOC)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    rundir = RUNS / stamp
    rundir.mkdir(parents=True, exist_ok=True)
    command = "python bench/run.py " + " ".join(argv if argv is not None else sys.argv[1:])

    if args.ablation:
        pool = matrix()
        cells = select(pool, args.cells if args.cells != "all" else ABLATION_CELLS)
        cells = [c for c in cells if (c.loss, c.beta, c.mu) == ("dapo", 0.0, 1)]
    else:
        pool = quick_matrix() if args.quick else matrix()
        tokens = [t.strip() for t in args.cells.split(",") if t.strip()]
        specs, patterns = [t for t in tokens if ":" in t], [t for t in tokens if ":" not in t]
        cells = select(pool, ",".join(patterns)) if patterns else ([] if specs else list(pool))
        cells += [parse_cell(s) for s in specs]
    if args.steps is not None or args.warmup is not None:
        cells = [
            replace(
                c,
                steps=args.steps if args.steps is not None else c.steps,
                warmup=args.warmup if args.warmup is not None else c.warmup,
            )
            for c in cells
        ]

    import importlib.util

    missing = [
        m for m in ("trl", "accelerate", "datasets") if importlib.util.find_spec(m) is None and not args.ablation
    ]
    if missing:
        parser.error(f"missing {', '.join(missing)}: pip install -e '.[bench]' (TRL 1.16)")

    import torch  # after argument parsing: --help stays fast

    threads = args.threads or torch.get_num_threads()  # torch's default: one thread per core (or OMP_NUM_THREADS)

    from build_models import build

    info = machine(threads)
    info["date"] = _dt.datetime.now().isoformat(timespec="seconds")
    log(
        f"{info['cpu']}, {info['cores_available']} cores available, {threads} torch threads per worker; "
        f"torch {info['torch']}, transformers {info['transformers']}, TRL {info['trl']}"
    )
    log(
        "TRL settings made explicit (its defaults are wrong for this CPU comparison): "
        "bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True, learning_rate=<cell "
        "lr>, lr_scheduler_type=constant, adam_beta2=0.99, use_bias_correction_kl=False; "
        "logging/saving/eval off, dataloader_num_workers=0 (the -bf16 rows: bf16=True)"
    )
    if args.tta_seeded:
        result = seeded_time_to_accuracy(
            args.tta_model.resolve(),
            [t.strip() for t in args.tta_tasks.split(",") if t.strip()],
            args.tta_seeds,
            args.tta_seconds or 300.0,
            args.tta_eval_every or 15.0,
            args.tta_gw_eval_every,
            args.tta_eval_size,
            args.tta_threads or recipe_threads("demo") or threads,
            rundir,
        )
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "tta_seeded.json").write_text(json.dumps(result, indent=1) + "\n")
        log("seeded time to accuracy:\n" + tta_seeded_section(result))
        if doc is not None:
            write_doc(doc, {"tta-seeded": tta_seeded_section(result) + f"\n\n_{command}; {info['date']}_"})
        return 0
    if args.per_step:
        result = learning_per_step(
            args.tta_model.resolve(),
            args.per_step_steps,
            args.per_step_every,
            args.per_step_seeds,
            args.tta_eval_size,
            args.tta_threads or threads,
            rundir,
        )
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "per_step.json").write_text(json.dumps(result, indent=1) + "\n")
        log("learning per step:\n" + per_step_section(result))
        if doc is not None:
            write_doc(
                doc,
                {"per-step": per_step_section(result) + f"\n\n_{command}; {threads} torch thread(s); {info['date']}_"},
            )
            log(f"wrote {doc}")
        return 0

    if args.generation_only:
        result = generation_throughput(threads, rundir, length=16 if args.quick else 64, reps=1 if args.quick else 3)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "generation.json").write_text(json.dumps(result, indent=1) + "\n")
        log("generation alone:\n" + generation_section(result))
        if doc is not None:
            write_doc(doc, {"generation": generation_section(result) + f"\n\n_{command}; {info['date']}_"})
            log(f"wrote {doc}")
        return 0
    for preset in sorted({c.preset for c in cells}):
        build(preset)
    bf16_decision = None  # the bf16 rows: only where this CPU's bf16 GEMM measures faster (bench/bf16.py)
    twins = [] if args.ablation or args.skip_matrix else bf16.bf16_cells(cells, args.bf16_cells)
    if twins:
        bf16_decision = bf16.probe(
            {p: json.loads((BENCH / "models" / p / "config.json").read_text()) for p in {c.preset for c in twins}},
            threads,
        )
        log(
            f"bf16 probe: {bf16_decision['reason']}"
            + (f"; bf16 rows: {', '.join(c.name for c in twins)}" if bf16_decision["on"] else "")
        )
        cells += twins if bf16_decision["on"] else []
    flops_before = gemm_flops(threads)
    log(f"fp32 GEMM: {flops_before / 1e9:.1f} GFLOP/s at {threads} threads")

    entries: list[dict[str, Any]] = []
    ablation_rows: list[dict[str, Any]] = []
    if not args.skip_matrix and cells:
        pairs_of = {c.name: (min(pairs, c.max_pairs) if c.max_pairs and not args.no_cap else pairs) for c in cells}
        if args.ablation:
            for index, (variant, env) in enumerate(ABLATIONS):
                log(f"ablation: {variant}")
                rounds = measure_cells(cells, pairs_of, threads, rundir, ("groupwise",), env, tag=f"-ablation{index}")
                for cell in cells:
                    ok = [r["groupwise"] for r in rounds[cell.name] if "error" not in r["groupwise"]]
                    ablation_rows.append(
                        {
                            "cell": cell.name,
                            "variant": variant,
                            "env": env,
                            "step_s": _median([statistics.median(r["step_seconds"]) for r in ok]),
                            "generation_s": _median([statistics.median(r["generation_seconds"]) for r in ok]),
                            "rss_mb": _median([r["peak_rss_mb"] for r in ok]),
                            "raw": [r["step_seconds"] for r in ok],
                        }
                    )
            ablation_rows.sort(key=lambda row: [c.name for c in cells].index(row["cell"]))
        else:
            workers = len(worker_groups(cells, pairs_of)) * 2
            log(
                f"{len(cells)} cells, {workers} worker processes (up to {pairs} "
                "A/B pairs per cell; one process per framework and round): "
                + ", ".join(f"{c.name} ({c.warmup}+{c.steps} steps, {pairs_of[c.name]} pair(s))" for c in cells)
            )
            rounds = measure_cells(cells, pairs_of, threads, rundir)
            entries = [{"rounds": rounds[cell.name], "cell": cell} for cell in cells]
    floors: dict[str, float] = {}
    if entries:
        floors = gemm_floors(
            [e["cell"] for e in entries],
            {
                p: json.loads((BENCH / "models" / p / "config.json").read_text())
                for p in {e["cell"].preset for e in entries}
            },
            prompt_tokens(),
            threads,
        )
        log(
            "GEMM floors (weight products alone, s/step): "
            + ", ".join(f"{name} {sec:.3g}" for name, sec in floors.items())
        )
    flops_after = gemm_flops(threads)
    # bf16 matmuls are a speed lever only where the CPU has bf16 units (AMX, AVX512-BF16): measure, do not assume
    flops = {
        "before": flops_before,
        "after": flops_after,
        "used": max(flops_before, flops_after),
        "bf16": gemm_flops(threads, n=512, seconds=1.0, dtype="bfloat16"),
    }
    summaries = [
        summarize(
            e["cell"],
            e["rounds"],
            flops["bf16"] if e["cell"].matmul == "bfloat16" else flops["used"],
            threads,
            floors.get(e["cell"].name),
        )
        for e in entries
    ]
    for s in summaries:
        log(
            f"{s['cell']}: groupwise {_f(s.get('groupwise_step_s'))} s/step, TRL {_f(s.get('trl_step_s'))} s/step, "
            f"speed-up {_f(s.get('ratio'), '{:.2f}x')}"
        )

    gen = None
    if not args.skip_generation and not args.ablation:
        gen = generation_throughput(threads, rundir, length=16 if args.quick else 64, reps=1 if args.quick else 3)

    tta = None
    if not args.skip_tta and not args.ablation:
        if (args.tta_model / "config.json").exists():
            tta_threads = args.tta_threads or recipe_threads("demo") or threads
            tta = time_to_accuracy(
                args.tta_model.resolve(),
                args.tta_seconds or (30.0 if args.quick else 300.0),
                args.tta_eval_every or (10.0 if args.quick else 15.0),
                args.tta_eval_size,
                tta_threads,
                rundir,
            )
        else:
            log(f"time to accuracy skipped: no model at {args.tta_model} (pass --tta-model DIR)")
            tta = {"error": f"no warm-started model at {args.tta_model}"}

    wall = time.perf_counter() - started
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.ablation:
        (out_dir / "ablation.json").write_text(json.dumps(ablation_rows, indent=1) + "\n")
        log("ablation:\n" + ablation_table(ablation_rows))
    else:
        if summaries:
            (out_dir / RESULTS.name).write_text(json.dumps(summaries, indent=1) + "\n")
        (out_dir / "run_info.json").write_text(
            json.dumps(
                {
                    "machine": info,
                    "gemm_flops": flops,
                    "command": command,
                    "wall_seconds": wall,
                    "rundir": str(rundir),
                    "tta": tta,
                    "generation": gen,
                    "bf16": bf16_decision,
                },
                indent=1,
            )
            + "\n"
        )
        if summaries:
            log("results:\n" + results_table(summaries))
        if tta:
            log("time to accuracy:\n" + tta_section(tta))
    sections: dict[str, str] = {}
    if args.ablation:
        sections["ablation"] = ablation_table(ablation_rows) + f"\n\n_{command}; threads = {threads}; {info['date']}_"
    else:
        sections["machine"] = machine_section(info, flops, command, wall)
        if summaries:
            note = (
                bf16.present_note(bf16_decision)
                if bf16_decision and bf16_decision["on"]
                else bf16.absent_note(bf16_decision)
            )
            sections["results"] = results_table(summaries) + f"\n\n{note}"
        if tta is not None:
            sections["tta"] = tta_section(tta)
        if gen is not None:
            sections["generation"] = generation_section(gen)
    if doc is not None:
        write_doc(doc, sections)
        log(f"wrote {doc}")
    else:
        quick_doc = out_dir / "performance.md"
        write_doc(quick_doc, sections)
        log(f"wrote {quick_doc} (docs/performance.md untouched)")
    log(f"done in {wall / 60:.1f} min; raw results and logs in {rundir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
