"""Driver for tests/test_dist_scope.py (run as a script, alone or under torchrun).

For every registered advantage estimator and shaper, token weight, sampler and objective term with
whole-batch state (``prepare``, or its own tokens and normaliser: ``token_subset``), it trains two steps
on the embedded model and records, per step, what the whole-batch components produced (advantages,
token weights, the kept prompt ids), the loss and gradient norm, and the sampler's state. Each rank
writes its own file, so the test can check that ranks agree with each other and with one process.
"""

from __future__ import annotations

import os
import sys

import torch

from groupwise import dist
from groupwise.build import build
from groupwise.config import load_config
from groupwise.registry import entries
from groupwise.trainer import Trainer

BASE = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=6",
    "eval.size=0",
    "threads=1",
    "train.steps=2",
    'update={name="sgd", lr=0.5}',
    "perf.keep_freed_memory=false",
    'objective.terms=["ppo_clip", {name="kl", coef=0.1}]',
]

# what a component gets in this driver's runs to have something to act on (the arithmetic task's completions are
# digits: LA-GRPO's default functional tokens + - * never occur there, "1" often does)
MUTUAL = [  # Mutual RL's strategy and its second actor (the same embedded model)
    'rollout.name="mutual"',
    'roles.peer={samples=true, model={path="default"}, advantage={estimator={name="xgrpo"}}, '
    'objective={terms=["ppo_clip"]}, update={name="sgd", lr=0.5}}',
]
EXAMPLE_OVERRIDES = {
    # OPD's token reward reads a frozen teacher's log-probs: the shipped hinted model, same tokenizer
    "advantage:opd_token": ['advantage.shapers=["opd_token"]', 'roles.teacher={frozen=true, model={path="hinted"}}'],
    "objective:la_grpo": ['objective.terms=[{name="la_grpo", tokens=["1"]}, {name="kl", coef=0.1}]'],
    # GAGPO reads the per-turn facts that only episodes with turn_facts=true write: its own key-and-door game
    "advantage:gagpo": [
        'advantage.estimator="gagpo"',
        'data.task="keydoor"',
        'rollout.name="episodes"',
        "rollout.params={max_turns=2, turn_facts=true}",
        "rollout.max_new_tokens=1",
    ],
    # XGRPO reads the pooled statistics only the mutual strategy writes, which samples with a second actor
    "advantage:xgrpo": ['advantage.estimator="xgrpo"', 'rollout.params={share="xgrpo"}', *MUTUAL],
    # the peer's rows joined with their sequence log-probs (PRP)
    "weight:peer_is": ['objective.weights=["peer_is"]', 'rollout.params={share="prp"}', *MUTUAL],
}


def _class_collects(cls) -> tuple:
    """A strategy class's ``collects`` when it is fixed (a property depends on the instance's options)."""
    value = getattr(cls, "collects", ())
    return () if isinstance(value, property) else value


def configurations() -> dict[str, list[str]]:
    configs: dict[str, list[str]] = {}
    for stage, name, cls in entries():
        if getattr(cls, "modality", "text") != "text":  # this driver trains the text policy
            continue
        if isinstance(getattr(cls, "reads_extras", None), tuple | frozenset):  # extras a non-text kind writes
            continue
        if getattr(cls, "artifacts", ()):  # needs an offline phase's artifact (ProFIL's probe); its filter is per row
            continue
        if stage == "advantage":
            # shapers run after grpo
            key = "advantage.shapers" if getattr(cls, "shaper", False) else "advantage.estimator"
            configs[f"advantage:{name}"] = [f'{key}=["{name}"]' if key.endswith("shapers") else f'{key}="{name}"']
            wanted = set(getattr(cls, "rollout_extras", ()))
            if f"advantage:{name}" in EXAMPLE_OVERRIDES:
                configs[f"advantage:{name}"] = EXAMPLE_OVERRIDES[f"advantage:{name}"]
            # an estimator that reads what only some strategy collects (ReMax's greedy baseline) runs with it (a
            # strategy whose collects depends on its options, a property, is named in EXAMPLE_OVERRIDES instead)
            elif wanted:
                strategy = next(n for s, n, c in entries() if s == "rollout" and wanted <= set(_class_collects(c)))
                configs[f"advantage:{name}"].append(f'rollout.name="{strategy}"')
        elif stage == "weight":
            configs[f"weight:{name}"] = EXAMPLE_OVERRIDES.get(f"weight:{name}", [f'objective.weights=["{name}"]'])
        # whole-batch state once per step
        elif stage == "objective" and (hasattr(cls, "prepare") or hasattr(cls, "token_subset")):
            configs[f"objective:{name}"] = EXAMPLE_OVERRIDES.get(
                f"objective:{name}", [f'objective.terms=["{name}", {{name="kl", coef=0.1}}]']
            )
        elif stage == "sampling":
            configs[f"sampling:{name}"] = [
                f'sampling={{name="{name}"}}',
                'advantage.estimator={name="grpo", scale="batch"}',
            ]
    return configs


def main(out_dir: str, only: str = "") -> None:
    results = {}
    for label, extra in configurations().items():
        if only and only not in label:
            continue
        cfg, _ = load_config(
            None,
            [
                *BASE,
                *extra,
                f'out="{out_dir}/{label.replace(":", "_")}/'
                f'world{os.environ.get("WORLD_SIZE", "1")}_rank{os.environ.get("RANK", "0")}"',
            ],
        )
        trainer = Trainer(build(cfg))
        steps = []
        seen = {}
        observe = trainer.observe

        def recording(batch, seen=seen, observe=observe):
            seen["advantages"] = batch.advantages.clone()
            seen["weight"] = None if batch.weight is None else batch.weight.clone()
            seen["prompts"] = batch.prompt_index.clone()
            observe(batch)

        trainer.observe = recording
        for _ in range(cfg.train.steps):
            row = trainer.run_step()
            steps.append(
                {
                    **seen,
                    "loss": row["loss"],
                    "grad_norm": row.get("grad_norm", float("nan")),
                    "sampler": trainer.sampler.state_dict(),
                }
            )
            trainer.step += 1
        results[label] = steps
    torch.save(results, f"{out_dir}/result_rank{os.environ.get('RANK', '0')}_world{dist.world_size()}.pt")
    dist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
