"""Data parallelism over torch.distributed (gloo for CPU tensors, NCCL for CUDA ones), started by torchrun.

Each rank generates and trains on its share of the step's groups. Normalisers and gradients are
summed over ranks, so one optimiser step over W ranks equals one process over the global batch.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def init() -> tuple[int, int]:
    """(rank, world_size); initialises the process group when launched by torchrun."""
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        _die_with_launcher()
        # CPU tensors (rollouts, rewards, statistics) always go over gloo;
        # CUDA tensors (a GPU run's gradients) over NCCL
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _die_with_launcher() -> None:
    """A worker gets SIGTERM when its launcher dies, however it dies (Linux ``PR_SET_PDEATHSIG``):
    the ranks then stop together at the end of the step and checkpoint; none is left running."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux: the launcher's own signal forwarding is all there is
        return
    if os.getppid() == 1:  # the launcher died before the call above
        os.kill(os.getpid(), signal.SIGTERM)


def agree(flags: list[bool]) -> list[bool]:
    """Each flag true on every rank if it is true on any: a decision (stop, checkpoint) all ranks share."""
    if world_size() == 1:
        return [bool(f) for f in flags]
    votes = torch.tensor([int(bool(f)) for f in flags], dtype=torch.long)  # [F]
    dist.all_reduce(votes, op=dist.ReduceOp.SUM)
    return [bool(v > 0) for v in votes.tolist()]


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    if world_size() > 1:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum gradients over ranks in one flat buffer (the loss is already globally normalised). Sharded
    parameters (FSDP2's DTensors) are left out: their gradients were reduce-scattered in the backward."""
    if world_size() == 1:
        return
    params = [p for p in params if not is_sharded(p)]
    if not params:
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


def all_gather_objects(items: list) -> list:
    """Concatenate every rank's Python list (rank order)."""
    if world_size() == 1:
        return items
    parts: list = [None] * world_size()
    dist.all_gather_object(parts, items)
    return [x for part in parts for x in part]


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` (any picklable value) on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_max(n: int) -> int:
    """The largest ``n`` over ranks."""
    if world_size() == 1:
        return n
    x = torch.tensor([n], dtype=torch.long)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return int(x.item())


def gather_rollout(local):
    """The step's whole batch from every rank's share: each field gathered along the group axis by
    its level (tensors; token-level ones padded to the longest T over ranks), list fields as
    objects. Identical on every rank; the identity at world size 1."""
    if world_size() == 1:
        return local
    from groupwise.types import Rollout

    T = all_max(local.shape[2])
    S = all_max(max((v.shape[2] for k, v in local.extras.items() if local.extra_levels[k] == "segment"), default=0))
    padded = local.pad_tokens(T).pad_segments(S)
    fields = {}
    for name, value in padded.fields():
        if isinstance(value, torch.Tensor):
            fields[name] = all_gather_rows(value)
        elif isinstance(value, list):
            fields[name] = all_gather_objects(value)
        elif name in ("extras", "row_flags"):  # dicts of tensors: every rank sets the same keys
            fields[name] = {k: all_gather_rows(v) for k, v in sorted(value.items())}
        else:
            fields[name] = value
    return Rollout(**fields)


# ------------------------------------------------------------ sharded tensors (dist.shard="fsdp2": DTensors)
def is_sharded(tensor: Any) -> bool:
    return isinstance(tensor, DTensor)


def local(tensor: Any) -> Any:
    """This rank's shard of a sharded tensor (a view: writing it writes the parameter); others as they are."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def full(obj: Any) -> Any:
    """``obj`` (a tensor or nested dicts / lists of them) with every sharded tensor gathered whole
    (a collective: every rank calls it with the same structure); other values as they are."""
    if is_sharded(obj):
        return obj.full_tensor()
    if isinstance(obj, dict):
        return {k: full(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(full(v) for v in obj)
    return obj


def like(value: Any, param: Any) -> Any:
    """A whole tensor ``value`` sharded as ``param`` is (its mesh and placements); a tensor of
    another shape (a step counter) or a non-tensor as it is."""
    if not is_sharded(param) or not isinstance(value, torch.Tensor) or value.shape != param.shape:
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements)


def shard_bounds(n: int) -> tuple[int, int]:
    """This rank's [start, stop) of ``n`` groups split as evenly as possible, in rank order."""
    W, r = world_size(), dist.get_rank() if world_size() > 1 else 0
    base, extra = divmod(n, W)
    start = r * base + min(r, extra)
    return start, start + base + (1 if r < extra else 0)
