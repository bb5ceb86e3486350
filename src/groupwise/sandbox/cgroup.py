"""Per-run control groups for the sandbox (used by ``bwrap.py``): one cgroup per test case, so that
a run's memory (RAM, shared memory, tmpfs pages, kernel memory; no swap), process count and CPU
share are bounded for the run as a whole, and its CPU time is measured exactly.

Each *role* is served by whichever hierarchy offers it here:

* ``acct``   — membership, CPU-time accounting and kill: cgroup v2 (``cpu.stat`` and ``cgroup.kill``
  exist in every v2 cgroup, with or without controllers), else v1 ``cpuacct``;
* ``memory`` — v2 ``memory.max`` + ``memory.swap.max = 0`` + ``memory.oom.group``, else v1
  ``memory.limit_in_bytes`` + ``memory.memsw.limit_in_bytes``;
* ``pids``   — v2 or v1 ``pids.max``;
* ``cpu``    — v2 ``cpu`` or v1 ``cpu``: every run is a sibling with the default (equal) weight.

A hybrid machine (v1 controllers plus an empty v2 hierarchy) gets v2 accounting and v1 limits.
Cgroup v2 only lets a cgroup enable controllers for its children while it holds no processes, and
the trainer's own cgroup holds the trainer, so v2 limits are found automatically only where that
works (``+memory`` into our cgroup's ``cgroup.subtree_control`` succeeds) or in a directory named
explicitly (``cgroup="/sys/fs/cgroup/<delegated>"``). Nothing here is trusted input: the candidate
never sees ``/sys/fs/cgroup`` (it is not mounted in the sandbox).

All run cgroups live under ``<parent>/groupwise-<pid>/``; they are removed after each run, the
parent directory at exit (stale ones of dead trainers are removed when found empty).
"""

from __future__ import annotations

import atexit
import os
import secrets
import threading
import time

ROLES = ("acct", "memory", "pids", "cpu")
_V1_CONTROLLER = {"acct": "cpuacct", "memory": "memory", "pids": "pids", "cpu": "cpu"}


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _mounts() -> tuple[tuple[str, str] | None, dict[str, tuple[str, str]]]:
    """(v2 mount point, its root) and {v1 controller: (mount point, root)} from mountinfo."""
    v2 = None
    v1: dict[str, tuple[str, str]] = {}
    try:
        lines = _read("/proc/self/mountinfo").splitlines()
    except OSError:
        return None, {}
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, extra = left.split(), right.split()
        if len(fields) < 5 or len(extra) < 3:
            continue
        root, point = fields[3], fields[4].replace("\\040", " ")
        if extra[0] == "cgroup2" and v2 is None:
            v2 = (point, root)
        elif extra[0] == "cgroup":
            for opt in extra[2].split(","):
                v1.setdefault(opt, (point, root))
    return v2, v1


def _own_paths() -> tuple[str | None, dict[str, str]]:
    """This process's cgroup path in v2 and in each v1 hierarchy (from /proc/self/cgroup)."""
    v2, v1 = None, {}
    try:
        lines = _read("/proc/self/cgroup").splitlines()
    except OSError:
        return None, {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        for ctrl in parts[1].split(","):
            if ctrl:
                v1[ctrl] = parts[2]
    return v2, v1


def _dir(mount: tuple[str, str], path: str) -> str:
    point, root = mount
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    return os.path.join(point, path.lstrip("/"))


def _sweep_stale(parent: str) -> None:
    """Remove empty ``groupwise-<pid>`` trees left by trainers that no longer run."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not name.startswith("groupwise-") or not name[10:].isdigit() or os.path.exists(f"/proc/{name[10:]}"):
            continue
        base = os.path.join(parent, name)
        try:
            for child in os.listdir(base):
                if os.path.isdir(os.path.join(base, child)):
                    os.rmdir(os.path.join(base, child))
            os.rmdir(base)
        except OSError:
            pass


class Hierarchy:
    """Where each role's run cgroups are created (``bases[role]``); found once per process."""

    def __init__(self, bases: dict[str, tuple[str, str]]) -> None:
        self.bases = bases  # role -> (base dir, "v1" | "v2")
        self.owner = os.getpid()  # a forked child inherits this object but must not remove our directories
        self._lock = threading.Lock()
        self._pending: list[str] = []  # run dirs that were still busy at removal; retried later

    def describe(self) -> dict[str, str | None]:
        return {role: (f"cgroup-{self.bases[role][1]}" if role in self.bases else None) for role in ROLES}

    def new_run(self, *, memory_bytes: int, max_pids: int) -> RunCgroup:
        self.retry_pending()
        try:
            return RunCgroup(self, memory_bytes=memory_bytes, max_pids=max_pids)
        except FileNotFoundError:  # our base was removed (e.g. as "stale" by a trainer in another PID namespace)
            for base, kind in set(self.bases.values()):
                os.makedirs(base, exist_ok=True)
                if kind == "v2":
                    for role in ("memory", "pids", "cpu"):
                        if self.bases.get(role, (None,))[0] == base:
                            _write(os.path.join(base, "cgroup.subtree_control"), f"+{role}")
            return RunCgroup(self, memory_bytes=memory_bytes, max_pids=max_pids)

    def defer(self, path: str) -> None:
        with self._lock:
            self._pending.append(path)

    def retry_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for path in pending:
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError:
                with self._lock:
                    self._pending.append(path)

    def close(self) -> None:
        if os.getpid() != self.owner:
            return
        self.retry_pending()
        for base in {b for b, _ in self.bases.values()}:
            try:
                os.rmdir(base)
            except OSError:
                pass


def _try_base(parent: str, kind: str, wanted: list[str]) -> tuple[str, list[str]] | None:
    """Create ``parent/groupwise-<pid>`` and return (it, the roles it can serve), or None."""
    _sweep_stale(parent)
    base = os.path.join(parent, f"groupwise-{os.getpid()}")
    try:
        os.makedirs(base, exist_ok=True)
    except OSError:
        return None
    if kind == "v1":
        return base, wanted
    roles = ["acct"] if "acct" in wanted else []
    try:
        available = _read(os.path.join(base, "cgroup.controllers")).split()
    except OSError:
        available = []
    for role in ("memory", "pids", "cpu"):
        if role in wanted and role in available:
            try:
                _write(os.path.join(base, "cgroup.subtree_control"), f"+{role}")
                roles.append(role)
            except OSError:
                pass
    return base, roles


def _probe(base: str, kind: str, roles: list[str]) -> list[str]:
    """The roles that really work: create a throw-away child and write each role's limit."""
    child = os.path.join(base, f"probe-{secrets.token_hex(4)}")
    try:
        os.mkdir(child)
    except OSError:
        return []
    ok = []
    try:
        for role in roles:
            try:
                if role == "acct":
                    _read(os.path.join(child, "cpu.stat" if kind == "v2" else "cpuacct.usage"))
                elif role == "memory":
                    _write(
                        os.path.join(child, "memory.max" if kind == "v2" else "memory.limit_in_bytes"), str(256 << 20)
                    )
                elif role == "pids":
                    _write(os.path.join(child, "pids.max"), "64")
                elif role == "cpu":
                    _read(os.path.join(child, "cpu.weight" if kind == "v2" else "cpu.shares"))
                ok.append(role)
            except OSError:
                pass
    finally:
        try:
            os.rmdir(child)
        except OSError:
            pass
    return ok


_FOUND: dict[str, Hierarchy | None] = {}
_FOUND_LOCK = threading.Lock()


def discover(spec: str = "auto") -> Hierarchy | None:
    """The usable hierarchy for ``spec`` ("auto", "off", or a v2 directory we may create children
    in), cached per process; None when no role works (the sandbox then uses its fallbacks)."""
    if spec == "off":
        return None
    with _FOUND_LOCK:
        if spec not in _FOUND:
            _FOUND[spec] = _discover(spec)
            if _FOUND[spec] is not None:
                atexit.register(_FOUND[spec].close)
        return _FOUND[spec]


def _discover(spec: str) -> Hierarchy | None:
    v2_mount, v1_mounts = _mounts()
    v2_own, v1_own = _own_paths()
    bases: dict[str, tuple[str, str]] = {}
    v2_parent = None
    if spec != "auto":
        v2_parent = spec if os.path.isfile(os.path.join(spec, "cgroup.controllers")) else None
    elif v2_mount is not None and v2_own is not None:
        v2_parent = _dir(v2_mount, v2_own)
        for role in ("memory", "pids", "cpu"):  # works only where our own cgroup holds no processes
            try:
                _write(os.path.join(v2_parent, "cgroup.subtree_control"), f"+{role}")
            except OSError:
                pass
    if v2_parent is not None and os.path.isdir(v2_parent):
        found = _try_base(v2_parent, "v2", list(ROLES))
        if found is not None:
            base, roles = found
            for role in _probe(base, "v2", roles):
                bases[role] = (base, "v2")
            if not bases:
                try:
                    os.rmdir(base)
                except OSError:
                    pass
    for role in ROLES:
        ctrl = _V1_CONTROLLER[role]
        if role in bases or ctrl not in v1_mounts or ctrl not in v1_own:
            continue
        parent = _dir(v1_mounts[ctrl], v1_own[ctrl])
        if not os.path.isdir(parent):
            continue
        found = _try_base(parent, "v1", [role])
        if found is not None and _probe(found[0], "v1", [role]):
            bases[role] = (found[0], "v1")
        elif found is not None and found[0] not in {b for b, _ in bases.values()}:
            try:
                os.rmdir(found[0])
            except OSError:
                pass
    return Hierarchy(bases) if bases else None


class RunCgroup:
    """The cgroup(s) of ONE run. Create before starting it, :meth:`join` its first process before
    that process forks, :meth:`remove` after every process of it is gone."""

    def __init__(self, hier: Hierarchy, *, memory_bytes: int, max_pids: int) -> None:
        self.hier = hier
        self.name = f"run-{secrets.token_hex(6)}"
        self.dirs: dict[str, tuple[str, str]] = {}  # role -> (run dir, kind)
        made: dict[str, str] = {}  # base -> run dir (v1 controllers may share a mount)
        try:
            for role, (base, kind) in hier.bases.items():
                if base not in made:
                    path = os.path.join(base, self.name)
                    os.mkdir(path)
                    made[base] = path
                self.dirs[role] = (made[base], kind)
            if "memory" in self.dirs:
                path, kind = self.dirs["memory"]
                if kind == "v2":
                    _write(os.path.join(path, "memory.max"), str(memory_bytes))
                    for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                        if os.path.exists(os.path.join(path, name)):
                            _write(os.path.join(path, name), value)
                else:
                    _write(os.path.join(path, "memory.limit_in_bytes"), str(memory_bytes))
                    if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
                        _write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(memory_bytes))
            if "pids" in self.dirs:
                _write(os.path.join(self.dirs["pids"][0], "pids.max"), str(max_pids))
        except OSError:
            self.remove()
            raise

    @property
    def roles(self) -> set[str]:
        return set(self.dirs)

    def join(self, pid: int) -> None:
        """Move ``pid`` into every run cgroup (raises OSError if any move fails)."""
        for path in {p for p, _ in self.dirs.values()}:
            _write(os.path.join(path, "cgroup.procs"), str(pid))

    def cpu_ns(self) -> int | None:
        """CPU time used by every process that was ever in the run (ns), or None."""
        if "acct" not in self.dirs:
            return None
        path, kind = self.dirs["acct"]
        try:
            if kind == "v2":
                for line in _read(os.path.join(path, "cpu.stat")).splitlines():
                    if line.startswith("usage_usec "):
                        return int(line.split()[1]) * 1000
                return None
            return int(_read(os.path.join(path, "cpuacct.usage")).strip())
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        if "memory" not in self.dirs:
            return 0
        path, kind = self.dirs["memory"]
        try:
            text = _read(os.path.join(path, "memory.events" if kind == "v2" else "memory.oom_control"))
        except OSError:
            return 0
        for line in text.splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def pids(self) -> list[int]:
        out: set[int] = set()
        for path in {p for p, _ in self.dirs.values()}:
            try:
                out.update(int(x) for x in _read(os.path.join(path, "cgroup.procs")).split())
            except (OSError, ValueError):
                pass
        return sorted(out)

    def kill(self) -> None:
        """SIGKILL everything in the run (v2 ``cgroup.kill`` is atomic against forks; the v1
        loop is not, which is why the sandbox kills by PID namespace or uid first)."""
        for path, kind in self.dirs.values():
            if kind == "v2" and os.path.exists(os.path.join(path, "cgroup.kill")):
                try:
                    _write(os.path.join(path, "cgroup.kill"), "1")
                except OSError:
                    pass
        for _ in range(50):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
            time.sleep(0.002)

    def remove(self) -> None:
        """rmdir the run's cgroups; one still busy (a task still exiting) is retried later."""
        for path in {p for p, _ in self.dirs.values()} | {
            os.path.join(b, self.name) for b, _ in self.hier.bases.values()
        }:
            for attempt in range(20):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if attempt == 19:
                        self.hier.defer(path)
                    else:
                        time.sleep(0.005)
        self.dirs = {}
