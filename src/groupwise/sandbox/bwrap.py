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
  a size-capped scratch tmpfs at ``/tmp`` and ``/dev/shm`` (as root: one tmpfs for both, mounted by
  us with an inode cap); ``/``, ``/dev`` remounted read-only;
* an environment of exactly :data:`SANDBOX_ENV` (bwrap itself is started with that environment
  too, so no parent secret exists anywhere inside);
* rlimits (address space, CPU seconds, file size, open files, processes) set by the harness before
  any candidate code runs, both soft and hard, so they cannot be raised again; ``RLIMIT_CORE`` is
  pinned at 1 from outside (the kernel's "no core dump, not even to a pipe" value) and seccomp
  refuses any change of it;
* a seccomp filter (x86_64, aarch64): no new namespaces, mounts, eBPF, ptrace…; sockets only of the
  families ``AF_UNIX``, ``AF_INET``, ``AF_INET6`` (others get ``EAFNOSUPPORT``: no netlink uevents,
  no ``AF_VSOCK`` to a VM host); ``memfd_create`` and SysV ``shmget`` are refused unless a per-run
  memory cgroup bounds them;
* one cgroup per run where cgroups can be written (``cgroup.py``): total memory, process count,
  an equal CPU weight, and exact CPU-time accounting for the whole run;
* an unprivileged uid that is not root on the host, so ``RLIMIT_NPROC`` is enforced: as a normal
  user, bwrap makes a user namespace (uid 65534 inside, further user namespaces disabled); as
  root, bwrap runs privileged without a user namespace (a user namespace would map the candidate
  to host root, which the kernel exempts from ``RLIMIT_NPROC``) keeping only CAP_SETUID/CAP_SETGID,
  and the harness drops to a fresh random uid per run before candidate code runs.

Every run: its own session and process group. It is **timed out** when its processes together have
used ``timeout_s`` of CPU time since the harness was ready (so a busy neighbour cannot make a
correct program time out), or when the wall-clock backstop ``wall_timeout_s`` (default
2 x ``timeout_s``) has passed; then the sandbox's PID 1 and the whole process group get SIGKILL and
the call returns only after the namespace is empty. At most ``max_output_bytes`` are read from each
of stdout, stderr and the result channel; more is a kill.

``unsafe_local=True`` runs the harness as a plain subprocess (same rlimits, own session, timeouts,
scrubbed environment, the run's cgroup where available) but WITHOUT namespaces or seccomp: the
candidate can use the network and read whatever a fresh unprivileged uid may read. It needs root
(the candidate runs as a fresh uid, never as the trainer's) and an interpreter that uid can run;
every process of that uid is killed after the run. Only for trusted code or throw-away machines.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import math
import os
import platform
import random
import resource
import secrets
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

try:
    from groupwise.sandbox import cgroup as _cgroup
except ImportError:  # loaded as a loose file next to cgroup.py (the unprivileged-user test does this)
    import cgroup as _cgroup  # type: ignore[no-redef]

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
    """Per-run resource limits (the rlimits apply to every process of the run, each; the cgroup
    limits, where cgroups work, to the whole run)."""

    timeout_s: float = 5.0  # CPU time of the whole run, from harness ready to kill
    memory_mb: int = 512  # RLIMIT_AS per process; and the run's total memory where a memory cgroup works
    max_output_bytes: int = 65536  # per stream: stdout, stderr, result channel
    max_processes: int = 16  # RLIMIT_NPROC (processes and threads of the run's uid); pids.max = this + 2
    scratch_mb: int = 64  # size of the /tmp tmpfs and RLIMIT_FSIZE
    open_files: int = 64  # RLIMIT_NOFILE
    wall_timeout_s: float | None = None  # wall-clock backstop from ready; None: 2 x timeout_s
    scratch_inodes: int = 16384  # inode cap of the scratch tmpfs (where we mount it ourselves: as root)

    @property
    def wall_s(self) -> float:
        return float(self.wall_timeout_s) if self.wall_timeout_s is not None else 2.0 * float(self.timeout_s)

    def rlimits(self) -> dict[str, int]:
        return {
            "RLIMIT_AS": int(self.memory_mb) << 20,
            "RLIMIT_CPU": int(math.ceil(self.timeout_s)) + 1,  # per-process backstop; the run's CPU budget kills first
            "RLIMIT_FSIZE": int(self.scratch_mb) << 20,
            "RLIMIT_NOFILE": int(self.open_files),
            "RLIMIT_NPROC": int(self.max_processes),
            # 1, not 0: the kernel ignores RLIMIT_CORE for a pipe core_pattern except the value 1
            # (fs/coredump.c treats it as "recursive crash, abort"); 1 byte is also too small for a core file
            "RLIMIT_CORE": 1,
        }


@dataclass
class RunResult:
    """What happened in one run. ``ready`` False means no verdict is possible (``infra_error``)."""

    ready: bool = False
    exit_code: int | None = None  # the harness's exit status (negative: killed by that signal)
    timed_out: bool = False
    timeout_kind: str | None = None  # "cpu" (the run's CPU budget) or "wall" (the backstop)
    output_capped: bool = False
    stdout: bytes = b""
    stderr: bytes = b""
    records: list[dict] = field(default_factory=list)  # records after "ready", in order
    malformed: bool = False  # a line on the result channel that is not a record with this run's nonce
    elapsed_s: float = 0.0  # from start to the namespace being empty
    startup_s: float = 0.0  # from start to "ready" (bwrap + interpreter start-up, limits applied)
    run_s: float = 0.0  # from "ready" to the harness exiting or being killed
    cpu_s: float | None = None  # CPU time of all the run's processes after "ready" (None: not measurable)
    cpu_source: str | None = None  # "cgroup-v2", "cgroup-v1", "proc" (a /proc walk: best effort) or None
    oom_kills: int = 0  # processes the run's memory cgroup killed
    infra_error: str | None = None


# --------------------------------------------------------------------------------------- seccomp

# Syscall numbers from the kernel's tables (x86_64: arch/x86/entry/syscalls/syscall_64.tbl; aarch64:
# include/uapi/asm-generic/unistd.h). Denied with EPERM: namespace and mount manipulation, kernel
# keyrings, eBPF, perf, userfaultfd, io_uring, ptrace, module/kexec loading, swap, reboot, syslog,
# acct, quotas, file handles, secret memory. clone3 gets ENOSYS (its flags sit in memory a filter cannot
# read; glibc then falls back to clone, whose flags are checked). clone/unshare are denied only with
# CLONE_NEW*; socket/socketpair only for families outside _FAMILIES (EAFNOSUPPORT); setrlimit/prlimit64
# only when they would change RLIMIT_CORE. memfd_create and shmget are denied when no memory cgroup
# bounds the run (their memory is not counted by RLIMIT_AS).
_DENY = (
    "setns keyctl add_key request_key bpf perf_event_open userfaultfd io_uring_setup io_uring_enter "
    "io_uring_register ptrace mount umount2 pivot_root chroot open_by_handle_at kexec_load kexec_file_load "
    "init_module finit_module delete_module fsopen fsconfig fsmount fspick move_mount open_tree mount_setattr "
    "swapon swapoff reboot syslog acct quotactl memfd_secret"
).split()
_DENY_UNBOUNDED = ("memfd_create", "shmget")
_SYSCALLS = {
    "x86_64": (
        0xC000003E,
        dict(
            clone=56,
            clone3=435,
            unshare=272,
            setns=308,
            keyctl=250,
            add_key=248,
            request_key=249,
            bpf=321,
            perf_event_open=298,
            userfaultfd=323,
            io_uring_setup=425,
            io_uring_enter=426,
            io_uring_register=427,
            ptrace=101,
            mount=165,
            umount2=166,
            pivot_root=155,
            chroot=161,
            open_by_handle_at=304,
            kexec_load=246,
            kexec_file_load=320,
            init_module=175,
            finit_module=313,
            delete_module=176,
            fsopen=430,
            fsconfig=431,
            fsmount=432,
            fspick=433,
            move_mount=429,
            open_tree=428,
            mount_setattr=442,
            swapon=167,
            swapoff=168,
            reboot=169,
            syslog=103,
            acct=163,
            quotactl=179,
            memfd_secret=447,
            memfd_create=319,
            shmget=29,
            socket=41,
            socketpair=53,
            setrlimit=160,
            prlimit64=302,
        ),
    ),
    "aarch64": (
        0xC00000B7,
        dict(
            clone=220,
            clone3=435,
            unshare=97,
            setns=268,
            keyctl=219,
            add_key=217,
            request_key=218,
            bpf=280,
            perf_event_open=241,
            userfaultfd=282,
            io_uring_setup=425,
            io_uring_enter=426,
            io_uring_register=427,
            ptrace=117,
            mount=40,
            umount2=39,
            pivot_root=41,
            chroot=51,
            open_by_handle_at=265,
            kexec_load=104,
            kexec_file_load=294,
            init_module=105,
            finit_module=273,
            delete_module=106,
            fsopen=430,
            fsconfig=431,
            fsmount=432,
            fspick=433,
            move_mount=429,
            open_tree=428,
            mount_setattr=442,
            swapon=224,
            swapoff=225,
            reboot=142,
            syslog=116,
            acct=89,
            quotactl=60,
            memfd_secret=447,
            memfd_create=279,
            shmget=194,
            socket=198,
            socketpair=199,
            setrlimit=164,
            prlimit64=261,
        ),
    ),
}
# NS CGROUP UTS IPC USER PID NET TIME
_CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00000080
# AF_UNIX: asyncio's self-pipe and multiprocessing use socketpair(AF_UNIX); AF_INET/AF_INET6 reach only the
# run's own loopback (new network namespace). Python start-up and the harness create no socket at all.
_FAMILIES = (1, 2, 10)
_RLIMIT_CORE = 4
_EAFNOSUPPORT = 97


def seccomp_filter(machine: str | None = None, *, memory_bounded: bool = False) -> bytes | None:
    """A classic-BPF seccomp program (raw ``struct sock_filter`` array, as ``bwrap --seccomp`` reads it)
    for this machine's architecture, or None where the syscall table is not known here.
    ``memory_bounded``: a per-run memory cgroup counts shared memory, so memfd_create/shmget may stay."""
    table = _SYSCALLS.get(machine or platform.machine())
    if table is None:
        return None
    arch, nr = table
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, JMP|JEQ|K, JMP|JGE|K, JMP|JSET|K, RET|K
    allow, eperm, enosys, kill = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38, 0x80000000
    eafnosupport = 0x00050000 | _EAFNOSUPPORT
    lo = lambda i: 16 + 8 * i  # noqa: E731  (low 32 bits of argument i: little-endian on both ABIs)
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill), (ld, 0, 0, 0)]  # foreign ABI (i386 on x86_64): kill
    if arch == 0xC000003E:
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, eperm)]  # the x32 ABI
    for name in _DENY + (list(_DENY_UNBOUNDED) if not memory_bounded else []):
        prog += [(jeq, 0, 1, nr[name]), (ret, 0, 0, eperm)]
    prog += [(jeq, 0, 1, nr["clone3"]), (ret, 0, 0, enosys)]
    for name in ("clone", "unshare"):  # flags are the first argument of both
        prog += [
            (jeq, 0, 4, nr[name]),
            (ld, 0, 0, lo(0)),
            (jset, 0, 1, _CLONE_NEW),
            (ret, 0, 0, eperm),
            (ret, 0, 0, allow),
        ]
    n = len(_FAMILIES)
    for name in ("socket", "socketpair"):  # the family is the first argument; the i-th test jumps to "allow"
        block = (
            [(ld, 0, 0, lo(0))]
            + [(jeq, n - i, 0, fam) for i, fam in enumerate(_FAMILIES)]
            + [(ret, 0, 0, eafnosupport), (ret, 0, 0, allow)]
        )
        prog += [(jeq, 0, len(block), nr[name])] + block
    # setrlimit(resource, new); prlimit64(pid, resource, new, old): deny changing RLIMIT_CORE (reading is fine)
    prog += [(jeq, 0, 3, nr["setrlimit"]), (ld, 0, 0, lo(0)), (jeq, 0, 1, _RLIMIT_CORE), (ret, 0, 0, eperm)]
    prog += [
        (jeq, 0, 7, nr["prlimit64"]),
        (ld, 0, 0, lo(1)),
        (jeq, 0, 5, _RLIMIT_CORE),
        (ld, 0, 0, lo(2)),
        (jeq, 0, 2, 0),
        (ld, 0, 0, lo(2) + 4),
        (jeq, 1, 0, 0),
        (ret, 0, 0, eperm),
    ]
    prog += [(ret, 0, 0, allow)]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


# --------------------------------------------------------------------------------------- helpers


def _readonly_fd(data: bytes) -> int:
    """A read-only fd holding ``data`` (stdin, config, seccomp program) that nobody can modify: a
    sealed memfd (in user-namespace mode the candidate is the owner of any file we create, so a
    file's permissions would not stop it from reopening the file for writing or growing it on the
    host's disk); an unlinked temporary file where memfds are unavailable."""
    try:
        fd = os.memfd_create("groupwise-sbx", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (AttributeError, OSError):
        fd = -1
    if fd >= 0:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            fcntl.fcntl(
                fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
            )
            return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            os.close(fd)
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


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_ticks(pid: int) -> int | None:
    """utime + stime + cutime + cstime of ``pid`` (its own CPU time and that of the children it reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2 :].split()
        return sum(int(x) for x in fields[11:15])
    except (OSError, ValueError, IndexError):
        return None


def _tree_cpu_ns(root: int) -> int | None:
    """CPU time of ``root`` and all its descendants, walking ``/proc/*/task/*/children`` (best effort:
    a child reaped by a parent that ignores SIGCHLD takes its CPU time with it)."""
    total, seen, stack = 0, set(), [root]
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        ticks = _stat_ticks(pid)
        if ticks is None:
            if pid == root:
                return None
            continue
        total += ticks
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                    stack.extend(int(x) for x in f.read().split())
        except (OSError, ValueError):
            pass
    return total * 1_000_000_000 // _CLK_TCK


def _uid_pids(uid: int, *, live_only: bool = False) -> list[int]:
    """Host pids owned by ``uid`` (unsafe mode: the run's fresh uid)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            if live_only:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
                if stat[stat.rindex(b")") + 2 :][:1] in (b"Z", b"X"):
                    continue
            found.append(int(name))
        except (OSError, ValueError):
            pass
    return found


def _uid_cpu_ns(uid: int) -> int:
    return sum(t for t in map(_stat_ticks, _uid_pids(uid)) if t is not None) * 1_000_000_000 // _CLK_TCK


_KILL_ALL = "import os\ntry:\n    os.kill(-1, 9)\nexcept OSError:\n    pass\n"


class _ScratchMounts:
    """As root: the scratch tmpfs of each run, mounted by us with ``nr_inodes`` (bwrap's ``--tmpfs``
    takes only a size). Mounted under a private directory of ours, bound into the sandbox at /tmp and
    /dev/shm, and detached from the host as soon as the sandbox is set up."""

    _libc = None

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="groupwise-scratch-")
        try:
            self._mount(self.root, self.root, None, 0x1000, None)  # MS_BIND onto itself ...
            self._mount(None, self.root, None, 0x40000, None)  # ... MS_PRIVATE: our mounts propagate nowhere
        except OSError:
            os.rmdir(self.root)
            raise
        weakref.finalize(self, _ScratchMounts._release_root, self.root)

    @classmethod
    def _mount(cls, source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
        if cls._libc is None:
            cls._libc = ctypes.CDLL(None, use_errno=True)
        enc = lambda x: None if x is None else x.encode()  # noqa: E731
        if cls._libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount {target}: {os.strerror(err)}")

    @classmethod
    def _umount(cls, target: str) -> None:
        if cls._libc is None:
            cls._libc = ctypes.CDLL(None, use_errno=True)
        cls._libc.umount2(target.encode(), 2)  # MNT_DETACH

    @staticmethod
    def _release_root(root: str) -> None:
        _ScratchMounts._umount(root)
        try:
            os.rmdir(root)
        except OSError:
            pass

    def new(self, size_bytes: int, inodes: int) -> str:
        path = os.path.join(self.root, "run-" + secrets.token_hex(6))
        os.mkdir(path, 0o700)
        try:
            # NOSUID NODEV
            self._mount("tmpfs", path, "tmpfs", 0x2 | 0x4, f"size={size_bytes},nr_inodes={inodes},mode=1777")
        except OSError:
            os.rmdir(path)
            raise
        return path

    def release(self, path: str) -> None:
        self._umount(path)
        try:
            os.rmdir(path)
        except OSError:
            pass


_SCRATCH: list = []  # [] not tried yet; [None] unavailable; [_ScratchMounts]
_SCRATCH_LOCK = threading.Lock()


def _scratch_mounts() -> _ScratchMounts | None:
    with _SCRATCH_LOCK:
        if not _SCRATCH:
            try:
                _SCRATCH.append(_ScratchMounts())
            except OSError:
                _SCRATCH.append(None)
        return _SCRATCH[0]


_HELP: dict[str, str] = {}  # bwrap path -> its --help text (which options this version has)


def _bwrap_help(bwrap: str) -> str:
    if bwrap not in _HELP:
        try:
            out = subprocess.run(
                [bwrap, "--help"], capture_output=True, timeout=10, env=dict(SANDBOX_ENV), stdin=subprocess.DEVNULL
            )
            _HELP[bwrap] = (out.stdout + out.stderr).decode(errors="replace")
        except (OSError, subprocess.SubprocessError):
            return ""
    return _HELP[bwrap]


_PROBED: dict[tuple, str | None] = {}  # (bwrap, python, root?) -> None (works) or the error text
_PROBE_LOCK = threading.Lock()


# --------------------------------------------------------------------------------------- sandbox


class Sandbox:
    """Runs single test cases of untrusted code; thread-safe (each run is independent).

    ``cgroup``: "auto" (per-run cgroups wherever this process may create them), "off" (none: the
    fallbacks of docs/sandbox.md), or the path of a cgroup v2 directory delegated to us."""

    def __init__(
        self, *, unsafe_local: bool = False, bwrap: str | None = None, python: str | None = None, cgroup: str = "auto"
    ) -> None:
        self.unsafe_local = bool(unsafe_local)
        self.python = os.path.realpath(python or sys.executable)
        self.root = os.geteuid() == 0
        self.bwrap = (
            None
            if self.unsafe_local
            else (bwrap or shutil.which("bwrap") or shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin"))
        )
        self.cgroup_spec = cgroup
        self._cg = _cgroup.discover(cgroup)
        self._flags = ""
        self._harness_dir: str | None = None
        self._ncpu = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
        if self.unsafe_local:
            # a private copy: run from the package directory, the harness would see ``rewards/math.py`` as ``math``
            self._harness_dir = tempfile.mkdtemp(prefix="groupwise-harness-")
            os.chmod(self._harness_dir, 0o755)
            shutil.copyfile(HARNESS_FILE, os.path.join(self._harness_dir, "harness.py"))
            os.chmod(os.path.join(self._harness_dir, "harness.py"), 0o644)
            weakref.finalize(self, shutil.rmtree, self._harness_dir, True)

    def features(self) -> dict[str, object]:
        """What bounds each run here (for logs, tests and docs/sandbox.md)."""
        roles = self._cg.describe() if self._cg is not None else dict.fromkeys(_cgroup.ROLES)
        scratch = None if (self.unsafe_local or not self.root) else _scratch_mounts()
        return {
            "memory_cgroup": roles["memory"],
            "pids_cgroup": roles["pids"],
            "cpu_weight_cgroup": roles["cpu"],
            "cpu_time": roles["acct"] or "proc",
            "memfd_shmget": "allowed (bounded by the memory cgroup)"
            if roles["memory"]
            else ("allowed (unsafe mode: no seccomp)" if self.unsafe_local else "denied"),
            "scratch_inode_cap": scratch is not None,
        }

    # ---------------------------------------------------------------- availability

    def check(self) -> None:
        """Fail closed: raise :class:`SandboxUnavailable` unless a trivial program runs and reports back."""
        if self.unsafe_local:
            self._check_unsafe()
            return
        if not self.bwrap:
            raise SandboxUnavailable(f"bubblewrap (`bwrap`) was not found on PATH. {INSTALL_HELP}")
        key = (self.bwrap, self.python, self.root, self.cgroup_spec)
        with _PROBE_LOCK:
            if key not in _PROBED:
                _PROBED[key] = self._probe()
            error = _PROBED[key]
        if error is not None:
            raise SandboxUnavailable(f"bubblewrap ({self.bwrap}) cannot start a sandbox here: {error}. {INSTALL_HELP}")

    def _check_unsafe(self) -> None:
        """Unsafe mode never runs a candidate as the trainer's uid (it could read the dataset and,
        as root, the trainer's memory): it needs root, to switch to a fresh uid per run, and an
        interpreter that such a uid may execute."""
        if not self.root:
            raise SandboxUnavailable(
                "unsafe_local=True runs each candidate as a fresh unprivileged uid, which needs "
                f"root; as uid {os.geteuid()} the candidates would run as you, with your files "
                "(the dataset and its expected answers) and your processes within reach, so it "
                "is refused. Install bubblewrap instead (see docs/sandbox.md), or run as root."
            )
        try:
            subprocess.run(
                [self.python, "-s", "-B", "-c", "pass"],
                user=SANDBOX_UID,
                group=SANDBOX_UID,
                extra_groups=[],
                env=dict(SANDBOX_ENV),
                cwd="/",
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=STARTUP_TIMEOUT_S,
                check=True,
            )
        except (OSError, subprocess.SubprocessError) as err:
            raise SandboxUnavailable(
                "unsafe_local=True: an unprivileged uid cannot run the "
                f"interpreter {self.python} ({type(err).__name__}; typically a "
                "directory above it, such as /root, is closed to other "
                "users), and candidates are never run as root. Give an "
                "interpreter every user may execute (the code reward's "
                '`python` option, e.g. python = "/usr/bin/python3"), '
                "or install bubblewrap."
            ) from err

    def _probe(self) -> str | None:
        self._flags = _bwrap_help(self.bwrap or "bwrap")
        if "--unshare-all" not in self._flags:
            return f"`{self.bwrap} --help` did not run or is not bubblewrap"
        if "--block-fd" not in self._flags or "--info-fd" not in self._flags:
            return f"`{self.bwrap}` is too old (no --block-fd/--info-fd)"
        res = self.run(
            code="def f():\n    return 41 + 1\n", mode="call", call="f()", limits=Limits(timeout_s=STARTUP_TIMEOUT_S)
        )
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

    def _bwrap_argv(
        self,
        limits: Limits,
        info_fd: int,
        cfg_fd: int,
        res_fd: int,
        seccomp_fd: int,
        block_fd: int = -1,
        scratch: str | None = None,
    ) -> list[str]:
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
        a += [
            "--ro-bind-try",
            "/etc/ld.so.cache",
            "/etc/ld.so.cache",
            "--ro-bind-try",
            "/etc/alternatives",
            "/etc/alternatives",
        ]
        if os.path.isdir("/nix/store"):  # a Nix interpreter's libraries live there, outside its prefix
            a += ["--ro-bind", "/nix/store", "/nix/store"]
            bound.append("/nix/store")
        # scratch: our own inode-capped tmpfs (root) bound at /tmp and /dev/shm, else two bwrap tmpfs
        a += ["--bind", scratch, "/tmp"] if scratch else [*perms("1777"), *size, "--tmpfs", "/tmp"]
        own = os.path.realpath(sys.executable) == self.python
        prefix = os.path.realpath(sys.base_prefix) if own else os.path.dirname(os.path.dirname(self.python))
        for path in sorted({prefix, os.path.dirname(self.python)}, key=len):
            if any(path == b or path.startswith(b + "/") for b in bound):
                continue
            parts = path.strip("/").split("/")
            for i in range(1, len(parts)):
                a += [*perms("0755"), "--dir", "/" + "/".join(parts[:i])]
            a += ["--ro-bind", path, path]
            bound.append(path)
        a += [*perms("0755"), "--dir", "/opt", *perms("0755"), "--dir", "/opt/groupwise"]
        a += ["--ro-bind", HARNESS_FILE, HARNESS_IN_SANDBOX]
        a += ["--proc", "/proc", "--dev", "/dev"]
        a += ["--bind", scratch, "/dev/shm"] if scratch else [*perms("1777"), *size, "--tmpfs", "/dev/shm"]
        a += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp", "--info-fd", str(info_fd)]
        if block_fd >= 0:  # PID 1 waits here, before it forks the harness, until it is in the run's cgroup
            a += ["--block-fd", str(block_fd)]
        if seccomp_fd >= 0:
            a += ["--seccomp", str(seccomp_fd)]
        a += ["--", self.python, "-s", "-B", HARNESS_IN_SANDBOX, str(cfg_fd), str(res_fd)]
        return a

    # ---------------------------------------------------------------- one run

    def run(
        self, *, code: str, mode: str, call: str | None = None, stdin: bytes = b"", limits: Limits = Limits()
    ) -> RunResult:
        """Run one test case: ``mode="stdio"`` (``code`` as a program reading ``stdin``) or
        ``mode="call"`` (define ``code``, evaluate the expression ``call``, report its value)."""
        if mode not in ("stdio", "call"):
            raise ValueError(f"mode must be 'stdio' or 'call', got {mode!r}")
        if self.unsafe_local and not self.root:  # never as the trainer's uid (check() says why)
            return RunResult(infra_error="unsafe_local=True needs root (see Sandbox.check)")
        nonce = secrets.token_hex(16)
        uid = _fresh_uid() if self.root else None
        t0 = time.monotonic()
        fds: list[int] = []
        cg = scratch = None
        try:
            if self._cg is not None:
                try:
                    cg = self._cg.new_run(
                        memory_bytes=int(limits.memory_mb) << 20, max_pids=int(limits.max_processes) + 2
                    )
                except OSError:
                    cg = None  # this run gets the fallbacks (memfd/shmget denied, /proc CPU accounting)
            if self.root and not self.unsafe_local and (mounts := _scratch_mounts()) is not None:
                try:
                    scratch = (mounts, mounts.new(int(limits.scratch_mb) << 20, int(limits.scratch_inodes)))
                except OSError:
                    scratch = None  # bwrap's own tmpfs: size cap only
            return self._run(code, mode, call, stdin, limits, uid, nonce, t0, fds, cg, scratch)
        except OSError as err:  # no fds, no memory for the input, ...: the parent's problem, not the candidate's
            return RunResult(
                infra_error=f"could not set up the run: {type(err).__name__}: {err}", elapsed_s=time.monotonic() - t0
            )
        finally:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            if scratch is not None:
                scratch[0].release(scratch[1])
            if cg is not None:
                cg.remove()

    def _run(
        self,
        code: str,
        mode: str,
        call: str | None,
        stdin: bytes,
        limits: Limits,
        uid: int | None,
        nonce: str,
        t0: float,
        fds: list[int],
        cg: _cgroup.RunCgroup | None,
        scratch: tuple | None,
    ) -> RunResult:
        workdir = None
        try:
            res_r, res_w = os.pipe()
            fds += [res_r, res_w]
            go_r = go_w = info_r = info_w = seccomp_fd = -1
            if cg is not None:  # the first process waits on this pipe until it is in the run's cgroup
                go_r, go_w = os.pipe()
                fds += [go_r, go_w]
            cfg = {
                "nonce": nonce,
                "mode": mode,
                "code": code,
                "call": call,
                "rlimits": limits.rlimits(),
                # sandbox + root: the harness starts as root inside and drops itself; unsafe: Popen drops
                "switch_uid": uid if not self.unsafe_local else None,
                "go_fd": go_r if (self.unsafe_local and go_r >= 0) else None,
            }
            cfg_fd = _readonly_fd(json.dumps(cfg).encode())
            fds.append(cfg_fd)
            in_fd = _readonly_fd(stdin) if stdin else os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            fds.append(in_fd)
            popen_kw: dict = {}
            if self.unsafe_local:
                assert uid is not None
                workdir = tempfile.mkdtemp(prefix="groupwise-scratch-")
                os.chown(workdir, uid, uid)
                popen_kw = {"user": uid, "group": uid, "extra_groups": []}
                env = {**SANDBOX_ENV, "HOME": workdir, "TMPDIR": workdir}
                harness = os.path.join(self._harness_dir or "", "harness.py")
                argv = [self.python, "-s", "-B", harness, str(cfg_fd), str(res_w)]
                pass_fds: tuple[int, ...] = (cfg_fd, res_w) + ((go_r,) if go_r >= 0 else ())
            else:
                info_r, info_w = os.pipe()
                fds += [info_r, info_w]
                if go_r < 0:  # no cgroup: PID 1 still waits, for its RLIMIT_CORE
                    go_r, go_w = os.pipe()
                    fds += [go_r, go_w]
                bpf = seccomp_filter(memory_bounded=cg is not None and "memory" in cg.roles)
                if bpf is not None:
                    seccomp_fd = _readonly_fd(bpf)
                    fds.append(seccomp_fd)
                env = dict(SANDBOX_ENV)
                argv = self._bwrap_argv(
                    limits, info_w, cfg_fd, res_w, seccomp_fd, go_r, scratch[1] if scratch else None
                )
                pass_fds = (cfg_fd, res_w, info_w, go_r) + ((seccomp_fd,) if seccomp_fd >= 0 else ())
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=in_fd,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=pass_fds,
                    start_new_session=True,
                    env=env,
                    cwd=workdir or "/",
                    close_fds=True,
                    **popen_kw,
                )
            except OSError as err:
                return RunResult(infra_error=f"could not start {argv[0]}: {err}", elapsed_s=time.monotonic() - t0)
            for fd in (cfg_fd, in_fd, res_w, info_w, seccomp_fd, go_r):  # the child holds its own copies
                if fd >= 0:
                    os.close(fd)
                    fds.remove(fd)
            if go_w >= 0:
                fds.remove(go_w)  # the supervisor owns it now
            sup = _Supervisor(
                proc,
                nonce,
                limits,
                res_r,
                info_r,
                go_w=go_w,
                cg=cg,
                ncpu=self._ncpu,
                unsafe_uid=uid if self.unsafe_local else None,
                python=self.python,
                on_ready=(lambda: scratch[0].release(scratch[1])) if scratch else None,
            )
            result = sup.run()
            result.elapsed_s = time.monotonic() - t0
            return result
        finally:
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)


class _Supervisor:
    """Reads one run's pipes under the caps, lets the run start once it is in its cgroup, enforces
    the CPU budget and the wall-clock backstop, kills and reaps everything."""

    def __init__(
        self,
        proc: subprocess.Popen,
        nonce: str,
        limits: Limits,
        res_r: int,
        info_r: int,
        *,
        go_w: int,
        cg: _cgroup.RunCgroup | None,
        ncpu: int,
        unsafe_uid: int | None,
        python: str,
        on_ready=None,
    ) -> None:
        self.proc, self.nonce, self.limits = proc, nonce, limits
        self.unsafe = unsafe_uid is not None
        self.unsafe_uid, self.python = unsafe_uid, python
        self.go_w, self.cg, self.ncpu, self.on_ready = go_w, cg, ncpu, on_ready
        assert proc.stdout is not None and proc.stderr is not None
        self.streams: dict[int, str] = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", res_r: "result"}
        if info_r >= 0:
            self.streams[info_r] = "info"
        self.buf: dict[str, bytearray] = {name: bytearray() for name in self.streams.values()}
        self.cap = {
            "stdout": limits.max_output_bytes,
            "stderr": limits.max_output_bytes,
            "result": limits.max_output_bytes,
            "info": 1 << 16,
        }
        self.open: set[int] = set(self.streams)
        self.capped = False
        self.ready_at: float | None = None
        self.pid1: int | None = None
        self.pid1_fd: int | None = None
        self.proc_fd: int | None = None
        self.setup_error: str | None = None
        self.cpu0: int | None = None  # CPU time (ns) at "ready"
        self.cpu_last: int | None = None
        self.cpu_source: str | None = None
        if self.unsafe and go_w >= 0:  # the harness waits for this byte before it applies its limits
            self._start(proc.pid)

    def _start(self, pid: int) -> None:
        """The run's first process (the sandbox's PID 1, blocked by bwrap; or the unsafe harness,
        blocked on its go fd) joins the cgroup and gets RLIMIT_CORE = 1, then may go on."""
        try:
            if not self.unsafe:
                resource.prlimit(pid, resource.RLIMIT_CORE, (1, 1))
            if self.cg is not None:
                self.cg.join(pid)
            os.write(self.go_w, b"1")
        except OSError as err:
            self.setup_error = f"could not place the run in its cgroup / set its limits: {err}"
        finally:
            os.close(self.go_w)
            self.go_w = -1

    # -------------------------------------------------------------- CPU time

    def _cpu_ns(self) -> int | None:
        if self.cg is not None and "acct" in self.cg.roles:
            value = self.cg.cpu_ns()
            self.cpu_source = "cgroup-" + self.cg.dirs["acct"][1]
        elif self.unsafe:
            value = _uid_cpu_ns(self.unsafe_uid)  # type: ignore[arg-type]
            self.cpu_source = "proc"
        elif self.pid1 is not None:
            value = _tree_cpu_ns(self.pid1)
            self.cpu_source = "proc"
        else:
            value = None
        if value is not None:
            self.cpu_last = value
        return value

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
            if self.go_w >= 0:
                self._start(pid)
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
        budget = int(self.limits.timeout_s * 1e9)  # ns of CPU time for the whole run
        next_cpu = 0.0
        kill = False
        finished = False
        try:
            while True:
                now = time.monotonic()
                if self.ready_at is not None and self.cpu0 is None:
                    self.cpu0 = self._cpu_ns()
                    if self.cpu0 is None:
                        self.cpu0 = -1  # not measurable here: the wall clock alone decides, at timeout_s
                    if self.on_ready is not None:  # the sandbox is set up: its scratch mount may leave the host
                        self.on_ready()
                        self.on_ready = None
                if self.ready_at is None:
                    deadline = start + STARTUP_TIMEOUT_S
                else:
                    deadline = self.ready_at + (self.limits.wall_s if self.cpu0 >= 0 else self.limits.timeout_s)
                if now >= deadline:
                    res.timed_out = self.ready_at is not None
                    res.timeout_kind = "wall" if res.timed_out else None
                    if self.ready_at is None:
                        res.infra_error = f"the sandbox was not ready after {STARTUP_TIMEOUT_S:.0f} s"
                    kill = True
                    break
                if self.setup_error is not None:
                    res.infra_error = self.setup_error
                    kill = True
                    break
                if self.capped:
                    kill = True
                    break
                if self._exited():
                    break
                wait = deadline - now
                if self.ready_at is not None and self.cpu0 >= 0:
                    if now >= next_cpu:
                        used = (self._cpu_ns() or self.cpu_last or self.cpu0) - self.cpu0
                        if used >= budget:
                            res.timed_out, res.timeout_kind = True, "cpu"
                            kill = True
                            break
                        # the run cannot use more than ncpu seconds of CPU per second: look again before it could
                        next_cpu = now + min(0.1, max(0.005, (budget - used) / 1e9 / self.ncpu))
                    wait = min(wait, max(0.0, next_cpu - now))
                if self.proc_fd is None:
                    wait = min(wait, 0.02)
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
            if self.go_w >= 0:
                os.close(self.go_w)
                self.go_w = -1
            sel.close()
            for fd in (self.pid1_fd, self.proc_fd):
                if fd is not None:
                    os.close(fd)
            for stream in (self.proc.stdout, self.proc.stderr):
                if stream is not None:
                    stream.close()
        if self.cpu0 is not None and self.cpu0 >= 0:
            if self.cg is not None and "acct" in self.cg.roles:
                self._cpu_ns()  # exact, now that every process of the run is gone
            res.cpu_s = max(0, (self.cpu_last or self.cpu0) - self.cpu0) / 1e9
            res.cpu_source = self.cpu_source
            if not res.timed_out and res.cpu_s * 1e9 >= budget:  # finished between two looks, over budget
                res.timed_out, res.timeout_kind = True, "cpu"
        if self.cg is not None:
            res.oom_kills = self.cg.oom_kills()
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
        if self.unsafe:
            self._kill_uid()
        elif kill and self.cg is not None:
            self.cg.kill()  # v2: cgroup.kill; PID 1's death has normally emptied it already
        self.proc.wait()
        if self.pid1_fd is not None:  # killed bwrap before it reaped PID 1: wait for the namespace to empty
            sel = selectors.DefaultSelector()
            sel.register(self.pid1_fd, selectors.EVENT_READ)
            sel.select(timeout=KILL_GRACE_S)
            sel.close()

    def _kill_uid(self) -> None:
        """Unsafe mode: kill every process of the run's uid, including daemons that left the process
        group. ``kill(-1, SIGKILL)`` sent AS that uid reaches all of its processes at once (a fork in
        progress fails), so nothing can slip away between a scan and a kill."""
        uid = self.unsafe_uid
        if uid is None:
            return
        limit = time.monotonic() + KILL_GRACE_S
        while True:  # always at least once: a scan of /proc alone can miss a process that is forking
            try:
                subprocess.run(
                    [self.python, "-S", "-I", "-c", _KILL_ALL],
                    user=uid,
                    group=uid,
                    extra_groups=[],
                    env={},
                    cwd="/",
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=KILL_GRACE_S,
                )
            except (OSError, subprocess.SubprocessError):
                for pid in _uid_pids(uid, live_only=True):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            for _ in range(10):  # SIGKILLed processes need a moment to die
                if not _uid_pids(uid, live_only=True) or time.monotonic() > limit:
                    return
                time.sleep(0.005)

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
                res.infra_error = (
                    f"the sandbox exited ({self.proc.returncode}) before the harness was ready: {tail or 'no output'}"
                )
