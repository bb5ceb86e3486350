"""policy/memory.py: with ``keep_freed_memory`` a freed 64 MiB block goes back to the heap and the
next allocation of that size reuses it without page faults; with glibc's defaults every such block
is a fresh mapping whose pages all fault in again. Run in a subprocess: the setting is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, json, resource, sys
from groupwise.policy.memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 64 << 20  # above glibc's largest automatic mmap threshold (32 MiB)
def faults_of_one_use():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(SIZE)
    ctypes.memset(block, 1, SIZE)  # touch every page
    libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_one_use()  # the first use faults in either mode
print(json.dumps({"applied": applied, "faults": [faults_of_one_use() for _ in range(3)]}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    kept, default = _probe("keep"), _probe("default")
    if not kept["applied"]:
        pytest.skip("the C library is not glibc (no mallopt)")
    pages = (64 << 20) // 4096
    assert min(default["faults"]) > pages // 2, default  # each use maps the block afresh: every page faults
    assert max(kept["faults"]) < pages // 20, kept  # the same block comes back from the heap
