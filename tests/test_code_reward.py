"""The ``code`` reward: scores, test formats, and that the sandbox contains abuse and forgery.

Every guarantee listed in docs/sandbox.md has a test here. Containment tests run a *probe* in the
sandbox that reports what it could do (the value crosses the boundary like any call result);
abuse and forgery tests check that the attempt scores 0.0, that the host is untouched and that no
process of the run survives. Tests needing bubblewrap are skipped, with the reason, when it is
unavailable; the fail-closed tests run everywhere.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from groupwise.registry import ConfigError, build, names
from groupwise.rewards import RewardError, score
from groupwise.sandbox import bwrap as _sandbox
from groupwise.sandbox.bwrap import SANDBOX_ENV, Sandbox, SandboxUnavailable
from groupwise.rewards._code_cases import Case, _decode, canonical, parse_tests, verdict
from groupwise.rewards.code import Code, extract_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sandbox_problem() -> str | None:
    try:
        Sandbox().check()
    except SandboxUnavailable as err:
        return str(err)
    return None


_PROBLEM = _sandbox_problem()
needs_bwrap = pytest.mark.skipif(_PROBLEM is not None, reason=f"no usable bubblewrap sandbox: {_PROBLEM}")

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = [{"call": "add(1, 2)", "expected": "3"}, {"call": "add(-5, 5)", "expected": "0"}, {"call": "add(10, 20)", "expected": "30"}, {"call": "add(2, 2)", "expected": "4"}]
SUM_STDIN = "import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)\n"
SUM_TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "40 2\n", "output": "42\n"}]


def _host_pids_with(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(name))
            except OSError:
                pass
    return found


def _children_of_this_process() -> list[int]:
    me, kids = str(os.getpid()), []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
                if stat[stat.rindex(b")") + 2 :].split()[1].decode() == me:
                    kids.append(int(name))
            except (OSError, ValueError):
                pass
    return kids


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Every test must leave no child process behind (sandboxes are reaped, canaries killed)."""
    before = set(_children_of_this_process())
    yield
    left = set(_children_of_this_process()) - before
    assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="module")
def reward():
    if _PROBLEM is not None:
        pytest.skip(f"no usable bubblewrap sandbox: {_PROBLEM}")
    return Code(timeout_s=5.0)


def observe(reward: Code, code: str, call: str = "probe()"):
    """Run ``code`` in the sandbox and return the value of ``call`` (a containment probe)."""
    res = reward.run_case(textwrap.dedent(code), Case("call", call=call, expected=canonical(None)))
    assert res.ready and not res.timed_out and res.exit_code == 0, (res.infra_error, res.stderr[-2000:])
    assert len(res.records) == 1 and res.records[0]["ok"], res.records
    return _decode(res.records[0]["value"])


# ----------------------------------------------------------------------------- parsing (no sandbox)


def test_extract_code_takes_last_python_block():
    text = "Plan:\n```python\nx = 1\n```\nbetter:\n```py\ndef f():\n    return 2\n```\nThat's it."
    assert extract_code(text) == "def f():\n    return 2\n"
    assert extract_code("def f(): return 3") == "def f(): return 3"
    assert extract_code("```\nnot python fenced\n```") == "```\nnot python fenced\n```"
    assert extract_code([{"role": "assistant", "content": "```python\nprint(1)\n```"}]) == "print(1)\n"


def test_parse_tests_formats():
    cases = parse_tests([
        {"input": "1\n", "output": "2\n"},
        {"call": "f(1)", "expected": "(1, 'a')"},
        {"call": "f(2)", "expected": [1, 2]},  # JSON value
        "assert f(3) == {1: 'x'}",
        "assert 4 == f(4)",
        "assert f(5) is None",
        {"call": "f(6)", "expected": "float('nan')"},
    ])
    assert [c.mode for c in cases] == ["stdio"] + ["call"] * 6
    assert cases[0].stdin == "1\n" and cases[0].stdout == "2\n"
    assert cases[1].expected == canonical((1, "a")) and cases[2].expected == canonical([1, 2])
    assert cases[3].call == "f(3)" and cases[3].expected == canonical({1: "x"})
    assert cases[4].call == "f(4)" and cases[4].expected == canonical(4)
    assert cases[5].expected == canonical(None) and cases[6].expected == canonical(float("nan"))
    assert parse_tests('[{"input": "", "output": "x"}]')[0].stdout == "x"  # a JSON string column
    assert parse_tests(None) is None and parse_tests([]) is None


@pytest.mark.parametrize("bad, match", [
    (["assert f(1)"], "bare truthiness"),
    (["assert abs(f(1) - 2) < 1e-9"], "unsupported test"),
    (["x = 1"], "one `assert"),
    ([{"call": "f(", "expected": "1"}], "not a Python expression"),
    ([{"call": "f(1)", "expected": "hello"}], "not a Python literal"),
    ([{"inp": "1"}], "a case is"),
    ("not json", "not JSON"),
    (5, "must be a list"),
])
def test_parse_tests_rejects_malformed(bad, match):
    with pytest.raises(RewardError, match=match):
        parse_tests(bad, where="row 7")


def test_canonical_is_type_strict():
    assert canonical(1) != canonical(1.0) != canonical(True)
    assert canonical([1, 2]) != canonical((1, 2))
    assert canonical({3, 1, 2}) == canonical({2, 3, 1}) and canonical({"b": 1, "a": 2}) == canonical({"a": 2, "b": 1})
    assert canonical(float("nan")) == canonical(float("nan")) and canonical(-0.0) != canonical(0.0)
    assert canonical(10**5000) != canonical(10**5000 + 1)  # beyond the int -> str digit limit
    with pytest.raises(TypeError):
        canonical(type("AlwaysEqual", (), {"__eq__": lambda s, o: True})())
    with pytest.raises(TypeError):
        canonical(type("I", (int,), {})(4))


def test_verdict_rules_without_sandbox():
    from groupwise.sandbox.bwrap import RunResult

    call = Case("call", call="f()", expected=canonical(4))
    good = RunResult(ready=True, exit_code=0, records=[{"kind": "result", "ok": True, "value": ["int", "4"]}])
    assert verdict(call, good) is True
    assert verdict(call, RunResult(ready=False, infra_error="x")) is None  # infrastructure: no verdict
    for change in ({"timed_out": True}, {"output_capped": True}, {"malformed": True}, {"exit_code": 1},
                   {"records": good.records * 2}, {"records": [{"kind": "result", "ok": True, "value": ["float", "4.0"]}]},
                   {"records": [{"kind": "result", "ok": True, "value": ["int", "zz"]}]}, {"records": []}):
        assert verdict(call, RunResult(**{**good.__dict__, **change})) is False, change
    stdio = Case("stdio", stdout="1 2\n3\n")
    assert verdict(stdio, RunResult(ready=True, exit_code=0, stdout=b"1 2  \r\n3\n\n")) is True  # line ends, trailing space
    assert verdict(stdio, RunResult(ready=True, exit_code=0, stdout=b"1  2\n3\n")) is False
    assert verdict(stdio, RunResult(ready=True, exit_code=1, stdout=b"1 2\n3\n")) is False


def test_config_validation():
    assert "code" in names("reward")
    for bad in ({"timeout_s": 0}, {"memory_mb": 8}, {"max_processes": 1}, {"workers": 0}, {"max_output_bytes": 10}):
        with pytest.raises(ConfigError):
            build("reward", "code", unsafe_local=True, **bad)


# ----------------------------------------------------------------------------- fail closed


def test_fails_closed_without_bwrap(monkeypatch):
    monkeypatch.setattr(_sandbox.shutil, "which", lambda *a, **k: None)
    with pytest.raises(SandboxUnavailable, match=r"apt-get install -y bubblewrap.*unsafe_local=True"):
        Code()


def test_fails_closed_when_bwrap_cannot_create_namespaces(tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text('#!/bin/sh\nif [ "$1" = --help ]; then echo "--unshare-all --size --disable-userns"; exit 0; fi\n'
                    'echo "bwrap: No permissions to creating new namespace" >&2\nexit 1\n')
    fake.chmod(0o755)
    with pytest.raises(SandboxUnavailable, match="No permissions to creating new namespace"):
        Sandbox(bwrap=str(fake)).check()
    with pytest.raises(SandboxUnavailable, match="is not bubblewrap"):
        Sandbox(bwrap="/bin/true").check()


@needs_bwrap
def test_infrastructure_failure_is_no_verdict(reward, monkeypatch):
    r = Code(timeout_s=5.0)
    monkeypatch.setattr(r._sandbox, "bwrap", "/bin/false")  # the sandbox "fails to start"
    out = r([""] * 2, [ADD, "def add(a, b): return 0"], tests=[ADD_TESTS[:1]] * 2)
    assert out == [None, None] and r.stats["infra_error"] == 2 and len(r.last_errors) == 2
    assert "before the harness was ready" in r.last_errors[0]
    res = score([r], [""], [ADD], {"tests": [ADD_TESTS[:1]]})  # excluded and counted upstream
    assert bool(res.excluded[0]) and res.counts["code/missing"] == 1


# ----------------------------------------------------------------------------- scores


@needs_bwrap
def test_correct_wrong_partial_scores(reward):
    partial = "def add(a, b):\n    return a + b if a < 5 else -1\n"  # passes add(1,2), add(-5,5), add(2,2): 3 of 4
    completions = [f"Here you go:\n```python\n{ADD}```", "def add(a, b):\n    return a - b\n", partial, "this is not code", SUM_STDIN, "print(3)"]
    tests = [ADD_TESTS] * 4 + [SUM_TESTS] * 2
    assert reward([""] * 6, completions, tests=tests) == [1.0, 0.0, 0.75, 0.0, 1.0, 0.5]
    assert reward([""], ["x"], tests=[None]) == [None]


@needs_bwrap
def test_all_or_nothing_and_column_name():
    r = Code(all_or_nothing=True, column="unit_tests")
    partial = "def add(a, b):\n    return a + b if a < 5 else -1\n"
    assert r([""] * 2, [ADD, partial], unit_tests=[ADD_TESTS, ADD_TESTS]) == [1.0, 0.0]
    assert r.stats["runs"] == 4 + 3  # the partial one stops at its first failure (add(10, 20))
    with pytest.raises(RewardError, match="unit_tests"):
        r([""], [ADD], tests=[ADD_TESTS])


@needs_bwrap
def test_value_comparison_is_strict(reward):
    code = "def f(k):\n    return {'int': 4, 'float': 4.0, 'bool': True, 'tuple': (1, 2), 'list': [1, 2], 'set': {3, 1}, 'nan': float('nan'), 'big': 7**3000}[k]\n"
    tests = [{"call": "f('int')", "expected": "4"}, {"call": "f('float')", "expected": "4"}, {"call": "f('bool')", "expected": "1"},
             {"call": "f('tuple')", "expected": "[1, 2]"}, {"call": "f('list')", "expected": "[1, 2]"}, {"call": "f('set')", "expected": "{1, 3}"},
             {"call": "f('nan')", "expected": "float('nan')"}, {"call": "f('big')", "expected": str(7**3000)}]
    cases = parse_tests(tests)
    got = [verdict(c, reward.run_case(code, c)) for c in cases]
    assert got == [True, False, False, False, True, True, True, True]


# ----------------------------------------------------------------------------- containment


@needs_bwrap
def test_no_network(reward):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    abstract = "\0groupwise-test-" + secrets.token_hex(8)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(abstract)
    unix.listen(8)
    try:
        out = observe(reward, f"""
            import socket
            def attempt(family, address):
                try:
                    s = socket.socket(family, socket.SOCK_STREAM)
                    s.settimeout(2)
                    s.connect(address)
                    return "connected"
                except OSError as err:
                    return type(err).__name__
            def probe():
                out = {{"tcp": attempt(socket.AF_INET, ("127.0.0.1", {port})), "unix": attempt(socket.AF_UNIX, {abstract!r})}}
                try:
                    socket.create_connection(("localhost", {port}), timeout=2)
                    out["name"] = "connected"
                except OSError as err:
                    out["name"] = type(err).__name__
                out["interfaces"] = sorted(name for _, name in socket.if_nameindex())
                return out
        """)
        assert "connected" not in out.values(), out
        assert out["interfaces"] == ["lo"]  # a fresh network namespace: its own loopback only
        for sock in (listener, unix):  # and nothing reached the host's listeners
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.accept()
    finally:
        listener.close()
        unix.close()


@needs_bwrap
def test_file_system_read_only_except_scratch(reward, tmp_path):
    marker = "gw-write-" + secrets.token_hex(6)
    host_targets = [os.path.join(ROOT, marker), f"/etc/{marker}", os.path.join(os.path.expanduser("~"), marker),
                    f"/usr/{marker}", f"/{marker}", str(tmp_path / marker), os.path.join(sys.base_prefix, marker)]
    out = observe(reward, f"""
        import os
        def probe():
            out = {{}}
            for p in {host_targets + [f"/tmp/{marker}", f"/dev/shm/{marker}"]!r}:
                try:
                    with open(p, "w") as f:
                        f.write("pwned")
                    out[p] = "written"
                except OSError as err:
                    out[p] = type(err).__name__
            return out
    """)
    assert all(out[p] != "written" for p in host_targets), out
    assert out[f"/tmp/{marker}"] == "written" and out[f"/dev/shm/{marker}"] == "written"  # the scratch tmpfs
    for p in host_targets + [f"/tmp/{marker}", f"/dev/shm/{marker}"]:
        assert not os.path.exists(p), f"{p} appeared on the host"


@needs_bwrap
def test_secrets_and_host_files_invisible(reward, tmp_path, monkeypatch):
    token = "gw-secret-" + secrets.token_hex(8)
    monkeypatch.setenv("GROUPWISE_TEST_SECRET", "xyz")
    monkeypatch.setenv("GROUPWISE_TEST_TOKEN", token)
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(token)
    home = os.path.expanduser("~")
    prefix_parts = os.path.realpath(sys.base_prefix).split("/")
    home_entries = [os.path.join(home, e) for e in os.listdir(home) if e not in prefix_parts][:20]
    host_files = [os.path.join(ROOT, "README.md"), os.path.abspath(__file__), str(secret_file), "/etc/passwd", "/etc/hostname", *home_entries]
    out = observe(reward, f"""
        import os
        def probe():
            leaks = []
            for pid in os.listdir("/proc"):
                for what in ("environ", "cmdline"):
                    try:
                        with open(f"/proc/{{pid}}/{{what}}", "rb") as f:
                            if {token.encode()!r} in f.read():
                                leaks.append((pid, what))
                    except OSError:
                        pass
            return {{"env": dict(os.environ), "leaks": leaks, "parent_visible": os.path.exists("/proc/{os.getpid()}/environ"),
                    "visible": [p for p in {host_files!r} if os.path.lexists(p)]}}
    """)
    assert "GROUPWISE_TEST_SECRET" not in out["env"] and token not in str(out["env"])
    assert set(out["env"]) <= set(SANDBOX_ENV) | {"PWD", "LC_CTYPE"}, out["env"]
    assert out["leaks"] == [] and out["parent_visible"] is False
    assert out["visible"] == [], out["visible"]


@needs_bwrap
def test_limits_applied_and_privileges_dropped(reward):
    out = observe(reward, """
        import os, resource, ctypes
        def probe():
            libc = ctypes.CDLL(None, use_errno=True)
            new_userns = libc.unshare(0x10000000)  # CLONE_NEWUSER
            limits = {n: resource.getrlimit(getattr(resource, n)) for n in ("RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE")}
            try:
                resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
                raised = True
            except (ValueError, OSError):
                raised = False
            status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
            return {"uid": os.getuid(), "euid": os.geteuid(), "limits": limits, "raised": raised, "unshare": new_userns,
                    "cap_eff": status["CapEff"].strip(), "no_new_privs": status["NoNewPrivs"].strip()}
    """)
    assert out["uid"] != 0 and out["euid"] != 0 and out["cap_eff"] == "0000000000000000" and out["no_new_privs"] == "1"
    assert out["limits"]["RLIMIT_AS"] == (512 << 20, 512 << 20) and out["limits"]["RLIMIT_NPROC"] == (16, 16)
    assert out["limits"]["RLIMIT_FSIZE"] == (64 << 20, 64 << 20) and out["limits"]["RLIMIT_CORE"] == (0, 0)
    assert out["raised"] is False and out["unshare"] == -1


# ----------------------------------------------------------------------------- abuse: contained, no credit


@needs_bwrap
def test_cpu_spin_killed_at_timeout_overrun_measured():
    r = Code(timeout_s=1.0)
    overruns = []
    for code in ("def add(a, b):\n    while True:\n        pass\n",
                 "import signal\nfor s in (signal.SIGTERM, signal.SIGALRM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):\n"
                 "    signal.signal(s, signal.SIG_IGN)\nsignal.alarm(0)\nwhile True:\n    pass\n"):
        t0 = time.monotonic()
        assert r([""], [code], tests=[ADD_TESTS[:1]]) == [0.0]
        overruns.append(time.monotonic() - t0 - r.timeout_s)
    print(f"\nwall-clock overrun beyond timeout_s=1.0: spin {overruns[0]:.3f} s, signal-ignoring spin {overruns[1]:.3f} s")
    assert all(0.0 <= o < 1.5 for o in overruns), overruns
    assert r.stats["timeout"] == 2


@needs_bwrap
def test_fork_bomb_contained_and_isolated_from_other_samples():
    marker = "gwbomb" + secrets.token_hex(6)
    bomb = textwrap.dedent(f"""
        import os, sys
        child = "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass\\n"
        while True:
            try:
                if os.fork() == 0:
                    os.execv(sys.executable, [sys.executable, "-c", child, {marker!r}])
            except OSError:
                pass
    """)
    r = Code(timeout_s=1.0, workers=2)
    t0 = time.monotonic()
    assert r([""] * 2, [bomb, ADD], tests=[ADD_TESTS[:1]] * 2) == [0.0, 1.0]  # the neighbour still passes
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0 + 3.0, elapsed
    assert _host_pids_with(marker) == []


@needs_bwrap
def test_process_limit_counts_each_run_separately(reward):
    code = """
        import os, time
        def probe():
            n = 0
            for _ in range(100):
                try:
                    if os.fork() == 0:
                        time.sleep(30)
                        os._exit(0)
                    n += 1
                except OSError:
                    return n
            return n
    """
    counts = [observe(reward, code) for _ in range(2)]  # the second run is not charged for the first one's children
    assert all(10 <= n < 16 for n in counts), counts  # max_processes=16 counts the harness (and an init) too


@needs_bwrap
def test_memory_bomb_hits_address_space_limit():
    r = Code(memory_mb=128, timeout_s=5.0)
    t0 = time.monotonic()
    assert r([""] * 2, ["x = bytearray(1 << 30)\n" + ADD, "def add(a, b):\n    return len(bytearray(1 << 31))\n"], tests=[ADD_TESTS[:1]] * 2) == [0.0, 0.0]
    assert time.monotonic() - t0 < 4.0
    assert observe(r, "def probe():\n    try:\n        bytearray(1 << 30)\n    except MemoryError:\n        return 'MemoryError'\n") == "MemoryError"


@needs_bwrap
def test_output_flood_capped():
    r = Code(timeout_s=5.0, max_output_bytes=65536)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    floods = {
        "stdout": "while True:\n    print('x' * 100000)\n",
        "stderr": "import sys\nwhile True:\n    sys.stderr.write('y' * 100000)\n",
        "result": "import os, sys\nfd = sys._getframe(1).f_locals['res_fd']\nwhile True:\n    os.write(fd, b'z' * 100000)\n",
    }
    t0 = time.monotonic()
    for name, code in floods.items():
        res = r.run_case(code, Case("stdio", stdout="x"))
        assert res.ready and res.output_capped and not res.timed_out, (name, res.infra_error)
        assert len(res.stdout) <= 65536 and len(res.stderr) <= 65536
        assert verdict(Case("stdio", stdout="x"), res) is False
    assert time.monotonic() - t0 < 4.0  # killed at the cap, not at the timeout
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 50_000  # KiB


@needs_bwrap
def test_double_forked_daemon_does_not_survive(reward):
    marker = "gwdaemon" + secrets.token_hex(6)
    code = f"""
        import os, sys, time
        def probe():
            r, w = os.pipe()
            if os.fork() == 0:
                os.setsid()
                pid = os.fork()
                if pid == 0:
                    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(1000)", {marker!r}])
                os.write(w, str(pid).encode())
                os._exit(0)
            grandchild = int(os.read(r, 100))
            time.sleep(0.2)
            os.kill(grandchild, 0)  # alive, reparented to the sandbox's init
            return "daemon running"
    """
    assert observe(reward, code) == "daemon running"
    assert _host_pids_with(marker) == []


@needs_bwrap
def test_ctypes_cannot_touch_host(reward):
    canary = subprocess.Popen(["sleep", "60"])
    marker = os.path.join(ROOT, "gw-ctypes-" + secrets.token_hex(6))
    try:
        code = f"""
            import ctypes
            libc = ctypes.CDLL(None)
            libc.system(b"touch {marker} /tmp/gw-ok; kill -9 {canary.pid}")
            libc.kill({canary.pid}, 9)
            libc.kill(-1, 9)
            def add(a, b):
                return a + b
        """
        out = reward([""], [textwrap.dedent(code)], tests=[ADD_TESTS[:1]])
        assert out in ([0.0], [1.0])  # kill(-1) hits only the sandbox's own processes; either way:
        time.sleep(0.1)
        assert canary.poll() is None, "the host canary was killed"
        assert not os.path.exists(marker)
    finally:
        canary.kill()
        canary.wait()


# ----------------------------------------------------------------------------- forgery: no credit

FORGERIES = {
    "fake records on every fd with the nonce": """
        import os, sys, json
        frame = sys._getframe(1)
        nonce, fd = frame.f_locals["nonce"], frame.f_locals["res_fd"]
        for value in (["str", "pass"], ["bool", True], ["int", "1"]):
            line = json.dumps({"nonce": nonce, "kind": "result", "ok": True, "value": value, "passed": True}) + "\\n"
            for target in (1, 2, fd):
                os.write(target, line.encode())
        def add(a, b):
            return None
    """,
    "one fake record then os._exit(0)": """
        import os, sys, json
        frame = sys._getframe(1)
        os.write(frame.f_locals["res_fd"], (json.dumps({"nonce": frame.f_locals["nonce"], "kind": "result", "ok": True, "value": ["str", "PASS"], "verdict": "pass"}) + "\\n").encode())
        os._exit(0)
    """,
    "monkeypatched harness encoder": """
        import sys
        harness = sys.modules["__main__"]
        harness.encode = lambda value, depth=0: ["bool", True]
        harness._dumps = lambda record: '{"ok": true, "passed": true}'
        sys._getframe(1).f_globals["encode"] = harness.encode
        def add(a, b):
            return -1
    """,
    "object whose __eq__ is always True": """
        class Anything:
            def __eq__(self, other): return True
            def __ne__(self, other): return False
            def __hash__(self): return 0
            def __repr__(self): return "3"
        def add(a, b):
            return Anything()
    """,
    "int subclass equal to everything": """
        class Int(int):
            def __eq__(self, other): return True
            def __repr__(self): return "3"
            __str__ = __repr__
        def add(a, b):
            return Int(99)
    """,
    "prints the expected output then crashes": """
        print(3)
        print('{"kind": "result", "ok": true, "value": ["int", "3"]}')
        def add(a, b):
            raise RuntimeError("crash")
    """,
    "os._exit(0) before the tests": """
        import os
        os._exit(0)
    """,
    "sys.exit(0) before the tests": """
        import sys
        sys.exit(0)
    """,
    "sys.exit(0) inside the function": """
        import sys
        def add(a, b):
            sys.exit(0)
    """,
    "overrides print, repr, json and sys.exit": """
        import builtins, json, sys, os
        builtins.print = lambda *a, **k: None
        builtins.repr = lambda x: "3"
        json.dumps = lambda *a, **k: '{"ok": true}'
        sys.exit = os._exit = lambda *a: None
        def add(a, b):
            return a - b
    """,
    "kills its own harness with SIGKILL": """
        import os, signal
        def add(a, b):
            os.kill(os.getpid(), signal.SIGKILL)
    """,
}

STDIO_FORGERIES = {
    "prints the answer then crashes": "print(3, flush=True)\nraise SystemExit(1)\n",
    "prints the answer then aborts": "import os\nprint(3, flush=True)\nos.abort()\n",
    "os._exit(0) before output": "import os\nos._exit(0)\n",
    "sys.exit(0) before output": "import sys\nsys.exit(0)\nprint(3)\n",
    "overridden print": "import builtins\nbuiltins.print = lambda *a, **k: None\nprint(3)\n",
}


@needs_bwrap
def test_forgeries_earn_nothing(reward):
    names_ = list(FORGERIES)
    codes = [textwrap.dedent(FORGERIES[n]) for n in names_]
    # control: the same harness-tampering preamble with a CORRECT function still passes
    control = "import builtins, json\nbuiltins.print = lambda *a, **k: None\njson.dumps = None\nbuiltins.repr = lambda x: 'nope'\n" + ADD
    out = reward([""] * (len(codes) + 1), codes + [control], tests=[[{"call": "add(1, 2)", "expected": "3"}]] * (len(codes) + 1))
    assert out[-1] == 1.0
    earned = {n: s for n, s in zip(names_, out) if s != 0.0}
    assert earned == {}, f"forgeries earned credit: {earned}"


@needs_bwrap
def test_stdio_forgeries_earn_nothing(reward):
    names_ = list(STDIO_FORGERIES)
    out = reward([""] * (len(names_) + 1), [STDIO_FORGERIES[n] for n in names_] + ["print(3)\n"], tests=[[{"input": "1 2\n", "output": "3\n"}]] * (len(names_) + 1))
    assert out[-1] == 1.0
    earned = {n: s for n, s in zip(names_, out) if s != 0.0}
    assert earned == {}, f"forgeries earned credit: {earned}"


@needs_bwrap
def test_expected_values_never_enter_the_sandbox(reward, monkeypatch):
    secret = "gw-expected-" + secrets.token_hex(8)
    sent: list[bytes] = []
    real_fd, real_argv = _sandbox._readonly_fd, Sandbox._bwrap_argv
    monkeypatch.setattr(_sandbox, "_readonly_fd", lambda data: sent.append(bytes(data)) or real_fd(data))
    monkeypatch.setattr(Sandbox, "_bwrap_argv", lambda self, *a: (lambda argv: sent.append(" ".join(argv).encode()) or argv)(real_argv(self, *a)))
    reward([""] * 2, ["def f():\n    return 1\n", "print(1)"],
           tests=[[{"call": "f()", "expected": repr(secret)}, f"assert f() == {secret!r}"], [{"input": "x\n", "output": secret}]])
    assert sent and not any(secret.encode() in blob for blob in sent)


# ----------------------------------------------------------------------------- unsafe_local


def test_unsafe_local_warns_and_still_limits(monkeypatch):
    monkeypatch.setenv("GROUPWISE_TEST_SECRET", "xyz")
    with pytest.warns(UserWarning, match="WITHOUT a sandbox"):
        r = Code(unsafe_local=True, timeout_s=2.5)  # room for a slow interpreter start on a loaded 2-core machine
    marker = "gwunsafe" + secrets.token_hex(6)
    daemon = textwrap.dedent(f"""
        import os, sys
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(1000)", {marker!r}])
            os._exit(0)
        def add(a, b):
            import os
            return a + b if "GROUPWISE_TEST_SECRET" not in os.environ else -1
    """)
    t0 = time.monotonic()
    out = r([""] * 3, [ADD, "def add(a, b):\n    while True:\n        pass\n", daemon], tests=[ADD_TESTS[:1]] * 3)
    assert out == [1.0, 0.0, 1.0]  # env scrubbed in unsafe mode too
    assert time.monotonic() - t0 < 2.5 + 4.0  # the endless loop is cut at the timeout, not waited out
    assert _host_pids_with(marker) == []  # swept: by the run's own uid (root) or its environment marker


# ----------------------------------------------------------------------------- the unprivileged-user path

SMOKE = """
import json, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bwrap import Limits, Sandbox
s = Sandbox()
s.check()
def value(code, **kw):
    r = s.run(code=code, mode="call", call="f()", limits=Limits(**kw))
    return r.records[0]["value"] if r.records and r.records[0].get("ok") else [r.timed_out, r.records, r.stderr[-500:].decode()]
out = {"uid": os.getuid()}
out["inside"] = value(
    "import os, socket, resource, ctypes\\n"
    "def f():\\n"
    "    try:\\n        socket.create_connection(('127.0.0.1', 9), timeout=1); net = 'connected'\\n"
    "    except OSError as e:\\n        net = type(e).__name__\\n"
    "    try:\\n        open('/usr/gw-x', 'w'); w = 'written'\\n"
    "    except OSError as e:\\n        w = type(e).__name__\\n"
    "    return [os.getuid(), net, w, ctypes.CDLL(None).unshare(0x10000000), resource.getrlimit(resource.RLIMIT_NPROC)[0]]\\n")
out["forks"] = value("import os, time\\ndef f():\\n    n = 0\\n    while n < 100:\\n        try:\\n            pid = os.fork()\\n        except OSError:\\n            return n\\n        if pid == 0:\\n            time.sleep(30)\\n            os._exit(0)\\n        n += 1\\n    return n\\n")
t0 = time.monotonic()
out["spin"] = value("def f():\\n    while True:\\n        pass\\n", timeout_s=1.0)
out["spin_s"] = time.monotonic() - t0
print(json.dumps(out))
"""


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="switching to an unprivileged user needs root (as a user, every other test covers this path)")
def test_unprivileged_user_path():
    """What most users run: bwrap as a normal user (user namespace, uid 65534 inside, seccomp)."""
    def runnable(python: str) -> bool:  # by uid 65534 (this venv's interpreter may sit under /root)
        try:
            return subprocess.run([python, "-c", "pass"], user=65534, group=65534, extra_groups=[], cwd="/", env={}, capture_output=True).returncode == 0
        except OSError:
            return False

    python = next((p for p in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p) and runnable(p)), None)
    if python is None:
        pytest.skip("no Python interpreter that an unprivileged user may run")
    work = tempfile.mkdtemp(prefix="gw-unpriv-")
    try:
        os.chmod(work, 0o755)
        for name in ("bwrap.py", "harness.py"):
            shutil.copyfile(os.path.join(os.path.dirname(_sandbox.__file__), name), os.path.join(work, name))
        with open(os.path.join(work, "smoke.py"), "w") as f:
            f.write(SMOKE)
        for name in os.listdir(work):
            os.chmod(os.path.join(work, name), 0o644)
        proc = subprocess.run([python, "-s", os.path.join(work, "smoke.py")], user=65534, group=65534, extra_groups=[], cwd="/",
                              env={"PATH": "/usr/bin:/bin"}, capture_output=True, timeout=60)
        if b"cannot start a sandbox" in proc.stderr:
            pytest.skip(f"unprivileged user namespaces unavailable: {proc.stderr.decode()[-500:]}")
        assert proc.returncode == 0, proc.stderr.decode()[-3000:]
        out = json.loads(proc.stdout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert out["uid"] == 65534
    uid, net, write, unshare, nproc = _decode(out["inside"])
    assert (uid, net, write, unshare, nproc) == (65534, "ConnectionRefusedError", "OSError", -1, 16)
    assert 10 <= _decode(out["forks"]) < 16
    assert out["spin"][0] is True and out["spin_s"] < 1.0 + 1.5
