"""Kills at named writes of a run, for the kill-and-resume tests (test code, not part of groupwise).

``python tests/killpoints.py POINT ARGS...`` runs ``groupwise ARGS...`` with POINT armed: the
process SIGKILLs itself at that write, leaving the disk as a kill there leaves it. In-process,
``arm(point, die, setattr)`` does the same with ``die`` raising (the fast tests; ``setattr`` is
``monkeypatch.setattr``). A point is ``WHAT:WHEN[#N]`` (``#N``: the N-th matching write, default 1):

- ``checkpoint:before_marker`` / ``before_rename`` / ``before_prune`` / ``after``: inside (or just
  after) the run's final checkpoint save (the one whose summary says finished);
- ``final:K``: inside the K-th file (by name) of ``final/``'s staging folder: the files before it
  whole, it half written, none after; ``final:published``: ``final/`` swapped in, nothing after;
- ``NAME:before`` / ``torn`` / ``after`` for a file written by ``runfolder.write_atomic`` (``summary.json``,
  ``FINISHED``, ``sft.pt``, ``sft.sha256``, ``run.json`` ...) or ``reward.png``: before the write,
  its temporary file half written, or once it is in place;
- ``compare:child``: a ``groupwise compare`` killed while its training child is running (after
  the child's first logged step); the child's pid is written to ``$KILLPOINTS_PIDFILE``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHECKPOINT_WHENS = ("before_marker", "before_rename", "before_prune", "after")


def sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def parse(point: str) -> tuple[str, str, int]:
    head, _, nth = point.partition("#")
    what, _, when = head.rpartition(":")
    return what, when, int(nth or 1)


def arm(point: str, die: Callable[[], None], setattr: Callable[[Any, str, Any], None] = setattr) -> None:
    from groupwise import checkpoint, run, runfolder

    what, when, nth = parse(point)
    seen = {"n": 0}

    def hit() -> bool:
        seen["n"] += 1
        return seen["n"] == nth

    if what == "checkpoint":
        real_save, real_fault, final = checkpoint.save, checkpoint._fault, {"on": False}

        def save(run_dir, step, state, keep_last=2):
            final["on"] = bool(state.get("summary", {}).get("finished"))
            path = real_save(run_dir, step, state, keep_last)
            if final["on"] and when == "after":
                die()
            return path

        setattr(checkpoint, "save", save)
        setattr(checkpoint, "_fault", lambda p: die() if final["on"] and p == f"checkpoint.{when}" else real_fault(p))
    elif what == "final":
        real_publish = runfolder.publish_dir

        def publish(tmp, target):
            if Path(target).name != "final":
                return real_publish(tmp, target)
            if when != "published":
                files = sorted(p for p in Path(tmp).rglob("*") if p.is_file())
                k = int(when)
                files[k].write_bytes(files[k].read_bytes()[: files[k].stat().st_size // 2])
                for later in files[k + 1 :]:
                    later.unlink()
                die()
            real_publish(tmp, target)
            die()

        setattr(runfolder, "publish_dir", publish)
    elif what == "reward.png":
        real_plot = run.plot_rewards

        def plot(rows, evals, path):
            if when == "torn":
                Path(path).with_name(f".{Path(path).name}.tmp{os.getpid()}").write_bytes(b"\x89PNG\r\n\x1a\n")
            if when in ("before", "torn"):
                die()
            real_plot(rows, evals, path)
            die()

        setattr(run, "plot_rewards", plot)
    elif what == "compare":
        from groupwise.claims import compare

        real_popen = subprocess.Popen

        class Runner:  # stands for the module `subprocess` inside groupwise.claims.compare
            @staticmethod
            def run(argv, **kwargs):
                child = real_popen(argv, **kwargs)
                if os.environ.get("KILLPOINTS_PIDFILE"):
                    Path(os.environ["KILLPOINTS_PIDFILE"]).write_text(str(child.pid))
                log = Path(next(a for a in argv if a.startswith("out=")).partition("=")[2].strip('"')) / "metrics.jsonl"
                while child.poll() is None and not (log.exists() and log.read_text().strip()):
                    time.sleep(0.02)
                die()
                return subprocess.CompletedProcess(argv, child.wait())

            STDOUT = subprocess.STDOUT
            DEVNULL = subprocess.DEVNULL

        setattr(compare, "subprocess", Runner)
    else:
        real_write = runfolder.write_atomic

        def write_atomic(path, data):
            path = Path(path)
            if path.name != what or not hit():
                return real_write(path, data)
            if when == "torn":
                raw = data.encode() if isinstance(data, str) else data
                path.with_name(f".{path.name}.tmp{os.getpid()}").write_bytes(raw[: len(raw) // 2])
            if when in ("before", "torn"):
                die()
            real_write(path, data)
            die()

        setattr(runfolder, "write_atomic", write_atomic)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    arm(sys.argv[1], sigkill)
    from groupwise.cli import main

    sys.exit(main(sys.argv[2:]))
