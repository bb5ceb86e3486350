"""Asynchronous training against today's synchronous step (issue 39): time to the demo's accuracy and
accuracy per optimiser step for ``train.max_staleness`` k in {0, 1, 2, 4} on a generation server.

Configurations (the ``demo`` recipe's algorithm, 2 cores):

- ``local``: today's run, ``rollout.backend = "local"``, 2 torch threads in the trainer (``local-1t``: 1);
- ``k=K``: ``rollout.backend = "server"``, a local ``groupwise serve`` process with 1 thread and a
  trainer with 1 thread, ``train.max_staleness = K`` (k = 0: the served synchronous step).

Each run trains ``--steps`` steps; every ``--every`` steps the weights are copied (the copy's time is
not training time); afterwards each copy is evaluated (held-out greedy accuracy on ``--eval-size``
test prompts) with the trainer's own engine, off the clock. Training time counts every step's wall
time, step 0 included (it starts the local server in the served configurations: that start is also
reported alone, ``server_start_s``). Results: ``bench/async_tta.json``; ``--markdown`` prints the
tables for docs/performance.md.

    OMP_NUM_THREADS=1 python bench/async_tta.py --seeds 0 1 2 --steps 400 --every 50
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

CONFIGS = {
    "local": ["threads=2"],
    "local-1t": ["threads=1"],  # the synchronous step with one thread: k=0's numbers, without a server
    "k=0": ["threads=1", 'rollout.backend="server"', "train.max_staleness=0"],
    "k=1": ["threads=1", 'rollout.backend="server"', "train.max_staleness=1"],
    "k=2": ["threads=1", 'rollout.backend="server"', "train.max_staleness=2"],
    "k=4": ["threads=1", 'rollout.backend="server"', "train.max_staleness=4"],
    # a diagnostic: k = 1 without the sampler/trainer correction (sampler_is with mode "none": weight 1)
    "k=1-noIS": [
        "threads=1",
        'rollout.backend="server"',
        "train.max_staleness=1",
        'objective.weights=[{name="sampler_is", mode="none"}]',
    ],
}
OUT = Path(__file__).resolve().parent / "async_tta.json"


def run(config: str, seed: int, steps: int, every: int, eval_size: int) -> dict:
    from groupwise.build import build
    from groupwise.config import load_config
    from groupwise.heldout import HeldOut
    from groupwise.trainer import Trainer

    cfg, _ = load_config("demo", [f"seed={seed}", f"train.steps={steps}", f"eval.size={eval_size}", *CONFIGS[config]])
    trainer = Trainer(build(cfg))
    snapshots, clock, server_start = [(0, 0.0, _copy(trainer))], 0.0, 0.0
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            row = trainer.run_step()
            clock += time.perf_counter() - t0
            server_start += row.get("serve/start_seconds", 0.0)
            trainer.step += 1
            if trainer.step % every == 0:
                snapshots.append((trainer.step, clock, _copy(trainer)))
                print(f"  {config} seed {seed}: step {trainer.step}, {clock:.1f} s", flush=True)
    finally:
        if hasattr(trainer.generation, "close"):
            trainer.generation.close()
    heldout, points = HeldOut(trainer), []
    for step, seconds, state in snapshots:
        trainer.policy.module.load_state_dict(state)
        points.append({"step": step, "train_s": seconds, "accuracy": heldout.evaluate()})
    return {"config": config, "seed": seed, "server_start_s": server_start, "points": points}


def _copy(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.policy.module.state_dict().items()}


def _mean_ci(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}" if values else "–"
    mean, sd = statistics.mean(values), statistics.stdev(values)
    t = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776}.get(len(values), 2.0)
    return f"{mean:.3f} ± {t * sd / math.sqrt(len(values)):.3f}"


def markdown(results: list[dict], target: float) -> str:
    configs = [c for c in CONFIGS if any(r["config"] == c for r in results)]
    seeds = sorted({r["seed"] for r in results})
    lines = [
        f"Target: held-out greedy accuracy ≥ {target} (first evaluation point at or above it); seeds {seeds}; "
        "training seconds include step 0 (and the local server's start in the served rows; its start alone in "
        "the last column).",
        "",
        "| configuration | time to target (s), per seed | steps to target, per seed | final accuracy "
        "| server start (s) |",
        "|---|---|---|---|---|",
    ]
    for c in configs:
        runs = [r for r in results if r["config"] == c]
        times, steps = [], []
        for r in runs:
            hit = next((p for p in r["points"] if p["accuracy"] >= target), None)
            times.append(f"{hit['train_s']:.0f}" if hit else f">{r['points'][-1]['train_s']:.0f}")
            steps.append(str(hit["step"]) if hit else f">{r['points'][-1]['step']}")
        final = _mean_ci([r["points"][-1]["accuracy"] for r in runs])
        start = statistics.mean(r["server_start_s"] for r in runs)
        lines.append(f"| {c} | {', '.join(times)} | {', '.join(steps)} | {final} | {start:.1f} |")
    lines += ["", "Accuracy per optimiser step (mean ± 95 % t half-width over seeds):", ""]
    marks = [p["step"] for p in results[0]["points"]]
    lines.append("| steps | " + " | ".join(configs) + " |")
    lines.append("|---:|" + "---:|" * len(configs))
    for i, step in enumerate(marks):
        cells = [_mean_ci([r["points"][i]["accuracy"] for r in results if r["config"] == c]) for c in configs]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    lines += ["", "Training seconds at each evaluation point (mean over seeds):", ""]
    lines.append("| steps | " + " | ".join(configs) + " |")
    lines.append("|---:|" + "---:|" * len(configs))
    for i, step in enumerate(marks):
        cells = [
            f"{statistics.mean(r['points'][i]['train_s'] for r in results if r['config'] == c):.1f}" for c in configs
        ]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--seeds", nargs="*", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--target", type=float, default=0.75)
    parser.add_argument("--markdown", action="store_true", help="print the tables of the results file")
    parser.add_argument("--out", type=Path, default=OUT, help="the results file (default bench/async_tta.json)")
    args = parser.parse_args()
    out = args.out
    results = json.loads(out.read_text()) if out.exists() else []
    if args.markdown:
        print(markdown(results, args.target))
        return
    torch.set_num_threads(1)
    for seed in args.seeds:  # seeds outside: an interrupted sweep still has every configuration of a seed
        for config in args.configs:
            result = run(config, seed, args.steps, args.every, args.eval_size)
            results = json.loads(out.read_text()) if out.exists() else []  # another sweep may have added to it
            results = [r for r in results if (r["config"], r["seed"]) != (config, seed)] + [result]
            out.write_text(json.dumps(results, indent=1))
            last = result["points"][-1]
            print(f"{config} seed {seed}: {last['train_s']:.1f} s, accuracy {last['accuracy']:.3f}", flush=True)


if __name__ == "__main__":
    main()
