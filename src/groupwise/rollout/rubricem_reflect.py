"""RubricEM's reflection meta-policy as a rollout strategy (registered as ``rubricem_reflect``): the
policy, under another prompt, writes reflections on its judged attempts; they are rewarded by how much
they improve a re-attempt, trained with GRPO next to the task rows, and the accepted ones go into a
rubric bank that later prompts of the same task type retrieve.

"RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards", arXiv
2605.10899, 2026 (spec 39; known from a summary, no code: every form below is [INFERRED] from the
spec's "same weights, different prompt: (task, trajectory, judge feedback) -> reflection R; reward
1[judge approves R]·(score(attempt | R) − score(attempt | no R)); GRPO over G reflections; accepted
reflections stored in a bank and retrieved into future prompts"). The bank: ``groupwise/rubric_bank.py``;
the stage judge: reward ``stage_rubric``; the stage advantage: estimator ``rubricem``.

**Change vs GRPO**: each step's batch holds, besides the G task rows of each prompt, a group of G
reflection rows per prompt (row j reflects on attempt j), each under its own reflection prompt
(``Rollout.ctx``) and rewarded by ``r_meta``; so the same weights learn to solve the task and to write
reflections that help solve it. Task prompts of a type with accepted reflections carry the newest
``retrieve`` of them in their context.

**Math** (group b of prompt x_b, task key κ_b = meta[key_column]; y_{b,j} its task rows, s(·) the
weighted total reward of the run's rewards, f_{b,j} the per-stage feedback)::

    arm_b       = u_b < retrieve_share,   u_b ~ U(0,1) from (seed, step), in draw order
    H_b         = bank.retrieve(κ_b, retrieve)            if arm_b, else []
    x̃_b         = context_template(hint = "; ".join(H_b), prompt = x_b)   if H_b, else x_b
    y_{b,j}     ~ π(· | x̃_b),  j < G                                        task rows (trained)
    f_{b,j}     = " ".join(f"{label}={part:.2g}")  over the text rewards' columns of y_{b,j}
    R_{b,j}     ~ π(· | reflect_template(prompt = x_b, attempt = y_{b,j}, feedback = f_{b,j}))
    y'_{b,j}    ~ π(· | context_template(hint = R_{b,j}, prompt = x_b))     re-attempt (scored only)
    base_{b,j}  = s(y_{b,j})                         baseline = "attempt"
                = mean_{j' valid} s(y_{b,j'})        baseline = "group"
    r_meta      = 1[approve(R_{b,j})] · (s(y'_{b,j}) − base_{b,j})
    bank.add(κ_b, R_{b,j})   for j = 0..G−1 in order, when approve(R_{b,j}) and r_meta > accept_above
    batch       = task groups ⊕ reflection groups (row j of reflection group b: R_{b,j} under its prompt)

Every column of a reflection row's ``reward_parts`` is ``r_meta``, so its total is Σ_k w_k·r_meta and
any estimator normalises it within the reflection group: ``rubricem`` gives every stage r_meta, i.e.
GRPO (population std) on the reflection rows.

**Defaults** (all [INFERRED]: the spec names the mechanism, the forms are ours)

- ``reflect_template = "{prompt}\\n{attempt}\\n{feedback}\\nhint:"`` — the task, the judged attempt and
  the judge's per-stage scores, short enough for the embedded model's 128 positions.
- ``context_template = "hint:{hint}\\n{prompt}"`` — a reflection put before the task (re-attempts
  and bank retrieval alike).
- ``reflection_tokens = 16`` — the spec's "short hint strings".
- ``baseline = "attempt"`` — score(attempt | no R) is the judged attempt R was written from (the
  spec's form read literally); ``"group"`` uses the group's mean task score (lower variance).
- ``approve = "nonempty"`` — the programmatic judge approves a reflection that is non-empty and ended
  (EOS within ``reflection_tokens``); ``"always"`` approves every one.
- ``accept_above = 0.0`` — a reflection enters the bank when approved and it improved the re-attempt.
- ``retrieve = 1`` — the newest reflection of the task's key goes into its prompt (the spec: "retrieved
  into future prompts"); ``0`` keeps the bank out of prompts (it is still filled).
- ``retrieve_share = 1.0`` — the share of groups drawn into the retrieval arm; ``0.5`` gives a
  same-step comparison of hinted and plain groups (the claim's metrics, Notes 4).
- ``key_column = "question"`` — the task type (``evidence``: the asked pair, e.g. ``a+d``; the spec's
  "bank = dict keyed by task type"); ``""`` keys by the prompt text itself.
- ``capacity = 8`` (the bank's), ``train_reflections = true`` (``false``: the reflection rows are
  generated and scored but not trained, the bank is still filled).

**Notes**

1. Reflection rows are judged by ``r_meta`` only; a re-attempt with no verdict (NaN total) leaves its
   reflection without one (NaN, excluded). A padding row (ragged group) gets no reflection.
2. Prompts: a reflection prompt shortens the attempt text (from its end) until prompt +
   ``rollout.max_new_tokens`` fits the model; a hinted prompt shortens the hint likewise. A chat prompt
   gets the hint in front of its last user message. Contexts are built from the row's ``prompt``
   column, so a run whose trainer prompts differ from it (``data.system_prompt``) is refused.
3. The bank is changed only from the gathered whole batch, in group and row order, so every rank holds
   the same bank; ``state_dict`` saves it (a resumed run retrieves what the straight run would).
4. ``step_stats``: ``rubricem_reflect/task_reward`` (task rows' mean total), ``first_attempt`` (task
   rows of groups without a reflection of their type: outside the arm, or no bank entry yet),
   ``second_attempt`` (task rows of arm groups whose type has a bank entry; with ``retrieve = 0`` they
   are not hinted, so the gap is then a placebo), ``second_minus_first``; ``first_attempt_run``,
   ``second_attempt_run`` and ``gap_run``: the same over every task row since the run began (kept in
   ``state_dict``); ``r_meta``, ``approved``,
   ``accepted`` (shares of reflections), ``reattempt_reward``, ``bank_size``, ``hinted_groups``.
   ``reward/<label>`` and ``reward_mean`` average over every row of the batch, reflection rows too.
5. The sampler's ``keep`` runs on the task groups; a dropped group gets no reflections and is not
   refilled (one round, whatever the sampler's ``max_rounds``). Reflection
   groups share their task's dataset row, so the per-prompt table (``PromptStats``) sees them too.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rollout.context import RolloutContext
from groupwise.rubric_bank import RubricBank, meta_reward
from groupwise.types import Request, Rollout

REFLECT_TEMPLATE = "{prompt}\n{attempt}\n{feedback}\nhint:"
CONTEXT_TEMPLATE = "hint:{hint}\n{prompt}"
BASELINES = ("attempt", "group")
APPROVALS = ("nonempty", "always")


def feedback_text(labels: list[str], parts: list[float]) -> str:
    """The judge's per-stage feedback of one attempt: ``"plan=0.5 compute=0 answer=1"`` (NaN: ``label=none``)."""
    return " ".join(
        f"{label}={part:.2g}" if math.isfinite(part) else f"{label}=none" for label, part in zip(labels, parts)
    )


def with_hint(prompt: Any, hint: str, template: str = CONTEXT_TEMPLATE) -> Any:
    """The prompt with a reflection in front: text through ``template``; a chat prompt's last user message likewise."""
    if isinstance(prompt, list):
        last = max((i for i, m in enumerate(prompt) if m.get("role") == "user"), default=None)
        if last is None:
            raise ConfigError(
                "rollout rubricem_reflect: a chat prompt without a user message has nowhere to put the hint"
            )
        return [
            *prompt[:last],
            {**prompt[last], "content": template.format(hint=hint, prompt=prompt[last]["content"])},
            *prompt[last + 1 :],
        ]
    return template.format(hint=hint, prompt=prompt)


def _text(prompt: Any) -> str:
    return "\n".join(str(m.get("content", "")) for m in prompt) if isinstance(prompt, list) else str(prompt)


@register("rollout", "rubricem_reflect")
@dataclass
class RubricEMReflect:
    """Task rows, then G reflections per group rewarded by r_meta (judge-gated re-attempt gain), a rubric bank into
    later prompts (RubricEM, spec 39)."""

    reflect_template: str = REFLECT_TEMPLATE
    context_template: str = CONTEXT_TEMPLATE
    reflection_tokens: int = 16
    baseline: str = "attempt"
    approve: str = "nonempty"
    accept_above: float = 0.0
    retrieve: int = 1
    retrieve_share: float = 1.0
    key_column: str = "question"
    capacity: int = 8
    train_reflections: bool = True
    request_options: ClassVar[tuple] = ("max_new_tokens",)  # the reflections' own length (Request.sampling)
    collects: ClassVar[tuple] = ()
    bank: RubricBank = field(init=False, repr=False, compare=False)
    last: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _stats: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # first sum, count, second sum, count
    _run: list = field(default_factory=lambda: [0.0, 0, 0.0, 0], init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, keys in (
            ("reflect_template", ("{prompt}", "{attempt}", "{feedback}")),
            ("context_template", ("{hint}", "{prompt}")),
        ):
            missing = [k for k in keys if k not in getattr(self, name)]
            if missing:
                raise ConfigError(f"rollout rubricem_reflect: {name}={getattr(self, name)!r} lacks {missing}")
        if not isinstance(self.reflection_tokens, int) or self.reflection_tokens < 1:
            raise ConfigError(
                f"rollout rubricem_reflect: reflection_tokens={self.reflection_tokens!r} must be an int >= 1"
            )
        if self.baseline not in BASELINES:
            raise ConfigError(f"rollout rubricem_reflect: baseline={self.baseline!r}; use one of {BASELINES}")
        if self.approve not in APPROVALS:
            raise ConfigError(f"rollout rubricem_reflect: approve={self.approve!r}; use one of {APPROVALS}")
        if not isinstance(self.retrieve, int) or self.retrieve < 0:
            raise ConfigError(
                f"rollout rubricem_reflect: retrieve={self.retrieve!r} "
                "must be an int >= 0 (0: the bank stays out of prompts)"
            )
        if not 0.0 <= self.retrieve_share <= 1.0:
            raise ConfigError(f"rollout rubricem_reflect: retrieve_share={self.retrieve_share} must be in [0, 1]")
        if not math.isfinite(self.accept_above):
            raise ConfigError(f"rollout rubricem_reflect: accept_above={self.accept_above} must be finite")
        if not isinstance(self.capacity, int) or self.capacity < 1:
            raise ConfigError(f"rollout rubricem_reflect: capacity={self.capacity!r} must be an int >= 1")
        self.bank = RubricBank(self.capacity)

    # ------------------------------------------------------------------ pieces
    def _task_key(self, meta: dict) -> str:
        if not self.key_column:
            return _text(meta["prompt"])
        if self.key_column not in meta:
            raise ConfigError(
                f"rollout rubricem_reflect: key_column={self.key_column!r} is not a column of the task's rows "
                f'(columns: {sorted(meta)}); name one, or key_column="" to key by the prompt text'
            )
        return str(meta[self.key_column])

    def _approved(self, text: str, truncated: bool) -> bool:
        return True if self.approve == "always" else bool(text.strip()) and not truncated

    def _fit(self, ctx: RolloutContext, build, piece: str, where: str) -> list[int]:
        """``encode(build(piece))``, the piece shortened from its end until it
        fits with the step's max_new_tokens (Note 2)."""
        room = ctx.policy.context - ctx.sampling["max_new_tokens"] if getattr(ctx.policy, "context", None) else None
        while True:
            ids = ctx.policy.encode(build(piece))
            if room is None or len(ids) <= room:
                return ids
            if not piece:
                raise ConfigError(
                    f"rollout rubricem_reflect: {where} does not fit the model's context even "
                    f"without it ({len(ids)} tokens + "
                    f"rollout.max_new_tokens={ctx.sampling['max_new_tokens']} > {ctx.policy.context})"
                )
            piece = piece[: max(0, len(piece) - max(1, (len(ids) - room)))]

    def _hinted(self, ctx: RolloutContext, key: int, hint: str) -> list[int]:
        """The context of row ``key``'s prompt with ``hint`` in front
        (exactly what the task and re-attempt rows are sampled under)."""
        prompt = ctx.meta(key)["prompt"]
        if list(ctx.policy.encode(prompt)) != list(ctx.prompt(key)):
            raise ConfigError(
                "rollout rubricem_reflect builds contexts from the rows' prompt column, but the trainer's "
                "prompts differ (data.system_prompt?); drop data.system_prompt for this strategy"
            )
        return self._fit(ctx, lambda h: with_hint(prompt, h, self.context_template), hint, f"the hint for row {key}")

    def _reflection_prompt(self, ctx: RolloutContext, key: int, attempt: str, feedback: str) -> list[int]:
        prompt = _text(ctx.meta(key)["prompt"])
        return self._fit(
            ctx,
            lambda a: self.reflect_template.format(prompt=prompt, attempt=a, feedback=feedback),
            attempt,
            f"the reflection prompt for row {key}",
        )

    # ------------------------------------------------------------------ the step
    def __call__(self, ctx: RolloutContext) -> Rollout:
        info = ctx.info(0)
        G = ctx.group_size
        ids = ctx.draw(ctx.batch_size)
        keys = [self._task_key(ctx.meta(i)) for i in ids]
        rng = random.Random(info.seed * 1_000_003 + info.step)
        arm = [rng.random() < self.retrieve_share for _ in ids]
        known = [a and bool(self.bank.retrieve(k, 1)) for a, k in zip(arm, keys)]  # second attempts of a type (Notes 4)
        hints = [self.bank.retrieve(k, self.retrieve) if a else [] for a, k in zip(arm, keys)]
        task = ctx.rollout(
            [Request(key=i, n=G, prompt=self._hinted(ctx, i, "; ".join(h)) if h else None) for i, h in zip(ids, hints)]
        )
        keep = ctx.keep(task)  # [B] bool
        kept = keep.nonzero().flatten().tolist()
        task = task.select(kept)
        ids, keys, known, hints = (
            [ids[b] for b in kept],
            [keys[b] for b in kept],
            [known[b] for b in kept],
            [hints[b] for b in kept],
        )
        labels = ctx.reward_stage.labels[: len(ctx.reward_stage.text)]
        slots = [
            (b, j)
            for b in range(len(ids))
            for j in range(G)
            if bool(task.group_valid[b, j]) or bool(task.mask[b, j].any())
        ]  # real rows
        self._stats = self._task_stats(task, known, hints)
        if not slots:
            self.last = {}
            return task
        parts = task.reward_parts.double()  # [B,G,K]
        requests = [
            Request(
                key=ids[b],
                n=1,
                offset=G + j,
                sampling={"max_new_tokens": self.reflection_tokens},
                prompt=self._reflection_prompt(
                    ctx, ids[b], task.completions[b][j], feedback_text(labels, parts[b, j, : len(labels)].tolist())
                ),
            )
            for b, j in slots
        ]
        refl = ctx.generate(requests)  # [R,1,T] in request order, decoded, not scored
        texts = [refl.completions[k][0] for k in range(len(slots))]
        again = ctx.rollout(
            [
                Request(key=ids[b], n=1, offset=2 * G + j, prompt=self._hinted(ctx, ids[b], texts[k]))
                for k, (b, j) in enumerate(slots)
            ]
        )
        r_meta, approved, accepted = self._meta(
            task, slots, texts, refl.truncated[:, 0].tolist(), again.rewards[:, 0].tolist(), keys
        )
        group_of = [[k for k, (b, _) in enumerate(slots) if b == g] for g in range(len(ids))]
        groups = [rows for rows in group_of if rows]
        # [B',G] row j: reflection on attempt j, under its prompt
        refl_groups = refl.regroup([[(k, 0) for k in rows] for rows in groups])
        self._score_reflections(ctx, refl_groups, [[r_meta[k] for k in rows] for rows in groups])
        self.last = {
            "slots": slots,
            "reflections": texts,
            "r_meta": r_meta,
            "approved": approved,
            "accepted": accepted,
            "reattempt": again.rewards[:, 0].tolist(),
            "task": task,
            "reflection_batch": refl_groups,
        }
        finite = [r for r in r_meta if math.isfinite(r)]
        again_ok = again.rewards[:, 0][torch.isfinite(again.rewards[:, 0])]
        self._stats.update(
            {
                "rubricem_reflect/r_meta": sum(finite) / len(finite) if finite else float("nan"),
                "rubricem_reflect/approved": sum(approved) / len(slots),
                "rubricem_reflect/accepted": sum(accepted) / len(slots),
                "rubricem_reflect/reattempt_reward": float(again_ok.double().mean()) if len(again_ok) else float("nan"),
                "rubricem_reflect/bank_size": float(len(self.bank)),
            }
        )
        if not self.train_reflections:
            return task
        return Rollout.concat([task, refl_groups])

    def _meta(self, task: Rollout, slots, texts, truncated, again, keys) -> tuple[list[float], list[bool], list[bool]]:
        """r_meta per reflection (Math) and the bank updates, in slot order (Notes 3)."""
        s = task.rewards.double()  # [B,G]
        valid = task.group_valid & torch.isfinite(s)  # [B,G]
        r_meta, approved, accepted = [], [], []
        for k, (b, j) in enumerate(slots):
            if self.baseline == "attempt":
                base = float(s[b, j]) if bool(valid[b, j]) else float("nan")
            else:
                base = float(s[b][valid[b]].mean()) if bool(valid[b].any()) else float("nan")
            ok = self._approved(texts[k], bool(truncated[k]))
            with_r = float(again[k])
            r = meta_reward(ok, with_r, base) if math.isfinite(with_r) and math.isfinite(base) else float("nan")
            r_meta.append(r)
            approved.append(ok)
            accepted.append(ok and math.isfinite(r) and r > self.accept_above)
            if accepted[-1]:
                self.bank.add(keys[b], texts[k])
        return r_meta, approved, accepted

    def _score_reflections(self, ctx: RolloutContext, batch: Rollout, r_meta: list[list[float]]) -> None:
        """Every text reward column of a reflection row is its r_meta (NaN on padding), then the context's finish."""
        B, G, _ = batch.shape
        values = torch.full((B, G), float("nan"), dtype=torch.float64)  # [B,G]
        for b, row in enumerate(r_meta):
            values[b, : len(row)] = torch.tensor(row, dtype=torch.float64)
        values[~batch.group_valid] = float("nan")
        batch.reward_parts = values[..., None].expand(B, G, len(ctx.reward_stage.text)).clone()  # [B,G,K_text]
        batch.set_extra("reward_failed", torch.zeros(B, G, dtype=torch.bool), "row")
        if not batch.info:  # as the text scorers fill it, so the batch concatenates with the task rows
            batch.info = [[{} for _ in range(G)] for _ in range(B)]
        ctx.finish(batch)

    def _task_stats(self, task: Rollout, known: list[bool], hints: list[list[str]]) -> dict[str, float]:
        s = task.rewards.double()  # [B,G]
        valid = task.group_valid & torch.isfinite(s)  # [B,G]
        second = torch.tensor(known, dtype=torch.bool)[:, None] & valid if known else valid & False  # [B,G]
        first = valid & ~second  # [B,G]

        def mean(m):
            return float(s[m].mean()) if bool(m.any()) else float("nan")

        self._run = [
            self._run[0] + float(s[first].sum()),
            self._run[1] + int(first.sum()),
            self._run[2] + float(s[second].sum()),
            self._run[3] + int(second.sum()),
        ]
        run_first = self._run[0] / self._run[1] if self._run[1] else float("nan")
        run_second = self._run[2] / self._run[3] if self._run[3] else float("nan")
        return {
            "rubricem_reflect/first_attempt_run": run_first,
            "rubricem_reflect/second_attempt_run": run_second,
            "rubricem_reflect/gap_run": run_second - run_first,
            "rubricem_reflect/task_reward": mean(valid),
            "rubricem_reflect/first_attempt": mean(first),
            "rubricem_reflect/second_attempt": mean(second),
            "rubricem_reflect/second_minus_first": mean(second) - mean(first),
            "rubricem_reflect/hinted_groups": sum(bool(h) for h in hints) / max(1, len(hints)),
        }

    def step_stats(self) -> dict[str, float]:
        return dict(self._stats)

    def state_dict(self) -> dict[str, Any]:
        return {"bank": self.bank.state_dict(), "run": list(self._run)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bank.load_state_dict(state["bank"])
        self._run = list(state["run"])
