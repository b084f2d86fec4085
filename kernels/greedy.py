"""Greedy decoding's argmax over the vocabulary, in two small Triton kernels.

torch's argmax reduces a row of logits in one thread block: for a 128k vocabulary at batch 1
that is ~38 us on an H100, as long as the whole attention of a layer. Here the first kernel
spreads each row over CHUNK-wide programs that each keep their max and its first index; the
second picks, per row, the best chunk (the first one on ties, so the result is torch's: the
lowest index of the maximum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from .pdl import kernel_options, wait_then_release

CHUNK = 4096


@triton.jit
def _chunk_argmax_kernel(x_ptr, best_ptr, where_ptr, n_cols, s_row, n_chunks, PDL: tl.constexpr,
                         BLOCK: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * s_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    i = tl.argmax(x, 0, tie_break_left=True)
    tl.store(best_ptr + row * n_chunks + chunk, tl.max(x, 0))
    tl.store(where_ptr + row * n_chunks + chunk, chunk * BLOCK + i)


@triton.jit
def _row_argmax_kernel(best_ptr, where_ptr, out_ptr, n_chunks, PDL: tl.constexpr, BLOCK: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    best = tl.load(best_ptr + row * n_chunks + c, mask=c < n_chunks, other=float("-inf"))
    first = tl.argmax(best, 0, tie_break_left=True)
    tl.store(out_ptr + row, tl.load(where_ptr + row * n_chunks + first).to(tl.int64))


def argmax(x: Tensor) -> Tensor:
    """Index of the maximum of each row of x [rows, n] (unit last stride), as int64 [rows]: the
    lowest index among equal maxima, like torch.argmax."""
    rows, n = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    n_chunks = triton.cdiv(n, CHUNK)
    best = torch.empty(rows, n_chunks, dtype=torch.float32, device=x.device)
    where = torch.empty(rows, n_chunks, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    options = kernel_options(x.device)
    _chunk_argmax_kernel[(rows, n_chunks)](x, best, where, n, x.stride(0), n_chunks, BLOCK=CHUNK, num_warps=8,
                                           **options)
    _row_argmax_kernel[(rows,)](best, where, out, n_chunks, BLOCK=max(16, triton.next_power_of_2(n_chunks)),
                                num_warps=1, **options)
    return out


INTERPRETED = isinstance(_chunk_argmax_kernel, InterpretedFunction)
