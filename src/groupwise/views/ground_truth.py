"""Ground-truth-conditioned view: the same rows, re-scored with the reference answer in the prompt.

The self-teacher context of GEAR: "GEAR: Granularity-Adaptive Advantage Reweighting for LLM Agents
via Self-Distillation", Li, Huang, Liu et al. (Microsoft Research Asia), 2026.
https://arxiv.org/abs/2605.11853 (spec: specs/32). ``Need("kl_to(ground_truth)")`` or
``Need("logp", view="ground_truth")`` asks the trainer to score the sampled completions under it.

**Change vs GRPO**: none by itself. A view edits the context a ``Need`` is evaluated under: every
group's prompt is rebuilt from its dataset row with the ground truth inserted; completions, mask
and the token axis T are untouched, so token t still predicts the same completion token.

**Math** (per group b, ``meta = rollout.meta[b]``, its dataset columns)::

    x_T[b]        = template.format(**meta)          (``{prompt}`` = x, ``{answer}`` = gt, any column)
    prompt_ids[b] = encode(x_T[b])

**Defaults**

- ``template = "Reference solution: {answer}\\n{prompt}"`` [INFERRED] the ground truth goes
  BEFORE the prompt, so that the completion still continues right after the prompt's last token
  (``37+45=`` must stay adjacent to its completion). The spec [ABSTRACT+SUMMARY] appends it after
  x (``x ⊕ "Reference solution: " ⊕ gt``): that placement is ``template = SPEC_TEMPLATE``.

**Notes**

1. Placement is the template: any arrangement of ``{prompt}``, ``{answer}`` and the other dataset
   columns is an option; ``{prompt}`` is required, positional fields (``{}``, ``{0}``) are not
   allowed, literal braces are written ``{{`` ``}}``. Column values are inserted verbatim.
2. A column the template names that a group's row lacks (or holds ``None``) is an error naming
   the column, the group and the columns the row has.
3. Chat prompts (``meta["prompt"]`` a list of messages): the template is applied to the content
   of the LAST user message, on a copy; ``encode`` then applies the chat template as usual.
4. ``apply`` returns a copy (``dataclasses.replace``) with fresh ``extras`` dicts, so a provider
   that writes into the view's rollout never touches the original batch.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from groupwise.registry import register
from groupwise.types import Rollout
from groupwise.views import edit_user_text

DEFAULT_TEMPLATE = "Reference solution: {answer}\n{prompt}"
SPEC_TEMPLATE = "{prompt}Reference solution: {answer}"  # the spec's x ⊕ "Reference solution: " ⊕ gt


def template_columns(template: str) -> tuple[str, ...]:
    """The dataset columns a template names, in order: ``"{answer}\\n{prompt}"`` -> ("answer", "prompt")."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise ValueError(
            f"ground_truth: template {template!r} is malformed ({err}); write literal braces as {{{{ }}}}"
        ) from err
    if any(not f or f.isdigit() for f in fields):
        raise ValueError(
            f"ground_truth: template {template!r} uses positional fields; name dataset columns, e.g. {{answer}}"
        )
    return tuple(dict.fromkeys(f.split(".")[0].split("[")[0] for f in fields))


@register("view", "ground_truth")
@dataclass
class GroundTruthView:
    """Prompt edited to contain the ground-truth answer (GEAR's self-teacher context, Li et al. 2026)."""

    template: str = DEFAULT_TEMPLATE

    def __post_init__(self) -> None:
        if "prompt" not in template_columns(self.template):
            raise ValueError(f"ground_truth: template {self.template!r} must contain {{prompt}}")

    def _text(self, meta: dict[str, Any], group: int = 0) -> Any:
        """The edited prompt of one group: a string, or a copy of its chat messages."""
        for col in template_columns(self.template):
            if meta.get(col) is None:
                raise ValueError(
                    f"ground_truth view: template {self.template!r} needs column {col!r}, "
                    f"which group {group} lacks; its columns are {sorted(meta)}"
                )
        return edit_user_text(
            meta["prompt"], lambda text: self.template.format(**{**meta, "prompt": text}), "ground_truth view", group
        )

    def apply(self, rollout: Rollout, encode: Callable[[Any], list[int]]) -> Rollout:
        B = len(rollout.prompt_ids)
        if len(rollout.meta) != B:
            raise ValueError(
                f"ground_truth view needs rollout.meta for each of the {B} groups, got {len(rollout.meta)}"
            )
        prompt_ids = [list(encode(self._text(meta, b))) for b, meta in enumerate(rollout.meta)]  # B token lists
        return dataclasses.replace(
            rollout, prompt_ids=prompt_ids, extras=dict(rollout.extras), extra_levels=dict(rollout.extra_levels)
        )
