"""Runs ONE test case of untrusted Python inside the sandbox (started by ``bwrap.py``).

Usage (inside the sandbox): ``python -s -B harness.py CONFIG_FD RESULT_FD``. In unsafe mode the
config may name a ``go_fd``: the harness waits for one byte on it (the parent is moving it into the
run's cgroup) before it applies its limits. Standard library only;
never imports ``groupwise``. The parent (``bwrap.py``) computes the verdict; this file only
reports what happened, one JSON line per record on ``RESULT_FD``::

    {"nonce": N, "kind": "ready"}                       limits applied, about to run candidate code
    {"nonce": N, "kind": "result", "ok": true, "value": TREE}   (mode "call")
    {"nonce": N, "kind": "result", "ok": false, "error": "..."} (mode "call")
    {"nonce": N, "kind": "done", "code": RC}            (mode "stdio", informational only)

In mode "stdio" the process exits with the program's status, except that a non-zero
``SystemExit`` code whose low 8 bits are 0 (``sys.exit(256)``) exits with 1 instead of wrapping to 0.

Nothing here is trusted by the parent after "ready": the candidate runs in this same process and
can read or overwrite anything of the harness (its memory, the nonce, the result fd). What the
candidate can NOT do is learn the expected answer, which never enters the sandbox; see
``docs/sandbox.md``.

``encode`` is also imported by the parent to canonicalise values, so it must stay side-effect free
at import time (everything else runs under ``if __name__ == "__main__"``).
"""

from __future__ import annotations

import json
import os
import sys

# private references, taken before any candidate code runs (candidates that shadow or patch the
# public names by accident do not break the harness; deliberate tampering earns nothing anyway)
_type = type
_len = len
_isinstance = isinstance
_dumps = json.dumps
_write = os.write
_exit = os._exit

MAX_DEPTH = 100


class Unsupported(TypeError):
    """A call result that is not a plain literal (exact builtin types only)."""


def encode(value: object, depth: int = 0) -> list:
    """A typed JSON tree of ``value``, accepting EXACT builtin literal types only.

    Subclasses (an ``int`` subclass with a custom ``__eq__`` / ``__repr__``, say) and any other
    object are rejected, and no method the candidate could override is ever called: values are
    read through the builtin types' own slots (``int.__format__``, ``float.__repr__``, ``list``
    iteration of an exact list...). Ints are hex (no decimal digit limit), floats their repr.
    """
    if depth > MAX_DEPTH:
        raise Unsupported(f"result nested deeper than {MAX_DEPTH}")
    t = _type(value)
    if value is None:
        return ["none"]
    if t is bool:
        return ["bool", value is True]
    if t is int:
        return ["int", int.__format__(value, "x")]
    if t is float:
        return ["float", float.__repr__(value)]
    if t is complex:
        return [
            "complex",
            float.__repr__(complex.__getattribute__(value, "real")),
            float.__repr__(complex.__getattribute__(value, "imag")),
        ]
    if t is str:
        return ["str", str.__str__(value)]
    if t is bytes:
        return ["bytes", bytes.hex(value)]
    if t is list or t is tuple:
        return [t.__name__, [encode(x, depth + 1) for x in t.__iter__(value)]]
    if t is set or t is frozenset:
        return [t.__name__, [encode(x, depth + 1) for x in t.__iter__(value)]]
    if t is dict:
        return ["dict", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in dict.items(value)]]
    raise Unsupported(f"result of type {t.__module__}.{t.__qualname__} is not a plain literal")


def _record(fd: int, nonce: str, **fields: object) -> None:
    data = (_dumps({"nonce": nonce, **fields}) + "\n").encode()
    while data:
        n = _write(fd, data)
        data = data[n:]


def _apply_limits(cfg: dict) -> None:
    import resource

    for name, value in cfg["rlimits"].items():
        what = getattr(resource, name)
        soft, hard = value, value + 1 if name == "RLIMIT_CPU" else value  # CPU: SIGXCPU, then SIGKILL a second later
        cur_soft, cur_hard = resource.getrlimit(what)
        if (cur_soft, cur_hard) == (soft, hard):  # set from outside already (RLIMIT_CORE: seccomp forbids changing it)
            continue
        if cur_hard != resource.RLIM_INFINITY:  # never above what we were given (raising a hard limit fails)
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        resource.setrlimit(what, (soft, hard))
    uid = cfg.get("switch_uid")
    if uid is not None:  # root inside the sandbox (bwrap ran privileged): drop to an unprivileged uid
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        if os.getuid() != uid or os.geteuid() != uid or os.getgid() != uid:
            raise RuntimeError("could not drop privileges")


def _error_text(err: BaseException) -> str:
    try:
        return f"{_type(err).__name__}: {err}"[:2000]
    except BaseException:
        return "unprintable exception"


def _main() -> None:
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # the harness's own directory (unsafe mode: a private temp dir) is not importable
    cfg_fd, res_fd = int(sys.argv[1]), int(sys.argv[2])
    with os.fdopen(cfg_fd, "rb") as f:
        cfg = json.loads(f.read().decode())
    nonce = cfg["nonce"]
    if cfg.get("go_fd") is not None:  # unsafe mode: wait until the parent has put us in the run's cgroup
        if os.read(cfg["go_fd"], 1) != b"1":
            _exit(70)  # the parent gave up: no "ready", an infrastructure failure
        os.close(cfg["go_fd"])
    _apply_limits(cfg)
    # everything before this line is infrastructure; from here on, failures are the candidate's
    _record(res_fd, nonce, kind="ready")

    import types

    code = cfg["code"]
    mode = cfg["mode"]
    sys.argv = ["main.py"]
    if mode == "stdio":
        module = types.ModuleType("__main__")
        module.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = module
        rc = 0
        try:
            exec(compile(code, "main.py", "exec"), module.__dict__)
        except SystemExit as stop:
            c = stop.code
            # a status is 8 bits: a plain int would wrap (sys.exit(256) -> 0); any non-zero code stays non-zero
            if _type(c) in (int, bool):
                rc = 0 if c == 0 else (c & 0xFF) or 1
            else:
                rc = 0 if c is None else 1
            if _type(c) not in (int, bool, type(None)):
                try:
                    sys.stderr.write(f"{c}\n")
                except BaseException:
                    pass
        except BaseException:
            rc = 1
            try:
                import traceback

                traceback.print_exc()
            except BaseException:
                pass
        try:
            import atexit

            atexit._run_exitfuncs()
        except BaseException:
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                rc = rc or 1
        try:
            _record(res_fd, nonce, kind="done", code=rc & 0xFF)
        except BaseException:
            pass
        _exit(rc & 0xFF)

    # mode == "call": define the candidate's functions, evaluate ONE call expression, report the
    # value. The module is not __main__, so example code under `if __name__ == "__main__":` is skipped.
    module = types.ModuleType("solution")
    module.__dict__["__builtins__"] = __builtins__
    sys.modules["solution"] = module
    try:
        exec(compile(code, "solution.py", "exec"), module.__dict__)
        value = eval(compile(cfg["call"], "<test>", "eval"), module.__dict__)
        tree = encode(value)
    except BaseException as err:  # SystemExit and KeyboardInterrupt too: the call did not return
        _record(res_fd, nonce, kind="result", ok=False, error=_error_text(err))
        _exit(0)
    _record(res_fd, nonce, kind="result", ok=True, value=tree)
    _exit(0)


if __name__ == "__main__":
    _main()
