"""Loading a Hugging Face causal LM and its tokenizer, prompt encoding, and the reference model."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from groupwise.dist import like
from groupwise.policy import precision, sharding

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "default"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(path: str) -> str:
    """``"default"`` is the tiny model shipped in the package, and another bare name of a folder in
    ``groupwise/models/`` (``"hinted"``) is that shipped model; anything else is a local folder or hub id."""
    if path == "default":
        if not (DEFAULT_MODEL / "config.json").exists():
            raise FileNotFoundError(
                f"the embedded default model is missing at {DEFAULT_MODEL}; rebuild it with `groupwise warmstart`"
            )
        return str(DEFAULT_MODEL)
    shipped = DEFAULT_MODEL.parent / path
    if "/" not in path and not Path(path).exists() and (shipped / "config.json").exists():
        return str(shipped)
    return path


def resolve_device(name: str) -> torch.device:
    """``model.device``: ``cpu``; ``cuda`` (this rank's GPU: ``cuda:LOCAL_RANK`` under torchrun);
    ``cuda:N``; ``auto`` = ``cuda`` when a GPU is visible, else ``cpu``."""
    from groupwise.errors import ConfigError

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"config key model.device: {name!r} but torch sees no CUDA device (torch {torch.__version__}); "
                f'use model.device="cpu" or "auto", or install a CUDA build of torch'
            )
        index = int(name.split(":", 1)[1]) if ":" in name else int(os.environ.get("LOCAL_RANK", 0))
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"config key model.device: cuda:{index} does not exist ({torch.cuda.device_count()} visible)"
            )
        return torch.device("cuda", index)
    raise ConfigError(f"config key model.device: {name!r}; allowed: cpu, cuda, cuda:N, auto")


def load_policy(path: str, dtype: str = "float32", lora: dict | None = None) -> tuple[Any, Any]:
    """Model + tokenizer from a local folder (or a hub id when a network exists); with ``lora`` (PEFT
    ``LoraConfig`` arguments) the adapters are added, their random initialisation drawn from seed 0
    (every run, and every seed of a comparison, starts from the same adapters, as from the same base)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bar is the one that matters

    if dtype not in _DTYPES:
        raise ValueError(f"model.dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    path = resolve_model_path(path)
    local = Path(path).exists()
    shipped = ", ".join(sorted(p.name for p in DEFAULT_MODEL.parent.iterdir() if (p / "config.json").exists()))
    if not local and (
        os.environ.get("HF_HUB_OFFLINE") == "1" or path.startswith((".", "/", "~")) or path.count("/") > 1
    ):
        raise FileNotFoundError(
            f"model.path={path!r} is not a local model folder (shipped models: {shipped}; or a folder with config.json)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=_DTYPES[dtype], local_files_only=local, attn_implementation="sdpa"
        )
    except OSError as err:
        raise FileNotFoundError(
            f"model.path={path!r}: no model could be loaded ({type(err).__name__}); it is neither a local model folder "
            f"nor a reachable hub id (shipped models: {shipped})"
        ) from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if lora:
        from peft import LoraConfig, get_peft_model

        # the adapters' random init (LoRA's A) is the same in every process: a run is reproducible
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))
    return model, tokenizer


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids = {tokenizer.eos_token_id}
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(extra, int):
        ids.add(extra)
    elif isinstance(extra, (list, tuple)):
        ids.update(extra)
    return sorted(i for i in ids if i is not None)


def encode_prompt(tokenizer: Any, prompt: Any) -> list[int]:
    """Token ids of a prompt; the chat template is applied when the tokenizer has one.

    ``prompt`` is a string, or a list of chat messages ``[{"role": ..., "content": ...}]``."""
    if getattr(tokenizer, "chat_template", None):
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    if not isinstance(prompt, str):
        raise ValueError("a list of chat messages needs a tokenizer with a chat template")
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


class Reference:
    """The frozen reference policy: a copy of the initial weights, or, with LoRA, the base model
    with its adapters disabled (no second copy in memory)."""

    def __init__(self, model: Any):
        self.uses_adapter = hasattr(model, "disable_adapter")
        self._model = model if self.uses_adapter else copy.deepcopy(model).eval().requires_grad_(False)

    @contextlib.contextmanager
    def model(self) -> Iterator[Any]:
        if self.uses_adapter:
            with self._model.disable_adapter():
                yield self._model
        else:
            yield self._model

    def state_dict(self) -> dict:
        return {} if self.uses_adapter else self._model.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if state and not self.uses_adapter:
            self._model.load_state_dict(state)


class LMPolicy:
    """A Hugging Face causal LM as the trainer's policy: everything language-model-specific lives
    here — loading, the sampling engine, prompt encoding and the context check, EOS, decoding, the
    packed training forward and the frozen reference snapshot. The trainer sees only the ``Policy``
    protocol (``components.py``)."""

    trainable = True
    modality = "text"
    # what Request.sampling may set
    request_options = frozenset({"greedy", "temperature", "top_p", "top_k", "max_new_tokens"})
    # what forward computes (providers/forward.py); step_mean / x0_pred are a continuous policy's
    quantities = frozenset({"logp", "logprobs", "entropy", "topk", "hidden", "attn_at", "hidden_at"})

    def __init__(self, model_cfg: Any, perf: Any):
        from groupwise.policy.engine import CPUEngine

        self.device = resolve_device(getattr(model_cfg, "device", "cpu"))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL and the default CUDA stream of this rank
        self.module, self.tokenizer = load_policy(model_cfg.path, model_cfg.dtype, model_cfg.lora or None)
        self.module.to(self.device)
        self.perf = perf
        self.eos = eos_ids(self.module, self.tokenizer)
        base = self.module.get_base_model() if hasattr(self.module, "get_base_model") else self.module
        # model.matmul: the products' dtype over float32 master weights (auto: measured here, once)
        self.matmul = precision.resolve(getattr(model_cfg, "matmul", "float32"), base.config, self.device)
        self.engine = CPUEngine(
            self.module,
            self.eos,
            self.tokenizer.pad_token_id,
            share_prefix=perf.share_prefix,
            drop_finished=perf.drop_finished,
            functional=perf.functional,
            matmul=self.matmul.low,
        )
        self.context: int | None = getattr(self.module.config, "max_position_embeddings", None)
        self.reference: Reference | None = None
        self._token_texts: list[str] | None = None  # built on first use (token_texts)
        self.ref_sync_every, self.ref_sync_alpha = model_cfg.ref_sync_every, model_cfg.ref_sync_alpha
        self.full: sharding.FullWeights | None = None  # dist.shard="fsdp2": the gathered whole weights (shard())

    # ------------------------------------------------------------------ sharding (dist.shard="fsdp2")
    def shard(self) -> None:
        """Shard the module over the ranks with FSDP2 (``policy/sharding.py``), in place. Generation and
        no-grad scoring of the policy then run on a whole copy gathered once after the weights move
        (``whole()``), the training forward on the shards. Call before any optimiser is bound."""
        self.full = sharding.FullWeights(self.module)
        # the packed forward calls the decoder and the head, not the root's forward: registered so the
        # root's own parameters (embeddings, final norm, head) are gathered and their gradients reduced
        self.module.groupwise_forward = lambda rollout, quantities, want_entropy=False: self._forward(
            rollout, quantities, self.module, want_entropy
        )
        sharding.shard(self.module, ("groupwise_forward",))
        self.engine.model = self.full.module

    @property
    def collective_forward(self) -> bool:
        """Every training forward is a collective (sharded weights): all ranks must run as many."""
        return self.full is not None

    def whole(self) -> Any:
        """The module with whole weights: the module itself, or (sharded) the gathered copy, gathered now
        if the weights moved since the last gather (a collective: every rank asks at the same point)."""
        return self.module if self.full is None else self.full.get(self.module)

    def idle_pass(self) -> torch.Tensor:
        """A zero loss through every sharded layer (one token): what a rank with fewer micro-batches than
        another runs, so that every rank runs the same collectives. Its backward adds nothing."""
        ids = torch.full((1, 1), int(self.tokenizer.pad_token_id), dtype=torch.long, device=self.device)  # [1,1]
        return self.module(input_ids=ids).logits.sum() * 0.0

    @property
    def hooks(self) -> frozenset[str]:
        """The generation hook kinds (``groupwise.hooks``) its engine applies to a ``Request.hook``."""
        return self.engine.hooks

    # ------------------------------------------------------------------ text
    def encode(self, prompt: Any) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def encode_completion(self, text: str) -> list[int]:
        """Token ids of a completion as the policy would write it: the text, then EOS (supervised phases)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False)) + [
            self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else self.eos[0]
        ]

    def check_fits(self, ids: list[int], max_new_tokens: int, where: str) -> None:
        from groupwise.errors import ConfigError

        if self.context and len(ids) + max_new_tokens > self.context:
            raise ConfigError(
                f"{where}: prompt of {len(ids)} tokens + "
                f"rollout.max_new_tokens={max_new_tokens} exceeds the model's context of "
                f'{self.context}; lower rollout.max_new_tokens, or set data.on_bad_row="skip" to drop such prompts'
            )

    def token_texts(self) -> list[str]:
        """The text of each token id as ``decode`` writes it (special tokens are ""): what components
        that map token positions to spans of the completion text read (``use_vocabulary``)."""
        if self._token_texts is None:
            special = set(self.tokenizer.all_special_ids)
            self._token_texts = ["" if i in special else self.tokenizer.decode([i]) for i in range(len(self.tokenizer))]
        return self._token_texts

    def decode(self, rollout: Any) -> list[list[str]]:
        """[B][G] completion texts (EOS removed, special tokens skipped)."""
        B, G, T = rollout.shape
        counts, actions = rollout.mask.sum(-1).tolist(), rollout.actions.tolist()  # host ints, converted once
        eos = set(self.eos)
        rows = [[t for t in actions[b][g][: counts[b][g]] if t not in eos] for b in range(B) for g in range(G)]
        flat = self.tokenizer.batch_decode(rows, skip_special_tokens=True) if rows else []
        return [flat[b * G : (b + 1) * G] for b in range(B)]

    # ------------------------------------------------------------------ sampling
    def generate(self, requests: list[Any], sampling: dict, info: Any, engine: Any = None) -> Any:
        """One group per request, ``request.n`` rows each (rows past a request's n are padding with
        ``group_valid`` False). Row j of a request draws its randomness from
        ``sample_seed(seed, step, key, offset + j)``, whatever else is in the batch. ``engine``: what
        samples (default this policy's own ``CPUEngine``; ``policy/served.py``: a generation server)."""
        from groupwise.seeds import sample_seed
        from groupwise.types import Rollout

        self.whole()  # sharded: the engine decodes on the gathered copy (gathered once per rollout phase)
        engine = self.engine if engine is None else engine
        sampling = dict(sampling)
        max_new, greedy = sampling.pop("max_new_tokens"), sampling.pop("greedy", False)
        parts = {}
        for n in sorted({r.n for r in requests}):  # one engine call per distinct group size (usually one)
            chosen = [i for i, r in enumerate(requests) if r.n == n]
            seeds = [
                sample_seed(info.seed, info.step, requests[i].key, requests[i].offset + j)
                for i in chosen
                for j in range(n)
            ]
            hooks = [requests[i].hook for i in chosen]  # generation hooks (groupwise.hooks), None: the clean model
            parts[n] = (
                chosen,
                engine.generate(
                    [requests[i].prompt for i in chosen],
                    n,
                    torch.tensor(seeds, dtype=torch.long),
                    max_new,
                    greedy=greedy,
                    hooks=hooks if any(h is not None for h in hooks) else None,
                    **sampling,
                ),
            )
        B, G = len(requests), max(r.n for r in requests)
        T = max(gen.tokens.shape[2] for _, gen in parts.values())
        tokens = torch.full((B, G, T), int(self.tokenizer.pad_token_id), dtype=torch.long)  # [B,G,T]
        lengths = torch.zeros(B, G, dtype=torch.long)  # [B,G]
        truncated = torch.zeros(B, G, dtype=torch.bool)  # [B,G]
        logp = torch.zeros(B, G, T)  # [B,G,T]
        for n, (chosen, gen) in parts.items():
            if len(parts) == 1:  # the common case: the engine's tensors as they are
                tokens, lengths, truncated, logp = gen.tokens, gen.lengths, gen.truncated, gen.logp
                break
            index, t = torch.tensor(chosen), gen.tokens.shape[2]
            tokens[index, :n, :t], lengths[index, :n], truncated[index, :n], logp[index, :n, :t] = (
                gen.tokens,
                gen.lengths,
                gen.truncated,
                gen.logp,
            )
        sizes = torch.tensor([r.n for r in requests])  # [B]
        return Rollout(
            prompt_ids=[r.prompt for r in requests],
            actions=tokens,  # [B,G,T]
            mask=torch.arange(tokens.shape[2])[None, None, :] < lengths[..., None],  # [B,G,T]
            group_valid=torch.arange(G)[None, :] < sizes[:, None],  # [B,G] padding rows of ragged groups are not valid
            truncated=truncated,  # [B,G]
            prompt_index=torch.tensor([r.key for r in requests], dtype=torch.long),  # [B]
            logp_sampler=logp,  # [B,G,T]
        )

    # ------------------------------------------------------------------ scoring and training
    def forward(
        self, rollout: Any, quantities: Any = ("logp",), module: Any = None, want_entropy: bool = False
    ) -> dict:
        """Per-token quantities of the rollout's completions under ``module`` (default: this policy's
        own weights), one packed forward; differentiable when grad is enabled."""
        if module is None and self.full is not None:  # sharded: through the root's registered forward method
            return self.module.groupwise_forward(rollout, quantities, want_entropy)
        return self._forward(rollout, quantities, module, want_entropy)

    def _forward(self, rollout: Any, quantities: Any, module: Any, want_entropy: bool) -> dict:
        from groupwise.policy.forward import completion_logprobs

        perf = self.perf
        out = completion_logprobs(
            self.module if module is None else module,
            rollout.prompt_ids,
            rollout.actions,
            rollout.mask,
            rollout.group_valid,
            want_entropy=want_entropy,
            packed=perf.packed,
            share_prefix=None if perf.share_prefix else False,
            functional=perf.functional,
            quantities=quantities,
            row_prompts=rollout.ctx or None,
            matmul=self.matmul.low,
            recompute_mlp=perf.recompute_mlp,
            checkpoint_layers=perf.activation_checkpointing,
        )
        # the rollout, advantages and loss maths live on the host in float32; .to is differentiable
        if self.device.type != "cpu":
            out = {key: value.to("cpu", non_blocking=False) for key, value in out.items()}
        return out

    def scoring_models(self, with_reference: bool) -> dict[str, Any]:
        """The modules needs are read from, by role: this policy and (built on request) its frozen reference."""
        from groupwise.errors import ConfigError

        if self.ref_sync_every and not with_reference:
            raise ConfigError(
                f"model.ref_sync_every={self.ref_sync_every}: no component "
                "reads the reference model (add a kl term or a ref need)"
            )
        if with_reference and self.reference is None:
            self.reference = Reference(self.module)
            if self.ref_sync_every and self.reference.uses_adapter:
                raise ConfigError(
                    "model.ref_sync_every needs a reference copy; with "
                    "LoRA the reference is the base model with adapters off"
                )
        models = {"policy": lambda: contextlib.nullcontext(self.whole())}
        if self.reference is not None:
            models["ref"] = self.reference.model
        return models

    def rebase_reference(self) -> None:
        """The frozen reference becomes a copy of the current weights (called after an sft phase).
        With LoRA the reference is the base with adapters off, which an sft phase does not move: refused."""
        if self.reference is None:
            return
        if self.reference.uses_adapter:
            from groupwise.errors import ConfigError

            raise ConfigError(
                "an sft phase with model.lora: the reference (the base with adapters off) would not "
                "be the fine-tuned policy; drop model.lora or the components that read the reference"
            )
        self.reference.load_state_dict(self.module.state_dict())

    def score(self, module: Any, rollout: Any, quantities: Any) -> dict:
        """Quantities of ``rollout`` under one of :meth:`scoring_models`' modules (no-grad needs)."""
        return self.forward(rollout, quantities, module=module)

    def end_step(self, step: int) -> None:
        """After step ``step``'s update: every ``ref_sync_every`` steps the reference moves toward the
        policy, ``ref ← α·policy + (1 − α)·ref`` (TR-DPO, Gorbatovski et al. 2024; TRL's
        ``SyncRefModelCallback``, which counts optimiser steps where this counts trainer steps)."""
        if self.ref_sync_every and (step + 1) % self.ref_sync_every == 0:
            with torch.no_grad():
                for ref, live in zip(self.reference._model.parameters(), self.module.parameters(), strict=True):
                    ref.mul_(1.0 - self.ref_sync_alpha).add_(live.detach(), alpha=self.ref_sync_alpha)

    def parameters(self) -> list[Any]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def parameter_names(self) -> list[str]:
        """The names of :meth:`parameters`, in the same order."""
        return [n for n, p in self.module.named_parameters() if p.requires_grad]

    def train(self) -> None:
        if self.full is not None:  # the weights are about to move: the gathered copy is freed
            self.full.release()
        if not self.engine.functional:  # the functional maths has no dropout: skip two module-tree walks
            self.module.train()

    def eval(self) -> None:
        if not self.engine.functional:
            self.module.eval()

    @property
    def run_info(self) -> dict:
        """What the run records about this policy (``summary.json``): the products' dtype and why."""
        return {"matmul": self.matmul.as_dict()}

    @property
    def run_notes(self) -> list[str]:
        """Lines the run says once at start."""
        return [self.matmul.line()] if self.matmul.setting != "float32" else []

    def state_dict(self) -> dict:
        """Sharded, ``model`` holds this rank's shards (DTensors: the checkpoint writes each rank's own)."""
        return {
            "model": self.module.state_dict(),
            "reference": self.reference.state_dict() if self.reference else {},
            "matmul": self.matmul.dtype,
        }

    def load_state_dict(self, state: dict) -> None:
        # a resumed model.matmul=auto run keeps the dtype its start measured (a new probe could decide otherwise)
        self.matmul = precision.restored(self.matmul, state.get("matmul", self.matmul.dtype))
        self.engine.matmul = self.matmul.low
        if self.full is None:
            self.module.load_state_dict(state["model"])
        else:  # each rank keeps its shard of the whole weights; the copy holds them whole already
            with torch.no_grad():
                for name, param in self.module.named_parameters():
                    param.copy_(like(state["model"][name], param))
                for name, target in self.full.module.named_parameters():  # tied weights: one parameter
                    target.data = state["model"][name].to(target.dtype)
            self.full.current = True
            self.full.versions = tuple(p._version for p in self.module.parameters())
        if self.reference is not None:
            self.reference.load_state_dict(state["reference"])

    def save(self, folder: Any) -> None:
        """A loadable model folder (LoRA adapters merged into a copy: the live model keeps its adapters)."""
        if self.full is not None and not self.full.current:
            raise RuntimeError(
                "save() of a sharded policy needs its whole weights gathered on every rank first (whole())"
            )
        module = self.whole()
        model = copy.deepcopy(module).merge_and_unload() if hasattr(module, "merge_and_unload") else module
        model.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
