"""Golden values of the flow toy's shipped recipes and claim arms (issue 37, "done means": the
generalisation of the non-text policies must leave every existing flow number bit-identical).

Recorded on main at 257dc2a (before issue 37's changes), 3 RL steps of 4 prompts each, eval on 8
held-out labels: per step the loss, grad norm, mean reward and mean ratio, then the summed final
weights and the held-out accuracy after training. A change that moves any of them by one ulp fails.
Regenerate only for a change that is meant to move the flow toy's numbers (say so in its commit):
``PYTHONPATH=$PWD/src python tests/test_flow_golden.py``.
"""

from __future__ import annotations

import json
import sys

import pytest

from groupwise.build import build
from groupwise.config import load_config
from groupwise.run import Run
from groupwise.trainer import Trainer

# recipe, overrides: every flow recipe, and the claim arms that change the sampler or the terms
CASES = {
    "flash_grpo": ("flash_grpo", []),
    "flash_grpo_all": ("flash_grpo", ['model.params.sde="all"', "objective.weights=[]"]),
    "flash_grpo_per_row": ("flash_grpo", ['model.params.sde="one_per_row"']),
    "e2po_flow": ("e2po_flow", ['phases=[{name="e2po_perturbations", conditions=4, steps=5}]']),
    "alphagrpo_flow": ("alphagrpo_flow", []),
    "alphagrpo_unified": ("alphagrpo_unified", []),
    "slas": ("slas", []),
}
COMMON = ["train.steps=3", "eval.size=8", "rollout.prompts_per_step=4"]


def measure(name: str, out) -> dict:
    recipe, overrides = CASES[name]
    cfg, _ = load_config(recipe, [f'out="{out}"', *COMMON, *overrides])
    trainer = Trainer(build(cfg))
    summary = Run(trainer).train()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    state = trainer.policy.state_dict()
    weights = sum(float(v.double().sum()) for v in state["net"].values())
    if "think" in state:  # the unified policy's think LM
        weights += sum(float(v.double().sum()) for v in state["think"].values())
    return {
        "steps": [[r["loss"], r["grad_norm"], r["reward_mean"], r["ratio"]] for r in rows],
        "weights": weights,
        "accuracy_after": summary["accuracy_after"],
    }


GOLDEN = {
    "flash_grpo": {
        "steps": [
            [-1.862645149230957e-09, 0.0338543436002088, 0.03125, 1.0],
            [7.450580596923828e-09, 0.0900652723294399, 0.0625, 1.0],
            [-7.450580596923828e-09, 0.0973678106207297, 0.078125, 1.0],
        ],
        "weights": 10.435780088392681,
        "accuracy_after": 0.0,
    },
    "flash_grpo_all": {
        "steps": [
            [4.0978193283081055e-08, 0.08140308504044069, 0.046875, 1.0],
            [2.2351741790771484e-08, 0.03511176273253484, 0.0625, 1.0],
            [2.60770320892334e-08, 0.10732876397066593, 0.0625, 1.0],
        ],
        "weights": 10.034420343538319,
        "accuracy_after": 0.0,
    },
    "flash_grpo_per_row": {
        "steps": [
            [0.012143300846219063, 0.09719982750477164, 0.015625, 1.0],
            [0.017158836126327515, 0.032608320172631565, 0.046875, 1.0],
            [-0.050530970096588135, 0.11154609411847123, 0.0625, 1.0],
        ],
        "weights": 10.097736909510191,
        "accuracy_after": 0.0,
    },
    "e2po_flow": {
        "steps": [
            [-9.313225746154785e-10, 0.10602657580003162, 0.0078125, 1.0],
            [5.587935447692871e-09, 0.18892531580858132, 0.0390625, 1.0],
            [0.0, 0.12089543529602936, 0.0390625, 1.0],
        ],
        "weights": 7.004589489647152,
        "accuracy_after": 0.0,
    },
    "alphagrpo_flow": {
        "steps": [
            [-3.725290298461914e-09, 0.07687529548697171, 0.6262251301668584, 1.0],
            [1.862645149230957e-09, 0.12416807614540804, 0.6164277938078158, 1.0],
            [3.725290298461914e-09, 0.09062717330749698, 0.6272884919308126, 1.0],
        ],
        "weights": 42.56274674110099,
        "accuracy_after": 0.125,
    },
    "alphagrpo_unified": {
        "steps": [
            [-1.4901161193847656e-08, 0.12528908392043286, 0.6177414683625102, 1.0],
            [-3.725290298461914e-09, 0.1525656730292659, 0.5925210280693136, 1.0],
            [1.862645149230957e-09, 0.1317477718163414, 0.63035344844684, 1.0],
        ],
        "weights": 61.9112549494058,
        "accuracy_after": 0.125,
    },
    "slas": {
        "steps": [
            [-0.32885026931762695, 0.22731326034382743, 0.046875, 1.0],
            [-0.2813769578933716, 0.10140429063255155, 0.0625, 1.0],
            [-0.31827056407928467, 0.2412089498645136, 0.0625, 1.0],
        ],
        "weights": 9.820420836899252,
        "accuracy_after": 0.0,
    },
}


@pytest.mark.parametrize("name", list(CASES))
def test_flow_recipes_are_bit_identical_to_their_golden_values(name, tmp_path):
    assert measure(name, tmp_path / name) == GOLDEN[name]


if __name__ == "__main__":  # regenerate: prints the GOLDEN literal
    import pathlib
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        values = {case: measure(case, pathlib.Path(tmp) / case) for case in CASES}
    sys.stderr.write("GOLDEN = {\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in values.items()) + "}\n")
