"""Chat transcripts: messages rendered by the tokenizer's chat template, and which tokens are the assistant's.

An agent episode is a list of messages (``system`` / ``user`` / ``assistant`` / ``tool``,
``{"role": ..., "content": ...}``). Two operations are needed on it:

- **render** the messages (and the tool schemas) into the text the model reads, through the
  tokenizer's own template (``tokenizer.apply_chat_template``, transformers'
  https://huggingface.co/docs/transformers/en/chat_templating);
- **mark the assistant's tokens** of a rendered conversation, the only tokens that carry loss
  (``assistant_mask``). Two ways, the same answer on a template that supports both (tested):

  1. ``"markers"``: the template wraps each assistant turn in ``{% generation %} ... {% endgeneration %}``
     and transformers returns the mask (``return_assistant_tokens_mask``);
  2. ``"diff"`` (the fallback for templates without markers): render the prefixes
     ``messages[:i]`` (with the generation prompt) and ``messages[:i+1]``; the tokens the assistant
     message ``i`` adds are its own, up to and including its last end-of-turn token (EOS); what the
     template writes after it (a newline between turns) is not the assistant's.

Both need a **prefix-preserving** template (rendering more messages never changes how the earlier
ones render); ``check_prefix`` says which message breaks it. TRL's GRPO requires the same property
for tool calls (``trl/chat_template_utils.py``, ``is_chat_template_prefix_preserving``).

The rollout (``rollout/agent.py``) builds its rows turn by turn instead (the context of turn t+1 is
the tokens of turn t, the sampled action, and the rendered text of the messages that followed it),
so the model is trained on exactly the tokens it sampled; ``assistant_mask`` serves SFT on chat data
(``groupwise.models.chatstart``) and checks that both views agree.
"""

from __future__ import annotations

import re
from typing import Any

from groupwise.errors import ConfigError

_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_markers(tokenizer: Any) -> bool:
    """The tokenizer's chat template marks assistant turns with ``{% generation %}``."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("default", "")
    return bool(_MARKER.search(template))


def require_template(tokenizer: Any, who: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"{who}: the model's tokenizer has no chat template, so a chat transcript cannot be rendered; use a chat "
            f"model (model.path='chat', the shipped one) or set tokenizer.chat_template in the model folder's "
            f"tokenizer_config.json"
        )


def render(
    tokenizer: Any, messages: list[dict], tools: list | None = None, generation_prompt: bool = False, **kwargs: Any
) -> str:
    """The text the template makes of ``messages`` (and the tool schemas ``tools``); ``generation_prompt``
    appends the header that opens the assistant's next turn."""
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False, **kwargs
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of rendered text (the template writes its own special tokens: none are added)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def assistant_mask(
    tokenizer: Any, messages: list[dict], tools: list | None = None, method: str = "auto"
) -> tuple[list[int], list[bool]]:
    """(ids, mask) of the whole rendered conversation: ``mask[i]`` is True on the assistant's tokens.

    ``method``: ``"markers"`` (the template's generation markers), ``"diff"`` (prefix rendering,
    module docstring), ``"auto"`` (markers where the template has them, else diff)."""
    if method not in ("auto", "markers", "diff"):
        raise ConfigError(f"assistant_mask: method must be 'auto', 'markers' or 'diff', got {method!r}")
    if method == "markers" or (method == "auto" and has_generation_markers(tokenizer)):
        if not has_generation_markers(tokenizer):
            raise ConfigError(
                "assistant_mask: method='markers' needs {% generation %} markers in the chat template; use 'diff'"
            )
        out = tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), [bool(x) for x in out["assistant_masks"]]
    ids: list[int] = []
    mask: list[bool] = []
    eos = {tokenizer.eos_token_id} | set(tokenizer.all_special_ids)
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            ids, mask = _extend(tokenizer, messages, tools, i, ids, mask, generation_prompt=True, own=False)
            before = len(ids)
            ids, mask = _extend(tokenizer, messages, tools, i + 1, ids, mask, generation_prompt=False, own=True)
            added = ids[before:]
            ends = [k for k, t in enumerate(added) if t == tokenizer.eos_token_id]
            last = ends[-1] if ends else max((k for k, t in enumerate(added) if t in eos), default=len(added) - 1)
            for k in range(last + 1, len(added)):  # the separator the template writes after the turn
                mask[before + k] = False
        else:
            ids, mask = _extend(tokenizer, messages, tools, i + 1, ids, mask, generation_prompt=False, own=False)
    return ids, mask


def _extend(tokenizer, messages, tools, upto, ids, mask, *, generation_prompt, own):
    """ids/mask grown to the rendering of ``messages[:upto]``, the new tokens marked ``own``."""
    if upto == 0:
        full = encode(tokenizer, render(tokenizer, [], tools, generation_prompt)) if generation_prompt else []
    else:
        full = encode(tokenizer, render(tokenizer, messages[:upto], tools, generation_prompt))
    if full[: len(ids)] != ids:
        raise ConfigError(
            f"assistant_mask: the chat template is not prefix-preserving: rendering messages[:{upto}] changes the "
            f"tokens of the earlier messages (message {upto - 1}, role {messages[upto - 1].get('role')!r}); "
            f"the diff method needs a template that renders earlier messages the same whatever follows"
        )
    return full, mask + [own] * (len(full) - len(ids))
