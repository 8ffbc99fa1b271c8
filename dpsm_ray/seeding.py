"""Explicit, derived randomness: every random stream is a pure function of the run seed and a few
integers (epoch, example id, ...), never the global RNG, so runs are reproducible and results do
not depend on batch size, worker count or where a resumed run picked up."""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from any tuple of ints and strings (stable across processes and machines)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generator(*parts: int | str) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded from ``derive_seed(*parts)``."""
    return torch.Generator().manual_seed(derive_seed(*parts))


def counter_uniforms(seed: int, ids: torch.Tensor) -> torch.Tensor:
    """U(0, 1) in float64 for each id, a pure function of ``(seed, id)`` (a counter-based RNG).

    Two rounds of a 32-bit integer mixer; every intermediate stays below 2**63, so the arithmetic
    is exact in int64 on any device.
    """
    mask = 0xFFFFFFFF
    x = (ids.to(torch.int64) & mask) ^ ((seed * 0x9E3779B9) & mask)
    x = _mix32(_mix32(x) ^ ((seed >> 32) & mask))
    return (x.to(torch.float64) + 0.5) / 2.0**32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    mask = 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & mask
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & mask
    return x ^ (x >> 16)
