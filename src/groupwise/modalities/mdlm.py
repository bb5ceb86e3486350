"""A masked-diffusion language model as a policy kind (``model.policy = "mdlm"``; K2 of
``../shared/design/nontext.md``, issue 41): a small bidirectional transformer over the project's
tokenizer plus a [MASK] token, fitted by the masked-diffusion objective and sampled by iterative
unmasking (``modalities/mdlm_net.py``), scored by a likelihood estimator
(``modalities/mdlm_likelihood.py``).

Sources: MDLM (Sahoo et al. 2024, https://arxiv.org/abs/2406.07524) for the absorbing-state objective;
LLaDA (Nie et al. 2025, https://arxiv.org/abs/2502.09992) for low-confidence remasking; d1 /
diffu-GRPO (https://arxiv.org/abs/2504.12216) for RL with a mean-field log-prob. Its first papers
are 54 DACA-GRPO (stratified masking, denoising progress) and 12 HT-GRPO.

**Change vs GRPO**: none to the algorithm; the T axis is the L canvas positions, and ``logp`` is an
estimate (there is no tractable sampling log-prob).

**Math** (prompt x, canvas y of L positions: the completion's tokens then EOS padding)::

    fit (sft phase):  t ~ U(0,1), each position hidden with prob. t,
                      loss = (1/L) Σ_i 1[i hidden] · (−log p_θ(y_i | x, y_t)) / t     (mean over rows)
    logp[b,g,i]     = the estimator's ℓ_i:  "stratified(K)" or "elbo(M)"  (mdlm_likelihood.py)

**Defaults** (all [INFERRED]: the design's K2 toy)

- ``width = 64``, ``layers = 2``, ``heads = 4``, ``max_prompt = 16``, ``length = 8``, ``steps = 8``.
- ``estimator = "stratified(1)"`` (mean-field, d1's); ``allowed = ""`` (every token but [MASK]);
  ``tokenizer = "default"`` (the embedded model's 319 tokens; [MASK] = 319); ``init_seed = 0``.

**Notes**

1. Seeds: row j of a request samples with ``torch.Generator(sample_seed(seed, step, key, offset + j))``
   and stores that seed as the row extra ``mdlm_seed``; the estimator's draws (strata, ELBO masks)
   come from a generator seeded by it (``_estimator_gen``), so the current, old and reference
   forwards of a row see the same strata (common random numbers).
2. Contract: ``actions`` [B,G,L] are the canvas ids (every position trained); token extras
   ``commit_step`` [B,G,L] (int64, 1..S) and ``q_trace`` [B,G,L,S] (float32: the step-s
   probability of the finally committed token, NaN after its commit step); ``logp_sampler`` is
   the estimator's value at sampling time, so ``sampler_is`` would measure nothing on this kind: the
   policy declares ``sampler_logp = "estimate"`` and the build refuses every component that reads it as
   the sampler's log-prob (``reads_sampler_logp``: ``sampler_is``, ``vespo``'s ``sampler_is``,
   ``anchor = "sampler"`` of the trust-region terms).
3. ``allowed`` (characters) restricts the canvas vocabulary to their ids plus EOS: log-probs are
   renormalised over it, in sampling and in scoring alike. Completions decode up to the first EOS.
4. The net runs in float64 (as the other toy kinds). Quantities: ``logp`` (the configured
   estimator), ``entropy`` (of each position's predicted distribution in the stratified pass),
   and the estimators as needs any objective can read, ``strat_logp(K)`` and ``elbo(M)`` [B,G,L].
5. ``save`` writes ``mdlm_policy.pt`` (config + weights); ``model.path`` loads it (``policy/kinds.py``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from groupwise.modalities.mdlm_likelihood import elbo_logp, stratified_logp, stratified_partition
from groupwise.modalities.mdlm_net import Denoiser, unmask
from groupwise.modalities.net_policy import NetPolicy
from groupwise.seeds import sample_seed
from groupwise.types import Request, Rollout, StepInfo

QUANTITIES = frozenset({"logp", "entropy", "strat_logp", "elbo"})
FILE = "mdlm_policy.pt"
_ESTIMATOR = re.compile(r"(stratified|elbo)\((\d+)\)")


def parse_estimator(text: str, length: int) -> tuple[str, int]:
    """``"stratified(4)"`` -> ("stratified", 4); K in 1..length, M >= 1; anything else is a ValueError."""
    match = _ESTIMATOR.fullmatch(str(text).replace(" ", ""))
    if not match or int(match[2]) < 1 or (match[1] == "stratified" and int(match[2]) > length):
        raise ValueError(
            f"MDLMPolicy: estimator={text!r}; use 'stratified(K)' with 1 <= K <= length ({length}; K = 1 is "
            "mean-field) or 'elbo(M)' with M >= 1"
        )
    return match[1], int(match[2])


class MDLMPolicy(NetPolicy):
    """A masked-diffusion LM: iterative unmasking, a configured likelihood estimator (K2)."""

    policy_file = FILE  # what save writes and model.path loads (policy/kinds.py)
    shared_attributes = ("tokenizer",)  # a snapshot shares the tokenizer, not a copy

    def __init__(
        self,
        width: int = 64,
        layers: int = 2,
        heads: int = 4,
        max_prompt: int = 16,
        length: int = 8,
        steps: int = 8,
        estimator: str = "stratified(1)",
        allowed: str = "",
        tokenizer: str = "default",
        init_seed: int = 0,
    ):
        from transformers import AutoTokenizer

        from groupwise.policy.lm import resolve_model_path

        if min(width, layers, heads, max_prompt, length) < 1 or width % heads or not 1 <= steps <= length:
            raise ValueError(
                f"MDLMPolicy: need width, layers, heads, max_prompt, length >= 1, width % heads == 0 and "
                f"1 <= steps <= length; got {width}, {layers}, {heads}, {max_prompt}, {length}, steps={steps}"
            )
        self.estimator = parse_estimator(estimator, length)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(resolve_model_path(tokenizer))
        V = len(self.tokenizer)
        self.eos, self.mask_id = int(self.tokenizer.eos_token_id), V
        ids = [self.tokenizer.convert_tokens_to_ids(c) for c in allowed]
        if any(i is None or i == self.tokenizer.unk_token_id for i in ids):
            raise ValueError(f"MDLMPolicy: allowed={allowed!r} has characters that are not tokens of {tokenizer!r}")
        self.vocab_ok = torch.ones(V, dtype=torch.bool) if not allowed else torch.zeros(V, dtype=torch.bool)  # [V]
        self.vocab_ok[ids + [self.eos]] = True
        self.config = {
            "width": width, "layers": layers, "heads": heads, "max_prompt": max_prompt, "length": length,
            "allowed": allowed, "tokenizer": tokenizer,
        }  # fmt: skip
        self.length, self.steps, self.max_prompt = length, steps, max_prompt
        with torch.random.fork_rng(devices=[]):  # seeded init that leaves the global stream alone
            torch.manual_seed(init_seed)
            self.net = Denoiser(V, width, layers, heads, max_prompt, length).double()
        self.trainable = True
        self.modality = "mdlm"
        self.sampler_logp = "estimate"  # Note 2: the build refuses components that read it as the sampler's
        self.row_extras, self.token_extras = frozenset({"mdlm_seed"}), frozenset({"commit_step", "q_trace"})
        self.request_options = frozenset({"greedy"})
        self.quantities = QUANTITIES
        self.reference: MDLMPolicy | None = None
        self.context = None

    # ------------------------------------------------------------------ encoding
    def encode(self, prompt: Any) -> list[int]:
        """A text prompt as token ids (no special tokens); an encoded prompt (a list of ids: what the rollout
        context passes as a request's prompt) as it is."""
        if isinstance(prompt, (list, tuple)):
            return [int(i) for i in prompt]
        return list(self.tokenizer.encode(str(prompt), add_special_tokens=False))

    def decode(self, rollout: Rollout) -> list[list[str]]:
        """[B][G] each canvas up to its first EOS ("" for padding rows)."""
        texts = []
        for row, oks in zip(rollout.actions.tolist(), rollout.group_valid.tolist()):
            texts.append([self._text(ids) if ok else "" for ids, ok in zip(row, oks)])
        return texts

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids[: ids.index(self.eos)] if self.eos in ids else ids)

    def check_fits(self, ids: list, max_new_tokens: int, where: str) -> None:
        if len(ids) > self.max_prompt:
            raise ValueError(
                f"{where}: a prompt of {len(ids)} tokens is longer than the mdlm's max_prompt={self.max_prompt}; "
                "raise model.params.max_prompt (a new architecture: refit the model)"
            )

    def _logq_fn(self, contexts: Sequence[list[int]]):
        """canvas [N,L] -> log p_θ(· | context, canvas) [N,L,V] float64, renormalised over the allowed ids."""
        for c in contexts:
            self.check_fits(c, 0, "MDLMPolicy")
        P = max(1, max(len(c) for c in contexts))
        prompt = torch.tensor([[self.eos] * (P - len(c)) + list(c) for c in contexts], dtype=torch.long)  # [N,P]
        pad = torch.tensor([[True] * (P - len(c)) + [False] * len(c) for c in contexts])  # [N,P]

        def logq(canvas: Tensor) -> Tensor:
            logits = self.net(prompt, pad, canvas).masked_fill(~self.vocab_ok, -torch.inf)  # [N,L,V]
            return torch.log_softmax(logits, -1)

        return logq

    @staticmethod
    def _estimator_gen(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(sample_seed(int(seed), -1, 0, 0))  # apart from the sampling draws

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def generate(self, requests: Sequence[Request], sampling: dict, info: StepInfo) -> Rollout:
        if not requests or any(r.n < 1 for r in requests):
            raise ValueError("MDLMPolicy.generate needs at least one request, each with n >= 1")
        prompts = [self.encode(r.prompt) for r in requests]
        B, G, L = len(requests), max(r.n for r in requests), self.length
        valid = torch.arange(G)[None, :] < torch.tensor([r.n for r in requests])[:, None]  # [B,G]
        seeds = torch.tensor(
            [[sample_seed(info.seed, info.step, r.key, r.offset + j) for j in range(G)] for r in requests]
        )  # [B,G]
        gens = None if sampling.get("greedy") else [torch.Generator().manual_seed(int(s)) for s in seeds.view(-1)]
        contexts = [p for p in prompts for _ in range(G)]  # B*G
        canvas, commit, trace = unmask(self._logq_fn(contexts), B * G, L, self.steps, gens, self.mask_id)
        keep = valid[..., None]  # [B,G,1]
        out = Rollout(
            prompt_ids=prompts,
            actions=torch.where(keep, canvas.view(B, G, L), self.eos),  # [B,G,L]
            mask=keep.expand(B, G, L).clone(),  # [B,G,L] every canvas position is sampled
            group_valid=valid,
            truncated=torch.zeros(B, G, dtype=torch.bool),
            prompt_index=torch.tensor([r.key for r in requests], dtype=torch.long),
            meta=[{"prompt": r.prompt} for r in requests],
        )
        out.set_extra("mdlm_seed", seeds, "row")  # [B,G] int64 (Note 1)
        out.set_extra("commit_step", torch.where(keep, commit.view(B, G, L), 0), "token")  # [B,G,L]
        out.set_extra("q_trace", trace.view(B, G, L, self.steps).float(), "token")  # [B,G,L,S]
        out.logp_sampler = self.forward(out, ("logp",))["logp"]  # [B,G,L] the estimator at sampling time
        out.completions = self.decode(out)
        return out

    # ------------------------------------------------------------------ scoring
    def forward(self, rollout: Rollout, quantities: Sequence[str] = ("logp",)) -> dict[str, Tensor]:
        """``logp`` [B,G,L] by the configured estimator, ``entropy`` [B,G,L], ``strat_logp(K)`` and
        ``elbo(M)`` [B,G,L] (Note 4); 0 outside the mask."""
        unknown = [q for q in quantities if q.split("(")[0] not in QUANTITIES]
        if unknown:
            raise ValueError(f"MDLMPolicy.forward computes {sorted(QUANTITIES)}, not {unknown}")
        if "mdlm_seed" not in rollout.extras:
            raise ValueError("MDLMPolicy.forward needs the row extra 'mdlm_seed', written by MDLMPolicy.generate")
        B, G, L = rollout.shape
        y = rollout.actions.reshape(B * G, L)  # [N,L]
        seeds = rollout.extras["mdlm_seed"].reshape(-1).tolist()  # N
        contexts = [c if c else [self.eos] for row in rollout.row_contexts() for c in row]
        logq = self._logq_fn(contexts)
        sel = rollout.mask.bool()  # [B,G,L]
        own = f"{self.estimator[0]}({self.estimator[1]})"  # logp and entropy come from the configured estimator
        specs = {q: own if q in ("logp", "entropy") else q.replace("strat_logp", "stratified") for q in quantities}
        specs.setdefault("logp", own)  # always computed, as every policy's forward does
        if "entropy" in specs and own.startswith("elbo"):
            specs["entropy"] = "stratified(1)"  # the ELBO's draws have no one distribution per token: mean-field's
        values: dict[str, tuple[Tensor, Tensor]] = {}  # estimator -> (ℓ, entropy) [N,L]
        for spec in set(specs.values()):
            kind, n = parse_estimator(spec, L)
            gens = [self._estimator_gen(s) for s in seeds]  # Note 1: the same draws in every forward of a row
            if kind == "elbo":
                values[spec] = (elbo_logp(logq, y, n, gens, self.mask_id), torch.zeros(()))
            else:
                strata = torch.stack([stratified_partition(L, n, g) for g in gens])  # [N,L]
                values[spec] = stratified_logp(logq, y, strata, n, self.mask_id)
        return {
            q: torch.where(sel, values[spec][q == "entropy"].view(B, G, L), 0.0).float() for q, spec in specs.items()
        }  # each [B,G,L]

    # ------------------------------------------------------------------ demonstrations (M1)
    def encode_target(self, row: dict) -> Tensor:
        """A demonstration row's ``answer`` as the canvas [L]: its tokens, then EOS padding."""
        if "answer" not in row:
            raise ValueError(f"MDLMPolicy.encode_target: a row needs an `answer` column; got {sorted(row)}")
        ids = self.encode(row["answer"])
        if len(ids) > self.length or not bool(self.vocab_ok[ids].all()):
            raise ValueError(
                f"MDLMPolicy.encode_target: answer {row['answer']!r} needs at most length={self.length} tokens "
                f"of allowed={self.config['allowed']!r}"
            )
        return torch.tensor(ids + [self.eos] * (self.length - len(ids)), dtype=torch.long)  # [L]

    def supervised_loss(self, prompts: Sequence[list], targets: Sequence[Tensor], gen: torch.Generator) -> Tensor:
        """The masked-diffusion loss of the module Math (t and the masks drawn from ``gen``)."""
        y = torch.stack(list(targets))  # [N,L]
        N, L = y.shape
        t = torch.rand(N, generator=gen, dtype=torch.float64).clamp_min(1e-3)  # [N]
        hidden = torch.rand(N, L, generator=gen, dtype=torch.float64) < t[:, None]  # [N,L]
        logq = self._logq_fn([list(p) for p in prompts])(torch.where(hidden, self.mask_id, y))  # [N,L,V]
        nll = -logq.gather(-1, y[..., None])[..., 0]  # [N,L]
        return (torch.where(hidden, nll, 0.0).sum(-1) / t).mean() / L
