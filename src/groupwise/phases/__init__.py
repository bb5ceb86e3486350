"""Phases: what a run does before its RL steps (core-2 §2 G).

A run is ``phases`` (each a component of stage ``phase``, in order) and then the RL steps of
``[train]``. A phase is one of two kinds:

- ``kind = "sft"`` trains the policy itself (supervised warm start); its weights carry into RL;
- ``kind = "offline"`` produces a named **artifact** (a dict of tensors and numbers: a trained
  probe, a table) without changing the policy. A component that lists the name in its
  ``artifacts`` gets it through ``use_artifact(name, value)`` before the first RL step; a listed
  name that no configured phase produces is a build error.

``phase(ctx) -> dict | None`` is called with a :class:`PhaseContext`. Every phase's output is
saved in the run folder as it completes — ``phases/<name>.pt`` (the policy's state after an sft
phase, the artifact of an offline one), then its digest ``phases/<name>.sha256`` last, each
replaced atomically — so a run killed in a later phase does not redo it, and a resumed run loads
the artifacts it injects. An output without its digest (a kill between the two writes) was never
finished: the phase runs again, as a phase killed midway does (phases are short); an output whose
digest does not match is damaged, an error naming it. Once an RL checkpoint exists the sft phases
are done: their weights are in it.
After an sft phase (run or loaded) the policy's frozen reference is reset to the trained weights:
RL's reference is the policy RL starts from.

Under torchrun every rank runs every phase (same seeds, same rows). Whether a phase's file is
there already is decided by all ranks together (rank 0 writes it), and an offline phase's artifact
is rank 0's on every rank: a rank whose own result differs is told so. A summary's NaN numbers
(an AUROC without both classes) are written as null.
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from groupwise import dist, runfolder
from groupwise.errors import ConfigError
from groupwise.registry import build_spec

KINDS = ("sft", "offline")


@dataclass
class PhaseContext:
    """What a phase may use: the policy (trained by an sft phase), the task's rows, the run's seed,
    ``prompt(split, rows, i)`` (the policy's prompt ids of a row, checked against its context),
    ``accuracy(policy, rows, split)`` (greedy accuracy under the eval reward), ``say`` (one line
    to the console), and the artifacts of the phases before it. For phases that sample and score
    like an RL step: ``score(rollout, info)`` (the run's rewards into ``rollout.rewards`` [B,G],
    ``rollout.meta`` set by the caller; the step's reward metrics are left as they were),
    ``advantage(rollout, info)`` (the run's advantage estimator on a scored rollout), ``models``
    (the frozen roles' policies by name: a proposal or teacher model) and ``max_new_tokens`` (the
    run's generation budget)."""

    policy: Any
    train_rows: list[dict]
    eval_rows: list[dict]
    seed: int
    prompt: Callable[[str, list[dict], int], list[int]]
    accuracy: Callable[..., float]
    say: Callable[[str], None]
    artifacts: dict[str, Any] = field(default_factory=dict)
    score: Callable[..., Any] | None = None
    advantage: Callable[..., Any] | None = None
    models: dict[str, Any] = field(default_factory=dict)
    max_new_tokens: int = 0
    summary: dict[str, Any] = field(default_factory=dict)  # what each phase reports, under its name, into summary.json


def build_phases(specs: list) -> list[Any]:
    """The configured phases; each needs a ``kind`` of sft or offline and a unique name."""
    phases, seen = [], set()
    for spec in specs:
        phase = build_spec("phase", spec)
        kind, name = getattr(phase, "kind", None), phase_name(phase)
        if kind not in KINDS:
            raise ConfigError(f"phase {name!r} has kind {kind!r}; a phase is one of {KINDS}")
        if name in seen:
            raise ConfigError(f'two phases are named {name!r}; give one an `artifact = "..."` name')
        seen.add(name)
        phases.append(phase)
    return phases


def phase_name(phase: Any) -> str:
    """A phase's name: its ``artifact`` field when set, else its registry name."""
    return getattr(phase, "artifact", "") or phase.registry_name


def check_artifacts(phases: list[Any], components: list[Any]) -> None:
    """Every artifact a component lists is produced by an offline phase configured before RL."""
    made = {phase_name(p) for p in phases if p.kind == "offline"}
    for component in components:
        for name in getattr(component, "artifacts", ()):
            if name not in made:
                who = (
                    f"{getattr(component, 'stage', '')} component "
                    f"{getattr(component, 'registry_name', type(component).__name__)!r}"
                )
                raise ConfigError(
                    f"{who} needs the artifact {name!r}, which no offline phase "
                    f"produces (offline phases: {sorted(made) or 'none'}); "
                    f'add one to `phases`, e.g. phases = [{{name = "...", artifact = "{name}"}}]'
                )


def run_phases(phases: list[Any], ctx: PhaseContext, folder: Path, rl_started: bool, rank: int) -> dict[str, Any]:
    """Run (or load) every phase in order; returns the artifacts by name."""
    for phase in phases:
        name = phase_name(phase)
        path = folder / f"{name}.pt"
        if phase.kind == "sft" and rl_started:
            continue  # its weights are in the RL checkpoint the run resumed from
        # decided together: rank 0 writes the file, a later rank must not see it and skip the barrier
        if dist.agree([is_saved(path)])[0]:
            saved = load_output(path)
            if phase.kind == "sft":
                ctx.policy.load_state_dict(saved["policy"])
                rebase_reference(ctx.policy)
            else:
                ctx.artifacts[name] = saved["artifact"]
            ctx.summary[name] = json_safe(saved.get("summary", {}))
            ctx.say(f"phase {name!r}: done already ({path}), loaded")
            continue
        if rl_started:  # an artifact computed now would see the RL-trained policy, not the one the run began RL with
            digest = path.with_suffix(".sha256").name
            raise RuntimeError(
                f"phase {name!r}: its output {path} (with its digest {digest}) is missing, but the "
                f"run's RL steps have begun; restore the files or train into a new folder"
            )
        if path.exists():
            ctx.say(
                f"phase {name!r}: {path.name} has no digest (a run killed while saving it): running the phase again"
            )
        ctx.say(f"phase {name!r} ({phase.kind}) ...")
        out = phase(ctx) or {}
        if phase.kind == "sft":
            rebase_reference(ctx.policy)
        ctx.summary[name] = json_safe(out.pop("summary", {}) if isinstance(out, dict) else {})
        if phase.kind == "offline":
            out = ctx.artifacts[name] = same_on_every_rank(name, out, ctx.say)
        if rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            state = {"policy": ctx.policy.state_dict()} if phase.kind == "sft" else {"artifact": out}
            save_output(path, {**state, "summary": ctx.summary[name]})
        dist.barrier()
    return ctx.artifacts


def same_on_every_rank(name: str, artifact: Any, say: Callable[[str], None]) -> Any:
    """Rank 0's artifact on every rank (the one its file holds, so a fresh run uses what a resumed
    one loads). Every rank computes the phase with the same seeds; one whose result differs from
    rank 0's (a rank-dependent or non-deterministic phase) is told so, then uses rank 0's."""
    if dist.world_size() == 1:
        return artifact
    buffer = io.BytesIO()
    torch.save(artifact, buffer)
    digests = dist.all_gather_objects([hashlib.sha256(buffer.getvalue()).hexdigest()])
    if len(set(digests)) == 1:
        return artifact  # the same bytes everywhere: nothing to send
    say(
        f"phase {name!r}: the ranks computed different artifacts "
        f"(digests {[d[:8] for d in digests]}); every rank uses rank 0's"
    )
    return dist.broadcast_object(artifact)


def json_safe(value: Any) -> Any:
    """A phase's summary for summary.json (written with allow_nan=False): NaN / inf numbers become None."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def rebase_reference(policy: Any) -> None:
    """After an sft phase the frozen reference (KL terms, ``Need(model="ref")``) is the policy RL
    starts from, not the weights the run loaded: the policy's ``rebase_reference`` when it has one."""
    if hasattr(policy, "rebase_reference"):
        policy.rebase_reference()


def inject(artifacts: dict[str, Any], components: list[Any]) -> None:
    for component in components:
        for name in getattr(component, "artifacts", ()):
            component.use_artifact(name, artifacts[name])


def save_output(path: Path, obj: dict) -> None:
    """``path``, then ``path.sha256`` (of its bytes) last, each replaced atomically. The digest is
    removed first, so at every moment of a save a file without a matching digest is not taken for
    a finished one: :func:`is_saved` calls it never written."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    digest = path.with_suffix(".sha256")
    digest.unlink(missing_ok=True)
    runfolder.write_atomic(path, data)
    runfolder.write_atomic(digest, hashlib.sha256(data).hexdigest() + "\n")


def is_saved(path: Path) -> bool:
    """The phase's output was finished: the file and its digest are both there (the digest is written last)."""
    return path.exists() and path.with_suffix(".sha256").exists()


def load_output(path: Path) -> dict:
    """A saved phase output, checked against its digest (see :func:`is_saved` for one never finished)."""
    digest = path.with_suffix(".sha256")
    if not digest.exists():
        raise RuntimeError(
            f"{path}: the phase output has no digest {digest.name}: it was never finished "
            f"(a rerun runs the phase again)"
        )
    data = path.read_bytes()
    if digest.read_text().strip() != hashlib.sha256(data).hexdigest():
        raise RuntimeError(
            f"{path}: the phase output is incomplete or damaged (its sha256 does not match {digest.name}); "
            f"delete both files to run that phase again"
        )
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
