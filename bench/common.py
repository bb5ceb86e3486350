"""What both sides of the benchmark share: the cells, the reward, the prompts, the greedy evaluation,
the FLOP count and the machine description.

Everything here is imported by the orchestrator (``run.py``) and by the per-measurement worker
(``worker.py``); nothing here imports TRL or the groupwise trainer, so a worker of one framework
never loads the other framework's code (its peak RSS is its own).
"""

from __future__ import annotations

import os
import platform
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
MODELS = BENCH / "models"
RUNS = BENCH / "runs"
RESULTS = BENCH / "results.json"
DOC = ROOT / "docs" / "performance.md"

# Offline only: every model and tokenizer is a local folder.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_DISABLED": "true",
    "DISABLE_MLFLOW_INTEGRATION": "TRUE",
}


# --------------------------------------------------------------------------------------------
# Cells
# --------------------------------------------------------------------------------------------
@dataclass
class Cell:
    """One benchmark configuration, run identically by both frameworks."""

    preset: str  # tiny | small | medium (groupwise.models.build.PRESETS)
    prompts: int  # prompts per optimiser step (B)
    group: int  # completions per prompt (G)
    length: int  # max completion length (fixed: see README, "fixed-length completions")
    loss: str = "dapo"  # dapo (token mean over the step) | grpo (mean over rows of each row's token mean)
    beta: float = 0.0  # KL-to-reference coefficient
    mu: int = 1  # num_iterations: optimiser passes over each rollout
    lr: float = 1e-5
    epsilon: float = 0.2
    micro_groups: int = 8  # groups per forward/backward micro-batch (TRL: micro batch of micro_groups*G rows)
    warmup: int = 2  # steps run before timing starts
    steps: int = 5  # timed steps (one step = one rollout + its mu optimiser steps)
    max_pairs: int = 0  # cap on A/B pairs for this cell (0 = no cap)
    # float32 | bfloat16: the products' dtype (groupwise model.matmul; TRL bf16=True), bench/bf16.py
    matmul: str = "float32"

    @property
    def name(self) -> str:
        extra = (
            ("" if self.loss == "dapo" else f"-{self.loss}")
            + (f"-beta{self.beta:g}" if self.beta else "")
            + (f"-mu{self.mu}" if self.mu != 1 else "")
        )
        extra += "-bf16" if self.matmul == "bfloat16" else ""
        return f"{self.preset}-{self.prompts}x{self.group}-L{self.length}{extra}"

    @property
    def micro(self) -> int:
        """Groups per micro-batch, a divisor of ``prompts``."""
        m = max(1, min(self.micro_groups, self.prompts))
        while self.prompts % m:
            m -= 1
        return m


def matrix() -> list[Cell]:
    """The full ``make bench`` matrix, budgeted so that it and time to accuracy finish in about 20 minutes
    on 2 quiet cores.

    Every worker process costs ~10 s before its first step (importing torch, transformers and the
    framework), so each A/B round is one process per framework and extra rounds are the expensive part:
    the three cheapest cells, whose short steps are also the noisiest, get 2 pairs (``--pairs``); every
    other cell is capped at one (``max_pairs``).
    Heavy cells get fewer timed steps, and the three heaviest (64 x 8) no warm-up step: their single
    step takes 10 s to minutes, and a first step is 5-15 % slower for both frameworks alike
    (``*_warmup_s`` in the results), so their ratios stand; the 30M cell is warmed up because its
    FLOP efficiency is judged on its own.
    """

    def cell(preset: str, prompts: int, length: int, warmup: int, steps: int, max_pairs: int = 1, **kw: Any) -> Cell:
        return Cell(preset, prompts, 8, length, warmup=warmup, steps=steps, max_pairs=max_pairs, **kw)

    return [
        cell("tiny", 1, 16, 2, 5, max_pairs=0),
        cell("tiny", 1, 128, 1, 3),
        cell("tiny", 4, 16, 2, 5, max_pairs=0),
        cell("tiny", 4, 128, 1, 2),
        cell("tiny", 64, 16, 1, 2),
        cell("tiny", 64, 128, 0, 1),
        cell("small", 1, 16, 2, 4, max_pairs=0),
        cell("small", 1, 128, 1, 1),
        cell("small", 4, 16, 1, 2),
        cell("small", 4, 128, 1, 1),
        cell("small", 64, 16, 0, 1),
        cell("small", 64, 128, 0, 1),
        # warmed up: its FLOP efficiency is a target, and a cold first step is ~15 % slower
        cell("medium", 4, 128, 1, 1),
        # the algorithm variants, each against the base tiny-4x8-L16 cell
        cell("tiny", 4, 16, 1, 3, loss="grpo"),
        cell("tiny", 4, 16, 1, 3, beta=0.04),
        cell("tiny", 4, 16, 1, 3, mu=2),
    ]


def quick_matrix() -> list[Cell]:
    """``--quick``: two small cells (base, and grpo loss + KL + mu=2), 1 warm-up step and 2 timed steps."""
    return [
        Cell("tiny", 4, 8, 16, warmup=1, steps=2),
        Cell("tiny", 4, 8, 16, loss="grpo", beta=0.04, mu=2, warmup=1, steps=2),
    ]


def select(cells: Sequence[Cell], patterns: str) -> list[Cell]:
    """Cells whose name contains any comma-separated pattern (``all`` = every cell)."""
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    if not wanted or "all" in wanted:
        return list(cells)
    return [c for c in cells if any(p in c.name for p in wanted)]


def parse_cell(spec: str) -> Cell:
    """A cell from ``preset:BxG:L[:loss[:beta[:mu]]]``, e.g. ``small:4x8:128:grpo:0.04:2``."""
    parts = spec.split(":")
    prompts, group = (int(x) for x in parts[1].split("x"))
    cell = Cell(parts[0], prompts, group, int(parts[2]))
    if len(parts) > 3:
        cell.loss = parts[3]
    if len(parts) > 4:
        cell.beta = float(parts[4])
    if len(parts) > 5:
        cell.mu = int(parts[5])
    return cell


# --------------------------------------------------------------------------------------------
# Task data and the shared reward
# --------------------------------------------------------------------------------------------
TTA_TASKS = ("arithmetic", "mixed")  # built-in tasks with an ``answer`` column that the exact-match reward scores


def train_rows(task: str = "arithmetic") -> list[dict]:
    from groupwise.tasks import get_task

    return get_task(task).rows("train", 0, 0)


def heldout_rows(n: int = 0, task: str = "arithmetic") -> list[dict]:
    from groupwise.tasks import get_task

    rows = get_task(task).rows("test", 0, 0)
    return rows[:n] if n > 0 else rows


REWARD_FN = f"{BENCH / 'rewards.py'}:exact_answer"  # groupwise `{name="python", fn=...}` spec of the shared reward


# --------------------------------------------------------------------------------------------
# Greedy held-out evaluation (the same function on both frameworks' model objects)
# --------------------------------------------------------------------------------------------
def greedy_accuracy(model: Any, tokenizer: Any, rows: Sequence[dict], max_new_tokens: int, batch: int = 256) -> float:
    """Share of ``rows`` whose greedy completion (stripped, cut at EOS) equals the answer.

    Plain batched greedy decoding with a KV cache written here (no framework's own evaluation):
    prompts are left-padded, positions count real tokens only, a finished row keeps emitting EOS.
    """
    import inspect

    import torch
    from rewards import exact_answer  # noqa: E402 (bench/ is on sys.path)

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # renamed in transformers 5.x
    cache_kw = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"

    def returned_cache(output):
        cache = output.get("cache")
        return cache if cache is not None else output.get("past_key_values")

    was_training = model.training
    model.eval()
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    correct = 0
    try:
        with torch.no_grad():
            for start in range(0, len(rows), batch):
                chunk = rows[start : start + batch]
                encoded = [tokenizer(r["prompt"], add_special_tokens=True)["input_ids"] for r in chunk]
                width = max(len(e) for e in encoded)
                ids = torch.full((len(chunk), width), pad, dtype=torch.long)  # [n,P]
                mask = torch.zeros(len(chunk), width, dtype=torch.long)  # [n,P]
                for i, e in enumerate(encoded):
                    ids[i, width - len(e) :] = torch.tensor(e)
                    mask[i, width - len(e) :] = 1
                positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [n,P]
                out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
                cache = returned_cache(out)
                nxt = out.logits[:, -1].argmax(-1)  # [n]
                done = torch.zeros(len(chunk), dtype=torch.bool)
                tokens: list[torch.Tensor] = []
                last_pos = positions[:, -1]
                for t in range(max_new_tokens):
                    nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
                    tokens.append(nxt)
                    done |= nxt == eos
                    if bool(done.all()) or t + 1 == max_new_tokens:
                        break
                    mask = torch.cat([mask, torch.ones(len(chunk), 1, dtype=torch.long)], dim=1)
                    out = model(
                        input_ids=nxt[:, None],
                        attention_mask=mask,
                        position_ids=(last_pos + t + 1)[:, None],
                        use_cache=True,
                        **{cache_kw: cache},
                    )
                    cache = returned_cache(out)
                    nxt = out.logits[:, -1].argmax(-1)
                generated = torch.stack(tokens, dim=1).tolist()  # [n,T]
                texts = [tokenizer.decode([x for x in row if x != eos], skip_special_tokens=True) for row in generated]
                scores = exact_answer([r["prompt"] for r in chunk], texts, answer=[r["answer"] for r in chunk])
                correct += int(sum(scores))
    finally:
        model.train(was_training)
    return correct / max(1, len(rows))


# --------------------------------------------------------------------------------------------
# FLOPs, memory, machine
# --------------------------------------------------------------------------------------------
def parameter_counts(model: Any) -> dict[str, int]:
    """Total distinct parameters and non-embedding parameters (the tied embedding/head matrix excluded)."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings()
    untied = head is not None and head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    non_embedding = total - embedding - (head.weight.numel() if untied else 0)
    return {"params_total": total, "params_non_embedding": non_embedding}


def gemm_flops(threads: int, n: int = 1024, seconds: float = 2.0, dtype: str = "float32") -> float:
    """Peak-ish GEMM FLOP/s: the best of repeated ``n x n @ n x n`` matmuls at ``threads`` threads."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kind = getattr(torch, dtype)
        a, b = torch.randn(n, n, dtype=kind), torch.randn(n, n, dtype=kind)
        c = torch.empty(n, n, dtype=kind)
        for _ in range(3):
            torch.matmul(a, b, out=c)
        best = float("inf")
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            torch.matmul(a, b, out=c)
            best = min(best, time.perf_counter() - t0)
        return 2.0 * n**3 / best
    finally:
        torch.set_num_threads(previous)


def _status_mb(field: str) -> float | None:
    """A memory field of ``/proc/self/status`` (``VmHWM``, ``VmRSS``: kB) in MB; None where unreadable."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def peak_rss_mb() -> float:
    """Peak resident set size (MB) since the last :func:`reset_peak_rss`, or since the process started:
    Linux ``VmHWM`` (which ``/proc/self/clear_refs`` resets), else ``ru_maxrss`` (KiB on Linux)."""
    peak = _status_mb("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def reset_peak_rss() -> bool:
    """Start a new peak-RSS window for the next cell measured in this process: collect garbage, hand freed
    heap memory back to the OS (``malloc_trim``) so the previous cell's leftovers do not count, then
    reset Linux's high-water mark to the current RSS. False where the high-water mark cannot be reset."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rss_mb() -> float:
    """Current resident set size (MB; 0 where /proc is missing)."""
    return _status_mb("VmRSS") or 0.0


def import_floor_rss_mb() -> dict[str, float]:
    """Peak RSS (MB) of bare processes that only import torch, then also transformers' modeling code
    (which every Hugging Face model load imports: ``transformers.modeling_utils`` pulls in
    ``torch.distributed.tensor``/sympy and the loss utilities/scipy). Both frameworks' workers start
    above the second figure before they build anything, so it bounds how low either's peak can go."""
    import subprocess
    import sys

    probe = "import {}\nprint(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])"
    floors = {}
    for name, modules in (("torch", "torch"), ("torch_transformers_modeling", "torch, transformers.modeling_utils")):
        done = subprocess.run(
            [sys.executable, "-c", probe.format(modules)],
            capture_output=True,
            text=True,
            env={**os.environ, **OFFLINE_ENV},
            check=False,
        )
        if done.returncode == 0 and done.stdout.strip().isdigit():
            floors[name] = int(done.stdout.strip()) / 1024.0
    return floors


def machine(threads: int) -> dict[str, Any]:
    import torch

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    for package in ("transformers", "trl", "accelerate"):
        try:
            from importlib.metadata import version

            info[package] = version(package)
        except Exception:  # noqa: BLE001 - a missing package is reported as such
            info[package] = "not installed"
    info["import_floor_rss_mb"] = import_floor_rss_mb()
    try:
        info["load_average_at_start"] = os.getloadavg()
    except OSError:
        pass
    return info


@dataclass
class Measurement:
    """What one worker process reports for one framework on one cell."""

    framework: str
    cell: str
    step_seconds: list[float] = field(default_factory=list)  # wall time of each timed step (rollout + mu updates)
    warmup_seconds: list[float] = field(default_factory=list)  # wall time of each untimed warm-up step
    generation_seconds: list[float] = field(default_factory=list)  # groupwise only (TRL has no hook there)
    generated_tokens: list[float] = field(default_factory=list)  # completion tokens generated per timed step
    trained_tokens: list[float] = field(default_factory=list)  # completion tokens trained per timed step (x mu)
    peak_rss_mb: float = 0.0  # peak resident memory while this cell ran (the process's, from the cell's start)
    rss_at_start_mb: float = 0.0  # resident before the cell (interpreter, imports, leftovers of earlier cells)
    cell_index: int = 0  # position of the cell in its worker process (0 = first)
    threads: int = 0
    params_total: int = 0
    params_non_embedding: int = 0
    setup_seconds: float = 0.0
    notes: dict = field(default_factory=dict)
