"""Seeded, machine-independent random tensors for the built-in tasks (private helpers).

Each purpose ("model", "data", ...) gets its own ``torch.Generator`` whose seed is derived from the
run's seed by SHA-256, so the streams are independent of each other, of torch's global RNG and of
the order in which things are built.

Why float64: torch's CPU ``normal_`` on float32 picks a vectorized kernel by the CPU's capability
(AVX2, AVX-512, none), and those kernels use different ``log``/``cos`` implementations, so the same
seed can give different float32 bits on different machines. The float64 kernel is a scalar loop over
libm; rounding its result to float32 hides last-bit libm differences except with probability ~2^-29
per value. Uniform samples come from the integer stream and are exact everywhere.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch


def derive_seed(seed: int, *purpose: str) -> int:
    """A 63-bit generator seed for ``purpose`` derived from the run's seed (any Python int)."""
    text = "/".join(("swarmrun", *purpose, str(int(seed))))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") & (2**63 - 1)


def generator(seed: int, *purpose: str) -> torch.Generator:
    """A fresh CPU generator for ``purpose``."""
    g = torch.Generator(device="cpu")
    g.manual_seed(derive_seed(seed, *purpose))
    return g


def randn(shape: Sequence[int], g: torch.Generator, std: float = 1.0) -> torch.Tensor:
    """Normal samples (mean 0, ``std``) as float32, drawn in float64 (see the module docstring)."""
    return (torch.randn(tuple(shape), generator=g, dtype=torch.float64) * std).to(torch.float32)


def uniform(shape: Sequence[int], g: torch.Generator, bound: float) -> torch.Tensor:
    """Uniform samples in ``[-bound, bound)`` as float32, drawn in float64."""
    u = torch.rand(tuple(shape), generator=g, dtype=torch.float64)
    return ((u * 2.0 - 1.0) * bound).to(torch.float32)


def check_indices(indices: Sequence[int], n: int) -> torch.Tensor:
    """The indices as an int64 tensor.

    Raises:
        IndexError: an index outside ``0..n-1`` (negative indices are not wrapped around).
    """
    idx = torch.as_tensor(list(indices) if not isinstance(indices, torch.Tensor) else indices, dtype=torch.int64)
    if idx.dim() != 1:
        raise IndexError(f"indices must be one-dimensional, got shape {tuple(idx.shape)}")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise IndexError(f"example index out of range 0..{n - 1}: min {int(idx.min())}, max {int(idx.max())}")
    return idx
