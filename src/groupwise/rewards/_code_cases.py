"""Test cases of the code-execution reward (``rewards/code.py``, whose docstring gives the formats):
parsing a row's tests into :class:`Case` s, the canonical form that compares values by exact type and
value, decoding the untrusted value tree the sandbox sends back, and the trusted per-run verdict."""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

from groupwise.rewards._common import RewardError
from groupwise.sandbox.bwrap import RunResult
from groupwise.sandbox.harness import MAX_DEPTH, Unsupported, encode


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


_CALLS = {
    "float": float,
    "complex": complex,
    "set": set,
    "frozenset": frozenset,
    "tuple": tuple,
    "list": list,
    "dict": dict,
}


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
            'write it as the literal\'s source, e.g. "4", "\'text\'", "[1, 2]"'
        ) from err


def _from_assert(text: str, where: str) -> Case:
    try:
        tree = ast.parse(text.strip())
    except SyntaxError as err:
        raise RewardError(f"reward 'code': {where}: test {text!r} is not valid Python: {err}") from err
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise RewardError(
            f"reward 'code': {where}: a string test must be one `assert <call> == <literal>`, got {text!r}"
        )
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
                    raise RewardError(
                        f"reward 'code': {where}: {ast.unparse(lit)!r} is not a plain literal ({err})"
                    ) from err
                return Case("call", call=ast.unparse(expr), expected=expected)
        if (
            isinstance(op, ast.Is)
            and isinstance(right, ast.Constant)
            and right.value in (True, False, None)
            and type(right.value) in (bool, type(None))
        ):
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
    # only ASCII spaces and tabs: str.rstrip() would also forgive \x1c-\x1f, \x85, U+2028, U+3000...
    lines = [line.rstrip(" \t\r\n") for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
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
