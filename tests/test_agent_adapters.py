"""Issue 40, the rest: code tools in the sandbox, TRL's ``environment_factory`` classes as envs, and the
gymnasium adapter, each on real calls (the sandbox, a real registered gymnasium env), not mocks."""

from __future__ import annotations

import json
import time

import pytest

from groupwise.errors import ConfigError
from groupwise.rollout.code_tools import code_tool, function_source, python
from groupwise.rollout.tools import Call, Toolbox, calculator
from groupwise.sandbox.bwrap import Sandbox, SandboxUnavailable


def _sandbox_problem() -> str | None:
    try:
        Sandbox().check()
    except SandboxUnavailable as err:
        return str(err)
    return None


_PROBLEM = _sandbox_problem()
needs_bwrap = pytest.mark.skipif(_PROBLEM is not None, reason=f"no usable bubblewrap sandbox: {_PROBLEM}")


def _square(x: int) -> int:
    return x * x


@code_tool
def hypotenuse(a: int, b: int) -> str:
    """The integer hypotenuse of a right triangle (through a module-level helper: not self-contained).

    Args:
        a: one side.
        b: the other side.
    """
    import math

    return str(math.isqrt(_square(a) + _square(b)))


def _error(message: dict) -> str:
    return json.loads(message["content"])["error"]


# ---------------------------------------------------------------------------------------------- code tools
def test_a_code_tools_source_travels_without_its_decorator():
    src = function_source(hypotenuse)
    assert src.startswith("def hypotenuse(a: int, b: int) -> str:") and "@code_tool" not in src
    with pytest.raises(ConfigError, match="not a plain function"):
        code_tool(print)


@needs_bwrap
def test_code_tools_run_in_the_sandbox_with_a_timeout():
    box = Toolbox([calculator, python, hypotenuse], timeout=1.0)
    assert hypotenuse(3, 4) == "5"  # in-process it works; in the sandbox only the function travels, not _square
    assert "NameError: name '_square' is not defined" in _error(box.run(Call("hypotenuse", {"a": 3, "b": 4})))
    out = box.run(Call("python", {"code": "import os\nprint(6 * 7, os.getcwd(), os.path.exists('/work'))"}))
    # 6*7 = 42; the sandbox's working directory is its scratch /tmp and the host's /work is not mounted
    assert out == {"role": "tool", "name": "python", "content": "42 /tmp False\n"}
    raised = box.run(Call("python", {"code": "print(1)\n1 / 0"}))["content"]
    assert raised.startswith("1\nTraceback") and "ZeroDivisionError" in raised  # a program's error is its output
    t0 = time.monotonic()
    looped = box.run(Call("python", {"code": "while True:\n    pass"}))
    took = time.monotonic() - t0
    assert "within 1 s of CPU time" in _error(looped) and took < 10  # killed: 1 s of CPU, 2 s wall backstop
    assert "TypeError" in _error(box.run(Call("python", {"source": "print(1)"})))  # a wrong argument name
    assert box.run(Call("python", {"code": "print('after')"}))["content"] == "after\n"  # the next call is fine
    assert box.run(Call("calculator", {"expression": "2*3"}))["content"] == "6"  # plain tools still in-process
    stats = box.stats()
    # python: 5 calls, 2 errors (the timeout, the wrong argument; a traceback is a result); hypotenuse: 1 of 1
    assert stats["tools/python/calls"] == 5 and stats["tools/python/error_rate"] == pytest.approx(2 / 5)
    assert stats["tools/hypotenuse/error_rate"] == 1.0 and stats["tools/calculator/error_rate"] == 0.0


@code_tool
def isqrt_sum(a: int, b: int) -> int:
    """The integer square root of a*a + b*b.

    Args:
        a: one side.
        b: the other side.
    """
    import math

    return math.isqrt(a * a + b * b)


@needs_bwrap
def test_a_self_contained_code_tool_returns_its_value_as_text():
    box = Toolbox([isqrt_sum], timeout=2.0)
    assert box.run(Call("isqrt_sum", {"a": 5, "b": 12}))["content"] == "13"  # isqrt(25 + 144) = 13
    with pytest.raises(ConfigError, match="unknown keys"):
        Toolbox([isqrt_sum], sandbox={"memory": 1})
