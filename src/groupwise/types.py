"""The data that flows through the loop: one ``Rollout`` batch, ``Need`` declarations, ``StepInfo``.

Shapes: ``B`` groups (prompts), ``G`` rows per group, ``T`` action steps (completion tokens).
Every row field has ``[B, G, ...]`` leading dims so that a group's rows travel together.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

Level = Literal["group", "row", "token", "segment"]
_LEAD = {"group": 1, "row": 2, "token": 3, "segment": 2}  # a segment extra is [B,G,S]: its S is the batch's own


@dataclass(frozen=True)
class Need:
    """An input a component asks the trainer to compute.

    ``quantity``: a registered provider's name with an optional argument, per completion token:
    ``logp``, ``logprobs`` (the whole next-token log-distribution [.., V]), ``entropy``, ``topk(k)``
    (the k largest log-probs [.., k]), ``kl_to(VIEW)`` (full-vocabulary
    KL(π(·|ctx) ‖ π(·|VIEW ctx)) per token), ``hidden(l)`` (hidden state after layer l [.., H]).
    ``model``: a role name (``policy``, ``ref``); ``view``: a registered ``View`` that re-scores the
    rows under an edited context (``default`` = as sampled); ``grad``: computed inside each
    micro-batch with autograd (``True``) or once per step on the whole batch before micro-batching
    (``False``). An unknown quantity, model or view is a build error naming what exists.

    No-grad results land in the rollout under :attr:`key`: the policy's default ``logp`` is
    ``logp_old``, the reference's is ``logp_ref``; everything else is a token-level extra.
    """

    quantity: str
    model: str = "policy"
    view: str = "default"
    grad: bool = False

    @property
    def name(self) -> str:
        """The provider name: ``topk(5)`` -> ``topk``."""
        return self.quantity.split("(", 1)[0]

    @property
    def arg(self) -> str | None:
        """The provider argument: ``topk(5)`` -> ``"5"``; ``None`` without parentheses."""
        if "(" not in self.quantity:
            return None
        if not self.quantity.endswith(")"):
            raise ValueError(f"need quantity {self.quantity!r} must look like name or name(arg)")
        return self.quantity.split("(", 1)[1][:-1]

    @property
    def key(self) -> str:
        """Where the result lives: ``logp``/``entropy``/... for the policy's default view,
        ``ref.logp``, ``policy@ground_truth.logp`` otherwise."""
        owner = self.model if self.view == "default" else f"{self.model}@{self.view}"
        return self.quantity if owner == "policy" else f"{owner}.{self.quantity}"


@dataclass(frozen=True)
class Request:
    """One prompt's generation request (a group): ``n`` rows of dataset row ``key``. Row ``j`` takes
    its randomness from ``(seed, step, key, offset + j)``, so a later request for the same prompt in
    the same step (a refill round, an allocation round) continues at ``offset`` with fresh samples.
    ``prompt`` is the policy's encoding of the row's prompt (filled by the rollout context);
    ``sampling`` overrides the step's sampling settings for this request (ReMax's greedy baseline:
    ``{"greedy": True}``), with keys from the policy's ``request_options``; ``hook`` perturbs the
    model while it samples this request's rows (``groupwise.hooks``: a kind from the policy's
    ``hooks``), never when they are trained or scored; ``extras`` labels its rows before they are
    scored (name -> [n] values, set as float32 row extras of the rollout, 0 on rows of requests
    without the name), e.g. the steering intensity of each row for a reward that reads it.
    ``prefix`` (token ids, a policy with ``encode``) is a completion prefix the engine does not
    sample: the rows are sampled after ``prompt + prefix``, and each row's completion is ``prefix +
    sampled``, flagged ``forced`` (:data:`FORCED`); its forced tokens carry no loss (``loss_mask``
    holes) unless ``train_prefix``, and their ``logp_sampler`` is the policy's exact log-prob
    (``rollout/context.py``: a counterfactual branch is a row with another forced decision)."""

    key: int
    n: int
    offset: int = 0
    prompt: Any = None
    sampling: dict[str, Any] | None = None
    hook: Any = None
    extras: dict[str, Any] | None = None
    prefix: list[int] | None = None
    train_prefix: bool = False


@dataclass
class StepInfo:
    """What a component may know about where the run is."""

    step: int  # optimiser-step index of the rollout (0-based)
    seed: int  # run seed; per-sample randomness derives from (seed, step, prompt id, sample index)
    max_new_tokens: int  # the generation budget (Dr.GRPO's constant normaliser uses it)
    world_size: int = 1
    rank: int = 0
    round: int = 0  # refill round within a step (dynamic sampling); part of the sample seeds
    total_steps: int = 0  # rollouts in the phase (train.steps); 0 when unknown
    phase: str = "rl"  # the phase this step belongs to
    prompt_stats: Any = None  # the run's shared PromptStats table (groupwise.stats), or None


@dataclass
class Rollout:
    """One batch of groups. All tensors are on CPU unless a stage moves them.

    Required: ``prompt_ids`` (list of B token lists), ``actions`` [B,G,T] long, ``mask`` [B,G,T] bool.
    ``group_valid`` [B,G] marks real rows (ragged groups, rows excluded for a broken reward).

    Row contexts: by default every row of group b is trained and scored under ``prompt_ids[b]``.
    ``ctx`` ([B][G] token lists), when set, gives each row its own context (FBOS-RL's feedback-
    augmented prompts, GROW's local states); the training forward computes each distinct context
    once. ``behav_ctx`` ([B][G]), when set, is the context a row was SAMPLED under where that is not
    its training context (``[]`` = the same): LoPE's Lorem-perturbed prompts and FBOS-RL's feedback
    prompts of rows trained under the original prompt (``under_prompts``); the view ``behaviour``
    scores rows under it. Two masks: ``mask`` is the sequence (a prefix: the tokens that exist and
    are fed to the model); ``loss_mask``, when set, marks the tokens among them that are the
    policy's own actions (holes for environment tokens). ``row_mask`` combines both with ``group_valid``.

    ``row_flags``: named [B,G] bool flags, each set by the strategy that knows it and read by the
    components it concerns; ``injected`` (:data:`INJECTED`) marks rows not sampled by the policy under
    their training context (LoPE's swapped-in resamples, FBOS-RL's guided rows in EPA groups);
    ``forced`` (:data:`FORCED`) rows whose completion starts with a forced ``Request.prefix``;
    ``anchor`` (:data:`ANCHOR`) rows that are generated and scored, enter the advantage statistics, and
    are never trained (``Objective.loss_mask`` drops them: KVPO's unperturbed anchor). A
    batch whose parts set different flags gets ``False`` for a flag a part lacks.

    Segments: ``segment_id`` [B,G,T] long numbers the segments of a row (a multi-turn episode's
    turns, 0..S−1), −1 on tokens in no segment (padding, environment tokens); ``segment``-level
    extras [B,G,S] hold one value per segment (NaN where a row has fewer), e.g. an env's per-turn
    scores. Every field is sliced, padded and joined by its level, never by a list of names.
    """

    # B prompts: the policy's encoding of each (a text policy's token ids, chat template applied; a non-text
    # policy's own form, e.g. the flow toy's [label] or an observation vector of floats, read by it alone)
    prompt_ids: list[list[int]]
    actions: Tensor  # [B,G,T] int64 completion tokens (pad where mask is False)
    mask: Tensor  # [B,G,T] bool, tokens that receive loss
    group_valid: Tensor  # [B,G] bool
    truncated: Tensor  # [B,G] bool, hit the length limit without EOS
    prompt_index: Tensor  # [B] int64, dataset row of each group's prompt
    meta: list[dict[str, Any]] = field(default_factory=list)  # per group: dataset columns
    completions: list[list[str]] = field(default_factory=list)  # [B][G] decoded text
    rewards: Tensor | None = None  # [B,G] float32 (NaN where excluded)
    reward_parts: Tensor | None = None  # [B,G,K] float32, one column per reward function
    advantages: Tensor | None = None  # [B,G] or [B,G,T] float32
    logp_old: Tensor | None = None  # [B,G,T] float32
    logp_ref: Tensor | None = None  # [B,G,T] float32
    logp_sampler: Tensor | None = None  # [B,G,T] float32
    weight: Tensor | None = None  # [B,G,T] float32 token weights from the weight stage
    extras: dict[str, Tensor] = field(default_factory=dict)
    extra_levels: dict[str, Level] = field(default_factory=dict)
    info: list[list[dict[str, Any]]] = field(default_factory=list)  # [B][G] side outputs
    ctx: list[list[list[int]]] = field(default_factory=list)  # [B][G] each row's context; empty = the group's prompt
    loss_mask: Tensor | None = None  # [B,G,T] bool, the policy's own tokens within mask; None = all of mask
    # [B][G] the context each row was sampled under; [] = its training context
    behav_ctx: list[list[list[int]]] = field(default_factory=list)
    row_flags: dict[str, Tensor] = field(default_factory=dict)  # name -> [B,G] bool
    segment_id: Tensor | None = None  # [B,G,T] int64 segment of each token (a turn), -1 in none

    # ------------------------------------------------------------------ helpers
    @property
    def shape(self) -> tuple[int, int, int]:
        B, G, T = self.actions.shape
        return B, G, T

    @property
    def row_mask(self) -> Tensor:
        """[B,G,T] bool: the policy's tokens (``mask``, less ``loss_mask``'s holes) of valid rows."""
        mask = self.mask & self.group_valid[..., None]  # [B,G,T]
        return mask if self.loss_mask is None else mask & self.loss_mask

    def row_contexts(self) -> list[list[list[int]]]:
        """[B][G] the context of every row: ``ctx`` when set, else the group's prompt."""
        if self.ctx:
            return self.ctx
        G = self.actions.shape[1]
        return [[list(p)] * G for p in self.prompt_ids]

    def behaviour_contexts(self) -> list[list[list[int]]]:
        """[B][G] the context every row was sampled under: its ``behav_ctx`` entry when non-empty,
        else its training context."""
        train = self.row_contexts()
        if not self.behav_ctx:
            return train
        return [[list(c) if c else list(t) for c, t in zip(row, own)] for row, own in zip(self.behav_ctx, train)]

    def under_prompts(self) -> Rollout:
        """This batch with every row trained and scored under its group's prompt (``ctx`` cleared); a
        row whose context was another keeps it as the context it was sampled under (``behav_ctx``)."""
        if not self.ctx:
            return self
        sampled = self.behaviour_contexts()
        behav = [[list(c) if list(c) != list(p) else [] for c in row] for row, p in zip(sampled, self.prompt_ids)]
        return dataclasses.replace(self, ctx=[], behav_ctx=behav if any(c for row in behav for c in row) else [])

    def flag(self, name: str) -> Tensor:
        """[B,G] bool: the row flag ``name``, all False when the batch does not set it."""
        value = self.row_flags.get(name)
        return torch.zeros(self.actions.shape[:2], dtype=torch.bool) if value is None else value.bool()

    def set_flag(self, name: str, value: Tensor) -> None:
        if tuple(value.shape) != tuple(self.actions.shape[:2]) or value.dtype != torch.bool:
            raise ValueError(
                f"row flag {name!r} must be a [B,G] = {tuple(self.actions.shape[:2])} "
                f"bool tensor, got {tuple(value.shape)} {value.dtype}"
            )
        self.row_flags[name] = value

    def set_extra(self, key: str, value: Tensor, level: Level) -> None:
        lead = _LEAD[level]
        if tuple(value.shape[:lead]) != self.actions.shape[:lead] or (level == "segment" and value.dim() != 3):
            raise ValueError(
                f"extra {key!r} at level {level} needs leading shape {tuple(self.actions.shape[:lead])}"
                f"{' and one segment axis [B,G,S]' if level == 'segment' else ''}, got {tuple(value.shape)}"
            )
        self.extras[key] = value
        self.extra_levels[key] = level

    def select(self, groups: Tensor | list[int]) -> Rollout:
        """A new Rollout with only the given groups (every field sliced by its level, never by name)."""
        idx = torch.as_tensor(groups, dtype=torch.long)
        ids = idx.tolist()
        for key in self.extras:
            if key not in self.extra_levels:
                raise KeyError(f"extra {key!r} has no declared level")
        out = {}
        for name, v in self.fields():
            if isinstance(v, Tensor):
                out[name] = v[idx]
            elif isinstance(v, list):
                out[name] = [v[i] for i in ids] if v else []
            elif isinstance(v, dict) and _LEVELS[name][0] in ("row", "any"):  # a dict of tensors: row flags, extras
                out[name] = {k: t[idx] for k, t in v.items()}
            else:
                out[name] = dict(v) if isinstance(v, dict) else v
        return Rollout(**out)

    def fields(self) -> list[tuple[str, Any]]:
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]

    def pad_tokens(self, T: int) -> Rollout:
        """A copy whose token-level fields are padded (zeros / False, −1 for ``segment_id``) to ``T`` steps."""
        if self.actions.shape[2] == T:
            return self
        out = {}
        for name, v in self.fields():
            if isinstance(v, Tensor):
                out[name] = _pad_t(v, T, name)
            elif name == "extras":
                out[name] = {k: _pad_level(t, T, self.extra_levels[k]) for k, t in v.items()}
            else:
                out[name] = v
        return Rollout(**out)

    def pad_segments(self, S: int) -> Rollout:
        """A copy whose segment-level extras are padded (NaN) to ``S`` segments."""
        if all(t.shape[2] >= S for k, t in self.extras.items() if self.extra_levels[k] == "segment"):
            return self
        extras = {
            k: _pad_last(t, S, float("nan")) if self.extra_levels[k] == "segment" else t for k, t in self.extras.items()
        }
        return dataclasses.replace(self, extras=extras, extra_levels=dict(self.extra_levels))

    def pad_rows(self, G: int) -> Rollout:
        """A copy with ``G`` row slots per group, the new ones padding (``group_valid`` False, no tokens)."""
        extra = G - self.actions.shape[1]
        if extra <= 0:
            return self

        def pad(v: Tensor, fill: Any = 0) -> Tensor:
            return torch.cat([v, torch.full((v.shape[0], extra, *v.shape[2:]), fill, dtype=v.dtype)], dim=1)

        out: dict[str, Any] = {}
        for name, v in self.fields():
            level, fill = _LEVELS[name]
            if isinstance(v, Tensor):
                out[name] = v if level == "group" else pad(v, fill)
            elif level == "row" and isinstance(v, list):
                out[name] = [list(rows) + [copy.copy(fill)] * extra for rows in v] if v else []
            elif name == "row_flags":
                out[name] = {k: pad(t) for k, t in v.items()}
            elif name == "extras":
                out[name] = {
                    k: (t if self.extra_levels[k] == "group" else pad(t, _EXTRA_FILL[self.extra_levels[k]]))
                    for k, t in v.items()
                }
            else:
                out[name] = v
        return Rollout(**out)

    @staticmethod
    def concat(parts: list[Rollout]) -> Rollout:
        """Concatenate along the group axis, padding T, S (and G, with invalid rows) to the longest part."""
        if len(parts) == 1:
            return parts[0]
        parts = _same_optional_fields(parts)
        G = max(p.actions.shape[1] for p in parts)
        parts = [p.pad_rows(G) for p in parts]
        T = max(p.actions.shape[2] for p in parts)
        out: dict[str, Any] = {}
        for f in dataclasses.fields(parts[0]):
            vals = [getattr(p, f.name) for p in parts]
            if isinstance(vals[0], Tensor):
                out[f.name] = torch.cat([_pad_t(v, T, f.name) for v in vals])
            elif vals[0] is None:
                out[f.name] = None
            elif isinstance(vals[0], list):
                out[f.name] = [x for v in vals for x in v]
            elif f.name == "row_flags":
                out[f.name] = {k: torch.cat([v[k] for v in vals]) for k in vals[0]}
            elif f.name == "extras":
                out[f.name] = {
                    k: torch.cat([_pad_level(p.extras[k], T, p.extra_levels[k]) for p in parts]) for k in vals[0]
                }
            elif f.name == "extra_levels":
                out[f.name] = dict(vals[0])
        return Rollout(**out)

    @staticmethod
    def cat_tokens(parts: list[Rollout]) -> Rollout:
        """Rows of the same groups concatenated along T: row ``(b, g)`` of the result is row ``(b, g)``
        of every part in turn (a chain of sub-generations, M6; the non-text analogue of
        ``rollout.episodes.transcripts``). Each part's tokens (its ``mask``, a prefix) are packed one
        after the other, so the mask stays a prefix; T is the longest joined row. Token-level fields
        and token extras are joined; row-level fields (rewards, flags, contexts, row extras) come from
        the LAST part and group-level ones (prompts, dataset rows, meta, group extras) from the FIRST.
        Segment ids are offset so that every part is one segment (a part with its own ``segment_id``
        keeps its segments, numbered after the earlier parts'): part k's ids start at the total
        segment count S of parts 0..k−1, counted over the batch (a part's S is its largest id + 1, or
        its segment extras' width), and segment extras are joined along S (NaN where a part lacks one).
        One part is returned as it is."""
        if not parts:
            raise ValueError("cat_tokens needs at least one part")
        if len(parts) == 1:
            return parts[0]
        B, G = parts[0].shape[:2]
        for k, p in enumerate(parts):
            if p.shape[:2] != (B, G) or not torch.equal(p.prompt_index, parts[0].prompt_index):
                raise ValueError(
                    f"cat_tokens joins rows of the same groups: part {k} has [B,G] = {tuple(p.shape[:2])} and "
                    f"dataset rows {p.prompt_index.tolist()}, part 0 {(B, G)} and {parts[0].prompt_index.tolist()}"
                )
            T_k = p.shape[2]
            lengths = p.mask.sum(-1)  # [B,G]
            if not torch.equal(p.mask, torch.arange(T_k) < lengths[..., None]):
                raise ValueError(f"cat_tokens: part {k}'s mask is not a prefix of each row; pad rows at their end")
            for name in ("loss_mask", "logp_old", "logp_ref", "logp_sampler", "weight"):
                if (getattr(p, name) is None) != (getattr(parts[0], name) is None):
                    raise ValueError(f"cat_tokens: field {name!r} is set on some parts only; set it on all or none")
        # each part as one segment where it has none; then the batch's segment count per part
        segments = [
            p.segment_id if p.segment_id is not None else torch.where(p.mask, 0, -1).long()  # [B,G,T_k]
            for p in parts
        ]
        counts = []
        for p, seg in zip(parts, segments):
            widths = [t.shape[2] for k, t in p.extras.items() if p.extra_levels[k] == "segment"]
            counts.append(max([int(seg.max()) + 1 if seg.numel() else 0, *widths]))
        lengths = torch.stack([p.mask.sum(-1) for p in parts])  # [K,B,G]
        starts = torch.cumsum(lengths, 0) - lengths  # [K,B,G] each part's first position in the joined row
        T = int(lengths.sum(0).max())

        def join(values: list[Tensor], fill: Any = 0) -> Tensor:  # [B,G,T_k,...] each -> [B,G,T,...]
            out = torch.full((B, G, T, *values[0].shape[3:]), fill, dtype=values[0].dtype)
            for k, (v, p) in enumerate(zip(values, parts)):
                b, g, t = p.mask.nonzero(as_tuple=True)
                out[b, g, starts[k, b, g] + t] = v[b, g, t]
            return out

        first, last = parts[0], parts[-1]
        out: dict[str, Any] = {}
        for name, v in last.fields():
            level, fill = _LEVELS[name]
            if name == "segment_id":
                offsets = [sum(counts[:k]) for k in range(len(parts))]
                ids = [torch.where(seg >= 0, seg + o, -1) for seg, o in zip(segments, offsets)]
                out[name] = join(ids, -1)
            elif level == "token" or (level == "auto" and isinstance(v, Tensor) and v.dim() == 3):
                vals = [getattr(p, name) for p in parts]
                out[name] = None if vals[0] is None else join(vals, fill)
            elif level == "group":
                out[name] = getattr(first, name)
            elif name in ("extras", "extra_levels"):
                continue
            else:
                out[name] = v
        extras: dict[str, Tensor] = {}
        levels: dict[str, Level] = {}
        for key in dict.fromkeys(k for p in parts for k in p.extras):
            owners = [p for p in parts if key in p.extras]
            level = owners[0].extra_levels[key]
            if level == "token":
                if len(owners) != len(parts):
                    raise ValueError(f"cat_tokens: token extra {key!r} is set on some parts only")
                extras[key] = join([p.extras[key] for p in parts])
            elif level == "segment":
                cols = []
                for p, n in zip(parts, counts):
                    t = p.extras.get(key)
                    cols.append(
                        torch.full((B, G, n), float("nan")) if t is None else _pad_last(t.float(), n, float("nan"))
                    )
                extras[key] = torch.cat(cols, dim=2)  # [B,G,ΣS]
            elif level == "group" and key in first.extras:
                extras[key] = first.extras[key]
            elif level == "row" and key in last.extras:
                extras[key] = last.extras[key]
            else:
                continue
            levels[key] = level
        return Rollout(**out, extras=extras, extra_levels=levels)

    def join_rows(self, more: Rollout, groups: list[int]) -> Rollout:
        """This batch with ``more``'s rows appended to its groups: group ``k`` of ``more`` holds further
        rows of group ``groups[k]`` of this batch; rows that ``more`` sampled under another context
        than their group's prompt keep that context (``ctx``). Every group gets ``more``'s G
        new row slots; those of groups ``more`` does not cover are padding (``group_valid`` False,
        no tokens). Fields are joined by level: group-level ones (prompts, meta, group extras) are
        this batch's; row- and token-level ones are concatenated along the row axis."""
        B, G2 = self.shape[0], more.shape[1]
        T = max(self.shape[2], more.shape[2])
        own = [self.prompt_ids[g] for g in groups]
        if self.ctx or more.ctx or any(list(p) != list(q) for p, q in zip(more.prompt_ids, own)):
            # the new rows keep the context they were sampled under
            more = dataclasses.replace(more, ctx=more.row_contexts())
        a, b = _same_optional_fields([self.pad_tokens(T), more.pad_tokens(T)])
        index = torch.as_tensor(groups, dtype=torch.long)  # [B2]

        # [B2,G2,...] -> [B,G2,...] with padding rows for uncovered groups
        def spread(v: Tensor, fill: Any = 0) -> Tensor:
            out = torch.full((B, *v.shape[1:]), fill, dtype=v.dtype)
            out[index] = v
            return out

        out: dict[str, Any] = {}
        for name, v in a.fields():
            w = getattr(b, name)
            level, fill = _LEVELS[name]
            if level == "group" or name == "extra_levels":
                out[name] = v
            elif isinstance(v, Tensor) and isinstance(w, Tensor):
                out[name] = torch.cat([v, spread(w, fill)], dim=1)
            elif isinstance(v, Tensor) or isinstance(w, Tensor):
                raise ValueError(f"join_rows: field {name!r} is set on one batch only")
            elif level == "row" and isinstance(v, list) and (v or w):
                extra = {g: w[k] for k, g in enumerate(groups)} if w else {}
                out[name] = [list(v[g]) + list(extra.get(g, [copy.copy(fill)] * G2)) for g in range(B)]
            elif name == "row_flags":
                out[name] = {key: torch.cat([t, spread(b.row_flags[key])], dim=1) for key, t in a.row_flags.items()}
            elif name == "extras":
                out[name] = {
                    key: (
                        t
                        if a.extra_levels[key] == "group"
                        else torch.cat([t, spread(b.extras[key], _EXTRA_FILL[a.extra_levels[key]])], dim=1)
                    )
                    for key, t in a.extras.items()
                }
            else:
                out[name] = v
        return Rollout(**out)

    def regroup(self, rows: list[list[tuple[int, int]]]) -> Rollout:
        """A new batch whose group ``k`` holds the rows ``rows[k]`` (``(b, g)`` pairs of this batch),
        padded to the longest with invalid rows. Group-level fields (prompt, dataset row, meta, group
        extras) come from the group of each new group's first row; every row keeps the context it
        had (``ctx`` is set when some row's context is not its new group's prompt), the context it
        was sampled under (``behav_ctx``), its flags and segments."""
        if not rows or any(not r for r in rows):
            raise ValueError("regroup needs at least one row in every new group")
        K, J = len(rows), max(len(r) for r in rows)
        first = [r[0][0] for r in rows]
        bi = torch.tensor([[b for b, _ in r] + [r[0][0]] * (J - len(r)) for r in rows])  # [K,J]
        gi = torch.tensor([[g for _, g in r] + [r[0][1]] * (J - len(r)) for r in rows])  # [K,J]
        real = torch.tensor([[True] * len(r) + [False] * (J - len(r)) for r in rows])  # [K,J]
        lead = torch.tensor(first)  # [K]

        def take(v: Tensor, level: str, fill: Any = 0) -> Tensor:
            if level == "group":
                return v[lead]
            out = v[bi, gi]  # [K,J,...]
            pad = ~real.reshape(K, J, *([1] * (out.dim() - 2)))
            return torch.where(pad, torch.full((), fill, dtype=out.dtype), out)

        out: dict[str, Any] = {}
        contexts = self.row_contexts()
        for name, v in self.fields():
            level, fill = _LEVELS[name]
            if isinstance(v, Tensor):
                out[name] = take(v, level, fill)
            elif level == "group" and isinstance(v, list):
                out[name] = [v[b] for b in first] if v else []
            elif name == "ctx":
                own = [[contexts[b][g] for b, g in r] + [[]] * (J - len(r)) for r in rows]
                differs = any(
                    list(c) != list(self.prompt_ids[r[0][0]]) for k, r in enumerate(rows) for c in own[k][: len(r)]
                )
                out[name] = own if differs else []
            elif level == "row" and isinstance(v, list):
                out[name] = [[v[b][g] for b, g in r] + [copy.copy(fill)] * (J - len(r)) for r in rows] if v else []
            elif name == "row_flags":
                out[name] = {key: take(t, "row", False) for key, t in v.items()}
            elif name == "extras":
                out[name] = {
                    key: take(t, self.extra_levels[key], _EXTRA_FILL[self.extra_levels[key]]) for key, t in v.items()
                }
            else:
                out[name] = v
        return Rollout(**out)


# row flag: a row not sampled by the policy under its training context (a swapped-in or guided row)
INJECTED = "injected"
# row flag: a row whose leading completion tokens were imposed (``Request.prefix``), not drawn
FORCED = "forced"
# row flag: a row generated and scored (its reward enters the advantage statistics) but never trained:
# ``Objective.loss_mask`` drops it (KVPO's unperturbed anchor generation, ``rollout/kv_branches.py``)
ANCHOR = "anchor"

# Each field's level and the value of its padding (a padding row, or a padding token of a token field).
# "auto": row-level [B,G] or token-level [B,G,T] by the tensor's rank (advantages). Dicts of tensors
# (row_flags, extras) are handled by their own levels; extra_levels is their declaration.
_LEVELS: dict[str, tuple[str, Any]] = {
    "prompt_ids": ("group", None),
    "prompt_index": ("group", 0),
    "meta": ("group", None),
    "actions": ("token", 0),
    "mask": ("token", False),
    "loss_mask": ("token", False),
    "segment_id": ("token", -1),
    "logp_old": ("token", 0),
    "logp_ref": ("token", 0),
    "logp_sampler": ("token", 0),
    "weight": ("token", 0),
    "advantages": ("auto", 0),
    "group_valid": ("row", False),
    "truncated": ("row", False),
    "rewards": ("row", 0),
    "reward_parts": ("row", 0),
    "completions": ("row", ""),
    "info": ("row", None),
    "ctx": ("row", []),
    "behav_ctx": ("row", []),
    "row_flags": ("row", False),
    "extras": ("any", None),
    "extra_levels": ("declaration", None),
}
_EXTRA_FILL = {
    "group": 0,
    "row": 0,
    "token": 0,
    "segment": float("nan"),
}  # a padding row's value in an extra of each level


def _same_optional_fields(parts: list[Rollout]) -> list[Rollout]:
    """Parts to join where some set an optional field and others do not: the unset ones get its
    default, so nothing is dropped — ``ctx``: each group's prompt; ``loss_mask``: the whole ``mask``;
    ``segment_id``: −1 (no segment); another row list (``behav_ctx``, ``completions``, ``info``): its
    padding value per row; a row flag: False; a segment extra: padded (NaN) to the longest S."""
    if any(p.ctx for p in parts) and not all(p.ctx for p in parts):
        parts = [p if p.ctx else dataclasses.replace(p, ctx=p.row_contexts()) for p in parts]
    for name, (level, fill) in _LEVELS.items():
        if level == "row" and name != "ctx" and isinstance(getattr(parts[0], name), list):
            if any(getattr(p, name) for p in parts) and not all(getattr(p, name) for p in parts):
                parts = [
                    p
                    if getattr(p, name)
                    else dataclasses.replace(
                        p, **{name: [[copy.copy(fill) for _ in range(p.shape[1])] for _ in range(p.shape[0])]}
                    )
                    for p in parts
                ]
    if any(p.loss_mask is not None for p in parts) and any(p.loss_mask is None for p in parts):
        parts = [p if p.loss_mask is not None else dataclasses.replace(p, loss_mask=p.mask.clone()) for p in parts]
    if any(p.segment_id is not None for p in parts) and any(p.segment_id is None for p in parts):
        parts = [
            p
            if p.segment_id is not None
            else dataclasses.replace(p, segment_id=torch.full(p.shape, -1, dtype=torch.long))
            for p in parts
        ]
    flags = sorted({k for p in parts for k in p.row_flags})
    if any(set(p.row_flags) != set(flags) for p in parts):
        parts = [dataclasses.replace(p, row_flags={k: p.flag(k) for k in flags}) for p in parts]
    S = max((t.shape[2] for p in parts for k, t in p.extras.items() if p.extra_levels[k] == "segment"), default=0)
    return [p.pad_segments(S) for p in parts]


def _pad_t(v: Tensor, T: int, name: str) -> Tensor:
    level, fill = _LEVELS[name]
    is_token = level == "token" or (level == "auto" and v.dim() == 3)
    return _pad_last(v, T, fill) if is_token else v


def _pad_level(v: Tensor, T: int, level: str) -> Tensor:
    return _pad_last(v, T) if level == "token" else v


def _pad_last(v: Tensor, T: int, fill: Any = 0) -> Tensor:
    if v.shape[2] >= T:
        return v
    pad = torch.full((*v.shape[:2], T - v.shape[2], *v.shape[3:]), fill, dtype=v.dtype)
    return torch.cat([v, pad], dim=2)
