"""Triton matmul for decode-shaped inputs: y [M, N] = x [M, K] @ w[N, K]^T (+ bias) with M <= 16.

At decode a linear layer reads its whole weight to produce a handful of rows, so its time is
the weight's bytes over the bandwidth the kernel reaches. A GEMM library tiles for large M;
here each program owns BLOCK_N output channels and streams their weight rows once, in
BLOCK_K-wide strips, with enough programs that every SM keeps loads in flight.

    M == 1:  multiply-adds into a [BLOCK_N, BLOCK_K] fp32 tile, one reduction over K at the end
             (no tensor cores: one row of x would fill 1/16 of an MMA);
    M <= 16: x padded to 16 rows, one MMA per strip.

SPLIT_K > 1 cuts K into that many programs per channel block, which add their partial sums
into an fp32 buffer (for shapes with few channel blocks: otherwise some SMs idle). Which of
these, and which tile, wins per shape is measured, not assumed: kernels/matmul.py times them
against cuBLAS once per shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from .pdl import kernel_options, prefetch_weights, wait_then_release


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    split_k: int = 1


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, s_xm, s_om, k_per_split,
                 HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, ROW_X: tl.constexpr, PDL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    k_begin = tl.program_id(1) * k_per_split
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K
    # the first strip of weights starts towards L2 while the kernel that writes x finishes (pdl.py)
    prefetch_weights(w_rows + tl.minimum(k_begin + tl.arange(0, BLOCK_K // 64) * 64, K - 1)[None, :], PDL)
    wait_then_release(PDL)
    if ROW_X:  # one input row: fp32 multiply-adds, reduced once after the loop
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
            acc2 += w.to(tl.float32) * x.to(tl.float32)[None, :]
        acc = tl.sum(acc2, axis=1)[None, :]  # [1, BLOCK_N]
        rows = tl.zeros([1], dtype=tl.int32)
    else:
        m = tl.arange(0, BLOCK_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + m[:, None] * s_xm + k[None, :], mask=(m[:, None] < M) & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
        rows = m
    if HAS_BIAS:
        if k_begin == 0:  # split-K: the bias is added once
            acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + rows[:, None] * s_om + n[None, :]
    ok = (rows[:, None] < M) & n_ok[None, :]
    if ATOMIC:
        tl.atomic_add(dst, acc, mask=ok, sem="relaxed")
    else:
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=ok)


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None, config: GemvConfig, pdl: bool = True) -> Tensor:
    """x [M, K] (unit last stride) @ weight[N, K]^T + bias, for M <= 16; result [M, N] in x's dtype.
    pdl=False: launched in plain stream order even where programmatic dependent launch is on (pdl.py)."""
    M, K = x.shape
    N = weight.shape[0]
    if M > 16 or x.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError("gemv takes at most 16 rows with a unit last stride and a contiguous weight")
    split = config.split_k
    k_per_split = triton.cdiv(triton.cdiv(K, split), config.block_k) * config.block_k
    split = triton.cdiv(K, k_per_split)
    atomic = split > 1
    out = torch.zeros(M, N, dtype=torch.float32, device=x.device) if atomic else torch.empty(M, N, dtype=x.dtype,
                                                                                               device=x.device)
    row_x = M == 1
    grid = (triton.cdiv(N, config.block_n), split)
    _gemv_kernel[grid](x, weight, bias if bias is not None else weight, out, M, N, K, x.stride(0), out.stride(0),
                       k_per_split, HAS_BIAS=bias is not None, ATOMIC=atomic, ROW_X=row_x, BLOCK_M=16,
                       BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps,
                       num_stages=config.num_stages, **kernel_options(x.device, pdl))
    return out.to(x.dtype) if atomic else out


INTERPRETED = isinstance(_gemv_kernel, InterpretedFunction)
