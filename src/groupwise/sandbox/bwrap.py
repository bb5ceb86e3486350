"""Run one test case of untrusted Python in a throw-away sandbox (used by ``code.py``).

``Sandbox().run(code=..., mode="stdio"|"call", ...)`` starts ONE fresh process tree for ONE test
case and returns a :class:`RunResult` with everything the trusted parent needs to decide the
verdict (``rewards/_code_cases.py`` decides; nothing here interprets the candidate's claims). Standard library
only. Threat model, guarantees and the tests proving each: ``docs/sandbox.md``.

Isolation, in the default (sandboxed) mode, via bubblewrap (``bwrap``):

* new PID, network, IPC, UTS and cgroup namespaces (``--unshare-*``): no network at all (only the
  sandbox's own loopback), no view of or signal to host processes; ``--die-with-parent`` and
  ``--new-session``; when the sandbox's PID 1 dies the kernel kills everything left inside it;
* a file system made of read-only binds of ``/usr`` (``/bin``, ``/lib``… as on the host), the
  interpreter's install prefix (``sys.base_prefix``), ``/etc/ld.so.cache`` and the harness file;
  a size-capped scratch tmpfs at ``/tmp`` (and ``/dev/shm``); ``/``, ``/dev`` remounted read-only;
* an environment of exactly :data:`SANDBOX_ENV` (bwrap itself is started with that environment
  too, so no parent secret exists anywhere inside);
* rlimits (address space, CPU seconds, file size, open files, processes, no core files) set by the
  harness before any candidate code runs, both soft and hard, so they cannot be raised again;
* an unprivileged uid that is not root on the host, so ``RLIMIT_NPROC`` is enforced: as a normal
  user, bwrap makes a user namespace (uid 65534 inside, further user namespaces disabled); as
  root, bwrap runs privileged without a user namespace (a user namespace would map the candidate
  to host root, which the kernel exempts from ``RLIMIT_NPROC``) keeping only CAP_SETUID/CAP_SETGID,
  and the harness drops to a fresh random uid per run before candidate code runs.

Every run: its own session and process group; wall-clock ``timeout_s`` counted from the moment the
harness is ready; on timeout (or output over the cap) the sandbox's PID 1 and the whole process
group get SIGKILL and the call returns only after the namespace is empty. At most
``max_output_bytes`` are read from each of stdout, stderr and the result channel; more is a kill.

``unsafe_local=True`` runs the harness as a plain subprocess (same rlimits, own session, timeout,
group kill, scrubbed environment, and as root a fresh uid) but WITHOUT namespaces: the candidate
can use the network, read whatever the uid may read, and a double-forked daemon that leaves the
process group is found only by a best-effort scan. Only for trusted code or throw-away machines.
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
import platform
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field

HARNESS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness.py")
HARNESS_IN_SANDBOX = "/opt/groupwise/harness.py"
STARTUP_TIMEOUT_S = 30.0  # bwrap + interpreter start-up; a sandbox not ready by then is an infrastructure failure
KILL_GRACE_S = 5.0  # how long to wait for a killed sandbox's namespace to empty before giving up on it
SANDBOX_UID = 65534  # uid inside the user namespace (non-root mode)
SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONHASHSEED": "0",  # the same completion always prints sets/dicts in the same order
}
INSTALL_HELP = (
    "The 'code' reward runs model-written programs and refuses to do so without a sandbox. "
    "Install bubblewrap (Debian/Ubuntu: `sudo apt-get install -y bubblewrap`; Fedora/RHEL: "
    "`sudo dnf install -y bubblewrap`; Arch: `sudo pacman -S bubblewrap`) and make sure "
    "unprivileged user namespaces are allowed when not running as root (`sysctl "
    "user.max_user_namespaces` must be > 0; on Ubuntu 24.04+ bwrap needs its AppArmor profile, or "
    "`sysctl kernel.apparmor_restrict_unprivileged_userns=0`; inside Docker run the container with "
    "`--security-opt seccomp=unconfined` or as a privileged container). To run candidate code "
    "WITHOUT isolation on a throw-away machine, pass unsafe_local=True (see docs/sandbox.md)."
)


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create its namespaces here; the message says how to fix it."""


@dataclass(frozen=True)
class Limits:
    """Per-run resource limits (the rlimits apply to every process of the run, each)."""

    timeout_s: float = 5.0  # wall clock, from harness ready to kill
    memory_mb: int = 512  # RLIMIT_AS per process
    max_output_bytes: int = 65536  # per stream: stdout, stderr, result channel
    max_processes: int = 16  # RLIMIT_NPROC (processes and threads of the run's uid)
    scratch_mb: int = 64  # size of the /tmp tmpfs and RLIMIT_FSIZE
    open_files: int = 64  # RLIMIT_NOFILE

    def rlimits(self) -> dict[str, int]:
        return {
            "RLIMIT_AS": int(self.memory_mb) << 20,
            "RLIMIT_CPU": int(math.ceil(self.timeout_s)) + 1,  # backstop; the wall clock kills first
            "RLIMIT_FSIZE": int(self.scratch_mb) << 20,
            "RLIMIT_NOFILE": int(self.open_files),
            "RLIMIT_NPROC": int(self.max_processes),
            "RLIMIT_CORE": 0,
        }


@dataclass
class RunResult:
    """What happened in one run. ``ready`` False means no verdict is possible (``infra_error``)."""

    ready: bool = False
    exit_code: int | None = None  # the harness's exit status (negative: killed by that signal)
    timed_out: bool = False
    output_capped: bool = False
    stdout: bytes = b""
    stderr: bytes = b""
    records: list[dict] = field(default_factory=list)  # records after "ready", in order
    malformed: bool = False  # a line on the result channel that is not a record with this run's nonce
    elapsed_s: float = 0.0  # from start to the namespace being empty
    startup_s: float = 0.0  # from start to "ready" (bwrap + interpreter start-up, limits applied)
    run_s: float = 0.0  # from "ready" to the harness exiting or being killed
    infra_error: str | None = None


# --------------------------------------------------------------------------------------- seccomp

# Syscall numbers from the kernel's tables (x86_64: arch/x86/entry/syscalls/syscall_64.tbl; aarch64:
# include/uapi/asm-generic/unistd.h). Denied with EPERM: namespace and mount manipulation, kernel
# keyrings, eBPF, perf, userfaultfd, io_uring, ptrace, module/kexec loading, swap, reboot, syslog,
# acct, quotas, file handles. clone3 gets ENOSYS (its flags sit in memory a filter cannot read; glibc
# then falls back to clone, whose flags are checked). clone/unshare are denied only with CLONE_NEW*.
_DENY = ("setns keyctl add_key request_key bpf perf_event_open userfaultfd io_uring_setup io_uring_enter "
         "io_uring_register ptrace mount umount2 pivot_root chroot open_by_handle_at kexec_load kexec_file_load "
         "init_module finit_module delete_module fsopen fsconfig fsmount fspick move_mount open_tree mount_setattr "
         "swapon swapoff reboot syslog acct quotactl").split()
_SYSCALLS = {
    "x86_64": (0xC000003E, dict(clone=56, clone3=435, unshare=272, setns=308, keyctl=250, add_key=248, request_key=249, bpf=321,
        perf_event_open=298, userfaultfd=323, io_uring_setup=425, io_uring_enter=426, io_uring_register=427, ptrace=101, mount=165,
        umount2=166, pivot_root=155, chroot=161, open_by_handle_at=304, kexec_load=246, kexec_file_load=320, init_module=175,
        finit_module=313, delete_module=176, fsopen=430, fsconfig=431, fsmount=432, fspick=433, move_mount=429, open_tree=428,
        mount_setattr=442, swapon=167, swapoff=168, reboot=169, syslog=103, acct=163, quotactl=179)),
    "aarch64": (0xC00000B7, dict(clone=220, clone3=435, unshare=97, setns=268, keyctl=219, add_key=217, request_key=218, bpf=280,
        perf_event_open=241, userfaultfd=282, io_uring_setup=425, io_uring_enter=426, io_uring_register=427, ptrace=117, mount=40,
        umount2=39, pivot_root=41, chroot=51, open_by_handle_at=265, kexec_load=104, kexec_file_load=294, init_module=105,
        finit_module=273, delete_module=106, fsopen=430, fsconfig=431, fsmount=432, fspick=433, move_mount=429, open_tree=428,
        mount_setattr=442, swapon=224, swapoff=225, reboot=142, syslog=116, acct=89, quotactl=60)),
}
_CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00000080  # NS CGROUP UTS IPC USER PID NET TIME


def seccomp_filter(machine: str | None = None) -> bytes | None:
    """A classic-BPF seccomp program (raw ``struct sock_filter`` array, as ``bwrap --seccomp`` reads it)
    for this machine's architecture, or None where the syscall table is not known here."""
    table = _SYSCALLS.get(machine or platform.machine())
    if table is None:
        return None
    arch, nr = table
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, JMP|JEQ|K, JMP|JGE|K, JMP|JSET|K, RET|K
    allow, eperm, enosys, kill = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38, 0x80000000
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill), (ld, 0, 0, 0)]  # foreign ABI (i386 on x86_64): kill
    if arch == 0xC000003E:
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, eperm)]  # the x32 ABI
    for name in _DENY:
        prog += [(jeq, 0, 1, nr[name]), (ret, 0, 0, eperm)]
    prog += [(jeq, 0, 1, nr["clone3"]), (ret, 0, 0, enosys)]
    for name in ("clone", "unshare"):  # flags are the first argument of both (low 32 bits at offset 16)
        prog += [(jeq, 0, 4, nr[name]), (ld, 0, 0, 16), (jset, 0, 1, _CLONE_NEW), (ret, 0, 0, eperm), (ret, 0, 0, allow)]
    prog += [(ret, 0, 0, allow)]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


# --------------------------------------------------------------------------------------- helpers


def _readonly_fd(data: bytes) -> int:
    """A read-only fd on an unlinked temporary file holding ``data`` (stdin, config)."""
    fd, path = tempfile.mkstemp(prefix="groupwise-sbx-")
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        ro = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.unlink(path)
        os.close(fd)
    return ro


def _mapped_uid_ranges() -> list[tuple[int, int]]:
    try:
        with open("/proc/self/uid_map") as f:
            return [(int(a), int(a) + int(n)) for a, _, n in (line.split() for line in f if line.strip())]
    except OSError:
        return [(0, 65536)]


def _fresh_uid() -> int:
    """A random uid, mapped in this user namespace and (almost surely) used by nobody else."""
    for lo, hi in ((1 << 24, 1 << 25), (200_000, 1_000_000), (60_000, 65_000)):
        for a, b in _mapped_uid_ranges():
            if a <= lo and hi <= b:
                return random.SystemRandom().randrange(lo, hi)
    return SANDBOX_UID


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _pids_where(uid: int | None, marker: bytes | None) -> list[int]:
    """Host pids owned by ``uid`` or whose environment holds ``marker`` (unsafe-mode sweep)."""
    found = []
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if uid is not None and os.stat(f"/proc/{name}").st_uid == uid:
                found.append(int(name))
                continue
            if marker is not None:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if marker in f.read():
                        found.append(int(name))
        except OSError:
            pass
    return found


_HELP: dict[str, str] = {}  # bwrap path -> its --help text (which options this version has)


def _bwrap_help(bwrap: str) -> str:
    if bwrap not in _HELP:
        try:
            out = subprocess.run([bwrap, "--help"], capture_output=True, timeout=10, env=dict(SANDBOX_ENV), stdin=subprocess.DEVNULL)
            _HELP[bwrap] = (out.stdout + out.stderr).decode(errors="replace")
        except (OSError, subprocess.SubprocessError):
            return ""
    return _HELP[bwrap]


_PROBED: dict[tuple, str | None] = {}  # (bwrap, python, root?) -> None (works) or the error text
_PROBE_LOCK = threading.Lock()


# --------------------------------------------------------------------------------------- sandbox


class Sandbox:
    """Runs single test cases of untrusted code; thread-safe (each run is independent)."""

    def __init__(self, *, unsafe_local: bool = False, bwrap: str | None = None, python: str | None = None) -> None:
        self.unsafe_local = bool(unsafe_local)
        self.python = os.path.realpath(python or sys.executable)
        self.root = os.geteuid() == 0
        self.bwrap = None if self.unsafe_local else (bwrap or shutil.which("bwrap") or shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin"))
        self._flags = ""
        self._harness_dir: str | None = None
        self.unsafe_as_root = False  # unsafe mode as root, when a fresh uid cannot run the interpreter
        if self.unsafe_local:
            # a private copy: run from the package directory, the harness would see ``rewards/math.py`` as ``math``
            self._harness_dir = tempfile.mkdtemp(prefix="groupwise-harness-")
            os.chmod(self._harness_dir, 0o755)
            shutil.copyfile(HARNESS_FILE, os.path.join(self._harness_dir, "harness.py"))
            os.chmod(os.path.join(self._harness_dir, "harness.py"), 0o644)
            weakref.finalize(self, shutil.rmtree, self._harness_dir, True)

    # ---------------------------------------------------------------- availability

    def check(self) -> None:
        """Fail closed: raise :class:`SandboxUnavailable` unless a trivial program runs and reports back."""
        if self.unsafe_local:
            if self.root:  # run candidates as a fresh unprivileged uid if that uid can run the interpreter
                try:
                    subprocess.run([self.python, "-s", "-B", "-c", "pass"], user=SANDBOX_UID, group=SANDBOX_UID, extra_groups=[],
                                   env=dict(SANDBOX_ENV), cwd="/", stdin=subprocess.DEVNULL, capture_output=True, timeout=STARTUP_TIMEOUT_S, check=True)
                except (OSError, subprocess.SubprocessError):
                    self.unsafe_as_root = True
            return
        if not self.bwrap:
            raise SandboxUnavailable(f"bubblewrap (`bwrap`) was not found on PATH. {INSTALL_HELP}")
        key = (self.bwrap, self.python, self.root)
        with _PROBE_LOCK:
            if key not in _PROBED:
                _PROBED[key] = self._probe()
            error = _PROBED[key]
        if error is not None:
            raise SandboxUnavailable(f"bubblewrap ({self.bwrap}) cannot start a sandbox here: {error}. {INSTALL_HELP}")

    def _probe(self) -> str | None:
        self._flags = _bwrap_help(self.bwrap or "bwrap")
        if "--unshare-all" not in self._flags:
            return f"`{self.bwrap} --help` did not run or is not bubblewrap"
        res = self.run(code="def f():\n    return 41 + 1\n", mode="call", call="f()", limits=Limits(timeout_s=STARTUP_TIMEOUT_S))
        if not res.ready:
            return res.infra_error or "the sandbox did not start"
        recs = [r for r in res.records if r.get("kind") == "result"]
        if res.exit_code != 0 or len(recs) != 1 or recs[0].get("value") != ["int", "2a"]:
            tail = res.stderr.decode(errors="replace")[-2000:]
            return f"the probe program did not report 42 (exit {res.exit_code}, records {res.records}, stderr {tail!r})"
        return None

    # ---------------------------------------------------------------- command lines

    def _has(self, flag: str) -> bool:
        if not self._flags:
            self._flags = _bwrap_help(self.bwrap or "bwrap")
        return flag in self._flags

    def _bwrap_argv(self, limits: Limits, info_fd: int, cfg_fd: int, res_fd: int, seccomp_fd: int) -> list[str]:
        a: list[str] = [self.bwrap or "bwrap"]
        if self.root:
            # privileged bwrap, no user namespace (see module docstring); the harness drops to a fresh uid
            a += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
            a += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            a += ["--unshare-all", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
            if self._has("--disable-userns"):
                a += ["--disable-userns"]
        a += ["--die-with-parent", "--new-session"]
        if self._has("--clearenv"):  # bwrap >= 0.5; bwrap itself only ever gets SANDBOX_ENV anyway
            a += ["--clearenv"]
        if self._has("--hostname"):
            a += ["--hostname", "sandbox"]
        for key, value in SANDBOX_ENV.items():
            a += ["--setenv", key, value]
        size = ["--size", str(int(limits.scratch_mb) << 20)] if self._has("--size") else []  # bwrap >= 0.5

        def perms(mode: str) -> list[str]:  # bwrap >= 0.5
            return ["--perms", mode] if self._has("--perms") else []

        bound: list[str] = []
        for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                a += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                a += ["--ro-bind", top, top]
                bound.append(top)
        a += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache", "--ro-bind-try", "/etc/alternatives", "/etc/alternatives"]
        if os.path.isdir("/nix/store"):  # a Nix interpreter's libraries live there, outside its prefix
            a += ["--ro-bind", "/nix/store", "/nix/store"]
            bound.append("/nix/store")
        a += [*perms("1777"), *size, "--tmpfs", "/tmp"]
        for path in sorted({os.path.realpath(sys.base_prefix), os.path.dirname(self.python)}, key=len):
            if any(path == b or path.startswith(b + "/") for b in bound):
                continue
            parts = path.strip("/").split("/")
            for i in range(1, len(parts)):
                a += [*perms("0755"), "--dir", "/" + "/".join(parts[:i])]
            a += ["--ro-bind", path, path]
            bound.append(path)
        a += [*perms("0755"), "--dir", "/opt", *perms("0755"), "--dir", "/opt/groupwise"]
        a += ["--ro-bind", HARNESS_FILE, HARNESS_IN_SANDBOX]
        a += ["--proc", "/proc", "--dev", "/dev", *perms("1777"), *size, "--tmpfs", "/dev/shm"]
        a += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp", "--info-fd", str(info_fd)]
        if seccomp_fd >= 0:
            a += ["--seccomp", str(seccomp_fd)]
        a += ["--", self.python, "-s", "-B", HARNESS_IN_SANDBOX, str(cfg_fd), str(res_fd)]
        return a

    # ---------------------------------------------------------------- one run

    def run(self, *, code: str, mode: str, call: str | None = None, stdin: bytes = b"", limits: Limits = Limits()) -> RunResult:
        """Run one test case: ``mode="stdio"`` (``code`` as a program reading ``stdin``) or
        ``mode="call"`` (define ``code``, evaluate the expression ``call``, report its value)."""
        if mode not in ("stdio", "call"):
            raise ValueError(f"mode must be 'stdio' or 'call', got {mode!r}")
        nonce = secrets.token_hex(16)
        uid = _fresh_uid() if self.root and not self.unsafe_as_root else None
        cfg = {"nonce": nonce, "mode": mode, "code": code, "call": call, "rlimits": limits.rlimits()}
        # sandbox + root: the harness starts as root inside and drops itself; unsafe + root: Popen drops
        cfg["switch_uid"] = uid if (uid is not None and not self.unsafe_local) else None
        t0 = time.monotonic()
        fds: list[int] = []
        try:
            return self._run(cfg, stdin, limits, uid, nonce, t0, fds)
        except OSError as err:  # no fds, no disk for the temporary files, ...: the parent's problem, not the candidate's
            return RunResult(infra_error=f"could not set up the run: {type(err).__name__}: {err}", elapsed_s=time.monotonic() - t0)
        finally:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _run(self, cfg: dict, stdin: bytes, limits: Limits, uid: int | None, nonce: str, t0: float, fds: list[int]) -> RunResult:
        scratch = None
        try:
            cfg_fd = _readonly_fd(json.dumps(cfg).encode())
            fds.append(cfg_fd)
            in_fd = _readonly_fd(stdin) if stdin else os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            fds.append(in_fd)
            res_r, res_w = os.pipe()
            fds += [res_r, res_w]
            info_r = info_w = seccomp_fd = -1
            popen_kw: dict = {}
            if self.unsafe_local:
                scratch = tempfile.mkdtemp(prefix="groupwise-scratch-")
                if uid is not None:
                    os.chown(scratch, uid, uid)
                    popen_kw = {"user": uid, "group": uid, "extra_groups": []}
                env = {**SANDBOX_ENV, "HOME": scratch, "TMPDIR": scratch, "GROUPWISE_SANDBOX_RUN": nonce}
                harness = os.path.join(self._harness_dir or "", "harness.py")
                argv = [self.python, "-s", "-B", harness, str(cfg_fd), str(res_w)]
                pass_fds: tuple[int, ...] = (cfg_fd, res_w)
            else:
                info_r, info_w = os.pipe()
                fds += [info_r, info_w]
                bpf = seccomp_filter()
                if bpf is not None:
                    seccomp_fd = _readonly_fd(bpf)
                    fds.append(seccomp_fd)
                env = dict(SANDBOX_ENV)
                argv = self._bwrap_argv(limits, info_w, cfg_fd, res_w, seccomp_fd)
                pass_fds = (cfg_fd, res_w, info_w) + ((seccomp_fd,) if seccomp_fd >= 0 else ())
            try:
                proc = subprocess.Popen(
                    argv, stdin=in_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=pass_fds,
                    start_new_session=True, env=env, cwd=scratch or "/", close_fds=True, **popen_kw,
                )
            except OSError as err:
                return RunResult(infra_error=f"could not start {argv[0]}: {err}", elapsed_s=time.monotonic() - t0)
            for fd in (cfg_fd, in_fd, res_w, info_w, seccomp_fd):  # the child holds its own copies
                if fd >= 0:
                    os.close(fd)
                    fds.remove(fd)
            result = _Supervisor(proc, nonce, limits, res_r, info_r, unsafe_uid=uid if self.unsafe_local else None,
                                 unsafe_marker=nonce.encode() if self.unsafe_local else None).run()
            result.elapsed_s = time.monotonic() - t0
            return result
        finally:
            if scratch:
                shutil.rmtree(scratch, ignore_errors=True)


class _Supervisor:
    """Reads one run's pipes under the caps, enforces the wall clock, kills and reaps everything."""

    def __init__(self, proc: subprocess.Popen, nonce: str, limits: Limits, res_r: int, info_r: int,
                 unsafe_uid: int | None, unsafe_marker: bytes | None) -> None:
        self.proc, self.nonce, self.limits = proc, nonce, limits
        self.unsafe = unsafe_marker is not None
        self.unsafe_uid, self.unsafe_marker = unsafe_uid, unsafe_marker
        assert proc.stdout is not None and proc.stderr is not None
        self.streams: dict[int, str] = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", res_r: "result"}
        if info_r >= 0:
            self.streams[info_r] = "info"
        self.buf: dict[str, bytearray] = {name: bytearray() for name in self.streams.values()}
        self.cap = {"stdout": limits.max_output_bytes, "stderr": limits.max_output_bytes, "result": limits.max_output_bytes, "info": 1 << 16}
        self.open: set[int] = set(self.streams)
        self.capped = False
        self.ready_at: float | None = None
        self.pid1: int | None = None
        self.pid1_fd: int | None = None
        self.proc_fd: int | None = None

    # -------------------------------------------------------------- reading

    def _read(self, fd: int) -> None:
        name = self.streams[fd]
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.open.discard(fd)
            return
        room = self.cap[name] - len(self.buf[name])
        self.buf[name] += chunk[: max(room, 0)]
        if len(chunk) > room:
            self.capped = self.capped or name != "info"
            self.open.discard(fd)  # stop reading this stream; the run is killed (or already over)
        if name == "result" and self.ready_at is None and b"\n" in self.buf["result"]:
            self.ready_at = time.monotonic()
        if name == "info" and self.pid1 is None:
            self._take_pid1()

    def _take_pid1(self) -> None:
        try:
            info = json.loads(self.buf["info"].decode())
            pid = int(info["child-pid"])
        except (ValueError, KeyError, TypeError):
            return
        if _ppid(pid) != self.proc.pid:
            return
        self.pid1 = pid
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return
        if _ppid(pid) == self.proc.pid:  # still bwrap's child: the pidfd is the sandbox's PID 1
            self.pid1_fd = fd
        else:
            os.close(fd)

    # -------------------------------------------------------------- lifecycle

    def _exited(self) -> bool:
        """Has bwrap (or the unsafe harness) exited? Never reaps it: its pid, and so its process
        group id, stay reserved until we have killed the group."""
        try:
            info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return info is not None

    def run(self) -> RunResult:
        res = RunResult()
        sel = selectors.DefaultSelector()
        for fd in self.streams:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        try:
            self.proc_fd = os.pidfd_open(self.proc.pid)
            sel.register(self.proc_fd, selectors.EVENT_READ)
        except (AttributeError, OSError):
            self.proc_fd = None
        start = time.monotonic()
        kill = False
        finished = False
        try:
            while True:
                now = time.monotonic()
                deadline = start + STARTUP_TIMEOUT_S if self.ready_at is None else self.ready_at + self.limits.timeout_s
                if now >= deadline:
                    res.timed_out = self.ready_at is not None
                    if self.ready_at is None:
                        res.infra_error = f"the sandbox was not ready after {STARTUP_TIMEOUT_S:.0f} s"
                    kill = True
                    break
                if self.capped:
                    kill = True
                    break
                if self._exited():
                    break
                wait = deadline - now if self.proc_fd is not None else min(deadline - now, 0.02)
                for key, _ in sel.select(timeout=wait):
                    fd = key.fd
                    if fd == self.proc_fd:
                        continue
                    if fd in self.open:
                        self._read(fd)
                    if fd not in self.open:
                        try:
                            sel.unregister(fd)
                        except (KeyError, ValueError):
                            pass
            end = time.monotonic()
            finished = True
            self._finish(kill)
            res.run_s = (end if kill else time.monotonic()) - (self.ready_at or start)
            res.startup_s = (self.ready_at or end) - start
            self._drain(sel)
        finally:
            if not finished:  # an error in the parent: never leave the run behind
                self._finish(True)
            sel.close()
            for fd in (self.pid1_fd, self.proc_fd):
                if fd is not None:
                    os.close(fd)
            for stream in (self.proc.stdout, self.proc.stderr):
                if stream is not None:
                    stream.close()
        res.exit_code = self.proc.returncode
        res.output_capped = self.capped
        res.stdout, res.stderr = bytes(self.buf["stdout"]), bytes(self.buf["stderr"])
        self._parse(res)
        return res

    def _finish(self, kill: bool) -> None:
        """Kill (when asked), make sure no process of the run survives, and reap."""
        if kill:
            signalled = False
            try:
                if self.pid1_fd is not None:
                    signal.pidfd_send_signal(self.pid1_fd, signal.SIGKILL)
                    signalled = True
                elif self.pid1 is not None and _ppid(self.pid1) == self.proc.pid:
                    os.kill(self.pid1, signal.SIGKILL)
                    signalled = True
            except OSError:
                pass
            if signalled and not self.unsafe:  # bwrap exits once its PID 1 is gone, i.e. the namespace is empty
                limit = time.monotonic() + KILL_GRACE_S
                while not self._exited() and time.monotonic() < limit:
                    time.sleep(0.002)
        # the group of bwrap (sandbox) or of the harness (unsafe); safe: the leader is not reaped yet
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait()
        if self.pid1_fd is not None:  # killed bwrap before it reaped PID 1: wait for the namespace to empty
            sel = selectors.DefaultSelector()
            sel.register(self.pid1_fd, selectors.EVENT_READ)
            sel.select(timeout=KILL_GRACE_S)
            sel.close()
        if self.unsafe:
            self._sweep()

    def _sweep(self) -> None:
        """Unsafe mode: kill what left the process group (by the run's uid as root, else by the
        environment marker; a process that scrubbed its own environment escapes this)."""
        for _ in range(100):
            pids = _pids_where(self.unsafe_uid, self.unsafe_marker)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.01)

    def _drain(self, sel: selectors.BaseSelector) -> None:
        """Everything that wrote to the pipes is dead: read what is left (under the caps)."""
        limit = time.monotonic() + 1.0
        while self.open and time.monotonic() < limit:
            events = sel.select(timeout=max(0.0, limit - time.monotonic()))
            if not events:
                break
            for key, _ in events:
                if key.fd in self.open:
                    self._read(key.fd)
                if key.fd not in self.open and key.fd != self.proc_fd:
                    try:
                        sel.unregister(key.fd)
                    except (KeyError, ValueError):
                        pass

    def _parse(self, res: RunResult) -> None:
        data = bytes(self.buf["result"])
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        elif lines:
            res.malformed = True  # an unterminated last line
            lines.pop()
        records = []
        for line in lines:
            try:
                rec = json.loads(line.decode())
            except (ValueError, UnicodeDecodeError, RecursionError):
                res.malformed = True
                continue
            if not isinstance(rec, dict) or rec.get("nonce") != self.nonce:
                res.malformed = True
                continue
            records.append(rec)
        if records and records[0].get("kind") == "ready":
            res.ready = True
            res.records = records[1:]
        else:
            res.ready = False
            if res.infra_error is None:
                tail = bytes(self.buf["stderr"]).decode(errors="replace").strip()[-2000:]
                res.infra_error = f"the sandbox exited ({self.proc.returncode}) before the harness was ready: {tail or 'no output'}"
