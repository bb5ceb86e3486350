"""Shared test fixtures: random rollouts, Need filling, row permutations.

``make_rollout`` builds a small batch with every awkward case present by default: ragged groups
(an invalid row), a NaN reward, a valid but fully masked row, a truncated row, and garbage
(large finite values) in ``logp_old`` / ``logp_ref`` / token advantages outside the mask, so that
a component that reads padding shows it in its outputs or gradients.
"""

from __future__ import annotations

import dataclasses
import importlib

import torch
from torch import Tensor

from groupwise.objective import Objective
from groupwise.registry import build
from groupwise.run import Run
from groupwise.types import Need, Rollout, StepInfo


def paper_module(folder: str, module: str):
    """A module of a paper folder (``paper_module("27_alphagrpo", "number_attrs")``): a folder name
    starts with its spec number, so it is imported by name, not by an ``import`` statement."""
    return importlib.import_module(f"groupwise.papers.{folder}.{module}")


GROUP_FIELDS = {"prompt_ids", "prompt_index", "meta"}  # per-group fields; every other field is per row


def info_for(T: int, step: int = 0) -> StepInfo:
    return StepInfo(step=step, seed=0, max_new_tokens=T)


def make_rollout(
    B: int = 3,
    G: int = 4,
    T: int = 6,
    seed: int = 0,
    *,
    binary: bool = False,
    token_adv: bool = False,
    awkward: bool = True,
    garbage: float = 30.0,
) -> Rollout:
    """A random Rollout [B,G,T] with mask prefixes, rewards, logp_old/logp_ref and advantages.

    ``awkward`` adds: row (B-1, G-1) invalid (ragged group), reward (min(1,B-1), 0) NaN, row
    (0, G-1) valid but fully masked, row (0, 0) truncated (full length).
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B, G), generator=g)  # [B,G]
    group_valid = torch.ones(B, G, dtype=torch.bool)  # [B,G]
    if binary:
        rewards = torch.randint(0, 2, (B, G), generator=g).float()  # [B,G]
    else:
        rewards = torch.randn(B, G, generator=g)  # [B,G]
    if awkward:
        lengths[0, 0] = T
        group_valid[B - 1, G - 1] = False
        rewards[B - 1, G - 1] = float("nan")
        rewards[min(1, B - 1), 0] = float("nan")
    mask = torch.arange(T)[None, None, :] < lengths[..., None]  # [B,G,T]
    if awkward and G > 1:
        mask[0, G - 1] = False
    truncated = lengths >= T  # [B,G]
    logp_old = -torch.rand(B, G, T, generator=g) * 3.0  # [B,G,T]
    logp_ref = logp_old + 0.3 * torch.randn(B, G, T, generator=g)  # [B,G,T]
    adv = torch.randn(B, G, T, generator=g) if token_adv else torch.randn(B, G, generator=g)  # [B,G(,T)]
    if garbage:
        junk = (torch.rand(B, G, T, generator=g) * 2 - 1) * garbage  # [B,G,T]
        logp_old = torch.where(mask, logp_old, junk)
        logp_ref = torch.where(mask, logp_ref, -junk)
        if token_adv:
            adv = torch.where(mask, adv, junk)
    adv = torch.where(group_valid if adv.dim() == 2 else group_valid[..., None], adv, torch.zeros(()))
    return Rollout(
        prompt_ids=[[1, 2, b + 3] for b in range(B)],
        actions=torch.randint(0, 50, (B, G, T), generator=g),
        mask=mask,
        group_valid=group_valid,
        truncated=truncated,
        prompt_index=torch.arange(B),
        meta=[{"answer": str(b)} for b in range(B)],
        completions=[[f"c{b}{i}" for i in range(G)] for b in range(B)],
        rewards=rewards,
        advantages=adv,
        logp_old=logp_old,
        logp_ref=logp_ref,
        info=[[{"row": (b, i)} for i in range(G)] for b in range(B)],
    )


def make_logp(rollout: Rollout, seed: int = 1, scale: float = 0.3) -> Tensor:
    """[B,G,T] leaf tensor (requires grad): the current policy's log-probs, near ``logp_old``."""
    g = torch.Generator().manual_seed(seed)
    B, G, T = rollout.shape
    base = torch.where(rollout.mask, rollout.logp_old, -torch.rand(B, G, T, generator=g))  # [B,G,T]
    return (base + scale * torch.randn(B, G, T, generator=g)).detach().requires_grad_(True)


def fill_needs(rollout: Rollout, needs, seed: int = 7) -> dict[str, Tensor]:
    """Satisfy every declared Need with random data; returns grad quantities for ``out``.

    No-grad ``logp`` needs go to ``logp_ref`` / ``logp_old`` / ``logp_sampler`` by model; any other
    no-grad quantity becomes a token-level extra named by the quantity (policy, default view) or
    ``"<model>.<quantity>"``. Grad needs come back as ``out`` entries of the same names.
    """
    g = torch.Generator().manual_seed(seed)
    B, G, T = rollout.shape
    out: dict[str, Tensor] = {}
    for need in needs:
        assert isinstance(need, Need), need
        value = torch.rand(B, G, T, generator=g) * 2.0  # [B,G,T]
        if need.name == "hidden":  # a hidden state per token [B,G,T,H]
            value = torch.randn(B, G, T, HIDDEN, generator=g)
        if need.name == "logprobs":  # a next-token log-distribution per token [B,G,T,V] over make_rollout's 50 ids
            value = torch.log_softmax(2.0 * torch.randn(B, G, T, VOCAB, generator=g), dim=-1)
        if need.quantity == "logp":
            value = -value
        key = need.key
        if need.grad:
            out[key] = value.requires_grad_(True)
        elif need.quantity == "logp" and need.view == "default":
            slot = {"ref": "logp_ref", "policy": "logp_old", "old": "logp_old", "sampler": "logp_sampler"}.get(
                need.model
            )
            if slot is None:
                rollout.set_extra(key, value, "token")
            elif getattr(rollout, slot) is None:
                setattr(rollout, slot, value)
        else:
            rollout.set_extra(key, value, "token")
    return out


HIDDEN = 8  # hidden size of a filled hidden(l) need
VOCAB = 50  # vocabulary of a filled logprobs need (make_rollout's actions are ids 0..49)


def _example_probe(seed: int) -> dict:
    """A seeded ProFIL probe on HIDDEN-dim states (layer 1); ids divisible by 3 end a step (';')."""
    from groupwise.advantages.profil import AttnProbe

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        probe = AttnProbe(HIDDEN, 2)
    return {
        "state": probe.state_dict(),
        "layer": 1,
        "d_model": HIDDEN,
        "n_heads": 2,
        "d_head": probe.d_head,
        "sep": ";",
        "token_text": [";" if i % 3 == 0 else "x" for i in range(50)],
    }


# what a component defining ``use_vocabulary`` gets in the sweeps:
# a text per token id of make_rollout's actions (0..49),
# with the tags the defaults name: "[", "]" (F-GRPO's candidates) and "+", "-", "*" (LA-GRPO's functional tokens)
EXAMPLE_VOCABULARY = ["", "[", "]", ",", ">", "+", "-", "*", "x", " "] * 5


# what a component listing an artifact in ``artifacts`` gets in the sweeps (an offline phase makes the real one)
def _example_logz(seed: int) -> dict:
    """A DISA log Z table (beta 15, the objective's default) for prompt ids 0..63, no regressor."""
    g = torch.Generator().manual_seed(seed)
    return {"table": torch.randn(64, generator=g) * 3.0, "beta": 15.0, "regressor": None}


EXAMPLE_ARTIFACTS = {"probe": _example_probe, "table": lambda seed: {"rows": 0}, "logz": _example_logz}


def _turns(rollout: Rollout) -> int:
    """Two turns a row (``segment_id``: the first half of the tokens is turn 0), set once; the turn count."""
    B, G, T = rollout.shape
    if rollout.segment_id is None:
        turn = (torch.arange(T) * 2 // T).expand(B, G, T)  # [B,G,T]
        rollout.segment_id = torch.where(rollout.mask, turn, torch.full((), -1))  # [B,G,T]
    return 2


def _example_step_reward(rollout: Rollout, g: torch.Generator) -> None:
    """``env/step_reward`` [B,G,2]: 0/1 per turn (rollout episodes with turn_facts=true)."""
    S = _turns(rollout)
    rollout.set_extra("env/step_reward", torch.randint(0, 2, (*rollout.shape[:2], S), generator=g).float(), "segment")


def _example_state_id(rollout: Rollout, g: torch.Generator) -> None:
    """``env/state_id`` [B,G,2]: every row starts in state 0, its second turn in state 1 or 2 (shared states)."""
    S = _turns(rollout)
    state = torch.randint(1, 3, (*rollout.shape[:2], S), generator=g).float()  # [B,G,S]
    state[..., 0] = 0.0
    rollout.set_extra("env/state_id", state, "segment")


def _example_behav_seq_logp(rollout: Rollout, g: torch.Generator) -> None:
    """``behav_seq_logp`` [B,G]: a peer's sequence log-prob, on rows flagged ``injected`` (every other row)."""
    from groupwise.types import INJECTED

    B, G, _ = rollout.shape
    rollout.set_extra("behav_seq_logp", -torch.rand(B, G, generator=g) * 6.0, "row")
    rollout.set_flag(INJECTED, (torch.arange(G) % 2 == 1).expand(B, G).clone() & rollout.group_valid)


# rollout extras of a known shape: a filler per key (any other key gets a random group-level value)
EXAMPLE_EXTRAS = {
    "env/step_reward": _example_step_reward,
    "env/state_id": _example_state_id,
    "behav_seq_logp": _example_behav_seq_logp,
}


def fill_inputs(rollout: Rollout, component, seed: int = 7) -> dict[str, Tensor]:
    """``fill_needs`` for the component's needs, an example of each artifact it lists (``artifacts``),
    plus a random group-level value [B] for each extra it reads from the rollout strategy
    (``rollout_extras``, e.g. ReMax's ``baseline_reward``), decoded texts for one that
    ``reads_completions`` and a value per row for each ``row_info`` column (EDAS's answers)."""
    out = fill_needs(rollout, getattr(component, "needs", ()), seed)
    if hasattr(component, "use_vocabulary"):  # token texts of a text policy (role / phase maps from tags)
        component.use_vocabulary(EXAMPLE_VOCABULARY)
    for name in getattr(component, "artifacts", ()):
        assert name in EXAMPLE_ARTIFACTS, (
            f"add an example of the artifact {name!r} to tests/helpers.py EXAMPLE_ARTIFACTS"
        )
        component.use_artifact(name, EXAMPLE_ARTIFACTS[name](seed))
    g = torch.Generator().manual_seed(seed + 1)
    for key in getattr(component, "rollout_extras", ()):
        if key in EXAMPLE_EXTRAS:  # an extra of a known shape (the episodes' per-turn facts)
            EXAMPLE_EXTRAS[key](rollout, g)
        else:
            rollout.set_extra(key, torch.rand(rollout.shape[0], generator=g), "group")
    B, G, _ = rollout.shape
    # decoded texts, few distinct (EDAS's answers)
    if getattr(component, "reads_completions", False) and not rollout.completions:
        rollout.completions = [[str(v) for v in row] for row in torch.randint(0, 3, (B, G), generator=g).tolist()]
    for column in getattr(component, "row_info", ()):  # a reward's log_extra column per row, few distinct values
        values = torch.randint(0, 3, (B, G), generator=g).tolist()
        rollout.info = [
            [
                {**((rollout.info[b][i] or {}) if rollout.info else {}), "extra": {column: str(values[b][i])}}
                for i in range(G)
            ]
            for b in range(B)
        ]
    return out


def permute_rows(rollout: Rollout, perm: Tensor) -> Rollout:
    """A copy with the rows of group b reordered by ``perm[b]`` ([B,G] long) in every row field."""
    B, G, _ = rollout.shape
    out = {}
    for f in dataclasses.fields(rollout):
        v = getattr(rollout, f.name)
        if f.name in GROUP_FIELDS or v is None:
            out[f.name] = v
        elif isinstance(v, Tensor):
            out[f.name] = permute_tensor(v, perm)
        elif f.name == "extras":
            out[f.name] = {
                k: t if rollout.extra_levels[k] == "group" else permute_tensor(t, perm) for k, t in v.items()
            }
        elif f.name == "row_flags":
            out[f.name] = {k: permute_tensor(t, perm) for k, t in v.items()}
        elif f.name == "extra_levels":
            out[f.name] = dict(v)
        elif isinstance(v, list):
            out[f.name] = [[v[b][int(i)] for i in perm[b]] for b in range(B)] if v else []
        else:
            out[f.name] = v
    return Rollout(**out)


def permute_tensor(x: Tensor, perm: Tensor) -> Tensor:
    """Row-permute a [B,G,...] tensor within each group."""
    idx = perm.view(*perm.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return torch.gather(x, 1, idx)


def random_perm(B: int, G: int, seed: int = 3) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(G, generator=g) for _ in range(B)])  # [B,G]


def objective_for(terms: list, agg: str = "token_mean") -> Objective:
    names = {agg} | {t.agg for t in terms if getattr(t, "agg", None)}
    return Objective(terms=terms, aggregations={n: build("aggregation", n) for n in names}, default_agg=agg)


def rollout_from(logp_old: Tensor, adv: Tensor | None = None, mask: Tensor | None = None, **fields) -> Rollout:
    """A Rollout around given [B,G,T] log-probs (hand-computed tests); every row valid by default."""
    B, G, T = logp_old.shape
    mask = torch.ones(B, G, T, dtype=torch.bool) if mask is None else mask.bool()
    base = dict(
        prompt_ids=[[1] for _ in range(B)],
        actions=torch.zeros(B, G, T, dtype=torch.long),
        mask=mask,
        group_valid=torch.ones(B, G, dtype=torch.bool),
        truncated=torch.zeros(B, G, dtype=torch.bool),
        prompt_index=torch.arange(B),
        advantages=adv,
        logp_old=logp_old,
    )
    base.update(fields)
    return Rollout(**base)


def leaf(x) -> Tensor:
    return torch.as_tensor(x, dtype=torch.float32).clone().requires_grad_(True)


def train_recorded(tmp_path, objective: str, *overrides: str, steps: int = 2) -> tuple[list[dict], list[Rollout]]:
    """Train ``steps`` steps of the embedded model with ``objective`` (+ a k3 KL term) and
    ``overrides``; returns the metrics.jsonl rows and each step's whole batch as observed (after
    its advantages), having checked the objective is the one asked for and every loss is finite."""
    import json
    import math

    from test_trainer import make_trainer

    trainer = make_trainer(
        tmp_path,
        f'objective.terms=["{objective}", {{name="kl", coef=0.04}}]',
        *overrides,
        f"train.steps={steps}",
        "eval.size=0",
    )
    assert trainer.objective.terms[0].registry_name == objective
    seen: list[Rollout] = []
    observe = trainer.observe
    trainer.observe = lambda batch: (seen.append(batch), observe(batch))
    Run(trainer).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == steps and all(math.isfinite(r["loss"]) for r in rows)
    return rows, seen


def _split_equals_whole(obj: Objective, ro: Rollout, logp: Tensor, split, info: StepInfo) -> tuple[Tensor, Tensor]:
    """Assert the micro-batches ``split`` (whole groups) of ``ro``, with normalisers from the whole batch,
    add up to the whole batch's loss and gradient; returns (whole loss, its gradient [B,G,T])."""
    norms = obj.normalizers(ro, info)  # once, on the whole step batch
    whole_logp = logp.detach().clone().requires_grad_(True)
    whole = obj.loss(ro, {"logp": whole_logp}, norms, info)
    (grad_whole,) = torch.autograd.grad(whole, whole_logp)
    parts_logp = logp.detach().clone().requires_grad_(True)
    total = sum(obj.loss(ro.select(list(idx)), {"logp": parts_logp[list(idx)]}, norms, info) for idx in split)
    (grad_parts,) = torch.autograd.grad(total, parts_logp)
    torch.testing.assert_close(total.detach(), whole.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad_parts, grad_whole, atol=1e-6, rtol=1e-6)
    assert grad_whole.abs().sum() > 0
    return whole.detach(), grad_whole


def check_micro_batching(
    obj: Objective, ro: Rollout, split: list[list[int]], info: StepInfo, seed: int = 1
) -> tuple[Tensor, Tensor]:
    """``_split_equals_whole`` on seeded log-probs; padding gets exactly zero gradient."""
    whole, grad_whole = _split_equals_whole(obj, ro, make_logp(ro, seed=seed), split, info)
    assert (grad_whole[~obj.loss_mask(ro)] == 0).all()
    return whole, grad_whole


def assert_micro_batch_invariant(term, agg: str, ro: Rollout, logp: Tensor, split=([0, 4], [1], [2, 3, 5])) -> None:
    """``_split_equals_whole`` for one term under ``agg``, with the term's ``prepare`` (if any) run once on
    the whole batch first, as the trainer does."""
    info = info_for(ro.shape[2])
    if hasattr(term, "prepare"):
        term.prepare(ro, info)
    _split_equals_whole(objective_for([term], agg), ro, logp, split, info)


def run_two_ranks(driver: str, tmp_path) -> list:
    """Run the script ``driver`` under torchrun with two processes (argv: the tests folder, ``tmp_path``);
    each rank writes ``tmp_path/rank{r}.json``, returned in rank order."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "driver.py").write_text(driver)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(tmp_path / "driver.py"),
        str(Path(__file__).parent),
        str(tmp_path),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def train_one_and_two_ranks(args: list[str], tmp_path, policy_file: str, timeout: int = 600) -> list[dict]:
    """``groupwise train *args`` in one process (``tmp_path/one``) and under torchrun with two ranks
    (``tmp_path/two``); returns the two final saved states of a non-text policy (``final/<policy_file>``),
    one process first. A failed run fails the test with its stderr."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    states = []
    for launcher, folder in (
        ([sys.executable, "-m", "groupwise"], "one"),
        (
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "groupwise"],
            "two",
        ),
    ):
        result = subprocess.run(
            [*launcher, *args, f"out={tmp_path / folder}"], capture_output=True, text=True, env=env, timeout=timeout
        )
        assert result.returncode == 0, result.stderr[-3000:]
        states.append(torch.load(tmp_path / folder / "final" / policy_file, weights_only=False))
    return states


def assert_nets_close(one: dict, two: dict) -> None:
    """Two ranks' weights equal one process's (float64 toy nets: to summation order)."""
    for name, value in one.items():
        torch.testing.assert_close(two[name], value, atol=1e-9, rtol=1e-7, msg=name)


def assert_resume_is_exact(make_trainer, tmp_path, steps: int = 4, stop: int = 2, metric: str = "reward_mean") -> dict:
    """Kill-and-resume equals the uninterrupted run: ``make_trainer(out)`` builds a trainer of ``steps``
    steps checkpointing every ``stop``; run ``a`` goes straight through, run ``b`` stops after ``stop``
    steps and a second trainer resumes it. The policies' nets are equal bit for bit, and so is every
    logged ``metric`` (``reward_mean``). Returns the straight run's summary."""
    import json

    from groupwise.run import Run

    straight = make_trainer(tmp_path / "a")
    summary = Run(straight).train()
    first = make_trainer(tmp_path / "b")
    first.cfg.train.steps = stop
    Run(first).train()
    resumed = make_trainer(tmp_path / "b")
    Run(resumed).train(resume_allow=["train.steps"])
    for key, value in straight.policy.state_dict()["net"].items():
        assert torch.equal(value, resumed.policy.state_dict()["net"][key]), key
    rows = [
        [json.loads(line)[metric] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        for run in ("a", "b")
    ]
    assert rows[0] == rows[1] and len(rows[0]) == steps
    return summary
