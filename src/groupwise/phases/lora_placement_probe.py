"""LoRA placement's offline phase: S probe GRPO gradients w.r.t. LoRA-B (no update), scored, top-k mask.

"Not How Many, But Which: Parameter Placement in Low-Rank Adaptation", Sehanobish, Lovering, 2026,
https://arxiv.org/abs/2605.12207 — spec 29. Only the abstract was available; no code.

**Change vs GRPO**: none by itself. It runs before the RL steps on the policy as it is then (LoRA
freshly initialised, B = 0) and writes the artifact ``placement`` (a bool mask per LoRA-B weight)
that the ``lora_placement`` updater (``updates/lora_placement.py``) trains under.

**Procedure** (scores and diagnostics: ``updates/lora_placement.py``)::

    for s in 1..S (probes):
        rows      `prompts` train rows (a seeded draw per probe), `group_size` samples each
        rewards   the run's train rewards (ctx.score)
        A         grpo advantage (group mean / std)                                  [B,G]
        loss      − mean_rows( A · mean_t logp )   the GRPO / PPO-clip loss at ratio 1
                  (its gradient), seq_mean_token_mean as the demo recipe             scalar
        (objective = "sft": loss = − token mean of log π(answer + EOS | prompt) over the rows, no sampling)
        g^{(s)}   ∂loss/∂B for every LoRA-B entry, flattened                         [P]
    scores        placement_scores(G [S,P], score)                                   [P]
    mask          topk_mask(scores, k) with k = `k`, or round(fraction · P)          [P]

No weight moves (the probe gradients are dropped). The phase's summary: k, P, the diagnostics
``eff_rank`` / ``mean_cos`` of G, the probes' mean reward, and the chosen entries per module kind
(``q_proj``, ``v_proj``, …) and per layer.

**Defaults**

- ``probes = 8`` [INFERRED] the spec's S ≈ 8–16 ("<0.5 % of training cost" [ABSTRACT]).
- ``score = "net"`` [INFERRED] the spec's primary score, from the abstract's "consistently signed
  gradients"; ``sign_consistency``, ``magnitude``, ``random`` are the spec's alternatives.
- ``fraction = 0.02`` [INFERRED] within the spec's analogue's 1–5 % of B entries; ``k > 0`` sets k.
- ``per_module = false`` [INFERRED] global top-k (the spec's default).
- ``prompts = 32``, ``group_size = 8``, ``max_new_tokens = 6``, ``temperature = 1.0``
  [INFERRED] the demo recipe's batch.
- ``objective = "grpo"`` [ABSTRACT] placement under GRPO; ``"sft"`` probes the cross-entropy of
  the rows' answers instead (token mean): the abstract's contrast for the diagnostics (SFT
  gradients low-rank and stable, GRPO's high-rank and near-orthogonal). A second probe phase
  with another ``artifact`` name reports both in one run's summary.

**Notes**

1. Needs a PEFT LoRA policy (``model.lora``) and a text task; no LoRA-B weight is a ``ConfigError``.
2. A probe whose groups all have one reward has zero advantages: its gradient is 0 (it counts
   towards S, adding nothing to the scores).
3. Sampling takes its noise from steps −3, −4, … (RL's steps are 0, 1, …; −1 and −2 are other
   phases'); the ``random`` score and the row draws are seeded by the run's seed.
4. The ``lora_placement`` updater checks the mask names and shapes against the policy.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch

from groupwise.errors import ConfigError
from groupwise.phases import PhaseContext
from groupwise.phases.sft import teacher_forced
from groupwise.registry import build, register
from groupwise.types import Request, StepInfo
from groupwise.updates._lora import layer_of, lora_side, module_kind
from groupwise.updates.lora_placement import SCORES, grad_structure_stats, placement_scores, topk_mask


@register("phase", "lora_placement_probe")
@dataclass
class LoraPlacementProbe:
    """Probe GRPO gradients of LoRA-B (no update), score each entry, keep the top k as the trained mask."""

    kind = "offline"
    artifact: str = "placement"
    probes: int = 8
    score: str = "net"
    fraction: float = 0.02
    k: int = 0
    per_module: bool = False
    prompts: int = 32
    group_size: int = 8
    max_new_tokens: int = 6
    temperature: float = 1.0
    # "sft": cross-entropy on the rows' answers instead, the spec's SFT control of the diagnostics
    objective: str = "grpo"

    def __post_init__(self) -> None:
        if self.objective not in ("grpo", "sft"):
            raise ConfigError(f"phase lora_placement_probe: objective={self.objective!r}; allowed: grpo, sft")
        if self.score not in SCORES:
            raise ConfigError(f"phase lora_placement_probe: score={self.score!r}; allowed: {', '.join(SCORES)}")
        for key in ("probes", "prompts", "max_new_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"phase lora_placement_probe: {key}={getattr(self, key)} must be >= 1")
        if self.group_size < 2:
            raise ConfigError(
                f"phase lora_placement_probe: group_size={self.group_size}; "
                "GRPO's advantage needs >= 2 samples a prompt"
            )
        if self.k < 0 or not 0.0 < self.fraction <= 1.0:
            raise ConfigError(
                f"phase lora_placement_probe: need k >= 0 (got {self.k}) and fraction in (0, 1] (got {self.fraction})"
            )

    def __call__(self, ctx: PhaseContext) -> dict:
        t0, policy = time.perf_counter(), ctx.policy
        if (ctx.score is None and self.objective == "grpo") or not hasattr(policy, "parameter_names"):
            raise ConfigError("phase lora_placement_probe needs a text policy and the run's rewards")
        named = [(n, p) for n, p in zip(policy.parameter_names(), policy.parameters()) if lora_side(n) == "B"]
        if not named:
            raise ConfigError(
                "phase lora_placement_probe: the policy has no trainable "
                "LoRA-B weight; set model.lora (PEFT LoraConfig arguments)"
            )
        sizes = [p.numel() for _, p in named]
        P = sum(sizes)
        k = self.k or max(1, round(self.fraction * P))
        if k > P:
            raise ConfigError(f"phase lora_placement_probe: k={k} exceeds the {P} LoRA-B entries")
        estimator = build("advantage", "grpo")
        sampling = {"temperature": self.temperature, "top_p": 1.0, "top_k": 0, "max_new_tokens": self.max_new_tokens}
        grads, rewards = torch.zeros(self.probes, P), []  # [S,P]
        gen = torch.Generator().manual_seed(ctx.seed)
        for s in range(self.probes):
            order = torch.randperm(len(ctx.train_rows), generator=gen)[: self.prompts].tolist()
            prompts = [ctx.prompt("train", ctx.train_rows, i) for i in order]
            for _, p in named:
                p.grad = None
            if self.objective == "sft":  # the control: cross-entropy on the rows' answers (token mean)
                batch = teacher_forced(
                    prompts, [policy.encode_completion(str(ctx.train_rows[i]["answer"])) for i in order]
                )
                logp = policy.forward(batch, ["logp"])["logp"]  # [B,1,T]
                loss = -(logp * batch.mask).sum() / batch.mask.sum().clamp(min=1)
            else:
                info = StepInfo(step=-3 - s, seed=ctx.seed, max_new_tokens=self.max_new_tokens, phase=self.artifact)
                policy.eval()
                with torch.no_grad():
                    roll = policy.generate(
                        [Request(key=i, n=self.group_size, prompt=prompt) for i, prompt in zip(order, prompts)],
                        sampling,
                        info,
                    )
                roll.meta = [ctx.train_rows[i] for i in order]
                ctx.score(roll, info)
                adv = estimator(roll, info)  # [B,G]
                rewards.append(float(roll.rewards[roll.group_valid].mean()) if roll.group_valid.any() else float("nan"))
                logp = policy.forward(roll, ["logp"])["logp"]  # [B,G,T]
                mask = roll.mask & roll.group_valid[..., None]  # [B,G,T]
                rows = mask.any(-1)  # [B,G]
                row_mean = (logp * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B,G]
                loss = -(adv * row_mean)[rows].sum() / rows.sum().clamp(min=1)
            if loss.requires_grad:
                loss.backward()
            grads[s] = torch.cat(
                [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float().cpu()
                    for _, p in named
                ]
            )  # [P]
        for p in policy.parameters():  # no weight moves and no gradient is left behind
            p.grad = None
        scores = placement_scores(grads, self.score, seed=ctx.seed)  # [P]
        chosen = topk_mask(scores, k, sizes if self.per_module else None)  # [P]
        masks, kinds, layers, start = {}, Counter(), Counter(), 0
        for (name, p), size in zip(named, sizes):
            m = chosen[start : start + size].reshape(p.shape)
            masks[name] = m
            kinds[module_kind(name)] += int(m.sum())
            layers[str(layer_of(name))] += int(m.sum())
            start += size
        # NaN (one probe): None in summary.json
        stats = {key: (None if value != value else value) for key, value in grad_structure_stats(grads).items()}
        summary = {
            "k": k,
            "entries": P,
            "score": self.score,
            "probes": self.probes,
            **stats,
            "objective": self.objective,
            "probe_reward": sum(rewards) / len(rewards) if rewards else None,
            "by_module": dict(sorted(kinds.items())),
            "by_layer": dict(sorted(layers.items())),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        ctx.say(
            f"phase {self.artifact!r}: {k} of {P} LoRA-B entries by {self.score!r}; "
            f"probe gradients eff_rank {stats['eff_rank']:.2f}, mean cos "
            f"{stats['mean_cos'] if stats['mean_cos'] is not None else float('nan'):.3f}; "
            f"per module {dict(sorted(kinds.items()))}"
        )
        return {"masks": masks, "score": self.score, "k": k, "entries": P, "summary": summary}
