"""Memory and step time of data parallelism (``dist.shard="none"``) against FSDP2 (``"fsdp2"``) at
world size 2 (issue 38; the table in ``docs/scaling.md``).

``python bench/scaling.py [--preset medium] [--steps 4]`` builds ``bench/models/<preset>`` (the
benchmark's random-init model, ``build_models.py``), then for each mode launches
``torchrun --standalone --nproc_per_node 2 bench/scaling.py --worker ...``: every rank trains
``--steps`` GRPO steps with AdamW and records, after its last optimiser step (the moment the
gradients and both Adam moments all exist), the bytes it holds of parameters, gradients and
optimiser state (each tensor's local storage: a shard under FSDP2), its process peak RSS and the
median step time after the first. The result is written to ``bench/scaling.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def worker(model: str, mode: str, steps: int, out: Path) -> None:
    import torch
    from common import peak_rss_mb

    from groupwise import dist
    from groupwise.build import build
    from groupwise.config import load_config
    from groupwise.dist import local
    from groupwise.trainer import Trainer

    overrides = [
        f'model.path="{model}"',
        f'dist.shard="{mode}"',
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=32",
        "eval.size=0",
        "threads=1",
        'update={name="adamw", lr=1e-5, max_grad_norm=1.0}',
    ]
    trainer = Trainer(build(load_config(None, overrides)[0]))
    seconds = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.run_step()
        trainer.step += 1
        seconds.append(time.perf_counter() - t0)

    def nbytes(tensors) -> int:
        """Bytes of the distinct storages under ``tensors`` (FSDP2's gradient shards can be views of one
        reduce-scatter buffer: counted once)."""
        storages = {}
        for t in tensors:
            if t is not None:
                storage = local(t).untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    params = trainer.params
    optimizer = trainer.updater.torch_optim()
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    record = {
        "mode": mode,
        "rank": int(os.environ.get("RANK", 0)),
        "world": dist.world_size(),
        "parameters": sum(p.numel() for p in params),
        "param_bytes": nbytes(params),
        "grad_bytes": nbytes(p.grad for p in params),
        "optimizer_bytes": nbytes(states),
        "peak_rss_mb": peak_rss_mb(),
        "step_seconds": seconds,
        "median_step_seconds": statistics.median(seconds[1:] or seconds),
    }
    (out / f"{mode}_rank{record['rank']}.json").write_text(json.dumps(record, indent=1))
    dist.shutdown()


def activation_cost(model_dir: Path, rows: int, length: int, repeats: int) -> list[dict]:
    """Time of one training forward + backward (the packed forward, functional and the model's own) and
    the bytes autograd keeps for the backward, with and without ``perf.activation_checkpointing``."""
    import torch

    from groupwise.policy.forward import completion_logprobs
    from groupwise.policy.lm import load_policy

    torch.set_num_threads(1)
    model, _ = load_policy(str(model_dir))
    gen = torch.Generator().manual_seed(0)
    prompts = [[5, 17, 33, 2]] * (rows // 8)  # groups of 8 rows, full-length completions
    actions = torch.randint(1, 300, (rows // 8, 8, length), generator=gen)  # [B,G,T]
    mask = torch.ones(rows // 8, 8, length, dtype=torch.bool)  # [B,G,T]
    valid = torch.ones(rows // 8, 8, dtype=torch.bool)  # [B,G]
    out = []
    for functional in (True, False):
        for checkpoint_layers in (False, True):
            kept: dict[int, int] = {}

            def pack(t, kept=kept):
                kept.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                return t

            seconds = []
            for _ in range(repeats):
                kept.clear()
                model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    logp = completion_logprobs(
                        model, prompts, actions, mask, valid, functional=functional, checkpoint_layers=checkpoint_layers
                    )["logp"]  # [B,G,T]
                logp.sum().backward()
                seconds.append(time.perf_counter() - t0)
            out.append(
                {
                    "functional": functional,
                    "activation_checkpointing": checkpoint_layers,
                    "rows": rows,
                    "completion_tokens": length,
                    "saved_for_backward_mb": sum(kept.values()) / 2**20,
                    "median_seconds": statistics.median(seconds[1:] or seconds),
                }
            )
            print(out[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=str(HERE / "scaling.json"))
    parser.add_argument("--worker", nargs=4, metavar=("MODEL", "MODE", "STEPS", "DIR"))
    parser.add_argument("--skip-dist", action="store_true", help="only the activation checkpointing measurement")
    parser.add_argument("--skip-activation", action="store_true", help="keep --out's activation measurement")
    args = parser.parse_args()
    if args.worker:
        model, mode, steps, out = args.worker
        worker(model, mode, int(steps), Path(out))
        return
    from build_models import build

    model = build(args.preset)
    activation = (
        json.loads(Path(args.out).read_text())["activation"]
        if args.skip_activation
        else activation_cost(model, rows=32, length=64, repeats=3)
    )
    runs = HERE / "runs" / "scaling"
    runs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    results = []
    for mode in () if args.skip_dist else ("none", "fsdp2"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__]
        subprocess.run([*cmd, "--worker", str(model), mode, str(args.steps), str(runs)], check=True, env=env)
        results += [json.loads((runs / f"{mode}_rank{r}.json").read_text()) for r in (0, 1)]
    Path(args.out).write_text(
        json.dumps({"preset": args.preset, "steps": args.steps, "ranks": results, "activation": activation}, indent=1)
        + "\n"
    )
    for r in results:
        total = (r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]) / 2**20
        print(
            f"{r['mode']:>5} rank {r['rank']}: params {r['param_bytes'] / 2**20:.1f} MiB, "
            f"grads {r['grad_bytes'] / 2**20:.1f}, "
            f"optimiser {r['optimizer_bytes'] / 2**20:.1f}, total {total:.1f} MiB; peak RSS {r['peak_rss_mb']:.0f} MB; "
            f"step {r['median_step_seconds']:.2f} s"
        )


if __name__ == "__main__":
    main()
