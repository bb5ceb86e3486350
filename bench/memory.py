"""Peak resident memory of each phase of a groupwise step: collection (generation, scoring) and the
update (forward/backward/optimiser), for one bench cell and any ``key=value`` overrides.

    python bench/memory.py small:64x8:128 [perf.recompute_mlp=true perf.keep_freed_memory=false ...]

Each phase starts a new Linux peak-RSS window (``common.reset_peak_rss``); the line per step gives the
resident MB before the phase, its peak and what stays resident after it (glibc keeps freed blocks
while ``perf.keep_freed_memory`` is on, so "after" can equal the peak).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MODELS, parse_cell, peak_rss_mb, reset_peak_rss, rss_mb  # noqa: E402


def main(argv: list[str]) -> int:
    if not argv or ":" not in argv[0]:
        raise SystemExit(__doc__)
    import torch
    from worker import groupwise_overrides, groupwise_trainer

    cell, overrides, steps = parse_cell(argv[0]), argv[1:], 2
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as out:
        trainer = groupwise_trainer(
            groupwise_overrides(
                model=str(MODELS / cell.preset),
                threads=threads,
                out=out,
                prompts=cell.prompts,
                group=cell.group,
                length=cell.length,
                loss=cell.loss,
                beta=cell.beta,
                mu=cell.mu,
                lr=cell.lr,
                epsilon=cell.epsilon,
                micro_groups=cell.micro,
                steps=steps,
            )
            + overrides
        )
        print(f"{cell.name} {' '.join(overrides) or '(defaults)'}: built, resident {rss_mb():,.0f} MB")
        marks: dict[str, tuple[float, float, float]] = {}

        def windowed(name: str, phase):
            def run(*args, **kwargs):
                reset_peak_rss()
                before = rss_mb()
                result = phase(*args, **kwargs)
                marks[name] = (before, peak_rss_mb(), rss_mb())
                return result

            return run

        trainer.collect, trainer.update = windowed("collect", trainer.collect), windowed("update", trainer.update)
        for step in range(steps):
            start = time.perf_counter()
            trainer.run_step()
            trainer.step += 1
            phases = "; ".join(f"{name} {a:,.0f} -> peak {b:,.0f} -> {c:,.0f} MB" for name, (a, b, c) in marks.items())
            print(f"step {step}: {time.perf_counter() - start:.1f} s; {phases}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
