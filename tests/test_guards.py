"""Numerical guards: 2·10^4 random reward groups (4·10^3 for GCPO's per-group Shapley solver) —
constant, near-constant, single-sample, empty, NaN/inf-containing, and spread over float32's whole
range — give finite advantages from every registered estimator, and from every shaper after a
scaled (grpo) and an unscaled (dr_grpo) one."""

import pytest
import torch
from helpers import fill_inputs

from groupwise.registry import build, names
from groupwise.types import Rollout, StepInfo


def nasty_groups(n: int, G: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kind = torch.randint(0, 8, (n,), generator=gen)  # [n] one pathology per group
    r = torch.rand(n, G, generator=gen)  # [n,G]
    r[kind == 0] = 1.0  # constant
    r[kind == 1] = 0.5 + 1e-7 * torch.randn(int((kind == 1).sum()), G, generator=gen)  # near-constant
    big = kind == 2
    r[big] = torch.randn(int(big.sum()), G, generator=gen) * 1e30  # huge spread
    holes = (torch.rand(n, G, generator=gen) < 0.2) & (kind == 3)[:, None]
    r[holes] = float("nan")
    r[(kind == 3)[:, None] & (torch.rand(n, G, generator=gen) < 0.1)] = float("inf")
    valid = torch.ones(n, G, dtype=torch.bool)
    valid[kind == 4, 1:] = False  # single valid sample
    valid[kind == 5] = False  # empty group
    wide = kind == 6
    r[wide] = (torch.rand(int(wide.sum()), G, generator=gen) * 2 - 1) * 3.4e38  # up to float32's largest
    edge = kind == 7
    picks = torch.tensor([3e38, -3e38, 1e20, -1e20, 0.0])[torch.randint(0, 5, (int(edge.sum()), G), generator=gen)]
    r[edge] = picks  # sums and squares that overflow float32
    return r, valid


def _cases() -> list[tuple[str, str | None]]:
    """(name, upstream estimator): a shaper after grpo (scaled) and dr_grpo (unscaled, huge values)."""
    out = []
    for name in names("advantage"):
        shaper = getattr(build("advantage", name), "shaper", False)
        out += [(name, up) for up in ("grpo", "dr_grpo")] if shaper else [(name, None)]
    return out


# Eight pathologies drawn at random: 2·10^4 groups give each ~2,500 draws. GCPO solves a DPP Shapley
# game per group in Python (~0.5 ms each), so it gets fewer (10^5 groups took it 55 s of make test).
GROUPS = 20_000
FEWER_GROUPS = {"gcpo": 4_000}


@pytest.mark.parametrize("name,upstream", _cases(), ids=[f"{n}+{u}" if u else n for n, u in _cases()])
def test_no_non_finite_advantage_from_random_groups(name, upstream):
    rewards, valid = nasty_groups(FEWER_GROUPS.get(name, GROUPS), 8)
    B, G = rewards.shape
    rollout = Rollout(
        prompt_ids=[[1]] * B,
        actions=torch.zeros(B, G, 1, dtype=torch.long),
        mask=torch.ones(B, G, 1, dtype=torch.bool),
        group_valid=valid,
        truncated=torch.zeros(B, G, dtype=torch.bool),
        prompt_index=torch.arange(B),
        rewards=rewards,
    )
    component = build("advantage", name)
    if upstream is not None:  # a shaper reshapes an estimator's output
        rollout.advantages = build("advantage", upstream)(rollout, StepInfo(0, 0, 1))
    fill_inputs(rollout, component)  # needs, artifacts, vocabulary (estimators too: F-GRPO's phase map)
    for key in getattr(component, "rollout_extras", ()):  # ReMax's greedy baseline: a reward from the same nasty draw
        if key not in rollout.extras:  # one fill_inputs gave its own shape (GAGPO's per-turn facts) stays
            rollout.set_extra(key, rewards[:, 0].clone(), "group")
    adv = component(rollout, StepInfo(0, 0, 1))
    bad = int((~torch.isfinite(adv)).sum())
    print(f"{name}: {bad} non-finite of {adv.numel()}")
    assert bad == 0
    excluded = ~valid | ~torch.isfinite(rewards)
    assert (adv[excluded] == 0).all()
