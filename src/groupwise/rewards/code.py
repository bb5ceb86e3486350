"""Code-execution reward: the fraction of a row's tests that the model-written Python passes.

Each test case runs in its OWN fresh sandbox (``groupwise/sandbox/bwrap.py``: bubblewrap namespaces, read-only
file system with a scratch tmpfs, no network, scrubbed environment, rlimits, wall-clock kill of the
whole process tree, capped output). The verdict is computed here, in the trusted parent, from what
crossed the sandbox boundary; the expected answers never enter the sandbox. Threat model,
guarantees, residual risks and the tests proving them: ``docs/sandbox.md``.

    [[reward]]
    name = "code"
    column = "tests"          # dataset column holding each row's tests
    timeout_s = 5.0           # per test case, wall clock
    all_or_nothing = false    # true: 1.0 only when every test passes

**The code** is the last fenced block marked ```` ```python ```` (or ``py``/``python3``) in the
completion, else the whole completion.

**The tests** (the ``column`` value of a row; a JSON string holding the list is accepted too) are a
list of cases, each one of:

* ``{"input": "1 2\\n", "output": "3\\n"}`` — stdin/stdout: the code runs as ``__main__`` with
  ``input`` on stdin; it passes when it exits with status 0 and its stdout equals ``output`` after
  normalising line ends (``\\r\\n`` → ``\\n``), trailing whitespace of each line and trailing blank
  lines. Nothing else is forgiven (no case folding, no numeric tolerance).
* ``{"call": "add(1, 2)", "expected": "3"}`` — function call: the code is executed as module
  ``solution`` (so ``if __name__ == "__main__":`` blocks do not run), then the expression ``call``
  is evaluated in its namespace. ``expected`` is the source of a Python literal (``"3"``,
  ``"'abc'"``, ``"[1, (2, 3)]"``, ``"{'a': 1}"``, ``"float('nan')"``, ``"set()"``) or, if not a
  string, a JSON value used as is (JSON cannot express tuples: use the literal source). Only the
  result's value crosses the boundary, as a tree of EXACT builtin types (``None``, ``bool``,
  ``int``, ``float``, ``complex``, ``str``, ``bytes``, ``list``, ``tuple``, ``set``,
  ``frozenset``, ``dict``); it passes when type and value equal ``expected`` at every level
  (``1 != 1.0 != True``, ``[1] != (1,)``; floats compare by ``repr``: ``nan`` equals ``nan``,
  ``-0.0`` does not equal ``0.0``). Any other result type (a subclass, an object with a custom
  ``__eq__``) fails.
* ``"assert add(1, 2) == 3"`` — shorthand for the case above, split HERE so that ``3`` stays out of
  the sandbox. Only ``assert <expr> == <literal>`` (either side) and ``assert <expr> is
  True|False|None`` are accepted: a bare ``assert f(x)`` would tell the candidate the expected
  value (truthy) and is rejected with an error.

A row's tests are all of one file; ``None`` or an empty list gives ``None`` (no verdict), and a
malformed test is an error naming the row.

**Scores.** A candidate failure (syntax error, exception, non-zero exit, timeout, output over
``max_output_bytes``, wrong answer, a result that is not a plain literal, anything unexpected on
the result channel) scores that test 0. An infrastructure failure (the sandbox did not start, or
was not ready within 30 s) makes the whole sample ``None`` — excluded and counted, never 0 or 1;
it is counted in ``stats["infra_error"]`` and its message kept in ``last_errors``.
Reward = passed / total (``all_or_nothing=True``: 1.0 only if all pass, stopping at the first
failure).

**Fail closed.** Construction runs a probe program in the sandbox; without a working ``bwrap`` it
raises :class:`SandboxUnavailable` explaining how to install it — unless ``unsafe_local=True``,
which runs the same harness as a plain subprocess (rlimits, own session, timeout and group kill,
scrubbed environment) with NO namespace isolation: network, host files and escaped daemons are
then the candidate's to use. Only for code you trust.

Defaults: ``column="tests"``; ``timeout_s=5.0`` (per test case, from the moment the interpreter in
the sandbox is ready); ``memory_mb=512`` (RLIMIT_AS, per process); ``max_output_bytes=65536`` (per
stream); ``max_processes=16`` (RLIMIT_NPROC: processes and threads); ``all_or_nothing=False``;
``unsafe_local=False``; ``workers=2`` (samples scored concurrently, each in its own processes);
``weight=1.0``. The scratch ``/tmp`` (and ``/dev/shm``) is a 64 MiB tmpfs, 64 MiB is also the
largest file (RLIMIT_FSIZE); 64 open files. [INFERRED: the values asked for in the issue, not
tuned.] Limits are per process, so one test case may use up to ``max_processes × memory_mb`` of
address space; measured timeout overrun and every residual risk: ``docs/sandbox.md``.
"""

from __future__ import annotations

import ast
import json
import math
import re
import threading
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

from groupwise.registry import ConfigError, register
from groupwise.rewards._common import RewardError, get_column
from groupwise.sandbox.bwrap import Limits, RunResult, Sandbox, SandboxUnavailable
from groupwise.sandbox.harness import MAX_DEPTH, Unsupported, encode

__all__ = ["Code", "SandboxUnavailable", "extract_code", "parse_tests", "Case"]

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: Any) -> str:
    """The last ```python fenced block of the completion, else the whole completion.

    A conversational completion (a list of ``{"role", "content"}`` messages, as TRL passes them)
    uses the content of its last message.
    """
    if isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], dict):
        completion = completion[-1].get("content", "")
    text = completion if isinstance(completion, str) else str(completion)
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


# ------------------------------------------------------------------------------ test cases


@dataclass(frozen=True)
class Case:
    """One test case: ``mode="stdio"`` (``stdin`` → ``stdout``) or ``mode="call"`` (``call`` → value)."""

    mode: str
    stdin: str = ""
    stdout: str = ""
    call: str = ""
    expected: str = ""  # canonical form of the expected value (mode "call")


def _canon_tree(tree: list) -> list:
    tag = tree[0]
    if tag in ("list", "tuple"):
        return [tag, [_canon_tree(x) for x in tree[1]]]
    if tag in ("set", "frozenset"):
        return [tag, sorted(json.dumps(_canon_tree(x)) for x in tree[1])]
    if tag == "dict":
        return [tag, sorted(json.dumps([_canon_tree(k), _canon_tree(v)]) for k, v in tree[1])]
    return tree


def canonical(value: Any) -> str:
    """A string equal for two values iff they have the same exact types and values at every level."""
    return json.dumps(_canon_tree(encode(value)))


def _decode(tree: Any, depth: int = 0) -> Any:
    """Rebuild a value from the untrusted typed tree the harness sent; ValueError if malformed."""
    if depth > MAX_DEPTH or type(tree) is not list or not tree or type(tree[0]) is not str:
        raise ValueError("malformed value")
    tag, args = tree[0], tree[1:]
    try:
        if tag == "none" and not args:
            return None
        if tag == "bool" and len(args) == 1 and type(args[0]) is bool:
            return args[0]
        if tag == "int" and len(args) == 1 and type(args[0]) is str and re.fullmatch(r"-?[0-9a-f]+", args[0]):
            return int(args[0], 16)
        if tag == "float" and len(args) == 1 and type(args[0]) is str:
            return float(args[0])
        if tag == "complex" and len(args) == 2 and all(type(a) is str for a in args):
            return complex(float(args[0]), float(args[1]))
        if tag == "str" and len(args) == 1 and type(args[0]) is str:
            return args[0]
        if tag == "bytes" and len(args) == 1 and type(args[0]) is str:
            return bytes.fromhex(args[0])
        if tag in ("list", "tuple", "set", "frozenset") and len(args) == 1 and type(args[0]) is list:
            items = [_decode(x, depth + 1) for x in args[0]]
            return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
        if tag == "dict" and len(args) == 1 and type(args[0]) is list:
            out = {}
            for pair in args[0]:
                if type(pair) is not list or len(pair) != 2:
                    raise ValueError("malformed dict item")
                out[_decode(pair[0], depth + 1)] = _decode(pair[1], depth + 1)
            return out
    except (TypeError, OverflowError) as err:  # an unhashable set element or dict key, say
        raise ValueError(str(err)) from err
    raise ValueError(f"malformed value tagged {tag!r}")


_CALLS = {"float": float, "complex": complex, "set": set, "frozenset": frozenset, "tuple": tuple, "list": list, "dict": dict}


def _literal(node: ast.AST) -> Any:
    """``ast.literal_eval`` plus ``float('nan')``-style calls of builtin constructors on literals."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS and not node.keywords:
        return _CALLS[node.func.id](*[_literal(arg) for arg in node.args])
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [_literal(x) for x in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("dict unpacking is not a literal")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def parse_literal(source: str) -> Any:
    """The value of a Python literal given as source text (see the module docstring)."""
    return _literal(ast.parse(source.strip(), mode="eval").body)


def _expected_canonical(expected: Any, where: str) -> str:
    try:
        value = parse_literal(expected) if isinstance(expected, str) else expected
        return canonical(value)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError, Unsupported) as err:
        raise RewardError(
            f"reward 'code': {where}: expected={expected!r} is not a Python literal ({type(err).__name__}: {err}); "
            "write it as the literal's source, e.g. \"4\", \"'text'\", \"[1, 2]\""
        ) from err


def _from_assert(text: str, where: str) -> Case:
    try:
        tree = ast.parse(text.strip())
    except SyntaxError as err:
        raise RewardError(f"reward 'code': {where}: test {text!r} is not valid Python: {err}") from err
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise RewardError(f"reward 'code': {where}: a string test must be one `assert <call> == <literal>`, got {text!r}")
    test = tree.body[0].test
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, op, right = test.left, test.ops[0], test.comparators[0]
        if isinstance(op, ast.Eq):
            for expr, lit in ((left, right), (right, left)):
                try:
                    value = _literal(lit)
                except (ValueError, TypeError, SyntaxError):
                    continue
                try:
                    expected = canonical(value)
                except (TypeError, ValueError, RecursionError) as err:
                    raise RewardError(f"reward 'code': {where}: {ast.unparse(lit)!r} is not a plain literal ({err})") from err
                return Case("call", call=ast.unparse(expr), expected=expected)
        if isinstance(op, ast.Is) and isinstance(right, ast.Constant) and right.value in (True, False, None) and type(right.value) in (bool, type(None)):
            return Case("call", call=ast.unparse(left), expected=canonical(right.value))
    raise RewardError(
        f"reward 'code': {where}: unsupported test {text!r}; use `assert <call> == <literal>` or "
        "`assert <call> is True|False|None` (a bare truthiness assert would reveal its expected value to the candidate)"
    )


def parse_tests(tests: Any, where: str = "row") -> list[Case] | None:
    """A row's tests as :class:`Case` list (``None`` when the row has none)."""
    if tests is None:
        return None
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError as err:
            raise RewardError(f"reward 'code': {where}: the tests are a string but not JSON: {err}") from err
    if isinstance(tests, dict):
        tests = [tests]
    if not isinstance(tests, (list, tuple)):
        raise RewardError(f"reward 'code': {where}: tests must be a list of cases, got {type(tests).__name__}")
    cases = []
    for i, t in enumerate(tests):
        at = f"{where}, test {i}"
        if isinstance(t, str):
            cases.append(_from_assert(t, at))
        elif isinstance(t, dict) and "input" in t and "output" in t:
            if not isinstance(t["input"], str) or not isinstance(t["output"], str):
                raise RewardError(f"reward 'code': {at}: 'input' and 'output' must be strings")
            cases.append(Case("stdio", stdin=t["input"], stdout=t["output"]))
        elif isinstance(t, dict) and "call" in t and "expected" in t:
            if not isinstance(t["call"], str):
                raise RewardError(f"reward 'code': {at}: 'call' must be a string (a Python expression)")
            try:
                ast.parse(t["call"], mode="eval")
            except SyntaxError as err:
                raise RewardError(f"reward 'code': {at}: call={t['call']!r} is not a Python expression: {err}") from err
            cases.append(Case("call", call=t["call"], expected=_expected_canonical(t["expected"], at)))
        else:
            raise RewardError(
                f"reward 'code': {at}: a case is {{'input': str, 'output': str}}, {{'call': str, 'expected': literal}} "
                f"or 'assert <call> == <literal>', got {t!r}"
            )
    return cases or None


def _normalize(text: str) -> str:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def verdict(case: Case, res: RunResult) -> bool | None:
    """The trusted decision for one run: True (pass), False (candidate failure), None (infrastructure)."""
    if not res.ready:
        return None
    if res.timed_out or res.output_capped or res.malformed or res.exit_code != 0:
        return False
    if case.mode == "stdio":
        return _normalize(res.stdout.decode("utf-8", errors="replace")) == _normalize(case.stdout)
    results = [r for r in res.records if r.get("kind") == "result"]
    if len(res.records) != 1 or len(results) != 1 or results[0].get("ok") is not True:
        return False
    try:
        return canonical(_decode(results[0].get("value"))) == case.expected
    except (ValueError, RecursionError, MemoryError, Unsupported):
        return False


# ------------------------------------------------------------------------------ the reward


@register("reward", "code")
@dataclass
class Code:
    """Fraction of the row's tests the completion's Python passes, each run in a fresh sandbox."""

    column: str = "tests"
    timeout_s: float = 5.0
    memory_mb: int = 512
    max_output_bytes: int = 65536
    max_processes: int = 16
    all_or_nothing: bool = False
    unsafe_local: bool = False
    workers: int = 2
    weight: float = 1.0
    stats: Counter = field(init=False, repr=False, compare=False, default_factory=Counter)
    last_errors: list = field(init=False, repr=False, compare=False, default_factory=list)
    _sandbox: Sandbox = field(init=False, repr=False, compare=False)
    _lock: Any = field(init=False, repr=False, compare=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        checks = [
            ("timeout_s", isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and 0 < self.timeout_s <= 3600, "in (0, 3600]"),
            ("memory_mb", isinstance(self.memory_mb, int) and self.memory_mb >= 64, "an int >= 64 (the interpreter needs ~30 MB of address space)"),
            ("max_output_bytes", isinstance(self.max_output_bytes, int) and self.max_output_bytes >= 1024, "an int >= 1024"),
            ("max_processes", isinstance(self.max_processes, int) and self.max_processes >= 2, "an int >= 2 (the sandbox's init counts)"),
            ("workers", isinstance(self.workers, int) and self.workers >= 1, "an int >= 1"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ConfigError(f"reward 'code': {name}={getattr(self, name)!r} must be {want}")
        if not isinstance(self.column, str) or not self.column:
            raise ConfigError(f"reward 'code': column={self.column!r} must be a column name")
        self._sandbox = Sandbox(unsafe_local=self.unsafe_local)
        self._sandbox.check()  # fail closed, now rather than mid-training
        if self.unsafe_local:
            as_root = (
                " As root, and with an interpreter other users cannot run, candidates run AS ROOT: RLIMIT_NPROC is "
                "not enforced for root and nothing stops them from changing the machine."
                if self._sandbox.unsafe_as_root
                else ""
            )
            warnings.warn(
                "reward 'code' with unsafe_local=True runs model-written code WITHOUT a sandbox (no namespaces: "
                "it can use the network, read your files and leave processes behind); use it only for trusted code "
                "or on a throw-away machine." + as_root,
                UserWarning,
                stacklevel=3,
            )

    @property
    def limits(self) -> Limits:
        return Limits(timeout_s=float(self.timeout_s), memory_mb=self.memory_mb, max_output_bytes=self.max_output_bytes, max_processes=self.max_processes)

    def run_case(self, code: str, case: Case) -> RunResult:
        """Run one case of ``code`` in a fresh sandbox (exposed for tests and debugging)."""
        if case.mode == "stdio":
            return self._sandbox.run(code=code, mode="stdio", stdin=case.stdin.encode(), limits=self.limits)
        return self._sandbox.run(code=code, mode="call", call=case.call, limits=self.limits)

    def _score(self, completion: Any, cases: list[Case] | None) -> tuple[float | None, Counter, list[str]]:
        counts: Counter = Counter()
        errors: list[str] = []
        if not cases:
            counts["no_tests"] += 1
            return None, counts, errors
        code = extract_code(completion)
        passed = 0
        for case in cases:
            res = self.run_case(code, case)
            ok = verdict(case, res)
            counts["runs"] += 1
            if ok is None:
                counts["infra_error"] += 1
                errors.append(res.infra_error or "no verdict")
                return None, counts, errors
            if res.timed_out:
                counts["timeout"] += 1
            if res.output_capped:
                counts["output_capped"] += 1
            counts["passed" if ok else "failed"] += 1
            passed += ok
            if not ok and self.all_or_nothing:
                return 0.0, counts, errors
        if self.all_or_nothing:
            return 1.0, counts, errors
        return passed / len(cases), counts, errors

    def __call__(self, prompts: Sequence[str], completions: Sequence[Any], **columns: Any) -> list[float | None]:
        tests = get_column(columns, self.column, len(completions), "code")
        cases = [parse_tests(t, where=f"row {i} (column {self.column!r})") for i, t in enumerate(tests)]
        with ThreadPoolExecutor(max_workers=max(1, min(self.workers, len(completions) or 1))) as pool:
            outcomes = list(pool.map(self._score, completions, cases))
        scores: list[float | None] = []
        errors: list[str] = []
        with self._lock:
            for score, counts, errs in outcomes:
                scores.append(score)
                self.stats.update(counts)
                errors += errs
            self.last_errors = errors
        return scores
