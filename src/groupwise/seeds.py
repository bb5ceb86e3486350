"""Per-sample randomness that depends only on *who* the sample is, never on a running stream.

``sample_seed(seed, step, prompt_id, sample_index)`` names one rollout row; ``uniform_noise`` turns a
row seed and a token position into uniforms over the vocabulary with a counter-based hash
(splitmix64), so a row's sample is the same whatever else is in the batch, however the batch is
split, and after a resume.

Why a hash and not ``torch.Generator``: a generator is a stream, so a row's draws would depend on how
many draws came before it (batch order, dropped rows). A hash of (row, position, vocab id) does not.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64 increment (odd, 2^64 / golden ratio)
_MIX1 = 0xBF58476D1CE4E5B9  # splitmix64 finaliser multipliers
_MIX2 = 0x94D049BB133111EB
_UNIFORM_BITS = 24  # a float32 mantissa holds 24 bits exactly
# float32 just below 2^-24, i.e. 1/(2^24+1) rounded down: (v+1)·scale lies in (0,1) for v in [0, 2^24).
_UNIFORM_SCALE = float(torch.nextafter(torch.tensor(2.0**-24), torch.tensor(0.0)))


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 value torch stores for it."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _splitmix64(x: int) -> int:
    """One splitmix64 output for state ``x`` (pure Python, exact 64-bit arithmetic)."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def sample_seed(seed: int, step: int, prompt_id: int, sample_index: int) -> int:
    """A stable non-negative 63-bit seed for one rollout row (independent of ``PYTHONHASHSEED``)."""
    state = 0
    for value in (seed, step, prompt_id, sample_index):
        state = _splitmix64(state ^ (value & _MASK64))  # absorb one field, then mix
    return state >> 1  # 63 bits: fits a non-negative int64


def row_seeds(seed: int, step: int, prompt_ids: list[int], n: int) -> Tensor:
    """[B*n] int64 seeds for ``n`` samples of each prompt; row ``b*n + i`` is sample ``i`` of prompt ``b``."""
    return torch.tensor([sample_seed(seed, step, p, i) for p in prompt_ids for i in range(n)], dtype=torch.long)


# --------------------------------------------------------------------------- torch (int64, wrapping)
def _shift_right(z: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic: it copies the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _position_constants(positions: range, device=None) -> Tensor:
    """[P] int64: what each position adds to a row seed before the finaliser (exact 64-bit maths in Python)."""
    return torch.tensor([_signed(_splitmix64(p) + _GOLDEN) for p in positions], dtype=torch.long, device=device)


def _mix_rows(row_seeds: Tensor, position: int) -> Tensor:
    """[N] int64 key per (row seed, position): a full splitmix64 finaliser over N values (cheap)."""
    return _finalise(row_seeds.to(torch.long) + _signed(_splitmix64(position) + _GOLDEN))  # [N]


def _finalise(z: Tensor) -> Tensor:
    """splitmix64's finaliser, elementwise on int64 bit patterns (multiplication wraps mod 2^64)."""
    z = (z ^ _shift_right(z, 30)) * _signed(_MIX1)  # [N]
    z = (z ^ _shift_right(z, 27)) * _signed(_MIX2)  # [N]
    return z ^ _shift_right(z, 31)  # [N]


def noise_at(
    row_seeds: Tensor,
    position: int,
    token_ids: Tensor,
    out: Tensor | None = None,
    scratch: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """[N,K] float32 uniforms in (0,1) for the vocabulary ids ``token_ids`` ([N,K] or [K]) of each row.

    ``noise_at(s, p, ids)[r, j] == uniform_noise(s, p, V)[r, ids[r, j]]``, so sampling among a few
    candidate tokens (top-k / top-p) draws exactly the same noise as sampling over the full vocabulary.
    ``out`` (float32 [N,K]) and ``scratch`` (two int64 [N,K]) are optional preallocated workspaces.
    """
    keys = _mix_rows(row_seeds, position)  # [N]
    shape = (keys.shape[0], token_ids.shape[-1])
    z, shifted = (
        scratch
        if scratch is not None
        else (
            torch.empty(shape, dtype=torch.long, device=keys.device),
            torch.empty(shape, dtype=torch.long, device=keys.device),
        )
    )
    # splitmix64 stream of each row key, read at counter = token id (multiplication wraps mod 2^64)
    counters = token_ids.to(torch.long) * _signed(_GOLDEN)  # [N,K] or [K]
    torch.add(counters, keys[:, None], out=z)  # [N,K]
    for bits, multiplier in ((30, _MIX1), (27, _MIX2)):
        torch.bitwise_right_shift(z, bits, out=shifted).bitwise_and_((1 << (64 - bits)) - 1)  # [N,K] logical shift
        z.bitwise_xor_(shifted).mul_(_signed(multiplier))  # [N,K]
    # The top bits are final after the second multiply (the last xor-shift only touches low bits).
    top = torch.bitwise_right_shift(z, 64 - _UNIFORM_BITS, out=shifted).bitwise_and_((1 << _UNIFORM_BITS) - 1)  # [N,K]
    out = torch.empty(shape, dtype=torch.float32, device=keys.device) if out is None else out
    return out.copy_(top).add_(1.0).mul_(_UNIFORM_SCALE)  # [N,K] strictly inside (0,1)


def gumbel_span(row_seeds: Tensor, start: int, width: int, vocab: int) -> Tensor:
    """[N,width,V] float32 Gumbel noise ``-log(-log u)`` for positions ``start .. start+width-1`` in one
    vectorised pass, with ``u`` exactly ``uniform_noise(row_seeds, position, vocab)`` (the same integer ops)."""
    keys = _finalise(
        row_seeds.to(torch.long)[:, None] + _position_constants(range(start, start + width), row_seeds.device)[None, :]
    )  # [N,W]
    z = keys[:, :, None] + torch.arange(vocab, device=row_seeds.device) * _signed(_GOLDEN)  # [N,W,V] wraps
    for bits, multiplier in ((30, _MIX1), (27, _MIX2)):
        z = z.bitwise_xor_(_shift_right(z, bits)).mul_(_signed(multiplier))  # [N,W,V]
    top = _shift_right(z, 64 - _UNIFORM_BITS)  # [N,W,V]
    return top.float().add_(1.0).mul_(_UNIFORM_SCALE).log_().neg_().log_().neg_()  # [N,W,V]


def uniform_noise(row_seeds: Tensor, position: int, vocab: int) -> Tensor:
    """[N,V] float32 uniforms in (0,1) that depend only on (row seed, position, vocab index)."""
    token_ids = torch.arange(vocab, device=row_seeds.device)  # [V]
    return noise_at(row_seeds, position, token_ids)  # [N,V]


def reference_uniform(row_seed: int, position: int, token_id: int) -> float:
    """Pure-Python twin of ``uniform_noise`` for one element (pins down the bit-exact definition in tests)."""
    key = _splitmix64((row_seed + _splitmix64(position)) & _MASK64)
    z = (key + token_id * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    top = z >> (64 - _UNIFORM_BITS)
    return float(torch.tensor(top + 1.0, dtype=torch.float32) * _UNIFORM_SCALE)
