"""Loading a Hugging Face causal LM and its tokenizer, prompt encoding, and the reference model."""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path
from typing import Any, Iterator

import torch

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "default"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(path: str) -> str:
    """``"default"`` is the tiny model shipped in the package, and another bare name of a folder in
    ``groupwise/models/`` (``"hinted"``) is that shipped model; anything else is a local folder or hub id."""
    if path == "default":
        if not (DEFAULT_MODEL / "config.json").exists():
            raise FileNotFoundError(f"the embedded default model is missing at {DEFAULT_MODEL}; rebuild it with `groupwise warmstart`")
        return str(DEFAULT_MODEL)
    shipped = DEFAULT_MODEL.parent / path
    if "/" not in path and not Path(path).exists() and (shipped / "config.json").exists():
        return str(shipped)
    return path


def load_policy(path: str, dtype: str = "float32", lora: dict | None = None) -> tuple[Any, Any]:
    """Model + tokenizer from a local folder (or a hub id when a network exists)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bar is the one that matters

    if dtype not in _DTYPES:
        raise ValueError(f"model.dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    path = resolve_model_path(path)
    local = Path(path).exists()
    shipped = ", ".join(sorted(p.name for p in DEFAULT_MODEL.parent.iterdir() if (p / "config.json").exists()))
    if not local and (os.environ.get("HF_HUB_OFFLINE") == "1" or path.startswith((".", "/", "~")) or path.count("/") > 1):
        raise FileNotFoundError(f"model.path={path!r} is not a local model folder (shipped models: {shipped}; or a folder with config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype], local_files_only=local, attn_implementation="sdpa")
    except OSError as err:
        raise FileNotFoundError(f"model.path={path!r}: no model could be loaded ({type(err).__name__}); it is neither a local model folder "
                                f"nor a reachable hub id (shipped models: {shipped})") from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if lora:
        from peft import LoraConfig, get_peft_model

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
