"""A batched KV-cache generation engine for Hugging Face causal LMs, built for CPU rollouts.

One call samples ``n`` completions for each of ``B`` prompts, all ``B*n`` rows decoded together:

1. prompts are left-padded to one length; each prompt runs through the model ONCE (prefix sharing)
   and its KV cache is repeated ``n`` times along the batch (rows ``b*n .. b*n+n-1`` are prompt b);
2. each step samples one token per row with Gumbel-max over hashed uniforms
   (``seeds.noise_at``), so a row's sample depends only on its seed, never on the batch;
3. a row that emits EOS is finished (it emits pad from then on); finished rows are dropped from the
   cache once enough of them pile up, and the loop stops when every row is finished.

The model runs through ``policy.functional.DecodeState`` (fused weights, a preallocated KV cache
written in place) when it is a float32 Llama-family model, else through its own forward and a
``DynamicCache`` (``_HFState``); both give the same logits to float rounding. ``matmul``
(``model.matmul=bfloat16``, ``policy/precision.py``) runs the GEMMs in bfloat16 on either path
(fused bfloat16 weight snapshots in the functional decoder; autocast around the model's own
forward); sampling and ``logp`` work on float32 logits either way.

Generation hooks (``groupwise.hooks``: prompt-embedding deltas, residual-stream additions) are
applied per row on either path; a call with hooks the functional decoder does not support
(``DecodeState.hooks``) falls back to the model's own forward. A hooked call prefills each row
separately (no prompt sharing: each row's prompt keys and values differ).

``logp`` is the log-probability of each sampled token under the model's raw distribution
(``log_softmax`` of float32 logits, temperature 1): on-policy training uses it as ``logp_sampler``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

from groupwise.hooks import KINDS as HOOK_KINDS
from groupwise.hooks import hook_kinds, residual_module, row_hooks
from groupwise.policy.functional import DecodeState, unsupported_reason
from groupwise.policy.precision import autocast
from groupwise.seeds import gumbel_span, noise_at

# Sampling works on blocks of rows so that the [rows, V] noise buffers stay ~32 MB with a big vocab.
_SAMPLE_BLOCK_ELEMENTS = 1 << 22
# Drop finished rows from the KV cache once this fraction of the live rows has finished: compaction
# copies the whole cache, so doing it for every single finished row would cost more than it saves.
_DROP_FRACTION = 0.25
# Top-p looks for the nucleus among the best 256, then 4096, ... tokens before sorting the whole vocabulary.
_NUCLEUS_PROBES = (256, 4096, 32768)


@dataclass
class GenerationOutput:
    """What ``CPUEngine.generate`` returns; ``T`` is the longest completion actually generated."""

    tokens: Tensor  # [B,n,T] int64, pad after each row's end
    lengths: Tensor  # [B,n] int64, tokens generated including the EOS token if produced
    truncated: Tensor  # [B,n] bool, no EOS within max_new_tokens
    logp: Tensor  # [B,n,T] float32, raw-model (temperature 1) log-prob of each token, 0 after the end

    @property
    def mask(self) -> Tensor:
        """[B,n,T] bool: the generated tokens (including EOS)."""
        T = self.tokens.shape[-1]
        return torch.arange(T) < self.lengths[..., None]  # [B,n,T]


# --------------------------------------------------------------------------- token filters
def _candidates(scores: Tensor, top_k: int, top_p: float) -> tuple[Tensor | None, Tensor]:
    """Tokens that survive top-k then top-p, as (ids [N,K] or None for all V, scores [N,K]).

    Filtered-out tokens inside the K columns get ``-inf``. Top-p keeps the smallest prefix of the
    sorted distribution (after top-k) whose mass reaches ``top_p``; the top token always stays.
    """
    vocab = scores.shape[-1]
    use_top_k = 0 < top_k < vocab
    if not use_top_k and top_p >= 1.0:
        return None, scores  # [N,V]
    if use_top_k:
        kept, ids = scores.topk(top_k, dim=-1)  # [N,k] each, sorted best first
        if top_p >= 1.0:
            return ids, kept
        log_z = kept.logsumexp(dim=-1, keepdim=True)  # [N,1] top-k renormalises before top-p
    else:
        log_z = scores.logsumexp(dim=-1, keepdim=True)  # [N,1]
        # A nucleus is usually far narrower than the vocabulary: look among the best few first and
        # widen (finally: sort everything) only while some row's nucleus does not fit (same result).
        for probe in [p for p in _NUCLEUS_PROBES if p < vocab] + [vocab]:
            if probe == vocab:
                kept, ids = scores.sort(dim=-1, descending=True)  # [N,V] each
                break
            kept, ids = scores.topk(probe, dim=-1)  # [N,P] each, sorted best first
            if bool(((kept - log_z).exp().cumsum(dim=-1)[:, -1] >= top_p).all()):
                break
    mass = (kept - log_z).exp().cumsum(dim=-1)  # [N,K] mass of each token and the better ones
    # Mass of the strictly better tokens; token P's is exactly the probe's total checked above.
    mass_before = torch.nn.functional.pad(mass[:, :-1], (1, 0))  # [N,K]
    keep = mass_before < top_p  # [N,K] a token is needed while the mass so far is short of top_p
    keep[:, 0] = True  # the top token always stays (also covers top_p <= 0)
    width = int(keep.sum(dim=-1).max())  # one sync per step: the widest nucleus in the batch
    kept = kept[:, :width].masked_fill(~keep[:, :width], float("-inf"))  # [N,K']
    return ids[:, :width], kept  # [N,K'] each


def filter_logits(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """[N,V] float32 logits / temperature with everything outside top-k and top-p set to ``-inf``."""
    scores = logits.float() / temperature  # [N,V]
    ids, kept = _candidates(scores, top_k, top_p)  # [N,K] each
    if ids is None:
        return kept  # [N,V]
    return torch.full_like(scores, float("-inf")).scatter_(1, ids, kept)  # [N,V]


# --------------------------------------------------------------------------- sampler
class _Sampler:
    """Samples one token per row; owns [rows, V] workspaces so the hot loop allocates nothing big.

    Plain sampling over the whole vocabulary reads its Gumbel noise from spans computed for many
    positions at once (``seeds.gumbel_span``: the same numbers as per position, in one vectorised
    pass instead of ~15 small ops every token) while a span of all rows fits the noise budget."""

    def __init__(
        self,
        vocab: int,
        rows: int,
        *,
        temperature: float,
        top_k: int,
        top_p: float,
        greedy: bool,
        device: torch.device,
        row_seeds: Tensor | None = None,
        horizon: int = 0,
    ):
        self.greedy = greedy or temperature <= 0.0
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.block = max(1, min(rows, _SAMPLE_BLOCK_ELEMENTS // vocab))  # rows per block
        self.vocab_ids = torch.arange(vocab, device=device)  # [V]
        full_vocab = not self.greedy and not (0 < top_k < vocab) and top_p >= 1.0
        # spans of positions: all rows x `span` positions x V within the noise budget
        self.span = (
            min(horizon, _SAMPLE_BLOCK_ELEMENTS // (rows * vocab)) if full_vocab and row_seeds is not None else 0
        )
        self.row_seeds, self.horizon = row_seeds, horizon
        self.gumbel, self.gumbel_start = None, 0  # [R,span,V] float32, first position it covers
        # Workspaces (page-faulting a fresh 30+ MB tensor every token costs more than the maths).
        self.work = torch.empty(self.block, vocab, device=device)  # [blk,V] float32
        if full_vocab and not self.span:  # noise over the whole vocab each token
            self.noise = torch.empty(self.block, vocab, device=device)  # [blk,V] float32
            self.hash = (
                torch.empty(self.block, vocab, dtype=torch.long, device=device),  # [blk,V]
                torch.empty(self.block, vocab, dtype=torch.long, device=device),
            )  # [blk,V]

    def __call__(
        self, logits: Tensor, seeds: Tensor, position: int, rows: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(tokens [N] int64, logp [N] float32) for float32 ``logits`` [N,V] at completion ``position``;
        ``rows`` [N] are the rows' indices among the ``row_seeds`` given at construction."""
        if self.span and rows is not None:
            if self.gumbel is None or position >= self.gumbel_start + self.gumbel.shape[1]:
                width = min(self.span, self.horizon - position)
                self.gumbel, self.gumbel_start = (
                    gumbel_span(self.row_seeds, position, width, logits.shape[-1]),
                    position,
                )  # [R,W,V]
            gumbel = self.gumbel[:, position - self.gumbel_start].index_select(0, rows)  # [N,V]
            scores = logits / self.temperature if self.temperature != 1.0 else logits  # [N,V]
            tokens = gumbel.add_(scores).argmax(dim=-1)  # [N]
            logp = (logits.gather(1, tokens[:, None]) - torch.logsumexp(logits, dim=-1, keepdim=True)).squeeze(1)  # [N]
            return tokens, logp
        n = logits.shape[0]
        tokens = torch.empty(n, dtype=torch.long, device=logits.device)  # [N]
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)  # [N]
        for start in range(0, n, self.block):
            part = slice(start, min(n, start + self.block))
            tokens[part], logp[part] = self._block(logits[part], seeds[part], position)
        return tokens, logp

    def _block(self, logits: Tensor, seeds: Tensor, position: int) -> tuple[Tensor, Tensor]:
        rows = logits.shape[0]
        work = self.work[:rows]  # [n,V]
        # log-partition of the raw distribution, via the workspace instead of logsumexp's temporary
        top = logits.max(dim=-1, keepdim=True).values  # [n,1]
        log_z = torch.sub(logits, top, out=work).exp_().sum(dim=-1, keepdim=True).log_() + top  # [n,1]
        if self.greedy:
            tokens = logits.argmax(dim=-1)  # [n]
        else:
            scores = torch.div(logits, self.temperature, out=work)  # [n,V]
            ids, kept = _candidates(scores, self.top_k, self.top_p)  # [n,K] each
            if ids is None:  # full vocabulary: noise straight into the workspaces
                uniform = noise_at(
                    seeds,
                    position,
                    self.vocab_ids,
                    out=self.noise[:rows],
                    scratch=(self.hash[0][:rows], self.hash[1][:rows]),
                )  # [n,V]
                gumbel = uniform.log_().neg_().log_().neg_()  # [n,V] -log(-log u)
                tokens = kept.add_(gumbel).argmax(dim=-1)  # [n]
            else:  # noise only at the candidates' vocab ids: the same draws as over the full vocab
                gumbel = noise_at(seeds, position, ids).log_().neg_().log_().neg_()  # [n,K]
                pick = (kept + gumbel).argmax(dim=-1, keepdim=True)  # [n,1]
                tokens = ids.gather(1, pick).squeeze(1)  # [n]
        logp = (logits.gather(1, tokens[:, None]) - log_z).squeeze(1)  # [n]
        return tokens, logp


# --------------------------------------------------------------------------- model backends
class _HFState:
    """A batch being decoded through the model's own forward and a ``DynamicCache`` (any HF causal LM).

    Same interface as ``policy.functional.DecodeState``: ``prefill``, ``step``, ``select``,
    ``steer`` / ``close``. Generation hooks: ``embed_add`` enters the prefill as ``inputs_embeds``; a
    steering addition is a forward hook on the layer's module, removed by ``close``."""

    hooks = frozenset(HOOK_KINDS)

    def __init__(self, model, cache_arg: str, can_keep_last: bool, matmul: torch.dtype | None = None):
        self.model, self.cache_arg, self.can_keep_last, self.matmul = model, cache_arg, can_keep_last, matmul
        self.cache = DynamicCache(config=model.config)
        self.attention = torch.empty(0)
        self.steer_add: Tensor | None = None  # [A,D] what each live row adds after the steered layer
        self._handle = None

    def steer(self, layer: int, add: Tensor) -> None:
        """Add ``add`` [R,D] (one vector per row) to the residual stream after
        decoder layer ``layer`` (0: the embeddings)."""
        self.steer_add = add
        module = residual_module(self.model, layer)

        def hook(_module, _inputs, output):
            if isinstance(output, tuple):
                return (output[0] + self.steer_add[:, None, :].to(output[0].dtype), *output[1:])
            return output + self.steer_add[:, None, :].to(output.dtype)  # [N,S,D]

        self._handle = module.register_forward_hook(hook)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _forward(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, embed_add: Tensor | None = None
    ) -> Tensor:
        kwargs = {self.cache_arg: self.cache, "use_cache": True}
        if self.can_keep_last:
            kwargs["logits_to_keep"] = 1  # the lm_head runs on the last position only
        if embed_add is None:
            kwargs["input_ids"] = input_ids
        else:
            embeds = self.model.get_input_embeddings()(input_ids)  # [N,W,D]
            kwargs["inputs_embeds"] = embeds + embed_add.to(embeds.device, embeds.dtype)
        with autocast(input_ids.device, self.matmul):
            out = self.model(attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        return out.logits[:, -1, :].float()  # [N,V]

    def prefill(
        self,
        input_ids: Tensor,
        positions: Tensor,
        real: Tensor,
        repeat: int,
        capacity: int,
        embed_add: Tensor | None = None,
    ) -> Tensor:
        B, W = input_ids.shape
        self.attention = torch.zeros(B * repeat, capacity, dtype=torch.long, device=input_ids.device)  # [R,C]
        self.attention[:, :W] = real.repeat_interleave(repeat, dim=0)
        logits = self._forward(input_ids, real.long(), positions, embed_add)  # [B,V]
        self.cache.batch_repeat_interleave(repeat)
        return logits

    def step(self, tokens: Tensor, positions: Tensor, column: int) -> Tensor:
        self.attention[:, column] = 1  # the token joins the context
        return self._forward(tokens[:, None], self.attention[:, : column + 1], positions[:, None])  # [A,V]

    def select(self, keep: Tensor) -> None:
        self.cache.batch_select_indices(keep)
        self.attention = self.attention[keep]
        if self.steer_add is not None:
            self.steer_add = self.steer_add[keep]


# --------------------------------------------------------------------------- engine
class CPUEngine:
    """Batched sampling with a shared-prefix KV cache for any HF causal LM.

    ``share_prefix=False`` runs every row's prompt separately (the reference the test compares with);
    ``drop_finished=False`` keeps finished rows in the batch until the end; ``functional=False``
    decodes through the model's own forward even when ``policy.functional`` supports the model.
    ``hooks``: the generation hook kinds it can apply (``groupwise.hooks``), on either path.
    ``matmul``: the GEMMs' dtype when not float32 (``model.matmul``); may be changed between calls.
    """

    hooks = frozenset(HOOK_KINDS)

    def __init__(
        self,
        model,
        eos_token_ids: list[int],
        pad_token_id: int,
        share_prefix: bool = True,
        drop_finished: bool = True,
        functional: bool = True,
        matmul: torch.dtype | None = None,
    ):
        self.model = model
        self.matmul = matmul
        self.eos_token_ids = torch.tensor(list(eos_token_ids), dtype=torch.long)
        self.pad_token_id = int(pad_token_id)
        self.share_prefix = share_prefix
        self.drop_finished = drop_finished
        self.functional = functional and unsupported_reason(model) is None
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT forwards kwargs to it
        params = inspect.signature(base.forward).parameters
        # transformers 5.x renamed `past_key_values` to `cache`; accept either spelling.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._can_keep_last = "logits_to_keep" in params

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _new_state(self, kinds: set[str] = frozenset()):
        """Decoding state for one call; the functional one snapshots the current weights. Generation
        hooks of a kind the functional decoder does not apply send the call down the model's own forward."""
        # module hooks may come and go
        if self.functional and unsupported_reason(self.model) is None and kinds <= DecodeState.hooks:
            return DecodeState(self.model, self.matmul)
        return _HFState(self.model, self._cache_arg, self._can_keep_last, self.matmul)

    def _left_pad(self, prompt_ids: list[list[int]]) -> tuple[Tensor, Tensor, Tensor]:
        """(input_ids [B,L], attention_mask [B,L] bool, prompt lengths [B]) with prompts left-padded."""
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        lengths = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)  # [B]
        width = int(lengths.max())
        input_ids = torch.full((len(prompt_ids), width), self.pad_token_id, dtype=torch.long)  # [B,L]
        for b, p in enumerate(prompt_ids):  # once per call, not per token
            input_ids[b, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
        attention_mask = torch.arange(width) >= (width - lengths)[:, None]  # [B,L]
        return input_ids, attention_mask, lengths

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        row_seeds: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        greedy: bool = False,
        hooks: list | None = None,
    ) -> GenerationOutput:
        """Sample ``n`` completions per prompt; ``row_seeds`` [B*n] names each row's randomness;
        ``hooks`` [B] (each None or a ``groupwise.hooks`` hook) perturb the rows of their prompt."""
        B, device = len(prompt_ids), self.device
        R = B * n  # rows
        if row_seeds.shape != (R,):
            raise ValueError(f"row_seeds must have shape [{R}] (B*n), got {tuple(row_seeds.shape)}")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy)
        if hooks is not None and len(hooks) != B:
            raise ValueError(f"hooks must have one entry per prompt ({B}), got {len(hooks)}")
        hooks = hooks if hooks is not None and any(h is not None for h in hooks) else None
        kinds = hook_kinds(hooks or [])
        if kinds - self.hooks:
            raise ValueError(
                f"generation hooks {sorted(kinds - self.hooks)} cannot be "
                f"applied by this engine (it applies {sorted(self.hooks)})"
            )
        state = self._new_state(kinds)
        # no dropout in the functional maths: no train/eval switch (~1 ms per module tree walk)
        if isinstance(state, DecodeState):
            return self._generate(
                state, prompt_ids, n, row_seeds.to(device, torch.long), max_new_tokens, sampling, hooks
            )
        was_training = self.model.training
        self.model.eval()
        try:
            return self._generate(
                state, prompt_ids, n, row_seeds.to(device, torch.long), max_new_tokens, sampling, hooks
            )
        finally:
            state.close()
            self.model.train(was_training)

    def _generate(
        self,
        state,
        prompt_ids: list[list[int]],
        n: int,
        seeds: Tensor,
        max_new_tokens: int,
        sampling: dict,
        hooks: list | None = None,
    ) -> GenerationOutput:
        device = seeds.device
        B, R = len(prompt_ids), len(prompt_ids) * n
        input_ids, prompt_mask, prompt_lengths = (t.to(device) for t in self._left_pad(prompt_ids))  # [B,L],[B,L],[B]
        width = input_ids.shape[1]
        positions = (prompt_mask.long().cumsum(dim=-1) - 1).clamp_(min=0)  # [B,L] 0 at each first real token
        embed_add = None
        if hooks is not None:  # per-row perturbations (groupwise.hooks)
            dim = self.model.get_input_embeddings().weight.shape[1]
            # [R,W,D] | None, (layer, [R,D]) | None
            embed_add, steer = row_hooks(hooks, n, [len(p) for p in prompt_ids], width, dim)
            embed_add = None if embed_add is None else embed_add.to(device)
            if steer is not None:
                state.steer(steer[0], steer[1].to(device))

        # ---- prefill: each prompt once, then n copies of its KV cache (rows b*n .. b*n+n-1)
        if self.share_prefix and hooks is None:
            logits = state.prefill(input_ids, positions, prompt_mask, n, width + max_new_tokens)  # [B,V]
            logits = logits.repeat_interleave(n, dim=0)  # [R,V]
        else:  # every row's prompt separately (a hooked call: each row's prompt states differ)
            logits = state.prefill(
                input_ids.repeat_interleave(n, dim=0),
                positions.repeat_interleave(n, dim=0),
                prompt_mask.repeat_interleave(n, dim=0),
                1,
                width + max_new_tokens,
                embed_add=embed_add,
            )  # [R,V]

        # V from the logits (vocab may be padded)
        sample = _Sampler(logits.shape[-1], R, device=device, row_seeds=seeds, horizon=max_new_tokens, **sampling)

        # ---- per-live-row state (compacted together when finished rows are dropped)
        live = torch.arange(R, device=device)  # [A] output row of each live row
        live_seeds = seeds  # [A]
        next_position = prompt_lengths.repeat_interleave(n)  # [A] position of completion token 0
        finished = torch.zeros(R, dtype=torch.bool, device=device)  # [A]
        eos_ids = self.eos_token_ids.to(device)  # [E]

        tokens_out = torch.full((R, max_new_tokens), self.pad_token_id, dtype=torch.long, device=device)  # [R,M]
        logp_out = torch.zeros(R, max_new_tokens, dtype=torch.float32, device=device)  # [R,M]
        end_step = torch.full((R,), -1, dtype=torch.long, device=device)  # [R] step of the EOS, -1 if none
        steps = max_new_tokens
        for t in range(max_new_tokens):
            tokens, logp = sample(logits, live_seeds, t, live)  # [A], [A]
            tokens = tokens.masked_fill_(finished, self.pad_token_id)  # [A] finished rows emit pad
            tokens_out[live, t] = tokens
            logp_out[live, t] = logp.masked_fill_(finished, 0.0)
            ends = torch.isin(tokens, eos_ids) & ~finished  # [A] rows ending now
            end_step[live] = torch.where(ends, t, end_step[live])  # [A] no host sync (unlike live[ends])
            finished |= ends
            n_finished = int(finished.sum())  # the one host sync per token
            if n_finished == len(live):
                steps = t + 1
                break
            if t + 1 == max_new_tokens:
                break
            if self.drop_finished and n_finished >= max(1, _DROP_FRACTION * len(live)):
                keep = (~finished).nonzero().squeeze(1)  # [A'] rows still generating
                state.select(keep)
                live, live_seeds = live[keep], live_seeds[keep]  # [A'] each
                next_position, tokens, finished = next_position[keep], tokens[keep], finished[keep]  # [A'] each
            logits = state.step(tokens, next_position + t, width + t)  # [A,V] the token just sampled joins the context

        lengths = torch.where(end_step >= 0, end_step + 1, torch.full_like(end_step, steps))  # [R]
        return GenerationOutput(
            tokens=tokens_out[:, :steps].reshape(B, n, steps).cpu(),  # [B,n,T]
            lengths=lengths.reshape(B, n).cpu(),  # [B,n]
            truncated=(end_step < 0).reshape(B, n).cpu(),  # [B,n]
            logp=logp_out[:, :steps].reshape(B, n, steps).cpu(),  # [B,n,T]
        )
