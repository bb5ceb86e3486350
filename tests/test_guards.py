"""Numerical guards: 10^5 random reward groups — constant, near-constant, single-sample, empty,
NaN/inf-containing — give finite advantages from every registered estimator."""

import pytest
import torch

from groupwise.registry import build, names
from groupwise.types import Rollout, StepInfo
from helpers import fill_needs


def nasty_groups(n: int, G: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kind = torch.randint(0, 6, (n,), generator=gen)  # [n] one pathology per group
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
    return r, valid


@pytest.mark.parametrize("name", names("advantage"))
def test_no_non_finite_advantage_from_1e5_random_groups(name):
    rewards, valid = nasty_groups(100_000, 8)
    B, G = rewards.shape
    rollout = Rollout(prompt_ids=[[1]] * B, actions=torch.zeros(B, G, 1, dtype=torch.long), mask=torch.ones(B, G, 1, dtype=torch.bool), group_valid=valid,
                      truncated=torch.zeros(B, G, dtype=torch.bool), prompt_index=torch.arange(B), rewards=rewards)
    component = build("advantage", name)
    if getattr(component, "shaper", False):  # a shaper reshapes an estimator's output
        rollout.advantages = build("advantage", "grpo")(rollout, StepInfo(0, 0, 1))
        fill_needs(rollout, component.needs)
    adv = component(rollout, StepInfo(0, 0, 1))
    bad = int((~torch.isfinite(adv)).sum())
    print(f"{name}: {bad} non-finite of {adv.numel()}")
    assert bad == 0
    excluded = ~valid | ~torch.isfinite(rewards)
    assert (adv[excluded] == 0).all()
