"""Sharded training with FSDP2 (``dist.shard = "fsdp2"``): each rank keeps 1/W of every trained
parameter, its gradient and its optimiser state.

``shard(module)`` applies ``torch.distributed.fsdp.fully_shard`` to every decoder layer and then to
the root (embeddings, final norm and head: one group, which keeps tied input/output embeddings
one parameter). A layer's weights are all-gathered just before its forward (and again before its
backward) and freed after; gradients are reduce-scattered. The trainer's loss is already normalised
over the global batch, so gradients must be *summed* over ranks, not averaged: the reduce-scatter is
told a divide factor of 1 with plain ``SUM`` reductions (gloo has no pre-multiplied sum).

Every forward of a sharded module is a collective: every rank must run the same number of them, in
the same order (``FullWeights`` and ``Trainer._accumulate_gradients`` see to it).

Generation and the no-grad scoring of the policy do not run on the shards: ``FullWeights`` gathers
the whole state once into an unsharded copy of the module (at the first use after the weights
moved), the engine decodes every token on that copy, and ``release()`` frees it when training
starts again. This follows what FSDP-based RL trainers do for their inference engine (verl's
``FSDPVLLMShardingManager`` gathers the full state dict per rollout phase); here the "engine" is the
in-process decoder.

References: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``, the per-parameter DTensor
sharding of Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel").
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from groupwise.dist import full


def decoder_layers(module: Any) -> list[Any]:
    """The decoder layers of a Hugging Face causal LM (``model.layers``), or [] when not found."""
    inner = getattr(module, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


def shard(module: Any, forward_methods: tuple[str, ...] = ()) -> None:
    """``fully_shard`` per decoder layer, then the root, in place; gradients summed over ranks.
    ``forward_methods``: methods of the root that run the model without calling its ``forward``
    (the packed training forward calls the decoder and the head separately): each is made to
    gather the root's own parameters (embeddings, norm, head) first and reduce their gradients after,
    as ``forward`` would."""
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    for layer in decoder_layers(module):
        fully_shard(layer)
    fully_shard(module)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)  # the loss is normalised over the global batch: sum, not mean
            sub.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    for name in forward_methods:
        register_fsdp_forward_method(module, name)


class FullWeights:
    """An unsharded copy of a sharded module, filled by one all-gather per parameter when asked for
    (``get()``) and emptied by ``release()``. Built before ``shard`` from the still-whole module;
    between uses its parameters hold no memory (zero-element tensors). It is current while no shard
    was written since the gather (each parameter's in-place version counter: an optimiser step, a load or
    a rollback all bump it), so a model trained by any caller is never read stale."""

    def __init__(self, module: Any):
        # the copy's parameters start empty (the memo hands deepcopy a stand-in for each): no second
        # whole model in memory, not even for a moment; tied parameters map to one stand-in
        memo = {id(p): torch.nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device)) for p in module.parameters()}
        self.module = copy.deepcopy(module, memo).eval().requires_grad_(False)
        self.current = False
        self.versions: tuple[int, ...] = ()  # the shards' version counters at the last gather
        self.gathers = 0  # how many times the whole state was gathered (tests: once per rollout phase)

    def get(self, sharded: Any) -> Any:
        """The copy holding ``sharded``'s current weights (gathered now unless already current)."""
        versions = tuple(p._version for p in sharded.parameters())
        if not self.current or versions != self.versions:  # the same answer on every rank: they step together
            with torch.no_grad():
                params = dict(sharded.named_parameters())
                for name, target in self.module.named_parameters():
                    target.data = full(params[name].detach())
            self.current, self.versions = True, versions
            self.gathers += 1
        return self.module

    def release(self) -> None:
        """Free the gathered weights (the copy keeps its structure; tied parameters stay tied)."""
        for p in self.module.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.current = False


def wanted(cfg: Any, world: int) -> bool:
    """Shard the run's trained models: ``dist.shard="fsdp2"`` over more than one rank (one rank holds
    everything either way: nothing to shard)."""
    return cfg.dist.shard == "fsdp2" and world > 1


def refusals(cfg: Any) -> list[str]:
    """What ``dist.shard = "fsdp2"`` does not (yet) compose with in ``cfg``, each naming the key and
    the way out; [] when the combination is supported."""
    out = []
    where = 'dist.shard="fsdp2"'
    models = [("model", cfg.model)] + [
        (f"roles.{name}.model", rc.model) for name, rc in cfg.roles.items() if not rc.frozen
    ]
    for key, m in models:
        if m.policy != "lm":
            out.append(f"{key}.policy={m.policy!r}: {where} shards Hugging Face causal LMs only; use dist.shard=none")
        if m.lora:
            out.append(
                f"{key}.lora: {where} with PEFT adapters is not supported (the adapters are a few MB: DDP, "
                f'dist.shard="none", holds them whole at no cost)'
            )
        if m.dtype != "float32" or m.matmul != "float32":
            out.append(
                f"{key}.dtype={m.dtype!r}, {key}.matmul={m.matmul!r}: {where} trains float32 weights and products only "
                f'(FSDP2\'s MixedPrecisionPolicy is not wired in); use float32 or dist.shard="none"'
            )
    if cfg.model.ref_sync_every:
        out.append(
            f"model.ref_sync_every={cfg.model.ref_sync_every}: {where} keeps the reference whole and the policy "
            f'sharded, the mix is not implemented across them; use 0 or dist.shard="none"'
        )
    if cfg.rollout.backend != "local":
        out.append(
            f"rollout.backend={cfg.rollout.backend!r}: {where} pushes no weights to a generation server yet (they are "
            f'sharded); use rollout.backend="local" or dist.shard="none"'
        )
    if cfg.phases:
        names = [p if isinstance(p, str) else p.get("name") for p in cfg.phases]
        out.append(f"phases={names}: {where} runs RL steps only for now; run the phases without sharding first")
    return out
