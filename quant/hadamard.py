"""The Walsh-Hadamard rotation some codecs store their pages in (KVarN's keys and values, kitty-qh's
values): Hd = the Sylvester Hadamard matrix of order D divided by sqrt(D), symmetric and
orthonormal, so Hd @ Hd = I and (q Hd) . (k Hd) = q . k. It spreads a few outlier channels over
all of them before RTN; applied with the fast transform, O(D log D).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def fwht(x: Tensor) -> Tensor:
    """x @ Hd along the last dim (a power of 2), by log2(D) butterfly stages."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"Walsh-Hadamard rotation needs a power-of-2 head dim, got {d}")
    y, h = x.float(), 1
    while h < d:
        # pair element i with i + h inside every block of 2h: (a, b) -> (a + b, a - b)
        y = y.unflatten(-1, (d // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return y / math.sqrt(d)


def hadamard(d: int) -> Tensor:
    """The normalized Walsh-Hadamard matrix Hd (float32 [d, d])."""
    return fwht(torch.eye(d))
