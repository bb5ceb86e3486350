"""Driver for tests/test_fsdp.py (run under torchrun): builds a run with ``dist.shard="fsdp2"`` from the
overrides on the command line, trains ``train.steps`` steps with the step's own methods, and writes
what the test checks to ``OUT/rank<r>.json``: whether every trained parameter is a shard, the share of
the whole model this rank holds, how often the whole weights were gathered, whether the gathered copy
was empty again after each step, and the whole weights after training (rank 0, ``OUT/final.pt``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from groupwise import dist
from groupwise.build import build
from groupwise.config import load_config
from groupwise.trainer import Trainer


def main(out: str, overrides: list[str]) -> None:
    trainer = Trainer(build(load_config(None, overrides)[0]))
    policy = trainer.policy
    params = policy.parameters()
    record = {
        "world": dist.world_size(),
        "gathers_at_start": policy.full.gathers,
        "all_sharded": all(dist.is_sharded(p) for p in params),
        "local_elements": sum(dist.local(p).numel() for p in params),
        "shapes": [list(p.shape) for p in params],  # the whole parameters' shapes
        "gathers_after_step": [],
        "copy_elements_after_step": [],
        "rows": [],
    }
    for _ in range(trainer.cfg.train.steps):
        record["rows"].append(trainer.run_step())
        trainer.step += 1
        record["gathers_after_step"].append(policy.full.gathers)
        # the step freed the gathered copy before its update (policy.train())
        record["copy_elements_after_step"].append(sum(p.numel() for p in policy.full.module.parameters()))
    whole = policy.whole().state_dict()  # gathered: a collective
    rank = torch.distributed.get_rank()
    if rank == 0:
        torch.save({k: v.clone() for k, v in whole.items()}, Path(out) / "final.pt")
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))
    dist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
