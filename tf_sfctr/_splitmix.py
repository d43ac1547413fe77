"""Counter-based hashing (splitmix64) for reproducible, vectorised random numbers.

Every random quantity of the synthetic generator is ``mix(key + counter)``: a pure
function of integers, so results depend neither on NumPy's global state nor on how
rows are chunked, batched or sharded. ``mix`` is also the Mix64 that routes an id to
its owner rank (``tf_sfctr.distributed.owner_of``, the C++ ops' ``Mix64``). NumPy only,
so that neither user imports the other's package.
"""

from __future__ import annotations

import math

import numpy as np

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15  # splitmix64 increment (odd)
U64_GAMMA = np.uint64(GAMMA)
_U64_M1 = np.uint64(0xBF58476D1CE4E5B9)
_U64_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S32, _S12 = (np.uint64(s) for s in (30, 27, 31, 32, 12))
_LOW32 = np.uint64(0xFFFFFFFF)


def mix_int(x: int) -> int:
    """splitmix64 finaliser of a Python int (a bijection of 64-bit values)."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def derive_key(*parts: int) -> np.uint64:
    """A 64-bit key derived from a tuple of non-negative ints."""
    k = 0x243F6A8885A308D3
    for p in parts:
        k = mix_int(k + (p & MASK64) * GAMMA + GAMMA)
    return np.uint64(k)


def mix(z: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, in place on a uint64 array; returns it."""
    z ^= z >> _S30
    z *= _U64_M1
    z ^= z >> _S27
    z *= _U64_M2
    z ^= z >> _S31
    return z


def uniform(h: np.ndarray) -> np.ndarray:
    """Uniform floats in the open interval (0, 1) from 64-bit hashes (52 bits)."""
    return ((h >> _S12).astype(np.float64) + 0.5) * (2.0**-52)


def unit_weight(h: np.ndarray) -> np.ndarray:
    """Approximately normal weights with mean 0 and variance 1 from 64-bit hashes.

    The standardised sum of the four 16-bit quarters of each hash (Irwin-Hall with
    n = 4: bell shaped, bounded by +-3.46); much cheaper than Box-Muller.
    """
    q = np.ascontiguousarray(h, dtype=np.uint64).view(np.uint16)
    q = q.reshape(h.shape + (4,))
    total = q[..., 0].astype(np.int32) + q[..., 1] + q[..., 2] + q[..., 3]
    return (total - 131070.0) * (1.0 / math.sqrt(4.0 * (65536.0**2 - 1.0) / 12.0))


def normal_pair(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two independent N(0, 1) samples per hash (Box-Muller on its 32-bit halves)."""
    u1 = ((h >> _S32).astype(np.float64) + 0.5) * (2.0**-32)
    u2 = (h & _LOW32).astype(np.float64) * (2.0**-32)
    r = np.sqrt(-2.0 * np.log(u1))
    angle = (2.0 * math.pi) * u2
    return r * np.cos(angle), r * np.sin(angle)
