"""Compile-fix: a small built-in multi-turn code-repair toy (spec 50's CPU analogue) in the sandbox.

The "program" is one line of a mini-language, ``{a}+{b}=<slot>``; the slot is broken (empty) and
the agent repairs it: each action is the text put in the slot. Every action is run through the
tool ``compile()`` and the hidden semantic test, both executed in the project's code sandbox
(``groupwise/sandbox``, as ``rewards/code.py``): the sandbox compiles the slot text as a
mini-language expression (digits and ``+`` only, Python's ``compile(..., "eval")``) and evaluates
it; the value comes back across the boundary and the trusted parent compares it with the hidden
``a + b`` (the expected value never enters the sandbox). The episode ends on a pass (``success``),
when the step budget is spent (``policy_fail``), or on an injected or real sandbox failure
(``env_fail``). The observation after a failed step is the line again, so the agent retries.

Why this rendering: the embedded model was fine-tuned on ``"a+b="`` only, so it writes numbers
there (some wrong, some empty or malformed: the three reward tiers all occur).

**Change vs GRPO**: none by itself — an environment (``env`` stage, ``compile_fix``) and its task,
for the multi-turn strategies (``episodes``, ``governed_episodes``).

**Math** (episode of row (a, b), step k = 0..steps-1, action text x_k)::

    env_fail_k  = u_k < env_fail_prob (u_k from the reset seed) or the sandbox gave no verdict
    compiled_k  = x_k.strip() is a non-empty mini-language expression that compiles (in the sandbox)
    semantic_k  = compiled_k and value(x_k) == a + b
    s_k         = (compiled_k + semantic_k) / 2          ∈ {0, 0.5, 1}  (the step's process score)
    reward_k    = 1 if semantic_k else 0                 (the binary return: env_return)
    done        = semantic_k or env_fail_k or k + 1 == steps
    outcome()   = {cause, compiled: compiled_last, semantic: semantic_last, step_scores: [s_0..s_k], steps}

**Defaults**

- ``steps = 8`` [INFERRED] spec 50's step budget (a row's ``steps`` column overrides it).
- ``env_fail_prob = 0.05`` [INFERRED] spec 50's injected "sandbox errors" per step.
- ``timeout_s = 2.0`` [INFERRED] CPU seconds per sandbox run (the check is one ``compile`` + ``eval``).
- ``unsafe_local = False`` fail closed, as reward ``code``.

**Notes**

1. Verdicts are cached per process by slot text: the check is a pure function of the text (only
   the parent's comparison depends on the row), so repeated answers cost one sandbox run. A
   sandbox run without a verdict (``infra_error``) is an ``env_fail`` and is never cached.
2. The injected failure draws from a ``random.Random(seed)`` of the episode's reset seed, so an
   episode's failures depend only on (seed, step, row, episode), as every env of ``rollout/env.py``.
3. ``compiled``/``semantic`` in ``outcome()`` describe the last program state (the last action):
   an ``env_fail`` episode reports both False and its own cause, which the governance reads.
4. Under data parallelism every rank steps every episode (``rollout/env.py`` gathers the actions),
   so every rank runs the same checks; the cache and the seeded injection keep them identical, but
   a REAL sandbox failure on one rank only would make that rank's episode an ``env_fail`` alone
   (the ranks would then disagree). Not guarded here: on one machine the sandbox either works for
   every rank or fails the build.
5. ``action_value(row, action)`` scores a lone completion (held-out evaluation: reward
   ``env_return``): 1 if it passes the semantic test, else 0.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.tasks import Task, register_task, split_pool

TEST_SIZE = 300
_SPLIT_SEED = 5050
TOP = 50  # operands 0..49

# Runs INSIDE the sandbox: compile the slot text as a mini-language expression and evaluate it.
CHECKER = """
def check(src):
    text = src.strip()
    if not text or set(text) - set("0123456789+ ") or len(text) > 32:
        return [False, None]
    try:
        code = compile(text, "<fix>", "eval")
    except SyntaxError:
        return [False, None]
    return [True, eval(code, {"__builtins__": {}}, {})]
"""

_CACHE: dict[str, tuple[bool, int | None]] = {}
_SANDBOXES: dict[tuple, object] = {}
_LOCK = threading.Lock()


def _sandbox(unsafe_local: bool):
    from groupwise.sandbox.bwrap import Sandbox

    with _LOCK:
        key = (unsafe_local,)
        if key not in _SANDBOXES:
            box = Sandbox(unsafe_local=unsafe_local)
            box.check()  # fail closed at the first use, with the sandbox's own instructions
            _SANDBOXES[key] = box
        return _SANDBOXES[key]


def sandbox_check(text: str, timeout_s: float = 2.0, unsafe_local: bool = False) -> tuple[bool, int | None] | None:
    """(compiled, value) of a slot text, run in the sandbox; ``None``: no verdict (an infrastructure failure)."""
    if text in _CACHE:
        return _CACHE[text]
    from groupwise.sandbox.bwrap import Limits

    res = _sandbox(unsafe_local).run(
        code=CHECKER, mode="call", call=f"check({text!r})", limits=Limits(timeout_s=timeout_s, memory_mb=256)
    )
    results = [r for r in res.records if r.get("kind") == "result"]
    if res.infra_error or len(results) != 1:
        return None
    record = results[0]
    if not record.get("ok"):
        verdict: tuple[bool, int | None] = (False, None)  # the check raised (a huge literal, ...): does not compile
    else:
        verdict = _decode(record.get("value"))
    _CACHE[text] = verdict
    return verdict


def _decode(value) -> tuple[bool, int | None]:
    """The sandbox's typed value ``["list", [["bool", "True"], ["int", "7"]]]`` as (compiled, value)."""
    try:
        kind, items = value
        (kc, c), (kv, v) = items
        compiled = kc == "bool" and c in (True, "True")
        return compiled, (int(v) if compiled and kv == "int" else None)
    except (TypeError, ValueError):
        return False, None


def render(a: int, b: int) -> str:
    return f"{a}+{b}="


@register("env", "compile_fix")
@dataclass
class CompileFix:
    """Repair the slot of ``a+b=<slot>``: each action is checked (compile, then the hidden semantic test) in the
    sandbox."""

    steps: int = 8
    env_fail_prob: float = 0.05
    timeout_s: float = 2.0
    unsafe_local: bool = False
    a: int = field(default=0, init=False)
    b: int = field(default=0, init=False)
    left: int = field(default=0, init=False)
    cause: str = field(default="", init=False)
    scores: list = field(default_factory=list, init=False)
    last: tuple = field(default=(False, False), init=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise ConfigError(f"env compile_fix: steps must be an int >= 1, got {self.steps!r}")
        if not 0.0 <= self.env_fail_prob < 1.0:
            raise ConfigError(f"env compile_fix: env_fail_prob must be in [0, 1), got {self.env_fail_prob!r}")
        if not 0 < self.timeout_s <= 60:
            raise ConfigError(f"env compile_fix: timeout_s must be in (0, 60], got {self.timeout_s!r}")
        self._rng = random.Random(0)

    def reset(self, row: dict, seed: int) -> str:
        self.a, self.b = int(row["a"]), int(row["b"])
        self.left = int(row.get("steps") or self.steps)
        self.cause, self.scores, self.last = "", [], (False, False)
        self._rng = random.Random(seed)
        return render(self.a, self.b)

    def step(self, action: str) -> tuple[str, float, bool]:
        self.left -= 1
        verdict = (
            None
            if self._rng.random() < self.env_fail_prob
            else sandbox_check(str(action), self.timeout_s, self.unsafe_local)
        )
        if verdict is None:  # the sandbox failed (injected or real): nothing is known about the action
            self.cause, self.last = "env_fail", (False, False)
            return "sandbox error", 0.0, True
        compiled, value = verdict
        semantic = compiled and value == self.a + self.b
        self.scores.append((float(compiled) + float(semantic)) / 2)
        self.last = (compiled, semantic)
        if semantic:
            self.cause = "success"
        elif self.left <= 0:
            self.cause = "policy_fail"
        return render(self.a, self.b), float(semantic), bool(self.cause)

    def outcome(self) -> dict:
        return {
            "cause": self.cause,
            "compiled": self.last[0],
            "semantic": self.last[1],
            "step_scores": list(self.scores),
            "steps": len(self.scores) + (self.cause == "env_fail"),
        }

    def action_value(self, row: dict, action: str) -> float:
        verdict = sandbox_check(str(action), self.timeout_s, self.unsafe_local)
        return 1.0 if verdict is not None and verdict[0] and verdict[1] == int(row["a"]) + int(row["b"]) else 0.0


def format_row(a: int, b: int) -> dict:
    """``{"prompt": "3+4=", "answer": "7", "env": "compile_fix", "a": 3, "b": 4}``."""
    return {"prompt": render(a, b), "answer": str(a + b), "env": "compile_fix", "a": a, "b": b}


def _rows(split: str, n: int, seed: int = 0) -> list[dict]:
    pairs = [(a, b) for a in range(TOP) for b in range(TOP)]
    random.Random(_SPLIT_SEED).shuffle(pairs)
    return [format_row(a, b) for a, b in split_pool(pairs, split, n, seed, TEST_SIZE, "compile_fix")]


register_task(
    Task(
        "compile_fix",
        "multi-turn code repair: fill the slot of 'a+b=' (compile + "
        "semantic check in the sandbox), up to 8 steps; reward env_return",
        _rows,
        reward="env_return",
    )
)
