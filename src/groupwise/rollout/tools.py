"""Tools an agent may call: plain Python functions, offered through the chat template, called by the model.

A tool is a function with type hints and a docstring that describes each argument (Google style)::

    def calculator(expression: str) -> str:
        \"\"\"Evaluate an arithmetic expression.

        Args:
            expression: digits, + - * / and parentheses, e.g. "482*739".
        \"\"\"

named in a config as ``"my_pkg.tools:calculator"`` (imported like a plug-in, ``plugins.py``) or
passed as the function itself (the Python API), the same list TRL's ``GRPOTrainer(tools=[...])``
takes. Its JSON schema comes from transformers' own helper (``transformers.utils.get_json_schema``,
which TRL uses too, ``trl/trainer/grpo_trainer.py``); the chat template renders the schemas.

**Calls** are parsed from the assistant's text by a parser (``parse_calls``, a hook: any
``"module:function"`` with the same signature). The default reads the Hermes / Qwen format::

    <tool_call>{"name": "calculator", "arguments": {"expression": "482*739"}}</tool_call>

**Execution** (``Toolbox.run``): each call runs with a timeout (a worker thread; a call that overruns
is reported as an error, and its thread is left to finish on its own: Python cannot stop a thread, so
a tool must not hold resources forever). A tool flagged as a code tool (``rollout/code_tools.py``)
runs in a fresh sandbox instead, and an overrunning call is killed there. The result becomes a tool message
``{"role": "tool", "name": name, "content": str(result)}`` (TRL's form); an unknown tool, bad
arguments, an exception, a timeout or a malformed call become a tool message whose content is
``{"error": "..."}``, never a crash. ``Toolbox.stats()`` counts calls and errors per tool
(``tools/<name>/calls``, ``tools/<name>/error_rate``, ``tools/malformed``, ``tools/unknown``).
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from groupwise.errors import ConfigError
from groupwise.rollout.code_tools import SandboxRunner, is_code_tool

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


@dataclass
class Call:
    """One parsed tool call: a name and its arguments, or the error that made it unreadable."""

    name: str = ""
    arguments: dict = field(default_factory=dict)
    error: str = ""  # non-empty: the call was malformed (the text says why)


def parse_hermes(text: str) -> list[Call]:
    """Every ``<tool_call>{json}</tool_call>`` in ``text`` (Hermes / Qwen); an unclosed ``<tool_call>``
    or a body that is not ``{"name": str, "arguments": dict}`` is a malformed call."""
    calls = []
    for body in _CALL.findall(text):
        try:
            data = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(Call(error=f"the tool call is not valid JSON ({err.msg} at character {err.pos}): {body!r}"))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            calls.append(Call(error=f'a tool call is {{"name": str, "arguments": {{...}}}}, got {body!r}'))
            continue
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(Call(name=data["name"], error=f"the arguments must be a JSON object, got {arguments!r}"))
            continue
        calls.append(Call(data["name"], arguments))
    if text.count(_OPEN) > len(calls):  # an opened call that never closed (cut by max_new_tokens, or garbled)
        calls.append(Call(error="a <tool_call> was opened but not closed with </tool_call>"))
    return calls


PARSERS: dict[str, Callable[[str], list[Call]]] = {"hermes": parse_hermes}


def load_parser(spec: str | Callable) -> Callable[[str], list[Call]]:
    """A parser by name (``"hermes"``), ``"module:function"``, or the function itself."""
    if callable(spec):
        return spec
    if spec in PARSERS:
        return PARSERS[spec]
    if ":" in str(spec):
        return _load_function(spec, "rollout.params.tool_parser")
    raise ConfigError(
        f"rollout.params.tool_parser={spec!r}: not a parser; built in: {sorted(PARSERS)}, or 'module:function' "
        f"(text -> list of groupwise.rollout.tools.Call)"
    )


def _load_function(spec: str, where: str) -> Callable:
    from groupwise.plugins import import_module, split_spec

    module_name, attr = split_spec(spec)
    module = import_module(module_name, where)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{where}: module {module_name!r} has no function {attr!r}")
    return fn


def load_tool(spec: str | Callable, where: str = "rollout.params.tools") -> Callable:
    """The function ``spec`` names (``"module:function"``) or is; its JSON schema must be derivable."""
    fn = _load_function(spec, where) if isinstance(spec, str) else spec
    if not callable(fn):
        raise ConfigError(f"{where}: {spec!r} is not a function")
    schema(fn, where)
    return fn


def schema(fn: Callable, where: str = "tools") -> dict:
    """The function's tool schema ``{"type": "function", "function": {name, description, parameters}}``
    (transformers' ``get_json_schema``: type hints + docstring)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as err:
        raise ConfigError(
            f"{where}: no JSON schema for tool {getattr(fn, '__name__', fn)!r} ({err}); a tool needs type hints on "
            f"every argument and a docstring with an 'Args:' line for each (transformers.utils.get_json_schema)"
        ) from None


class Toolbox:
    """The tools of a run: schemas for the template, execution with a timeout, per-tool counts."""

    def __init__(
        self, tools: list, timeout: float = 5.0, parser: str | Callable = "hermes", sandbox: dict | None = None
    ):
        self.functions: dict[str, Callable] = {}
        for i, spec in enumerate(tools):
            fn = load_tool(spec, f"rollout.params.tools[{i}]")
            name = schema(fn)["function"]["name"]
            if name in self.functions:
                raise ConfigError(f"rollout.params.tools: two tools are named {name!r}; tool names must be unique")
            self.functions[name] = fn
        self.schemas = [schema(fn) for fn in self.functions.values()]
        self.timeout, self.parse = float(timeout), load_parser(parser)
        self.calls: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.malformed = 0
        self.env_tools: set[str] = set()  # names of the episodes' own tools seen so far (``bind``)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="groupwise-tool")
        # code tools (``rollout/code_tools.py``) run in the sandbox; it is checked now, only when one is offered
        self._sandbox = SandboxRunner(sandbox) if any(map(is_code_tool, self.functions.values())) else None

    def bind(self, functions: list, who: str) -> dict[str, Callable]:
        """An episode's own tools (an env's ``tools()``: methods bound to its instance) by name, checked: each has
        a schema and no name of the toolbox's; they count in ``stats()`` like the toolbox's own."""
        own: dict[str, Callable] = {}
        for fn in functions:
            name = schema(fn, f"{who}: env tool")["function"]["name"]
            if is_code_tool(fn):
                raise ConfigError(
                    f"{who}: the env's tool {name!r} is flagged as a code tool; an env's tools change its "
                    f"instance, so they run in the trainer's process: remove the flag"
                )
            if name in self.functions or name in own:
                raise ConfigError(f"{who}: the env's tool {name!r} has the name of another tool; tool names are unique")
            own[name] = fn
            self.env_tools.add(name)
        return own

    def run(self, call: Call, own: dict[str, Callable] | None = None) -> dict:
        """The tool message answering ``call`` (its result, or ``{"error": ...}``); ``own``: the episode's tools."""
        if call.error:
            self.malformed += 1
            return {"role": "tool", "name": call.name or "unknown", "content": json.dumps({"error": call.error})}
        self.calls[call.name] = self.calls.get(call.name, 0) + 1
        fn = self.functions.get(call.name) or (own or {}).get(call.name)
        if fn is None:
            return self._error(call.name, f"no tool {call.name!r}; the tools are {sorted(self.functions)}")
        if self._sandbox is not None and is_code_tool(fn):
            ok, text = self._sandbox.call(fn, call.arguments, self.timeout)
            return {"role": "tool", "name": call.name, "content": text} if ok else self._error(call.name, text)
        try:
            result = self._pool.submit(fn, **call.arguments).result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            self._pool.shutdown(wait=False)  # the overrunning call keeps its thread; later calls get a fresh one
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="groupwise-tool")
            return self._error(call.name, f"the tool did not return within {self.timeout:g} s")
        except Exception as err:
            return self._error(call.name, f"{type(err).__name__}: {err}")
        return {"role": "tool", "name": call.name, "content": str(result)}

    def _error(self, name: str, message: str) -> dict:
        self.errors[name] = self.errors.get(name, 0) + 1
        return {"role": "tool", "name": name, "content": json.dumps({"error": message})}

    def stats(self) -> dict[str, float]:
        """Counts since the last call: ``tools/<name>/calls``, ``tools/<name>/error_rate``, ``tools/malformed``
        (unreadable calls), ``tools/unknown`` (calls of a tool that does not exist)."""
        out = {
            "tools/malformed": float(self.malformed),
            "tools/unknown": float(
                sum(n for name, n in self.calls.items() if name not in self.functions and name not in self.env_tools)
            ),
        }
        for name in [*self.functions, *sorted(self.env_tools)]:
            n = self.calls.get(name, 0)
            out[f"tools/{name}/calls"] = float(n)
            out[f"tools/{name}/error_rate"] = self.errors.get(name, 0) / n if n else float("nan")
        self.calls, self.errors, self.malformed = {}, {}, 0
        return out


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with + - * / and parentheses.

    Args:
        expression: The expression, e.g. "482*739".
    """
    import ast
    import operator

    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not an arithmetic expression of integers: {expression!r}")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"
