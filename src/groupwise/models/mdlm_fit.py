"""Fit the shipped masked-diffusion model ``models/mdlm_sum_pairs`` (``python -m groupwise.models.mdlm_fit``).

The ``mdlm`` kind (``modalities/mdlm.py``) is fitted by the ``sft`` phase's demonstration path (its
``supervised_loss``: the masked-diffusion objective) on the ``sum_pairs`` train rows, and stops at
the first check whose greedy accuracy on a validation slice of the train split (never trained on)
reaches ``--target-accuracy``: a partly right model, as the embedded LM is, leaves RL room to
improve (design ``nontext.md`` §3 54: "the fitted model must be partly right (20–40 %)"). The test
split is read only for the final measurement. The record (arguments, history, test accuracy, wall
time) is ``fit.json`` beside the weights.

**Defaults** (all [INFERRED]): the kind's architecture (2 × 64, L = 8, S = 8), ``allowed`` = the
digits and "+", batch 64, AdamW lr 1e-3 (warm-up 50 steps), a check every 25 steps on 200
validation rows, ``--target-accuracy 0.3``, at most 4000 steps, seed 0.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

from groupwise.modalities.mdlm import MDLMPolicy
from groupwise.phases.sft import SFT
from groupwise.tasks.sum_pairs import check_pair, rows
from groupwise.types import Request, StepInfo

HERE = Path(__file__).parent / "mdlm_sum_pairs"


def greedy_accuracy(policy: MDLMPolicy, data: list[dict], batch: int = 100) -> float:
    """The share of rows whose greedy canvas is a right ``a+b``."""
    right = 0.0
    for start in range(0, len(data), batch):
        part = data[start : start + batch]
        requests = [Request(key=i, n=1, prompt=r["prompt"]) for i, r in enumerate(part)]
        out = policy.generate(requests, {"greedy": True}, StepInfo(step=0, seed=0, max_new_tokens=0))
        right += sum(check_pair(c[0], r["target"]) for c, r in zip(out.completions, part))
    return right / max(1, len(data))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--target-accuracy", type=float, default=0.3)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--val-size", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    policy = MDLMPolicy(allowed="0123456789+", init_seed=args.seed)
    train = rows("train", 0, args.seed)
    random.Random(args.seed).shuffle(train)
    val, train = train[: args.val_size], train[args.val_size :]
    phase = SFT(
        steps=args.steps,
        batch_size=64,
        target_accuracy=args.target_accuracy,
        eval_every=25,
        fine_eval_every=25,
        update={"name": "adamw", "lr": 1e-3, "warmup_steps": 50, "max_grad_norm": 1.0},
    )
    start = time.time()
    result = phase.fit(
        policy,
        train,
        val,
        args.seed,
        lambda split, r, i: policy.encode(r[i]["prompt"]),
        lambda pol, r, split: greedy_accuracy(pol, r),
    )
    seconds = time.time() - start
    test = greedy_accuracy(policy, rows("test", 0))
    policy.save(args.out)
    record = {
        "command": "python -m groupwise.models.mdlm_fit " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": vars(args),
        "config": policy.config,
        "steps": result["steps"],
        "val_accuracy": result["val_accuracy"],
        "test_greedy_accuracy": test,
        "seconds": round(seconds, 1),
        "history": result["history"],
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    (Path(args.out) / "fit.json").write_text(json.dumps(record, indent=1) + "\n")
    print(
        f"mdlm_sum_pairs: {result['steps']} steps, val {result['val_accuracy']:.3f}, test {test:.3f}, {seconds:.0f} s"
    )
    return record


if __name__ == "__main__":
    main()
