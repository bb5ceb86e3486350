"""Code tools: tools that run in the sandbox of the ``code`` reward, not in the trainer's process.

A tool that executes model-written code (a Python interpreter, a shell) or that should not share the
trainer's memory is flagged with :func:`code_tool`; ``Toolbox`` (``rollout/tools.py``) then runs each
call of it in a fresh sandbox (``groupwise/sandbox/bwrap.py``: bubblewrap namespaces, rlimits, seccomp,
no network; threat model in ``docs/sandbox.md``) with the toolbox's timeout, instead of a worker thread.
Unlike a thread, an overrunning sandboxed call is killed (its whole process tree), so a code tool may
loop forever without costing the run more than the timeout.

**How a call runs.** The tool's own source (``inspect.getsource``, its decorators removed) is defined in
the sandbox, called with the call's JSON arguments, and its result's ``str`` comes back as the tool
message. Only that function travels, not its module: a code tool is self-contained (it imports what it
needs inside its body, from what the sandbox's interpreter has, by default the standard library of the
trainer's Python). ``python`` below is the built-in one: it runs a program and returns what it printed.

**Timeout.** The toolbox's ``tool_timeout`` is the run's CPU time (the sandbox's ``Limits.timeout_s``),
with a wall-clock backstop of twice that; interpreter start-up (~0.1 s) is not counted.
"""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
from collections.abc import Callable
from typing import Any

from groupwise.errors import ConfigError

FLAG = "__groupwise_code_tool__"


def code_tool(fn: Callable) -> Callable:
    """Flag ``fn`` as a code tool (run in the sandbox); returns ``fn`` itself, still callable directly."""
    if not inspect.isfunction(fn):
        raise ConfigError(f"code_tool: {fn!r} is not a plain function (a code tool's source is what runs)")
    setattr(fn, FLAG, True)
    return fn


def is_code_tool(fn: Callable) -> bool:
    return bool(getattr(fn, FLAG, False))


def function_source(fn: Callable) -> str:
    """``fn``'s definition as a module of its own: dedented, decorators removed (they are not in the sandbox)."""
    try:
        text = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as err:
        raise ConfigError(
            f"code tool {fn.__name__!r}: its source cannot be read ({err}); define it in a file"
        ) from None
    tree = ast.parse(text)
    defs = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == fn.__name__]
    if len(defs) != 1:
        raise ConfigError(f"code tool {fn.__name__!r}: a code tool is a plain `def` (not a lambda or a method)")
    defs[0].decorator_list = []
    return ast.unparse(defs[0]) + "\n"


class SandboxRunner:
    """Runs code-tool calls, each in a fresh sandbox. ``options``: ``unsafe_local``, ``python``, ``cgroup``
    (as the ``code`` reward's), ``memory_mb`` [256], ``max_output_bytes`` [65536]."""

    def __init__(self, options: dict | None = None):
        from groupwise.sandbox.bwrap import Sandbox

        options = dict(options or {})
        self.memory_mb = int(options.pop("memory_mb", 256))
        self.max_output_bytes = int(options.pop("max_output_bytes", 65536))
        unknown = set(options) - {"unsafe_local", "python", "cgroup"}
        if unknown:
            raise ConfigError(
                f"rollout.params.sandbox: unknown keys {sorted(unknown)}; known: unsafe_local, python, cgroup, "
                f"memory_mb, max_output_bytes"
            )
        self.sandbox = Sandbox(**options)
        self.sandbox.check()  # fail closed at build (no bwrap: the message says how to install it)
        self._sources: dict[Callable, str] = {}

    def call(self, fn: Callable, arguments: dict, timeout: float) -> tuple[bool, str]:
        """(True, str(result)) or (False, why it failed: the tool's exception, a timeout, a crash)."""
        from groupwise.sandbox.bwrap import Limits

        if fn not in self._sources:
            self._sources[fn] = function_source(fn)
        payload = json.dumps(arguments)
        expression = f"str({fn.__name__}(**__import__('json').loads({payload!r})))"
        limits = Limits(timeout_s=timeout, memory_mb=self.memory_mb, max_output_bytes=self.max_output_bytes)
        res = self.sandbox.run(code=self._sources[fn], mode="call", call=expression, limits=limits)
        if not res.ready:
            return False, f"the sandbox did not start ({res.infra_error})"
        if res.timed_out:
            return False, f"the tool did not return within {timeout:g} s of CPU time (killed in the sandbox)"
        if res.output_capped:
            return False, f"the tool wrote more than {self.max_output_bytes} bytes (killed in the sandbox)"
        records = [r for r in res.records if r.get("kind") == "result"]
        if len(records) != 1:
            return False, f"the tool's process ended without a result (exit code {res.exit_code})"
        record: dict[str, Any] = records[0]
        if not record.get("ok"):
            return False, str(record.get("error", "unknown error"))
        value = record.get("value")
        if not (isinstance(value, list) and len(value) == 2 and value[0] == "str" and isinstance(value[1], str)):
            return False, "the tool's result is not a string"
        return True, value[1]


@code_tool
def python(code: str) -> str:
    """Run a Python program and return what it printed (stdout, then a traceback if it raised).

    Args:
        code: The program, e.g. "print(sum(range(10)))".
    """
    import contextlib
    import io
    import traceback

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
        except Exception:
            traceback.print_exc(file=out)
    return out.getvalue()
