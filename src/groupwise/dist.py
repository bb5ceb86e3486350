"""Data parallelism over torch.distributed (gloo on CPU, NCCL on GPU), started by torchrun.

Each rank generates and trains on its share of the step's groups. Normalisers and gradients are
summed over ranks, so one optimiser step over W ranks equals one process over the global batch.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init() -> tuple[int, int]:
    """(rank, world_size); initialises the process group when launched by torchrun."""
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    if world_size() > 1:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum gradients over ranks in one flat buffer (the loss is already globally normalised)."""
    if world_size() == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])  # [P]
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g).clone()
        offset += n


def all_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's [b_r,...] tensor along dim 0 (the b_r may differ)."""
    if world_size() == 1:
        return x
    if x.dtype == torch.bool:  # gloo has no bool all_gather
        return all_gather_rows(x.to(torch.uint8)).bool()
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world_size())]
    dist.all_gather(sizes, torch.tensor([x.shape[0]]))
    longest = int(max(sizes).item())
    padded = torch.zeros(longest, *x.shape[1:], dtype=x.dtype)
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(world_size())]
    dist.all_gather(parts, padded)
    return torch.cat([part[: int(n.item())] for part, n in zip(parts, sizes)])


def rank_offset(n_local: int) -> int:
    """Where this rank's rows start in :func:`all_gather_rows`' output."""
    if world_size() == 1:
        return 0
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world_size())]
    dist.all_gather(sizes, torch.tensor([n_local]))
    return int(sum(int(n.item()) for n in sizes[: dist.get_rank()]))


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
