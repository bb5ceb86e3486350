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

from groupwise.errors import ConfigError
from groupwise.registry import build, names
from groupwise.rewards import RewardError, score
from groupwise.rewards._code_cases import Case, _decode, canonical, parse_tests, verdict
from groupwise.rewards.code import Code, extract_code
from groupwise.sandbox import bwrap as _sandbox
from groupwise.sandbox.bwrap import SANDBOX_ENV, Sandbox, SandboxUnavailable

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
ADD_TESTS = [
    {"call": "add(1, 2)", "expected": "3"},
    {"call": "add(-5, 5)", "expected": "0"},
    {"call": "add(10, 20)", "expected": "30"},
    {"call": "add(2, 2)", "expected": "4"},
]
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
    res = reward._run_case(textwrap.dedent(code), Case("call", call=call, expected=canonical(None)))
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
    cases = parse_tests(
        [
            {"input": "1\n", "output": "2\n"},
            {"call": "f(1)", "expected": "(1, 'a')"},
            {"call": "f(2)", "expected": [1, 2]},  # JSON value
            "assert f(3) == {1: 'x'}",
            "assert 4 == f(4)",
            "assert f(5) is None",
            {"call": "f(6)", "expected": "float('nan')"},
        ]
    )
    assert [c.mode for c in cases] == ["stdio"] + ["call"] * 6
    assert cases[0].stdin == "1\n" and cases[0].stdout == "2\n"
    assert cases[1].expected == canonical((1, "a")) and cases[2].expected == canonical([1, 2])
    assert cases[3].call == "f(3)" and cases[3].expected == canonical({1: "x"})
    assert cases[4].call == "f(4)" and cases[4].expected == canonical(4)
    assert cases[5].expected == canonical(None) and cases[6].expected == canonical(float("nan"))
    assert parse_tests('[{"input": "", "output": "x"}]')[0].stdout == "x"  # a JSON string column
    assert parse_tests(None) is None and parse_tests([]) is None


@pytest.mark.parametrize(
    "bad, match",
    [
        (["assert f(1)"], "bare truthiness"),
        (["assert abs(f(1) - 2) < 1e-9"], "unsupported test"),
        (["x = 1"], "one `assert"),
        ([{"call": "f(", "expected": "1"}], "not a Python expression"),
        ([{"call": "f(1)", "expected": "hello"}], "not a Python literal"),
        ([{"inp": "1"}], "a case is"),
        ("not json", "not JSON"),
        (5, "must be a list"),
    ],
)
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
    for change in (
        {"timed_out": True},
        {"output_capped": True},
        {"malformed": True},
        {"exit_code": 1},
        {"records": good.records * 2},
        {"records": [{"kind": "result", "ok": True, "value": ["float", "4.0"]}]},
        {"records": [{"kind": "result", "ok": True, "value": ["int", "zz"]}]},
        {"records": []},
    ):
        assert verdict(call, RunResult(**{**good.__dict__, **change})) is False, change
    stdio = Case("stdio", stdout="1 2\n3\n")
    # line ends, trailing space
    assert verdict(stdio, RunResult(ready=True, exit_code=0, stdout=b"1 2  \r\n3\n\n")) is True
    assert verdict(stdio, RunResult(ready=True, exit_code=0, stdout=b"1  2\n3\n")) is False
    assert verdict(stdio, RunResult(ready=True, exit_code=1, stdout=b"1 2\n3\n")) is False


def test_config_validation():
    assert "code" in names("reward")
    for bad in (
        {"timeout_s": 0},
        {"memory_mb": 8},
        {"max_processes": 1},
        {"workers": 0},
        {"max_output_bytes": 10},
        {"wall_timeout_s": 1.0},
        {"cgroup": "/nonexistent"},
        {"python": "/nonexistent/python3"},
    ):
        with pytest.raises(ConfigError):
            build("reward", "code", unsafe_local=True, **bad)


# ----------------------------------------------------------------------------- fail closed


def test_fails_closed_without_bwrap(monkeypatch):
    monkeypatch.setattr(_sandbox.shutil, "which", lambda *a, **k: None)
    with pytest.raises(SandboxUnavailable, match=r"apt-get install -y bubblewrap.*unsafe_local=True"):
        Code()


def test_fails_closed_when_bwrap_cannot_create_namespaces(tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text(
        '#!/bin/sh\nif [ "$1" = --help ]; then echo "--unshare-all --size --disable-userns --block-fd '
        '--info-fd"; exit 0; fi\necho "bwrap: No permissions to creating new namespace" >&2\nexit 1\n'
    )
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
    completions = [
        f"Here you go:\n```python\n{ADD}```",
        "def add(a, b):\n    return a - b\n",
        partial,
        "this is not code",
        SUM_STDIN,
        "print(3)",
    ]
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
    code = (
        "def f(k):\n    return {'int': 4, 'float': 4.0, 'bool': True, 'tuple': (1, "
        "2), 'list': [1, 2], 'set': {3, 1}, 'nan': float('nan'), 'big': 7**3000}[k]\n"
    )
    tests = [
        {"call": "f('int')", "expected": "4"},
        {"call": "f('float')", "expected": "4"},
        {"call": "f('bool')", "expected": "1"},
        {"call": "f('tuple')", "expected": "[1, 2]"},
        {"call": "f('list')", "expected": "[1, 2]"},
        {"call": "f('set')", "expected": "{1, 3}"},
        {"call": "f('nan')", "expected": "float('nan')"},
        {"call": "f('big')", "expected": str(7**3000)},
    ]
    cases = parse_tests(tests)
    got = [verdict(c, reward._run_case(code, c)) for c in cases]
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
        out = observe(
            reward,
            f"""
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
                with open("/proc/net/dev") as f:  # (if_nameindex needs netlink, which the filter refuses)
                    out["interfaces"] = sorted(line.split(":")[0].strip() for line in f.read().splitlines()[2:])
                return out
        """,  # noqa: E501
        )
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
    host_targets = [
        os.path.join(ROOT, marker),
        f"/etc/{marker}",
        os.path.join(os.path.expanduser("~"), marker),
        f"/usr/{marker}",
        f"/{marker}",
        str(tmp_path / marker),
        os.path.join(sys.base_prefix, marker),
    ]
    out = observe(
        reward,
        f"""
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
    """,
    )
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
    host_files = [
        os.path.join(ROOT, "README.md"),
        os.path.abspath(__file__),
        str(secret_file),
        "/etc/passwd",
        "/etc/hostname",
        *home_entries,
    ]
    out = observe(
        reward,
        f"""
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
    """,  # noqa: E501
    )
    assert "GROUPWISE_TEST_SECRET" not in out["env"] and token not in str(out["env"])
    assert set(out["env"]) <= set(SANDBOX_ENV) | {"PWD", "LC_CTYPE"}, out["env"]
    assert out["leaks"] == [] and out["parent_visible"] is False
    assert out["visible"] == [], out["visible"]


@needs_bwrap
def test_limits_applied_and_privileges_dropped(reward):
    out = observe(
        reward,
        """
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
    """,  # noqa: E501
    )
    assert out["uid"] != 0 and out["euid"] != 0 and out["cap_eff"] == "0000000000000000" and out["no_new_privs"] == "1"
    assert out["limits"]["RLIMIT_AS"] == (512 << 20, 512 << 20) and out["limits"]["RLIMIT_NPROC"] == (16, 16)
    assert out["limits"]["RLIMIT_FSIZE"] == (64 << 20, 64 << 20) and out["limits"]["RLIMIT_CORE"] == (1, 1)
    assert out["raised"] is False and out["unshare"] == -1


# ----------------------------------------------------------------------------- abuse: contained, no credit


@needs_bwrap
def test_cpu_spin_killed_at_timeout_overrun_measured():
    r = Code(timeout_s=1.0)
    seen = []
    for code in (
        "while True:\n    pass\n",
        "import signal\nfor s in (signal.SIGTERM, signal.SIGALRM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):\n"
        "    signal.signal(s, signal.SIG_IGN)\nsignal.alarm(0)\nwhile True:\n    pass\n",
    ):
        t0 = time.monotonic()
        res = r._run_case(code, Case("stdio", stdout="x"))
        elapsed = time.monotonic() - t0
        assert (
            res.timed_out and res.timeout_kind in ("cpu", "wall") and verdict(Case("stdio", stdout="x"), res) is False
        )
        seen.append((elapsed - r.timeout_s, elapsed - res.startup_s - res.run_s, res.cpu_s, res.timeout_kind))
    # killed at its CPU budget (1 s; later in wall time only when the machine is busy, at most at wall_s = 2 s)
    print(f"\nbeyond timeout_s=1.0 (overrun, kill+teardown, cpu, kind): spin {seen[0]}, signal-ignoring spin {seen[1]}")
    assert all(
        0.0 <= over < r._limits.wall_s - r.timeout_s + 1.5 and teardown < 0.5 for over, teardown, _, _ in seen
    ), seen
    # a CPU kill comes at 1 s of CPU; a wall kill (a busy machine gave it less than 1 s of CPU in wall_s) before
    assert all(cpu is None or (1.0 <= cpu < 1.3 if kind == "cpu" else cpu < 1.3) for _, _, cpu, kind in seen), seen


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
    assert r(
        [""] * 2,
        ["x = bytearray(1 << 30)\n" + ADD, "def add(a, b):\n    return len(bytearray(1 << 31))\n"],
        tests=[ADD_TESTS[:1]] * 2,
    ) == [0.0, 0.0]
    assert time.monotonic() - t0 < 4.0
    assert (
        observe(
            r,
            "def probe():\n    try:\n        bytearray(1 << 30)\n  "
            "  except MemoryError:\n        return 'MemoryError'\n",
        )
        == "MemoryError"
    )


@needs_bwrap
def test_output_flood_capped():
    r = Code(timeout_s=5.0, max_output_bytes=65536)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    floods = {
        "stdout": "while True:\n    print('x' * 100000)\n",
        "stderr": "import sys\nwhile True:\n    sys.stderr.write('y' * 100000)\n",
        "result": "import os, sys\nfd = sys._getframe(1).f_locals['res_fd']\nwhile "
        "True:\n    os.write(fd, b'z' * 100000)\n",
    }
    t0 = time.monotonic()
    for name, code in floods.items():
        res = r._run_case(code, Case("stdio", stdout="x"))
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


# ------------------------------------------------------------------- kernel surfaces, shared memory, inodes, neighbours


@needs_bwrap
def test_socket_families_outside_the_allowlist_are_refused(reward):
    # creation only: an AF_VSOCK socket reaches a VM host's control channel, so never bind, listen or connect one
    out = observe(
        reward,
        """
        import asyncio, errno, socket
        def attempt(family, kind, proto=0):
            try:
                socket.socket(family, kind, proto).close()
                return "created"
            except OSError as err:
                return errno.errorcode.get(err.errno, str(err.errno))
        def probe():
            out = {
                "vsock": attempt(40, socket.SOCK_STREAM),
                "uevent": attempt(16, socket.SOCK_DGRAM, 15),  # NETLINK_KOBJECT_UEVENT: the host's device events (as root)
                "rtnetlink": attempt(16, socket.SOCK_RAW, 0),
                "packet": attempt(17, socket.SOCK_DGRAM),
                "alg": attempt(38, socket.SOCK_SEQPACKET),
            }
            try:
                socket.socketpair(40, socket.SOCK_STREAM)
                out["vsock_pair"] = "created"
            except OSError as err:
                out["vsock_pair"] = errno.errorcode.get(err.errno, str(err.errno))
            # what ordinary programs use still works: asyncio's self-pipe is socketpair(AF_UNIX)
            out["unix_pair"] = len(socket.socketpair())
            out["inet"] = attempt(socket.AF_INET, socket.SOCK_STREAM)
            out["asyncio"] = asyncio.run(asyncio.sleep(0, result="ran"))
            return out
    """,  # noqa: E501
    )
    refused = {k: out.pop(k) for k in ("vsock", "uevent", "rtnetlink", "packet", "alg", "vsock_pair")}
    assert refused == dict.fromkeys(refused, "EAFNOSUPPORT"), refused
    assert out == {"unix_pair": 2, "inet": "created", "asyncio": "ran"}


SHM_HOLD = """
import os
fds = [os.memfd_create("hold") for _ in range(8)]
for fd in fds:  # 8 x 32 MiB of shared memory: no address space (RLIMIT_AS), each below RLIMIT_FSIZE
    os.posix_fallocate(fd, 0, 32 << 20)
def add(a, b):
    return a + b
"""
SHM_PROBE = """
import ctypes, errno, os
def probe():
    out = {}
    try:
        fds = [os.memfd_create("hold") for _ in range(8)]
        out["memfd"] = "created"
        for fd in fds:
            os.posix_fallocate(fd, 0, 32 << 20)
        out["memfd"] = "held"
    except OSError as err:
        out["memfd"] = errno.errorcode[err.errno]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
    out["shmget"] = "created" if libc.shmget(0, 1 << 20, 0o1600) >= 0 else errno.errorcode[ctypes.get_errno()]  # IPC_PRIVATE, IPC_CREAT|0600
    return out
"""  # noqa: E501


def _shmem_kib() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Shmem:"))


@needs_bwrap
@pytest.mark.parametrize("cgroup", ["auto", "off"])
def test_shared_memory_is_bounded_per_run(cgroup):
    r = Code(memory_mb=128, timeout_s=5.0, cgroup=cgroup)
    bounded = r._sandbox.features()["memory_cgroup"]
    assert (bounded is None) == (cgroup == "off" or r._sandbox._cg is None or "memory" not in r._sandbox._cg.bases)
    shm0, rss0 = _shmem_kib(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    assert r([""], [SHM_HOLD], tests=[ADD_TESTS[:1]]) == [0.0]  # 256 MiB held against memory_mb=128: no credit
    res = r._run_case(textwrap.dedent(SHM_PROBE), Case("call", call="probe()", expected=canonical(None)))
    assert time.monotonic() - t0 < 4.0
    value = _decode(res.records[0]["value"]) if res.records and res.records[0].get("ok") else None
    if bounded:  # the run's memory cgroup: killed at the limit (or ENOMEM), never held
        assert (res.exit_code != 0 and res.oom_kills >= 1) or (value is not None and value["memfd"] == "ENOMEM"), (
            res.exit_code,
            value,
        )
    else:  # no memory cgroup: what RLIMIT_AS cannot see is refused outright
        assert value == {"memfd": "EPERM", "shmget": "EPERM"}, (value, res.stderr[-500:])
    # the parent sees no leak: no shared memory left, its own memory unchanged, no run cgroup left
    assert _shmem_kib() - shm0 < 64 << 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 50_000
    if r._sandbox._cg is not None:
        left = [n for base, _ in r._sandbox._cg.bases.values() for n in os.listdir(base) if n.startswith("run-")]
        assert left == [], left


INODE_FLOOD = """
import errno, os
def probe():
    n = 0
    try:
        while n < 200_000:
            open(f"/tmp/f{n}", "w").close()
            n += 1
        return [n, None, None]
    except OSError as err:
        try:
            open("/dev/shm/one-more", "w").close()
            shm = "created"
        except OSError as err2:
            shm = errno.errorcode[err2.errno]
        return [n, errno.errorcode[err.errno], shm]
"""


@needs_bwrap
def test_scratch_inodes_are_capped():
    r = Code(timeout_s=2.0)
    if not r._sandbox.features()["scratch_inode_cap"]:
        pytest.skip("no inode cap here: only root mounts the scratch tmpfs itself (see docs/sandbox.md)")
    t0 = time.monotonic()
    n, err, shm = observe(r, INODE_FLOOD)
    elapsed = time.monotonic() - t0
    assert 16_000 <= n < 16_384 and err == "ENOSPC" and shm == "ENOSPC", (
        n,
        err,
        shm,
    )  # /tmp and /dev/shm share the cap
    assert elapsed < r.timeout_s + 1.5, elapsed


@needs_bwrap
@pytest.mark.slow
# memory cgroup without the cap: fast when the cgroup's memory.max OOM-kills the flood first, ~0.95 s
# (like no defence at all) when the CPU budget ends it first — both seen here, so its bound is the residual's
@pytest.mark.parametrize(
    "inode_cap, cgroup, teardown_max",
    [(True, "auto", 0.5), (True, "off", 0.5), (False, "auto", 2.5), (False, "off", 2.5)],
)
def test_inode_flood_teardown_stays_inside_the_bound(inode_cap, cgroup, teardown_max, monkeypatch):
    # the probe: keep creating files until killed at timeout_s=5. The kill and the namespace teardown
    # (freeing every inode) must stay small: with the inode cap or a memory cgroup; without either (a normal
    # user without cgroups) the flood is bounded only by its CPU budget, and teardown_max is the measured residual
    if inode_cap is False:
        monkeypatch.setattr(_sandbox, "_SCRATCH", [None])  # as without root: bwrap's own tmpfs, no inode cap
    r = Code(timeout_s=5.0, cgroup=cgroup)
    if inode_cap and not r._sandbox.features()["scratch_inode_cap"]:
        pytest.skip("no inode cap here (not root)")
    if not inode_cap and cgroup == "auto" and not r._sandbox.features()["memory_cgroup"]:
        pytest.skip("no memory cgroup here")
    flood = (
        "import os\nn = 0\nwhile True:\n    try:\n        open(f'/tmp/{n}', "
        "'w').close()\n    except OSError:\n        pass\n    n += 1\n"
    )
    t0 = time.monotonic()
    res = r._run_case(flood, Case("stdio", stdout="x"))
    elapsed = time.monotonic() - t0
    teardown = elapsed - res.startup_s - res.run_s  # from the kill decision to the namespace being empty
    print(
        f"\ninode flood (cap {inode_cap}, cgroup {cgroup}): {elapsed:.2f} s, "
        f"CPU {res.cpu_s:.2f} s, teardown {teardown:.3f} s, oom {res.oom_kills}"
    )
    assert res.timed_out or res.oom_kills >= 1
    assert teardown < teardown_max, teardown
    assert elapsed < r._limits.wall_s + 1.5, elapsed


def _cpu_bomb(marker: str) -> str:
    return textwrap.dedent(f"""
        import os, sys
        for _ in range(15):  # 16 busy processes with the harness (RLIMIT_NPROC may refuse the last ones)
            try:
                if os.fork() == 0:
                    os.setsid()  # each its own session: with autogroup scheduling, its own share of the CPU
                    os.execv(sys.executable, [sys.executable, "-c", "while True:\\n    pass\\n", {marker!r}])
            except OSError:
                pass
        while True:
            pass
    """)


SLOW_CORRECT = """
import time
time.sleep(0.2)  # let the neighbour's bomb get going first
t = time.process_time()
while time.process_time() - t < 0.4:  # 0.4 s of CPU: slow, but well inside timeout_s=1
    pass
def add(a, b):
    return a + b
"""


def _bomb_beside_correct(cgroup: str) -> tuple[list, float, Code]:
    marker = "gwcpubomb" + secrets.token_hex(6)
    r = Code(timeout_s=1.0, workers=2, cgroup=cgroup)
    t0 = time.monotonic()
    out = r([""] * 2, [_cpu_bomb(marker), SLOW_CORRECT], tests=[ADD_TESTS[:1]] * 2)
    elapsed = time.monotonic() - t0
    assert _host_pids_with(marker) == []  # the bomb is killed, every process of it
    return out, elapsed, r


@needs_bwrap
@pytest.mark.parametrize("cgroup", ["auto", "off"])
def test_cpu_bomb_does_not_change_a_neighbours_verdict(cgroup):
    if os.getloadavg()[0] > (os.cpu_count() or 1):  # the neighbour's 0.4 s of CPU must fit its 2 s of wall time
        pytest.skip(
            f"machine busy (load {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
            "cores): other jobs, not the bomb, would starve the neighbour"
        )
    out, elapsed, r = _bomb_beside_correct(cgroup)
    assert out == [0.0, 1.0]  # the bomb scores 0, the slow correct neighbour still passes
    assert r.stats["timeout"] == 1
    assert elapsed < r._limits.wall_s + 1.5, elapsed


@needs_bwrap
@pytest.mark.slow
def test_cpu_bomb_beside_correct_program_five_times():
    seen = {}
    for cgroup in ("auto", "off"):
        runs = [_bomb_beside_correct(cgroup)[:2] for _ in range(5)]
        seen[cgroup] = runs
        assert all(out == [0.0, 1.0] for out, _ in runs), runs
    print("\nbomb beside correct, 5 rounds:", {k: [(o, round(e, 2)) for o, e in v] for k, v in seen.items()})


@needs_bwrap
def test_core_dumps_cannot_be_re_enabled(reward):
    out = observe(
        reward,
        """
        import ctypes, errno, os, platform, resource
        class Rlimit(ctypes.Structure):
            _fields_ = [("cur", ctypes.c_ulong), ("max", ctypes.c_ulong)]
        def probe():
            libc = ctypes.CDLL(None, use_errno=True)
            err = lambda rc: "changed" if rc == 0 else errno.errorcode[ctypes.get_errno()]
            out = {"before": resource.getrlimit(resource.RLIMIT_CORE)}
            # RLIMIT_CORE = 0 would let a pipe core_pattern's handler start again (the kernel spares only 1)
            out["setrlimit"] = err(libc.setrlimit(4, ctypes.byref(Rlimit(0, 0))))
            out["prlimit"] = err(libc.prlimit(0, 4, ctypes.byref(Rlimit(0, 0)), None))
            nr = {"x86_64": 160, "aarch64": 164}[platform.machine()]  # the raw setrlimit system call
            out["raw"] = err(libc.syscall(nr, 4, ctypes.byref(Rlimit(0, 0))))
            libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: harmless while RLIMIT_CORE stays 1
            pid = os.fork()
            if pid == 0:
                os.abort()
            out["core_dumped"] = os.WCOREDUMP(os.waitpid(pid, 0)[1])
            out["after"] = resource.getrlimit(resource.RLIMIT_CORE)
            return out
    """,
    )
    assert out == {
        "before": (1, 1),
        "setrlimit": "EPERM",
        "prlimit": "EPERM",
        "raw": "EPERM",
        "core_dumped": False,
        "after": (1, 1),
    }


STDIN_REOPEN = """
import errno, os, sys
data = sys.stdin.buffer.read()
try:
    with open("/proc/self/fd/0", "r+b", buffering=0) as f:  # our stdin, reopened for writing
        f.write(b"X" * 4096)
    result = "written"
except OSError as err:
    result = errno.errorcode[err.errno]
with open("/proc/self/fd/0", "rb") as f:
    print(result, f.read() == data, len(data))
"""


@needs_bwrap
def test_stdin_cannot_be_reopened_for_writing(reward):
    res = reward._run_case(STDIN_REOPEN, Case("stdio", stdin="1 2\n"))
    # (user mode: test_unprivileged_user_path)
    assert res.stdout.decode().split() in (["EPERM", "True", "4"], ["EACCES", "True", "4"]), res.stdout


def test_output_check_forgives_only_ascii_trailing_space():
    from groupwise.sandbox.bwrap import RunResult

    case = Case("stdio", stdout="3\n")
    check = lambda out: verdict(case, RunResult(ready=True, exit_code=0, stdout=out.encode()))  # noqa: E731
    assert check("3 \t\r\n\n") is True
    for tail in (
        "\x1c",
        "\x1d",
        "\x1e",
        "\x1f",
        "\x85",
        "\u2028",
        "\u3000",
        "\x0b",
        "\x0c",
    ):  # str.rstrip() would strip each
        assert check("3" + tail + "\n") is False, repr(tail)


@needs_bwrap
def test_exit_status_is_not_taken_modulo_256(reward):
    codes = [
        "print(3)\nraise SystemExit(256)\n",
        "import sys\nprint(3)\nsys.exit(512)\n",
        "import sys\nprint(3)\nsys.exit(-256)\n",
        "import sys\nprint(3)\nsys.exit(0)\n",
        "import sys\nprint(3)\nsys.exit(False)\n",
        "print(3)\n",
    ]
    assert reward([""] * 6, codes, tests=[[{"input": "", "output": "3\n"}]] * 6) == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]


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
    """,  # noqa: E501
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
    control = (
        "import builtins, json\nbuiltins.print = lambda *a, **k: "
        "None\njson.dumps = None\nbuiltins.repr = lambda x: 'nope'\n" + ADD
    )
    out = reward(
        [""] * (len(codes) + 1), codes + [control], tests=[[{"call": "add(1, 2)", "expected": "3"}]] * (len(codes) + 1)
    )
    assert out[-1] == 1.0
    earned = {n: s for n, s in zip(names_, out) if s != 0.0}
    assert earned == {}, f"forgeries earned credit: {earned}"


@needs_bwrap
def test_stdio_forgeries_earn_nothing(reward):
    names_ = list(STDIO_FORGERIES)
    out = reward(
        [""] * (len(names_) + 1),
        [STDIO_FORGERIES[n] for n in names_] + ["print(3)\n"],
        tests=[[{"input": "1 2\n", "output": "3\n"}]] * (len(names_) + 1),
    )
    assert out[-1] == 1.0
    earned = {n: s for n, s in zip(names_, out) if s != 0.0}
    assert earned == {}, f"forgeries earned credit: {earned}"


@needs_bwrap
def test_expected_values_never_enter_the_sandbox(reward, monkeypatch):
    secret = "gw-expected-" + secrets.token_hex(8)
    sent: list[bytes] = []
    real_fd, real_argv = _sandbox._readonly_fd, Sandbox._bwrap_argv
    monkeypatch.setattr(_sandbox, "_readonly_fd", lambda data: sent.append(bytes(data)) or real_fd(data))
    monkeypatch.setattr(
        Sandbox,
        "_bwrap_argv",
        lambda self, *a: (lambda argv: sent.append(" ".join(argv).encode()) or argv)(real_argv(self, *a)),
    )
    reward(
        [""] * 2,
        ["def f():\n    return 1\n", "print(1)"],
        tests=[
            [{"call": "f()", "expected": repr(secret)}, f"assert f() == {secret!r}"],
            [{"input": "x\n", "output": secret}],
        ],
    )
    assert sent and not any(secret.encode() in blob for blob in sent)


# ----------------------------------------------------------------------------- unsafe_local


def _runnable_by_others(python: str) -> bool:  # by uid 65534 (this venv's interpreter may sit under /root)
    try:
        return (
            subprocess.run(
                [python, "-c", "pass"], user=65534, group=65534, extra_groups=[], cwd="/", env={}, capture_output=True
            ).returncode
            == 0
        )
    except OSError:
        return False


def _python_for_other_users() -> str | None:
    if os.geteuid() != 0:
        return None
    return next(
        (
            p
            for p in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3")
            if os.path.exists(p) and _runnable_by_others(p)
        ),
        None,
    )


UNSAFE_PYTHON = _python_for_other_users()
needs_unsafe = pytest.mark.skipif(
    UNSAFE_PYTHON is None, reason="unsafe_local needs root and an interpreter an unprivileged uid may run"
)


def test_unsafe_local_never_runs_candidates_as_root_or_as_the_trainer(tmp_path, monkeypatch):
    if os.geteuid() == 0:  # as root, an interpreter other users cannot run (a copy in a 0700 directory): refused
        private = tmp_path / "private"
        private.mkdir(mode=0o700)
        shutil.copy2(os.path.realpath(sys.executable), private / "python3")
        with pytest.raises(SandboxUnavailable, match="unprivileged uid cannot run the interpreter.*python = "):
            Sandbox(unsafe_local=True, python=str(private / "python3")).check()
    monkeypatch.setattr(_sandbox.os, "geteuid", lambda: 1000)  # not root: the candidate would run as the trainer's uid
    with pytest.raises(SandboxUnavailable, match="needs root"):
        Sandbox(unsafe_local=True).check()


@needs_unsafe
def test_unsafe_local_candidate_cannot_read_the_trainers_memory():
    secret = "gw-answer-" + secrets.token_hex(8)
    with pytest.warns(UserWarning, match="WITHOUT a sandbox"):
        r = Code(unsafe_local=True, python=UNSAFE_PYTHON, timeout_s=5.0)
    forgery = textwrap.dedent("""
        import os, re
        def answer():
            pid = os.getppid()  # the trainer: unsafe mode has no PID namespace
            with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
                for line in maps:
                    span, perms = line.split()[:2]
                    if not perms.startswith("rw"):
                        continue
                    lo, hi = (int(x, 16) for x in span.split("-"))
                    try:
                        mem.seek(lo)
                        found = re.search(rb"gw-answer-[0-9a-f]{16}", mem.read(hi - lo))
                    except (OSError, OverflowError, ValueError):
                        continue
                    if found:
                        return found.group().decode()
    """)
    assert r([""], [forgery], tests=[[{"call": "answer()", "expected": repr(secret)}]]) == [0.0]


@needs_unsafe
def test_unsafe_local_warns_and_still_limits(monkeypatch):
    monkeypatch.setenv("GROUPWISE_TEST_SECRET", "xyz")
    with pytest.warns(UserWarning, match="WITHOUT a sandbox"):
        r = Code(unsafe_local=True, timeout_s=1.0, python=UNSAFE_PYTHON)
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
    assert time.monotonic() - t0 < r._limits.wall_s + 4.0  # the endless loop is cut at its CPU budget, not waited out
    assert _host_pids_with(marker) == []  # every process of the run's uid is killed, however it left the group


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
out["stdin"] = s.run(code=STDIN_REOPEN, mode="stdio", stdin=b"1 2\\n").stdout.decode().split()
out["memfd"] = value("import os\\ndef f():\\n    try:\\n        os.memfd_create('x'); return 'created'\\n    except OSError as e:\\n        return e.errno\\n")
out["vsock"] = value("import socket\\ndef f():\\n    try:\\n        socket.socket(40, socket.SOCK_STREAM); return 'created'\\n    except OSError as e:\\n        return e.errno\\n")
t0 = time.monotonic()
out["spin"] = value("def f():\\n    while True:\\n        pass\\n", timeout_s=1.0)
out["spin_s"] = time.monotonic() - t0
print(json.dumps(out))
"""  # noqa: E501


@needs_bwrap
@pytest.mark.skipif(
    os.geteuid() != 0,
    reason="switching to an unprivileged user needs root (as a user, every other test covers this path)",
)
def test_unprivileged_user_path():
    """What most users run: bwrap as a normal user (user namespace, uid 65534 inside, seccomp)."""
    python = UNSAFE_PYTHON
    if python is None:
        pytest.skip("no Python interpreter that an unprivileged user may run")
    work = tempfile.mkdtemp(prefix="gw-unpriv-")
    try:
        os.chmod(work, 0o755)
        for name in ("bwrap.py", "cgroup.py", "harness.py"):
            shutil.copyfile(os.path.join(os.path.dirname(_sandbox.__file__), name), os.path.join(work, name))
        with open(os.path.join(work, "smoke.py"), "w") as f:
            f.write(f"STDIN_REOPEN = {STDIN_REOPEN!r}\n" + SMOKE)
        for name in os.listdir(work):
            os.chmod(os.path.join(work, name), 0o644)
        proc = subprocess.run(
            [python, "-s", os.path.join(work, "smoke.py")],
            user=65534,
            group=65534,
            extra_groups=[],
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
            capture_output=True,
            timeout=60,
        )
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
    assert out["stdin"] == ["EPERM", "True", "4"]  # the candidate owns the file here, yet cannot change its stdin
    # no memory cgroup for a normal user: memfd refused; EAFNOSUPPORT
    assert _decode(out["memfd"]) == 1 and _decode(out["vsock"]) == 97
    assert out["spin"][0] is True and out["spin_s"] < 1.0 + 1.5
