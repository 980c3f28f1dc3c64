"""Counter-based randomness: every random number is a pure function of its coordinates.

Augmentation parameters and epoch orders are not drawn from a stateful generator
(whose output would depend on how many samples a rank has already drawn, i.e. on
the world size, the batch composition and the number of workers). Instead each
number is a hash of its coordinates::

    u = hash(seed, epoch, sample index, stream, column)  ->  [0, 1)

so view v of sample i is identical whether the sample is augmented on 1 rank or
8, in a batch of 16 or 512, first or last in the batch.

Why hand-written: `torch.Generator` is stateful and per-device (CPU and CUDA give
different numbers for the same seed), and torch has no vectorised counter-based
RNG in its public API. The hash is splitmix64's finaliser (Steele et al., 2014),
chained over the coordinates, on int64 tensors: multiplication wraps modulo 2**64
like uint64 arithmetic, and logical right shifts are emulated with a mask because
torch's ``>>`` on negative int64 is arithmetic. Integer ops are exact, so CPU and
CUDA give bit-identical numbers. Seed, epoch and stream are folded into one
64-bit key in Python (exact big-int arithmetic); only the per-sample index and
the column are hashed on the device.

Example::

    idx = torch.tensor([7, 3, 42])
    u = sample_uniform(seed=0, epoch=5, indices=idx, stream=1, count=4)   # [3, 4] in [0, 1)
    # u[1] == sample_uniform(0, 5, torch.tensor([3]), 1, 4)[0], bit for bit
    z = sample_normal(0, 5, idx, stream=2, count=768)                     # [3, 768] N(0, 1), e.g. pixel noise
    for batch in global_batches(n=50_000, global_batch=512, epoch=5, seed=0):
        local = batch[local_slice(len(batch))]    # this rank's share (unison.distributed.collectives)
"""

from __future__ import annotations

import torch

__all__ = ["sample_uniform", "sample_normal", "epoch_permutation", "global_batches", "hash64"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: splitmix64's increment
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
# Streams reserved for this module (augmentations use small non-negative streams).
_PERM_STREAM = 0x7E57_0001


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 value that has it (for torch scalars)."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _mix_int(z: int) -> int:
    """splitmix64 finaliser on a Python int (reference for the tensor version)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    # Logical shift right: torch's >> sign-extends negative int64, so clear the top k bits.
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (wrapping multiplication = uint64 arithmetic)."""
    z = (z ^ _srl(z, 30)) * _signed(_M1)
    z = (z ^ _srl(z, 27)) * _signed(_M2)
    return z ^ _srl(z, 31)


def combine_key(*parts: int) -> int:
    """Fold integer coordinates into one 64-bit key (exact, order-sensitive)."""
    h = 0x5EED_0F_0E15_0A  # arbitrary non-zero start
    for p in parts:
        h = _mix_int(h ^ ((p * _GOLDEN + _GOLDEN) & _MASK64))
    return h


def hash64(key: int, indices: torch.Tensor, count: int) -> torch.Tensor:
    """int64 [len(indices), count]: 64 random bits per (key, index, column), on indices.device."""
    idx = indices.reshape(-1).to(torch.int64)
    h = _mix(idx * _signed(_GOLDEN) + _signed(key))  # one lane per sample...
    cols = torch.arange(count, dtype=torch.int64, device=idx.device)
    # ...then one per column; the extra round decorrelates neighbouring indices/columns.
    return _mix(_mix(h[:, None] ^ (cols[None, :] * _signed(_M2) + _signed(_GOLDEN))))


def sample_uniform(seed: int, epoch: int, indices: torch.Tensor, stream: int, count: int) -> torch.Tensor:
    """float32 [len(indices), count] in [0, 1), a pure function of (seed, epoch, index, stream, column).

    Uses the top 24 bits of the hash, so every value is an exact float32 multiple of
    2**-24 (never rounds up to 1.0) and identical on every device.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    bits = hash64(combine_key(seed, epoch, stream), indices, count)
    return _srl(bits, 40).to(torch.float32) * (2.0**-24)


def sample_normal(seed: int, epoch: int, indices: torch.Tensor, stream: int, count: int) -> torch.Tensor:
    """float32 [len(indices), count] standard normal, a pure function like `sample_uniform`.

    For many columns per sample (pixel noise): one hash per sample seeds a splitmix64
    sequence (one mix per 64 bits), and each 64-bit word gives two 24-bit uniforms for a
    Box-Muller pair (computed in float64, so the float32 result is device-independent).
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    pairs = (count + 1) // 2
    key = hash64(combine_key(seed, epoch, stream), indices, 1)  # [B, 1]
    steps = torch.arange(1, pairs + 1, dtype=torch.int64, device=key.device) * _signed(_GOLDEN)
    bits = _mix(key + steps[None])  # splitmix64: state_k = key + k * golden, output mix(state_k)
    u1 = (_srl(bits, 40) + 1).to(torch.float64) * (2.0**-24)  # (0, 1]: finite log
    u2 = (_srl(bits, 16) & 0xFFFFFF).to(torch.float64) * (2.0**-24)
    r, ang = torch.sqrt(-2 * torch.log(u1)), (2 * torch.pi) * u2
    return torch.cat((r * torch.cos(ang), r * torch.sin(ang)), dim=1)[:, :count].to(torch.float32)


def epoch_permutation(n: int, epoch: int, seed: int) -> torch.Tensor:
    """int64 permutation of range(n) for this epoch; identical on every rank, device and torch version.

    Sorting hashed keys (rather than `torch.randperm`) keeps the order independent of the
    torch version and of the device.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    keys = hash64(combine_key(seed, epoch, _PERM_STREAM), torch.arange(n, dtype=torch.int64), 1)[:, 0]
    return torch.argsort(keys, stable=True)  # stable: ties (vanishingly rare) still deterministic


def global_batches(n: int, global_batch: int, epoch: int, seed: int) -> list[torch.Tensor]:
    """This epoch's global batches of dataset indices (drop_last), the same list on every rank.

    Each rank then takes its contiguous share, e.g. ``batch[local_slice(len(batch))]``.
    Raises ValueError when not even one full batch fits (training would do nothing).
    """
    if global_batch <= 0:
        raise ValueError(f"global_batch must be positive, got {global_batch}")
    if global_batch > n:
        raise ValueError(f"global batch {global_batch} is larger than the dataset ({n} samples)")
    perm = epoch_permutation(n, epoch, seed)
    return list(perm[: (n // global_batch) * global_batch].split(global_batch))
