"""AlphaGRPO's reflection task: a first attempt per prompt, then G self-reflective refinements of its
worst attempt, each trained under the reflection context; the stage-1 reward is kept for FPR.

"AlphaGRPO: GRPO over a unified AR+diffusion model with decompositional verifiable reward",
Huang, Wu, Yang, Liu, Zhao (ICML 2026), https://arxiv.org/abs/2605.12495 — spec 27, bullets
"Reflection task" and "FPR" (the authors' ``tasks/reflect.py``, read for the spec; our code).

**Change vs GRPO**: a step has two rounds. Stage 1 samples ``initial`` attempts per prompt and
scores them; the attempt to refine is the lowest-reward one (``select = "lowest"``) or one drawn
with probability ∝ softmax(1 − r) (``select = "softmax"``). Stage 2 samples the G rows of the group
under the *reflection context* — the prompt, that attempt and a reflection instruction — and scores
them with the same rewards (against the original row). Only the refinements are trained, each row
under its reflection context (``Rollout.ctx``); the stage-1 attempts train nothing. The refined
attempt's reward is the group extra ``stage1_reward`` [B], which the ``alphagrpo`` advantage reads
for FPR (``fpr = true``) or as a baseline (``baseline = "group_mean"`` / ``"grpo_anchor"``).

**Math** (group ``b``, prompt ``x_b``)::

    first  = ctx.rollout([Request(i_b, n=initial)])                        scored, r1[b, j]
    j*_b   = argmin_j r1[b, j]                                              select = "lowest"
           ~ Categorical(softmax_j(1 − r1[b, j]))                           select = "softmax"
    c_b    = template.format(prompt=x_b, completion=y1[b, j*_b], instruction=instruction)
    refine = ctx.rollout([Request(i_b, n=G, offset=initial, prompt=encode(c_b))])   r[b, g]
    stage1_reward[b] = r1[b, j*_b];   ctx[b][g] = encode(c_b);   prompt_ids[b] = encode(x_b)
    advantage (alphagrpo, fpr):  r[b, g] := min_g stage1_reward  if r[b, g] ≤ stage1_reward[b]
    reflect/improved = mean over valid refinements of 1[r[b, g] > stage1_reward[b]]   (raw r, before FPR)

**Defaults**

- ``initial = 1`` [CODE] stage 1 generates one image per prompt (more: the lowest of several).
- ``select = "lowest"`` [CODE] the authors' default; ``"softmax"`` [CODE] their sampled option.
- ``template = "{prompt}{completion}\\n{instruction}"`` [INFERRED] the prompt, the attempt as the
  model wrote it after the prompt, then the instruction on a new line (the paper conditions on the
  image and a reflection prompt); a chat prompt gets the attempt as an assistant turn and the
  instruction as a user turn.
- ``instruction = "Reflect: check each attribute, then answer again="`` [INFERRED] the paper's
  reflection prompt asks for a critique and a fix; the toy's ends in ``=`` as its prompts do.
- ``train_first = false`` [INFERRED] only the refinements are trained (the reflection task alone);
  ``true`` also trains the stage-1 attempts, as a group of their own under the plain prompt (GRPO
  among the ``initial >= 2`` attempts; ``stage1_reward`` NaN, so FPR leaves them as they are) —
  the paper trains generation and reflection in one model. The batch is then ``[first groups;
  refinement groups]``, two groups per prompt: the estimator must keep groups apart (``by =
  "group"``) and use the plain baseline, which ``check`` enforces at build.

**Notes**

1. The whole step is skipped, in the paper, when no refinement improved. With ``fpr = true`` a group
   where none improved is constant (every reward the stage-1 one), advantage exactly 0; a step where
   none improved anywhere has zero advantage everywhere — only a KL term still moves the model.
   ``step_stats`` logs ``reflect/any_improved`` (0 on such a step).
2. Only valid rows with a finite reward can be selected; a group with none refines its first row and
   gets ``stage1_reward = NaN``: FPR then leaves its refinements as they are (``r ≤ NaN`` is false).
3. The softmax draw is seeded by ``(seed, step, prompt id)`` only, so a run is reproducible and the
   draw does not depend on the world size.
4. The refinements are scored under ``meta`` of the original row (the rewards see the dataset prompt,
   never the reflection context); their old log-probs are taken by the trainer's first forward under
   the reflection context, the context they were sampled under.
5. The sampler's ``keep`` runs on the refined groups (and, with ``train_first``, on the first ones).
   ``step_stats``: ``reflect/improved``, ``reflect/any_improved``, ``reflect/stage1_reward`` (mean of the refined
   attempts' rewards) and ``reflect/refined_reward`` (mean raw reward of the refinements).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rollout.context import RolloutContext
from groupwise.types import Request, Rollout

TEMPLATE = "{prompt}{completion}\n{instruction}"
INSTRUCTION = "Reflect: check each attribute, then answer again="
SELECTS = ("lowest", "softmax")


def reflection_context(prompt, completion: str, instruction: str = INSTRUCTION, template: str = TEMPLATE):
    """The reflection context: text from the template, or for a chat prompt (a list of messages)
    the attempt as an assistant turn and the instruction as a user turn."""
    if isinstance(prompt, list):
        return [*prompt, {"role": "assistant", "content": completion}, {"role": "user", "content": instruction}]
    return template.format(prompt=prompt, completion=completion, instruction=instruction)


def select_attempt(
    rewards: torch.Tensor, valid: torch.Tensor, select: str = "lowest", generator: torch.Generator | None = None
) -> int:
    """The row of one group to refine: its lowest finite reward
    (first on ties), or a draw ∝ exp(1 − r); -1 when none is finite."""
    ok = valid & torch.isfinite(rewards)  # [I]
    if not bool(ok.any()):
        return -1
    r = rewards.double()  # [I]
    if select == "lowest":
        return int(torch.where(ok, r, torch.inf).argmin())
    logits = torch.where(ok, 1.0 - r, -torch.inf)  # [I]
    return int(torch.multinomial(torch.softmax(logits, 0), 1, generator=generator))


@register("rollout", "alphagrpo_reflect")
@dataclass
class AlphaGRPOReflect:
    """A first attempt per prompt, then G refinements of its worst attempt under a reflection context; ``stage1_reward``
    for FPR (AlphaGRPO)."""

    collects = ("stage1_reward",)
    initial: int = 1
    select: str = "lowest"
    template: str = TEMPLATE
    instruction: str = INSTRUCTION
    train_first: bool = False

    def __post_init__(self) -> None:
        if self.initial < 1:
            raise ConfigError(
                f"rollout alphagrpo_reflect: initial={self.initial} must be >= 1 (attempts per prompt in stage 1)"
            )
        if self.train_first and self.initial < 2:
            raise ConfigError(
                "rollout alphagrpo_reflect: train_first needs initial >= 2 (a "
                f"group of one attempt has no advantage); got initial={self.initial}"
            )
        if self.select not in SELECTS:
            raise ConfigError(f"rollout alphagrpo_reflect: select={self.select!r}; use one of {', '.join(SELECTS)}")
        for key in ("{prompt}", "{completion}", "{instruction}"):
            if key not in self.template:
                raise ConfigError(f"rollout alphagrpo_reflect: template={self.template!r} must contain {key}")
        self._stats: dict[str, float] = {}

    def check(self, components: list) -> None:
        """At build, with ``train_first``: the batch holds two groups per prompt (first attempts and
        refinements), so an estimator that pools a prompt's groups or reads the stage-1 baseline would
        mix them (the first groups' ``stage1_reward`` is NaN)."""
        if not self.train_first:
            return
        for c in components:
            if getattr(c, "stage", "") != "advantage":
                continue
            if getattr(c, "by", "group") == "prompt" or getattr(c, "baseline", "group") != "group":
                raise ConfigError(
                    "rollout alphagrpo_reflect: train_first puts the first "
                    "attempts and the refinements of a prompt in two groups; "
                    f"the estimator {getattr(c, 'registry_name', type(c).__name__)!r} "
                    f"pools by={getattr(c, 'by', None)!r} / "
                    f'baseline={getattr(c, "baseline", None)!r}: use by="group", baseline="group"'
                )

    def __call__(self, ctx: RolloutContext) -> Rollout:
        ids = ctx.draw(ctx.batch_size)
        info = ctx.info(0)
        first = ctx.rollout([Request(key=i, n=self.initial) for i in ids])
        stage1, requests = [], []
        for b, key in enumerate(ids):
            gen = (
                torch.Generator().manual_seed((info.seed * 1_000_003 + info.step) * 1_000_003 + int(key))
                if self.select == "softmax"
                else None
            )
            j = select_attempt(first.rewards[b], first.group_valid[b], self.select, gen)
            stage1.append(float(first.rewards[b, j]) if j >= 0 else float("nan"))
            j = max(j, 0)  # Note 2: no finite attempt -> the first row, stage-1 reward NaN
            text = reflection_context(first.meta[b]["prompt"], first.completions[b][j], self.instruction, self.template)
            requests.append(Request(key=key, n=ctx.group_size, offset=self.initial, prompt=ctx.policy.encode(text)))
        refined = ctx.rollout(requests)
        contexts = [list(p) for p in refined.prompt_ids]  # the reflection context each group was sampled under
        refined.ctx = [[c] * refined.shape[1] for c in contexts]  # [B][G]
        refined.prompt_ids = [list(p) for p in first.prompt_ids]  # the group's prompt stays the dataset prompt
        s = torch.tensor(stage1, dtype=torch.float32)  # [B]
        refined.set_extra("stage1_reward", s, "group")
        ok = refined.group_valid & torch.isfinite(refined.rewards)  # [B,G]
        better = ok & (refined.rewards > s[:, None])  # [B,G] NaN stage-1 never counts as improved
        n_ok = int(ok.sum())
        finite = torch.isfinite(s)
        self._stats = {
            "reflect/improved": float(better.sum()) / max(1, n_ok),
            "reflect/any_improved": float(bool(better.any())),
            "reflect/stage1_reward": float(s[finite].mean()) if bool(finite.any()) else float("nan"),
            "reflect/refined_reward": float(refined.rewards[ok].mean()) if n_ok else float("nan"),
        }
        if self.train_first:  # Defaults: the first attempts as groups of their own, under the plain prompt
            first.set_extra("stage1_reward", torch.full((first.shape[0],), float("nan")), "group")
            refined = Rollout.concat([first, refined])  # [2B,...]
        keep = ctx.keep(refined)  # [B] bool (or [2B])
        return refined if bool(keep.all()) else refined.select(keep.nonzero().flatten())

    def step_stats(self) -> dict[str, float]:
        return dict(self._stats)
