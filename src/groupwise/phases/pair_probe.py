"""PAIR's offline phase: label the frozen base's own multi-turn episodes turn by turn and fit the two-stage probe.

"PAIR: Prefix-Aware Internal Reward", 2026, https://arxiv.org/abs/2605.17877 — spec 03 (authors'
``probing/train_pair.py``, through the spec).

**Change vs GRPO**: none by itself. Before the RL steps it plays the policy as it is then (the
frozen base) on the task's environment, labels every assistant turn clean (1) or contaminated (0),
reads the turn features the ``pair`` reward reads (``rewards/pair.py``: ``hidden_at(L)`` at the
turn's last token, attention statistics of ``attn_at(l)``) from the same forward, and fits ``PairProbe``.
Artifact ``pair_probe``: the probe's tensors and the layers it was fitted on.

**Procedure**::

    episodes  `samples` episodes of each of `prompts` train rows, history mode (the transcript as
              context, as rollout `episodes` plays them), temperature `temperature`, max_turns
    label_t   1 if the episode can still be won after its turns 0..t (a search over `actions` from
              the env state, the env being deterministic), else 0: a turn after the first wrong
              one is contaminated even when it looks right locally
    features  rewards.pair.row_turn_features on policy.forward(rows, [hidden_at(L), attn_at(l)...])
    balance   the majority class of the train turns down-sampled at random to the minority's size
    probe     PairProbe(C).fit(h, a, y): stage 1 on h, stage 2 on [a ; s_bc in-sample]

**Defaults**

- ``C = 0.01`` (sklearn ``LogisticRegression(penalty="l2", C=0.01)``), StandardScaler, balanced
  classes, stage 2 on stage 1's in-sample probabilities [CODE].
- labels from the env's own outcome search, on the base's sampled episodes [INFERRED]: the spec's
  data rewrites one assistant turn of a clean trajectory to be wrong; here the base's own mistakes
  play that part (the reach base errs in about half its episodes), so the probe sees the states
  RL will score.
- ``actions = ["1", "2", "3", "4"]`` [INFERRED] the reach game's moves (the search's candidates).
- ``prompts = 256``, ``samples = 4``, ``temperature = 1.0``, ``max_turns = 16``,
  ``val_fraction = 0.25`` [INFERRED] sized for the toy on a CPU.
- ``hidden_layer = 4``, ``attn_layers = (1, 2, 3, 4)`` [INFERRED] the embedded model's layers
  (must equal the ``pair`` reward's).

**Notes**

1. Summary (``summary.json`` under the phase's name): episodes, turns, positive share, the held-out
   AUROC of ``s_bc`` and of ``s_final`` (the spec's behavioural test 1) and their train AUROCs.
   Held-out = the episodes of a seeded ``val_fraction`` of the rows, never fitted on, not balanced.
2. Sampling draws its noise from step −2 (RL's steps are 0, 1, …), as the other offline phases.
3. The search caches env states by ``repr`` (a dataclass env's fields); an env whose state its
   repr does not show would be searched uncached, still correctly.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from groupwise.errors import ConfigError
from groupwise.phases import PhaseContext
from groupwise.registry import build, register
from groupwise.rewards.pair import PairProbe, row_turn_features
from groupwise.rollout.env import _Rows, env_name, play
from groupwise.rollout.episodes import transcripts
from groupwise.types import StepInfo


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve of ``scores`` for ``labels`` (1 positive), ties counted half;
    NaN without both classes."""
    s, y = scores.double(), labels.bool()
    pos, neg = s[y], s[~y]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).double().sum() + 0.5 * (pos[:, None] == neg[None, :]).double().sum()
    return float(greater / (len(pos) * len(neg)))


def can_win(env, actions: list[str], cache: dict) -> bool:
    """Whether some sequence of ``actions`` from the env's current state ends with a positive reward."""
    key = repr(env)
    if key in cache:
        return cache[key]
    won = False
    for a in actions:
        nxt = copy.deepcopy(env)
        _, reward, done = nxt.step(a)
        if reward > 0 or (not done and can_win(nxt, actions, cache)):
            won = True
            break
    cache[key] = won
    return won


def turn_labels(env_proto, row: dict, texts: list[str], actions: list[str], seed: int, cache: dict) -> list[int]:
    """[n] 1 while the episode can still be won after turn t (or has been won), else 0."""
    env = copy.deepcopy(env_proto)
    env.reset(row, seed)
    labels, ret = [], 0.0
    for text in texts:
        _, reward, done = env.step(text)
        ret += reward
        labels.append(int(ret > 0 or (not done and can_win(env, actions, cache))))
    return labels


@register("phase", "pair_probe")
@dataclass
class PairProbePhase:
    """PAIR's probe: turn labels from an outcome search on the base's own episodes, the two-stage linear probe on hidden
    states and attention."""

    kind = "offline"
    artifact: str = "pair_probe"
    hidden_layer: int = 4
    attn_layers: tuple = (1, 2, 3, 4)
    C: float = 0.01
    prompts: int = 256
    samples: int = 4
    temperature: float = 1.0
    max_turns: int = 16
    separator: str = " "
    env: str | None = None
    env_params: dict = field(default_factory=dict)
    actions: tuple = ("1", "2", "3", "4")
    val_fraction: float = 0.25

    def __post_init__(self) -> None:
        self.attn_layers, self.actions = tuple(int(l) for l in self.attn_layers), tuple(str(a) for a in self.actions)
        for key in ("prompts", "samples", "max_turns"):
            if getattr(self, key) < 1:
                raise ConfigError(f"phase pair_probe: {key}={getattr(self, key)} must be >= 1")
        if (
            self.C <= 0
            or not 0.0 <= self.val_fraction < 1.0
            or not self.actions
            or self.hidden_layer < 0
            or any(l < 1 for l in self.attn_layers)
        ):
            raise ConfigError(
                f"phase pair_probe: need C > 0 (got {self.C}), val_fraction in [0, 1) (got "
                f"{self.val_fraction}), a non-empty actions list (got {list(self.actions)}), hidden_layer "
                f">= 0 and attn_layers >= 1 (got {self.hidden_layer}, {list(self.attn_layers)})"
            )

    def __call__(self, ctx: PhaseContext) -> dict:
        policy, t0 = ctx.policy, time.perf_counter()
        n = min(self.prompts, len(ctx.train_rows))
        order = torch.randperm(len(ctx.train_rows), generator=torch.Generator().manual_seed(ctx.seed))[:n].tolist()
        rows = [ctx.train_rows[i] for i in order]
        info = StepInfo(step=-2, seed=ctx.seed, max_new_tokens=ctx.max_new_tokens or 1, phase=self.artifact)
        sampling = {
            "temperature": self.temperature,
            "top_p": 1.0,
            "top_k": 0,
            "max_new_tokens": ctx.max_new_tokens or 1,
        }
        policy.eval()
        with torch.no_grad():
            played = play(
                _Rows(policy, rows, sampling, info),
                list(range(n)),
                self.samples,
                self.max_turns,
                self.env,
                self.env_params,
                history=True,
                separator=self.separator,
                who=f"phase {self.artifact}",
            )
            batch, _ = transcripts(played, self.separator)
            quantities = ["logp", f"hidden_at({self.hidden_layer})", *(f"attn_at({l})" for l in self.attn_layers)]
            out = policy.forward(batch, quantities)
        protos, cache = {}, {}
        H, A, y, row_of = [], [], [], []
        lengths = batch.mask.sum(-1)  # [B,G]
        for b, group in enumerate(played.episodes):
            name = env_name(self.env, rows[group[0].key], f"phase {self.artifact}")
            proto = protos.setdefault(name, build("env", name, **self.env_params))
            for g, ep in enumerate(group):
                if not ep.actions:
                    continue
                labels = turn_labels(proto, rows[ep.key], ep.texts, list(self.actions), 0, cache.setdefault(name, {}))
                spans, h, a = row_turn_features(
                    out[f"hidden_at({self.hidden_layer})"][b, g],
                    [out[f"attn_at({l})"][b, g] for l in self.attn_layers],
                    batch.row_mask[b, g],
                    len(batch.prompt_ids[b]),
                    int(lengths[b, g]),
                    batch.segment_id[b, g],
                )
                if len(spans) != len(labels):
                    raise RuntimeError(
                        f"phase {self.artifact}: episode {b}/{g} has {len(labels)} "
                        f"actions but {len(spans)} turns in its transcript"
                    )
                H.append(h)
                A.append(a)
                y += labels
                row_of += [b] * len(labels)
        H, A, y, row_of = torch.cat(H), torch.cat(A), torch.tensor(y, dtype=torch.float64), torch.tensor(row_of)
        val_rows = torch.randperm(n, generator=torch.Generator().manual_seed(ctx.seed + 1))[
            : round(self.val_fraction * n)
        ]
        is_val = torch.isin(row_of, val_rows)  # [N]
        train = self._balanced((~is_val).nonzero().flatten(), y, ctx.seed + 2)
        probe = PairProbe(self.C).fit(H[train], A[train], y[train])
        summary = {
            "episodes": sum(len(g) for g in played.episodes),
            "turns": len(y),
            "positive_share": float(y.mean()),
            "train_turns": len(train),
            "val_turns": int(is_val.sum()),
            "seconds": 0.0,
        }
        for split, index in (("train", train), ("val", is_val.nonzero().flatten())):
            s_bc, s_final = probe.score(H[index], A[index])
            summary[f"{split}_auroc_bc"], summary[f"{split}_auroc_final"] = (
                auroc(s_bc, y[index]),
                auroc(s_final, y[index]),
            )
        summary["seconds"] = round(time.perf_counter() - t0, 1)
        ctx.say(
            f"phase {self.artifact!r}: {summary['turns']} turns ({summary['positive_share']:.2f} clean); "
            f"held-out AUROC s_bc {summary['val_auroc_bc']:.3f}, s_final {summary['val_auroc_final']:.3f}"
        )
        return {
            "probe": probe.state(),
            "hidden_layer": self.hidden_layer,
            "attn_layers": list(self.attn_layers),
            "summary": summary,
        }

    @staticmethod
    def _balanced(index: torch.Tensor, y: torch.Tensor, seed: int) -> torch.Tensor:
        """``index`` with its majority label down-sampled (seeded) to the minority's count."""
        pos, neg = index[y[index] == 1], index[y[index] == 0]
        k = min(len(pos), len(neg))
        if k == 0:
            raise RuntimeError(
                f"phase pair_probe: the train turns are all of one label ({len(pos)} clean, {len(neg)} contaminated); "
                f"sample more episodes (prompts, samples) or raise the temperature"
            )
        g = torch.Generator().manual_seed(seed)
        pick = lambda x: x[torch.randperm(len(x), generator=g)[:k]]  # noqa: E731
        return torch.cat([pick(pos), pick(neg)]).sort().values
