"""Driver for tests/test_fsdp_all.py (run as a script, alone or under torchrun with ``dist.shard="fsdp2"``).

For every registered objective term of the text policy (alone with a KL term, as tests/dist_scope_driver.py
builds them; the auxiliary terms next to PPO-clip) and every updater that trains whole weights, it trains
two steps on the embedded model and records per step the loss and gradient norm, and after training the
whole weights (``policy.whole()``: gathered under sharding); a configuration the build refuses records the
refusal. One more configuration reads the quantities
that come from layer hooks (``hidden(l)``, ``hidden_at(l)``, ``attn_at(l)``) through the policy's own
forward after training, on the last whole batch: under sharding that forward runs on the shards
(``groupwise_forward``, every layer gathered in turn). Rank 0 writes ``OUT/fsdp_all_world<W>.pt``.
"""

from __future__ import annotations

import os
import sys

import torch
from dist_scope_driver import EXAMPLE_OVERRIDES

from groupwise import dist
from groupwise.build import build
from groupwise.config import load_config
from groupwise.errors import ConfigError
from groupwise.registry import entries
from groupwise.trainer import Trainer

BASE = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=6",
    "eval.size=0",
    "threads=1",
    "train.steps=2",
    'update={name="sgd", lr=0.1, max_grad_norm=1.0}',  # small steps: two must not amplify the ranks' rounding past 1e-6
    "perf.keep_freed_memory=false",
    'advantage.estimator={name="grpo", scale="batch"}',  # needs every rank's rewards
]
KL = '{name="kl", coef=0.1}'
# terms that add to a policy loss rather than being one: trained next to PPO-clip
AUXILIARY = {"kl", "entropy_bonus"}
# the updaters' settings for these runs (gxpo: its extrapolation on from the first step, not after 50)
UPDATERS = {
    "sgd": 'update={name="sgd", lr=0.1, max_grad_norm=1.0}',
    # eps well above the rounding of a near-zero gradient coordinate: at eps 1e-8 AdamW's first step is about
    # lr * sign(g), and a coordinate whose gradient is rounding noise moves by up to lr either way
    "adamw": 'update={name="adamw", lr=1e-3, eps=1e-3, max_grad_norm=1.0}',
    "gxpo": 'update={name="gxpo", optimizer="adamw", lr=1e-3, gate_warmup=0}',
}
HOOKED = ("logp", "hidden(2)", "hidden_at(3)", "attn_at(1)")  # read by the "needs:hooks" configuration


def configurations() -> dict[str, list[str]]:
    configs: dict[str, list[str]] = {}
    for stage, name, cls in entries():
        if getattr(cls, "modality", "text") != "text" or getattr(cls, "artifacts", ()):
            continue  # another policy (refused: model.policy) or an offline phase's artifact (refused: phases)
        if stage == "objective":
            if name == "kl":
                terms = f'["ppo_clip", {KL}]'
            elif name in AUXILIARY:
                terms = f'["ppo_clip", "{name}", {KL}]'
            else:
                terms = f'["{name}", {KL}]'
            configs[f"objective:{name}"] = EXAMPLE_OVERRIDES.get(f"objective:{name}", [f"objective.terms={terms}"])
        elif stage == "update" and name in UPDATERS:
            configs[f"update:{name}"] = [f'objective.terms=["ppo_clip", {KL}]', UPDATERS[name]]
    # the frozen reference's hidden(l) in an advantage (GCPO's embedding) and the policy's hooked quantities
    configs["needs:hooks"] = [
        f'objective.terms=["ppo_clip", {KL}]',
        'update={name="sgd", lr=0.0}',  # the hooked quantities are read at the same weights on both sides
        'advantage.estimator={name="gcpo", embedding="hidden", layer=2}',
    ]
    return configs


def main(out_dir: str, only: str = "") -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))  # before build: the process group starts there
    extra_args = ['dist.shard="fsdp2"'] if world > 1 else []
    results = {}
    for label, extra in configurations().items():
        if only and only not in label:
            continue
        cfg, _ = load_config(
            None, [*BASE, *extra, *extra_args, f'out="{out_dir}/{label.replace(":", "_")}/world{world}"']
        )
        try:
            trainer = Trainer(build(cfg))
        except ConfigError as err:  # refused under sharding (the test checks which, and that one process runs it)
            results[label] = {"refused": str(err)}
            continue
        seen = {}
        observe = trainer.observe

        def recording(batch, seen=seen, observe=observe):
            seen["batch"] = batch
            observe(batch)

        trainer.observe = recording
        rows = []
        for _ in range(cfg.train.steps):
            row = trainer.run_step()
            rows.append({"loss": row["loss"], "grad_norm": row.get("grad_norm", float("nan"))})
            trainer.step += 1
        record = {"rows": rows}
        if label == "needs:hooks":  # every rank the same whole batch: the same collectives
            with torch.no_grad():
                out = trainer.policy.forward(seen["batch"], HOOKED)
            record["hooked"] = {q: out[q].detach().clone() for q in HOOKED}
        whole = trainer.policy.whole().state_dict()  # gathered under sharding: a collective
        record["weights"] = {k: v.detach().clone() for k, v in whole.items()}
        results[label] = record
        print(f"{label}: {rows}", flush=True)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, f"{out_dir}/fsdp_all_world{world}.pt")
    dist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
