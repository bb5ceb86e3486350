"""``model.matmul``: the dtype of the model's matrix products, with float32 master weights.

``float32`` (the default) is the plain path. ``bfloat16`` keeps the weights, the residual stream,
the norms, the attention softmax and everything after the output head in float32 and runs only the
GEMMs in bfloat16: each weight is cast once per forward (training; the cast is differentiable, so
the gradient lands on the float32 master weight) or once per rollout (generation), each GEMM's
input is cast to bfloat16 and its output back to float32. The head's logits are float32 before any
log-softmax, so log-probs, ratios, advantages and losses stay float32.

``auto`` measures, once at start, a GEMM of the model's own shape in both dtypes at the run's thread
count (``probe``: a fraction of a second) and turns bfloat16 on only where it is at least
``MIN_SPEEDUP`` times faster: a CPU with bfloat16 matrix units (AVX512-BF16, AMX) measures ~4x on
a 512-wide GEMM; one without them emulates bfloat16 and measures it slower, so it stays float32 and
the run says so. The decision is made by measurement, never by a CPU name.

Explicit casts, not ``torch.autocast``, on the functional path (``policy/functional.py``): autocast
turns ``addmm``'s residual into bfloat16 and casts the weights again at every decode step; measured
on the demo at one thread (AVX512-BF16 EPYC, shared), the training forward + backward ran 2.6x
faster than float32 with explicit casts and 1.3x with autocast, generation 1.35x and 1.28x. The
model's own (Hugging Face) forward, used off the functional path, runs under autocast.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

CHOICES = ("float32", "bfloat16", "auto")
MIN_SPEEDUP = 1.3  # auto: bfloat16 only where its GEMM measures at least this much faster
PROBE_ROWS = 256  # the GEMM's row count: a micro-batch's tokens, or a decode step's rows, are of this order
PROBE_SECONDS = 0.04  # per dtype per round (2 rounds, best of each): ~0.2 s in all


@dataclass(frozen=True)
class MatmulChoice:
    """What ``model.matmul`` resolved to, and why (``summary.json`` ``matmul``; said once at start)."""

    setting: str  # the configured value: float32 | bfloat16 | auto
    dtype: str  # float32 | bfloat16: what the products run in
    fp32_gflops: float | None = None  # the probe's measurements (auto only)
    bf16_gflops: float | None = None
    shape: tuple[int, int, int] | None = None  # the probe's GEMM (rows, in, out)
    threads: int = 0
    reason: str = ""

    @property
    def low(self) -> torch.dtype | None:
        """The products' dtype when it is not float32 (what the forward and the engine take), else None."""
        return torch.bfloat16 if self.dtype == "bfloat16" else None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["shape"] = list(self.shape) if self.shape else None
        return out

    def line(self) -> str:
        """One log line."""
        return f"model.matmul={self.setting}: products in {self.dtype} ({self.reason})"


def gemm_gflops(
    dtype: torch.dtype, rows: int, inner: int, outer: int, seconds: float = PROBE_SECONDS, device: str = "cpu"
) -> float:
    """GFLOP/s of ``[rows,inner] @ [inner,outer]`` in ``dtype`` at the current thread count,
    timed for about ``seconds``."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(rows, inner, generator=gen).to(device, dtype)  # [M,K]
    b = torch.randn(inner, outer, generator=gen).to(device, dtype)  # [K,N]
    out = torch.empty(rows, outer, dtype=dtype, device=device)  # [M,N]
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    torch.mm(a, b, out=out)  # warm-up: kernel selection, packing buffers
    sync()
    reps, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b, out=out)
        reps += 1
        if reps % 4 == 0:
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return 2.0 * rows * inner * outer * reps / elapsed / 1e9


def probe(rows: int, inner: int, outer: int, device: str = "cpu", rounds: int = 2) -> tuple[float, float]:
    """(float32, bfloat16) GFLOP/s of the same GEMM, alternated ``rounds`` times, best of each
    (a shared CPU's noise only ever slows a measurement down)."""
    fp32 = bf16 = 0.0
    for _ in range(rounds):
        fp32 = max(fp32, gemm_gflops(torch.float32, rows, inner, outer, device=device))
        bf16 = max(bf16, gemm_gflops(torch.bfloat16, rows, inner, outer, device=device))
    return fp32, bf16


def decide(fp32_gflops: float, bf16_gflops: float, min_speedup: float = MIN_SPEEDUP) -> tuple[bool, str]:
    """(use bfloat16, why) from the two measurements."""
    ratio = bf16_gflops / fp32_gflops if fp32_gflops > 0 else 0.0
    measured = f"GEMM probe: float32 {fp32_gflops:.1f} GFLOP/s, bfloat16 {bf16_gflops:.1f} GFLOP/s, {ratio:.2f}x"
    if ratio >= min_speedup:
        return True, f"{measured} >= {min_speedup:g}x: bfloat16 products on"
    slower = "slower than" if ratio < 1.0 else "not enough faster than"
    return False, f"{measured} < {min_speedup:g}x: this CPU's bfloat16 GEMM is {slower} float32, staying float32"


def probe_shape(config: Any) -> tuple[int, int, int]:
    """The probe's GEMM for a model config: (rows, hidden, intermediate) — the MLP's up projection."""
    hidden = int(getattr(config, "hidden_size", 0) or 256)
    return PROBE_ROWS, hidden, int(getattr(config, "intermediate_size", 0) or 4 * hidden)


def resolve(
    setting: str,
    config: Any = None,
    device: str = "cpu",
    measure: Callable[[int, int, int], tuple[float, float]] | None = None,
) -> MatmulChoice:
    """``model.matmul`` -> a ``MatmulChoice``; ``auto`` runs ``measure`` (default ``probe``) on the model's shape."""
    from groupwise.errors import ConfigError

    if setting not in CHOICES:
        raise ConfigError(f"config key model.matmul={setting!r}; choices: {', '.join(CHOICES)}")
    threads = torch.get_num_threads()
    if setting != "auto":
        why = "configured" if setting == "bfloat16" else "the default plain path"
        return MatmulChoice(setting, setting, threads=threads, reason=why)
    shape = probe_shape(config)
    fp32, bf16 = (measure or (lambda m, k, n: probe(m, k, n, device=str(device))))(*shape)
    on, why = decide(fp32, bf16)
    from groupwise import dist

    if dist.world_size() > 1:  # every rank the same products: bfloat16 only where every rank measured it faster
        slower_somewhere = dist.agree([not on])[0]
        if on and slower_somewhere:
            on, why = False, f"{why}, but another rank measured otherwise: staying float32 on every rank"
    return MatmulChoice(setting, "bfloat16" if on else "float32", round(fp32, 1), round(bf16, 1), shape, threads, why)


def restored(choice: MatmulChoice, dtype: str) -> MatmulChoice:
    """``choice`` with the products' dtype a checkpoint recorded (a resumed ``auto`` run keeps its start's decision)."""
    if choice.setting != "auto" or dtype == choice.dtype or dtype not in ("float32", "bfloat16"):
        return choice
    return MatmulChoice(
        choice.setting,
        dtype,
        choice.fp32_gflops,
        choice.bf16_gflops,
        choice.shape,
        choice.threads,
        f"restored from the checkpoint (this start's probe said: {choice.reason})",
    )


# --------------------------------------------------------------------------- the products
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in ``weight``'s dtype when it differs from ``x``'s (the input cast to
    it, the output cast back, the bias added in ``x``'s dtype); the plain ``F.linear`` otherwise."""
    if weight.dtype == x.dtype:
        return torch.nn.functional.linear(x, weight, bias)
    out = torch.nn.functional.linear(x.to(weight.dtype), weight).to(x.dtype)
    return out if bias is None else out.add_(bias)


def addmm(x: torch.Tensor, a: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """``x + a @ weight_t`` (the residual folded into the product), the product in ``weight_t``'s dtype."""
    if weight_t.dtype == x.dtype:
        return torch.addmm(x, a, weight_t)
    return torch.mm(a.to(weight_t.dtype), weight_t).to(x.dtype).add_(x)


def autocast(device: torch.device | str, low: torch.dtype | None):
    """Autocast for a model's own (Hugging Face) forward when ``low`` is set; a no-op context otherwise."""
    import contextlib

    if low is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=low)
