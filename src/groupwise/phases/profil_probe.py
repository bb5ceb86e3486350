"""ProFIL's offline phase: label the base model's own steps by forced answers and train the probe once.

"Drop the Act: Probe-Filtered RL for Faithful Chain-of-Thought Reasoning", Swapnil Parekh, 2026.
https://arxiv.org/abs/2605.11467 — spec 34. Only the abstract was available; no code.

**Change vs GRPO**: none by itself. It runs before the RL steps, on the policy as it is then (the
frozen base: after any sft phase, before RL) and produces the artifact ``probe`` that the ``profil``
advantage shaper (``advantages/profil_shaper.py``) applies to every RL batch.

**Procedure** (maths in ``advantages/profil.py``)::

    rollouts   samples completions for each of `prompts` train rows (temperature, seeded)
    steps      segment_steps(token texts, sep)              step id per completion token
    forced_k   greedy `forced_tokens` tokens after  prompt + completion up to step k's last token + marker,
               read up to the first sep                     (the answer the prefix already gives)
    final      the completion's text after its last marker, up to sep (rollouts without one: skipped)
    labels     commitment_labels(forced, final)             1 = step k comes after a committed step
    H          hidden(layer) of the base on the rollout     [N,T,d], the state predicting each token
    probe      AttnProbe(d, n_heads), BCE on the labelled steps of the train prompts, Adam, full batch

**Defaults**

- trained once on the frozen base; labels from forced answers, no humans [ABSTRACT].
- ``marker = "Therefore, the final answer is"`` (spec's forcing string), ``sep = "\\n"`` [INFERRED];
  the ``profil`` recipe's toy uses ``"#"`` and ``";"``.
- ``layer = 1`` [INFERRED] the spec's small-scale analogue ("probe on layer-1 states").
- ``n_heads = 4`` [INFERRED]; ``steps = 300``, ``lr = 1e-2``, ``val_fraction = 0.25`` [INFERRED].
- ``prompts = 192``, ``samples = 2``, ``temperature = 1.0``, ``max_new_tokens = 32``,
  ``forced_tokens = 8`` [INFERRED] sized for the toy on a CPU.

**Notes**

1. ``hidden(l)`` at token t is the state at the position that *predicts* t (the prefix before it),
   as the ``hidden`` provider defines it; the shaper reads the same quantity from the reference.
2. The artifact holds the probe's weights and shape, ``layer``, ``sep`` and the text of every
   vocabulary id (``token_text``), so the shaper finds the same steps from token ids alone.
3. Summary (``summary.json`` under the phase's name): rollouts sampled and labelled, labelled
   steps, their positive share, probe train / held-out accuracy and the held-out majority-class
   accuracy (what a constant guess gets). Held-out = the rollouts of a seeded ``val_fraction`` of
   the prompts, never trained on.
4. Sampling draws its noise from step −2 (RL's steps are 0, 1, …; held-out sampling uses −1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from groupwise.advantages.profil import AttnProbe, commitment_labels, segment_steps
from groupwise.errors import ConfigError
from groupwise.phases import PhaseContext
from groupwise.registry import register
from groupwise.types import Request, StepInfo


def answer_after(text: str, marker: str, sep: str) -> str | None:
    """The text after the last ``marker`` up to the next ``sep``, stripped; None without a marker."""
    if marker not in text:
        return None
    return text.rsplit(marker, 1)[1].split(sep, 1)[0].strip()


def step_ids_of(tokens: list[int], token_text: list[str], sep: str, pad_to: int) -> torch.Tensor:
    """[pad_to] int64 step id per completion token (−1: no step, EOS, padding)."""
    texts = [token_text[t] if 0 <= t < len(token_text) else "" for t in tokens]
    return segment_steps(texts, sep=sep, pad_to=pad_to)  # [T]


@register("phase", "profil_probe")
@dataclass
class ProfilProbe:
    """ProFIL's probe: forced-answer commitment labels on the base model's rollouts, an attention-pooling probe on
    hidden(layer)."""

    kind = "offline"
    artifact: str = "probe"
    layer: int = 1
    n_heads: int = 4
    prompts: int = 192
    samples: int = 2
    temperature: float = 1.0
    max_new_tokens: int = 32
    marker: str = "Therefore, the final answer is"
    sep: str = "\n"
    forced_tokens: int = 8
    steps: int = 300
    lr: float = 1e-2
    val_fraction: float = 0.25

    def __post_init__(self) -> None:
        for key in ("prompts", "samples", "max_new_tokens", "forced_tokens", "steps", "n_heads"):
            if getattr(self, key) < 1:
                raise ConfigError(f"phase profil_probe: {key}={getattr(self, key)} must be >= 1")
        if self.layer < 0 or not 0.0 <= self.val_fraction < 1.0 or not self.marker or not self.sep:
            raise ConfigError(
                f"phase profil_probe: need layer >= 0 (got {self.layer}), val_fraction in [0, 1) (got "
                f"{self.val_fraction}), a non-empty marker and sep (got {self.marker!r}, {self.sep!r})"
            )

    def __call__(self, ctx: PhaseContext) -> dict:
        policy, t0 = ctx.policy, time.perf_counter()
        if not hasattr(policy, "tokenizer"):
            raise ConfigError(
                "phase profil_probe needs a text policy with a tokenizer "
                f"(this one is {getattr(policy, 'modality', '?')})"
            )
        tok = policy.tokenizer
        token_text = [tok.decode([i], skip_special_tokens=True) for i in range(len(tok))]
        n = min(self.prompts, len(ctx.train_rows))
        order = torch.randperm(len(ctx.train_rows), generator=torch.Generator().manual_seed(ctx.seed))[:n].tolist()
        rows = [ctx.train_rows[i] for i in order]
        policy.eval()
        info = StepInfo(step=-2, seed=ctx.seed, max_new_tokens=self.max_new_tokens, phase=self.artifact)
        sampling = {"temperature": self.temperature, "top_p": 1.0, "top_k": 0, "max_new_tokens": self.max_new_tokens}
        with torch.no_grad():
            roll = policy.generate(
                [
                    Request(key=i, n=self.samples, prompt=ctx.prompt(f"phase:{self.artifact}", rows, i))
                    for i in range(n)
                ],
                sampling,
                info,
            )
            hidden = policy.forward(roll, ["logp", f"hidden({self.layer})"])[f"hidden({self.layer})"]  # [B,G,T,d]
        B, G, T = roll.shape
        hidden = hidden.reshape(B * G, T, -1).float()  # [N,T,d]
        lengths = roll.mask.reshape(B * G, T).sum(-1).tolist()  # [N]
        actions = roll.actions.reshape(B * G, T).tolist()
        # [N,T]
        step_ids = torch.stack([step_ids_of(actions[r][: lengths[r]], token_text, self.sep, T) for r in range(B * G)])
        # per row: [K] or None
        labels = self._labels(policy, roll.prompt_ids, actions, lengths, step_ids, token_text, G)
        used = [r for r in range(B * G) if labels[r] is not None and len(labels[r])]
        if not used:
            raise RuntimeError(
                f"phase profil_probe: none of the {B * G} base rollouts states a final answer after {self.marker!r}; "
                f"the probe has no labels (check marker and sep against the task's format)"
            )
        K = int(step_ids.max()) + 1
        y = torch.full((B * G, K), float("nan"))  # [N,K]
        for r in used:
            y[r, : len(labels[r])] = labels[r]
        val_prompts = set(
            torch.randperm(B, generator=torch.Generator().manual_seed(ctx.seed + 1))[
                : round(self.val_fraction * B)
            ].tolist()
        )
        train = [r for r in used if r // G not in val_prompts]
        val = [r for r in used if r // G in val_prompts]
        with torch.random.fork_rng():
            torch.manual_seed(ctx.seed)
            probe = AttnProbe(hidden.shape[-1], self.n_heads)
        optimiser = torch.optim.Adam(probe.parameters(), lr=self.lr)
        for _ in range(self.steps):
            optimiser.zero_grad()
            p = probe.probe_scores(hidden[train], step_ids[train])  # [n,K']
            target = y[train][:, : p.shape[1]]  # [n,K']
            present = ~torch.isnan(target)
            loss = torch.nn.functional.binary_cross_entropy(p[present].clamp(1e-6, 1 - 1e-6), target[present])
            loss.backward()
            optimiser.step()
        probe.eval()
        summary = {
            "rollouts": B * G,
            "labelled_rollouts": len(used),
            "train_rollouts": len(train),
            "val_rollouts": len(val),
            "labelled_steps": int((~torch.isnan(y[used])).sum()),
            "positive_share": _mean(y[used]),
            "train_accuracy": self._accuracy(probe, hidden, step_ids, y, train),
            "val_accuracy": self._accuracy(probe, hidden, step_ids, y, val),
            "val_majority": _majority(y[val]) if val else None,
            "final_loss": float(loss.detach()),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        ctx.say(
            f"phase {self.artifact!r}: {len(used)} labelled rollouts, {summary['labelled_steps']} steps "
            f"({summary['positive_share']:.2f} post-commitment); probe accuracy train "
            f"{summary['train_accuracy']:.3f}, held-out {summary['val_accuracy'] if val else float('nan'):.3f}"
        )
        return {
            "state": probe.state_dict(),
            "layer": self.layer,
            "d_model": hidden.shape[-1],
            "n_heads": self.n_heads,
            "d_head": probe.d_head,
            "sep": self.sep,
            "token_text": token_text,
            "summary": summary,
        }

    def _labels(self, policy, prompts, actions, lengths, step_ids, token_text, G) -> list:
        """Per rollout: [K] commitment labels from forced answers, or None without a final answer."""
        marker_ids = policy.encode_completion(self.marker)[:-1]  # without the EOS
        requests, where, finals = [], [], []
        for r, n in enumerate(lengths):
            ids, text = (
                actions[r][:n],
                "".join(token_text[t] if 0 <= t < len(token_text) else "" for t in actions[r][:n]),
            )
            finals.append(answer_after(text, self.marker, self.sep))
            K = int(step_ids[r].max()) + 1
            if finals[r] is None or K < 1:
                continue
            for k in range(K - 1):  # the last step's forced answer is the final one: it never decides a label
                end = int((step_ids[r] == k).nonzero().max()) + 1
                prompt = list(prompts[r // G]) + ids[:end] + marker_ids
                policy.check_fits(
                    prompt, self.forced_tokens, f"phase {self.artifact}: forced answer of rollout {r}, step {k}"
                )
                requests.append(Request(key=len(requests), n=1, prompt=prompt))
                where.append((r, k))
        forced: dict[tuple[int, int], str | None] = {}
        if requests:
            info = StepInfo(step=-2, seed=0, max_new_tokens=self.forced_tokens, phase=self.artifact)
            with torch.no_grad():
                gen = policy.generate(
                    requests,
                    {
                        "temperature": 1.0,
                        "top_p": 1.0,
                        "top_k": 0,
                        "max_new_tokens": self.forced_tokens,
                        "greedy": True,
                    },
                    info,
                )
            counts = gen.mask[:, 0].sum(-1).tolist()
            for j, (r, k) in enumerate(where):
                text = "".join(
                    token_text[t] if 0 <= t < len(token_text) else "" for t in gen.actions[j, 0, : counts[j]].tolist()
                )
                forced[(r, k)] = text.split(self.sep, 1)[0].strip()
        out = []
        for r, final in enumerate(finals):
            K = int(step_ids[r].max()) + 1
            if final is None or K < 1:
                out.append(None)
                continue
            out.append(commitment_labels([forced[(r, k)] for k in range(K - 1)] + [final], final))  # [K]
        return out

    @staticmethod
    def _accuracy(probe, hidden, step_ids, y, rows) -> float | None:
        if not rows:
            return None
        with torch.no_grad():
            p = probe.probe_scores(hidden[rows], step_ids[rows])  # [n,K']
        target = y[rows][:, : p.shape[1]]
        present = ~torch.isnan(target)
        return float(((p[present] > 0.5).float() == target[present]).float().mean())


def _mean(y: torch.Tensor) -> float:
    present = ~torch.isnan(y)
    return float(y[present].mean()) if present.any() else float("nan")


def _majority(y: torch.Tensor) -> float:
    share = _mean(y)
    return max(share, 1.0 - share)
