"""Math answer verification with math-verify, in a worker process with a hard per-item timeout.

Checks a completion's final answer against the gold answer with Hugging Face's math-verify
(https://github.com/huggingface/Math-Verify): ``parse`` both sides to SymPy, then ``verify``
(numeric, symbolic, set/interval and string equivalence). This is the accuracy reward of open-r1
(https://github.com/huggingface/open-r1, ``src/open_r1/rewards.py``) and TRL's math examples.

**Change vs GRPO**: none — standard practice, the rule-based accuracy reward of R1-style GRPO
training; it only fills the reward column that GRPO's advantage estimator then centres and scales.

**Math** (per completion ``i``; ``golds = columns[column]``)::

    gold   = gold_answer(golds[i])                 (None -> score None, not sent to a worker)
    text   = completion_answer_text(completions[i])
    parsed = parse("\\boxed{" + gold + "}")        (LaTeX and plain-expression extraction)
    score  = None                                  if parsed is empty (the gold does not parse)
    score  = 0.0                                   if parse(text) is empty (no answer found)
    score  = 1.0 if verify(parsed, parse(text)) else 0.0
    score  = None                                  if the item runs past timeout_s, math-verify
                                                   raises, or the worker crashes

Gold answers (the ``column``, default ``answer``) are extracted by :func:`gold_answer`:

1. MATH / MATH-500 (Hendrycks et al. 2021): the content of the last ``\\boxed{...}`` (braces
   balanced) -> e.g. ``"\\left( 3, \\frac{\\pi}{2} \\right)"``.
2. GSM8K (Cobbe et al. 2021): the solution ends ``#### 42`` -> ``"42"``; thousands separators are
   dropped (``#### 1,450,000`` -> ``"1450000"``).
3. The text after ``The answer is:`` (MetaMath-style tails).
4. Anything else is taken as the bare answer (``"82"``, ``"\\frac{1}{2}"``).

The completion is parsed with math-verify's default extraction (LaTeX and plain expressions,
``\\boxed`` first); if it has no ``\\boxed`` but contains GSM8K's ``####`` marker, only the text
after the last one is parsed (:func:`completion_answer_text`).

**Defaults**

- ``column = "answer"`` [INFERRED].
- ``timeout_s = 5.0`` [CODE] math-verify's default ``timeout_seconds`` (``verify``).
- ``num_workers = 1`` [INFERRED] one core per worker; raise it on large hosts.
- ``weight = 1.0`` [CODE] TRL ``GRPOConfig.reward_weights = None`` weighs every reward 1.0.
- ``log_answer = False`` [INFERRED] nothing is logged unless asked.

**Notes**

1. A box is looked for first so that a Markdown ``####`` heading in a boxed solution is not taken
   for GSM8K's marker.
2. The ``####`` rule for completions is [INFERRED]: a model trained on GSM8K solutions answers in
   that format; without this, 4 of the 1,319 GSM8K test reference solutions fail to verify against
   their own answer.
3. Scores: 1.0 equivalent, 0.0 not (or no answer found), ``None`` (no verdict) when the gold does
   not parse, when the row's gold is ``None``, or when verification runs out of time.
4. **Never hangs.** Some answers make verification run for ever: with ``\\boxed{9^{9^{9^{9}}}}``
   SymPy tries to evaluate the power tower. math-verify's own timeout uses ``signal.alarm``, which
   works only on the main thread (elsewhere it raises), fires only when control returns to the
   interpreter (not inside C extensions that never check for signals), and scores a timeout 0.0
   rather than "no verdict". Verification therefore runs in persistent worker processes with
   math-verify's timeouts off (``_math_worker.py``), fed whole batches to amortise the IPC
   (``_math_pool.py``); each item gets ``timeout_s`` of wall-clock time, and on expiry the worker
   is killed (SIGKILL), the item scores ``None``, the worker is restarted (~1 s, not counted
   against any item) and the rest of its batch resent. The pool's ``timeouts`` counts these items.
5. Workers are fresh interpreters (as with multiprocessing's "spawn", but never re-running the
   caller's ``__main__``) and die with the parent (Linux ``PR_SET_PDEATHSIG``). They start on the
   first call; ``close()`` stops them, and a copy or unpickled reward starts its own.
6. :func:`verify_in_process` scores one pair in the calling process WITHOUT a timeout (tests,
   notebooks).
7. ``timeout_s <= 0`` or ``num_workers < 1`` is a ``ConfigError`` at build time; a missing column
   is an error that names it.
8. ``log_answer = True`` logs each completion's final answer (:func:`final_answer`: the last
   ``\\boxed{}``, else the text after GSM8K's last ``####``, else the stripped completion) through
   ``log_extra("final_answer", ...)`` into ``rollout.info[b][g]["extra"]["final_answer"]``, for
   components that read a row's final answer (EDAS, ``advantages/edas.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rewards._common import get_column
from groupwise.rewards._math_pool import MathVerifierPool

# ----------------------------------------------------------------------------- answer extraction


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None."""
    best: tuple[int, str] | None = None  # (position, content)
    for command in ("\\boxed", "\\fbox"):
        start = text.rfind(command)
        while start >= 0:
            content = _braced_after(text, start + len(command))
            if content is not None:
                if best is None or start > best[0]:
                    best = (start, content)
                break
            start = text.rfind(command, 0, start)
    return best[1] if best is not None else None


def _braced_after(text: str, pos: int) -> str | None:
    """The ``{...}`` group starting at ``pos`` (after optional spaces), braces balanced, else None."""
    while pos < len(text) and text[pos] == " ":
        pos += 1
    if pos >= len(text) or text[pos] != "{":
        return None
    depth = 0
    for end in range(pos, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                return text[pos + 1 : end]
    return None  # unbalanced


def gsm8k_answer(text: str) -> str | None:
    """The final answer after GSM8K's last ``####`` marker, thousands separators dropped."""
    if "####" not in text:
        return None
    answer = text.rsplit("####", 1)[1].strip().splitlines()
    if not answer:
        return None
    value = answer[0].strip()
    value = _drop_thousands_separators(value)
    return value or None


def _drop_thousands_separators(value: str) -> str:
    out = []
    for i, ch in enumerate(value):
        if ch == "," and 0 < i < len(value) - 1 and value[i - 1].isdigit() and value[i + 1].isdigit():
            continue
        out.append(ch)
    return "".join(out)


def gold_answer(text: Any) -> str | None:
    """The final answer of a gold solution: last ``\\boxed{}``, else GSM8K ``####``, else
    ``The answer is:``, else the whole (stripped) text. None for None or an empty answer."""
    if text is None:
        return None
    text = str(text)
    for extract in (last_boxed, gsm8k_answer):
        found = extract(text)
        if found is not None:
            return found.strip() or None
    marker = "The answer is:"
    if marker in text:
        return text.rsplit(marker, 1)[1].strip() or None
    return text.strip() or None


def completion_answer_text(completion: str) -> str:
    """The part of a completion that math-verify parses: after GSM8K's last ``####`` if there is
    such a marker and no ``\\boxed`` answer, else all of it."""
    if "####" in completion and last_boxed(completion) is None:
        return completion.rsplit("####", 1)[1]
    return completion


def final_answer(completion: str) -> str:
    """A completion's final answer as text: the last ``\\boxed{}``, else GSM8K's ``####`` tail, else
    the whole completion, stripped (what ``log_answer`` logs; not what math-verify parses)."""
    for extract in (last_boxed, gsm8k_answer):
        found = extract(completion)
        if found is not None:
            return found.strip()
    return completion.strip()


def verify_in_process(gold: str, completion: str) -> float | None:
    """Score one pair in this process, WITHOUT a timeout (tests, notebooks). ``gold`` is a solution
    or bare answer; returns 1.0, 0.0 or None like the reward."""
    from groupwise.rewards._math_worker import judge

    extracted = gold_answer(gold)
    return None if extracted is None else judge(extracted, completion_answer_text(completion))


# ----------------------------------------------------------------------------- the reward


@register("reward", "math")
@dataclass
class Math:
    """1.0 if math-verify finds the completion's answer equivalent to the gold ``column``, else 0.0."""

    column: str = "answer"
    timeout_s: float = 5.0
    num_workers: int = 1
    weight: float = 1.0
    log_answer: bool = False  # log each final answer as info extra "final_answer" (Note 8)
    _pool: MathVerifierPool | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError(f"reward 'math': timeout_s must be > 0, got {self.timeout_s}")
        if self.num_workers < 1:
            raise ConfigError(f"reward 'math': num_workers must be >= 1, got {self.num_workers}")

    @property
    def _workers(self) -> MathVerifierPool:
        if self._pool is None:
            self._pool = MathVerifierPool(self.timeout_s, self.num_workers)
        return self._pool

    @property
    def _timeouts(self) -> int:
        return self._pool.timeouts if self._pool is not None else 0

    def accepts_kwarg(self, name: str) -> bool:
        return self.log_answer and name == "log_extra"

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], log_extra: Any = None, **columns: Any
    ) -> list[float | None]:
        golds = get_column(columns, self.column, len(completions), "math")
        if self.log_answer and log_extra is not None:
            log_extra("final_answer", [final_answer(c) for c in completions])
        extracted = [gold_answer(g) for g in golds]
        todo = [i for i, g in enumerate(extracted) if g is not None]
        verdicts = self._workers.verify([(extracted[i], completion_answer_text(completions[i])) for i in todo])
        scores: list[float | None] = [None] * len(completions)
        for i, verdict in zip(todo, verdicts):
            scores[i] = verdict
        return scores

    def close(self) -> None:
        """Stop the worker processes (they also stop when this object is collected or at exit)."""
        if self._pool is not None:
            self._pool.close()

    def __getstate__(self) -> dict[str, Any]:  # copies and pickles start their own workers
        state = dict(self.__dict__)
        state["_pool"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
