"""GRPO learns: on the embedded model and the addition task, a short seeded run (well under 60 s
on 2 cores) raises both the training reward and held-out greedy accuracy."""

import json

from groupwise.build import build
from groupwise.config import load_config
from groupwise.run import Run
from groupwise.trainer import Trainer


def test_reward_rises_on_addition(tmp_path):
    cfg, _ = load_config("demo", ["train.steps=80", "eval.size=300", "train.max_seconds=60", f'out="{tmp_path}"'])
    summary = Run(Trainer(build(cfg))).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    third = len(rows) // 3
    early = sum(r["reward_mean"] for r in rows[:third]) / third
    late = sum(r["reward_mean"] for r in rows[-third:]) / third
    print(
        f"reward {early:.3f} -> {late:.3f}; held-out accuracy {summary['accuracy_before']:.3f} "
        f"-> {summary['accuracy_after']:.3f} in {summary['wall_seconds']:.0f} s"
    )
    assert late > early + 0.05
    assert summary["accuracy_after"] > summary["accuracy_before"] + 0.05
