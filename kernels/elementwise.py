"""Triton kernels for the model's per-token arithmetic between the matmuls: RMSNorm (alone or
after the residual add), RoPE and the SiLU gate, each one kernel instead of the 2 to 8 that the torch expressions launch, and the
store of a decode step's new K and V into the cache's dense tier (one kernel for both, in
place of two index-put kernels and their index arithmetic).

A decode step of a 32-layer model otherwise runs over a thousand such tiny kernels; inside a
CUDA graph each still costs a couple of microseconds, which at batch 1 is a large share of a
step whose floor is reading the weights once. The torch versions in kernels/reference.py are
the oracle and the off-GPU path; rounding follows them: arithmetic in fp32, rounded to the
activation dtype where the torch expression rounds (the normalised row before its weight,
SiLU before the product).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from .pdl import kernel_options, wait_then_release


@triton.jit
def _rms_norm_kernel(x_ptr, h_ptr, w_ptr, sum_ptr, out_ptr, n_cols, eps, ADD: tl.constexpr, PDL: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    ty = out_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: read before the wait (pdl.py)
    wait_then_release(PDL)
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if ADD:  # the residual sum, rounded as the torch add rounds it, is both stored and normalised
        x = (x.to(tl.float32) + tl.load(h_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)).to(ty)
        tl.store(sum_ptr + row * n_cols + cols, x, mask=mask)
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    normed = (x * rstd).to(ty).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (normed * w).to(ty), mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim of x (any leading shape)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n).contiguous()
    out = torch.empty_like(rows)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows.shape[0],)](rows, rows, w_ptr=weight, sum_ptr=rows, out_ptr=out, n_cols=n, eps=eps,
                                       ADD=False, BLOCK=block, num_warps=min(8, max(1, block // 512)),
                                       **kernel_options(x.device))
    return out.view(x.shape)


def add_rms_norm(x: Tensor, h: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + h, RMSNorm(x + h)) in one kernel: the residual add folded into the norm after it."""
    n = x.shape[-1]
    rows, add = x.reshape(-1, n).contiguous(), h.reshape(-1, n).contiguous()
    total, out = torch.empty_like(rows), torch.empty_like(rows)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows.shape[0],)](rows, add, w_ptr=weight, sum_ptr=total, out_ptr=out, n_cols=n, eps=eps,
                                       ADD=True, BLOCK=block, num_warps=min(8, max(1, block // 512)),
                                       **kernel_options(x.device))
    return total.view(x.shape), out.view(x.shape)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, T, sx_b, sx_h, sx_t, sc_b, sc_t, HALF: tl.constexpr,
                 PDL: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # one (batch, head, token) row
    wait_then_release(PDL)
    t, h, b = pid % T, (pid // T) % H, pid // (T * H)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    x = x_ptr + b * sx_b + h * sx_h + t * sx_t
    x1 = tl.load(x + i, mask=mask).to(tl.float32)
    x2 = tl.load(x + HALF + i, mask=mask).to(tl.float32)
    c = cos_ptr + b * sc_b + t * sc_t
    s = sin_ptr + b * sc_b + t * sc_t
    out = out_ptr + pid * 2 * HALF
    ty = out_ptr.dtype.element_ty
    y1 = x1 * tl.load(c + i, mask=mask).to(tl.float32) - x2 * tl.load(s + i, mask=mask).to(tl.float32)
    y2 = x2 * tl.load(c + HALF + i, mask=mask).to(tl.float32) + x1 * tl.load(s + HALF + i, mask=mask).to(tl.float32)
    tl.store(out + i, y1.to(ty), mask=mask)
    tl.store(out + HALF + i, y2.to(ty), mask=mask)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, D] (any strides, last dim contiguous) rotated by cos/sin [B, 1, T, D];
    a contiguous [B, H, T, D] result."""
    B, H, T, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.expand(B, 1, T, D), sin.expand(B, 1, T, D)
    if cos.stride(-1) != 1 or cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(B, H, T, D, dtype=x.dtype, device=x.device)
    half = D // 2
    _rope_kernel[(B * H * T,)](x, cos, sin, out, H, T, x.stride(0), x.stride(1), x.stride(2),
                               cos.stride(0), cos.stride(2), HALF=half, BLOCK=triton.next_power_of_2(half),
                               num_warps=1, **kernel_options(x.device))
    return out


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n_cols, gate_row_stride, up_row_stride, PDL: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    wait_then_release(PDL)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask).to(tl.float32)
    u = tl.load(up_ptr + row * up_row_stride + cols, mask=mask).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (act * u).to(ty), mask=mask)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """SiLU(gate) * up, elementwise (the gated MLP's activation). gate and up may be column
    slices of one fused matmul output: rows are addressed by stride, not copied."""
    n = gate.shape[-1]
    gate_rows, up_rows = gate.reshape(-1, n), up.reshape(-1, n)
    if gate_rows.stride(-1) != 1 or up_rows.stride(-1) != 1:
        gate_rows, up_rows = gate_rows.contiguous(), up_rows.contiguous()
    out = torch.empty(gate_rows.shape, dtype=gate.dtype, device=gate.device)
    block = 1024
    grid = (gate_rows.shape[0], triton.cdiv(n, block))
    _silu_mul_kernel[grid](gate_rows, up_rows, out, n, gate_rows.stride(0), up_rows.stride(0), BLOCK=block, num_warps=4,
                           **kernel_options(gate.device))
    return out.view(gate.shape)


@triton.jit
def _store_token_kernel(k_ptr, v_ptr, dense_k_ptr, dense_v_ptr, slots_ptr, index_ptr, H,
                        s_k_b, s_k_h, s_v_b, s_v_h, s_d_slot, s_d_h, s_d_t, D: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # one (batch row, kv head)
    wait_then_release(PDL)
    b, h = pid // H, pid % H
    slot = tl.load(slots_ptr + b).to(tl.int64)
    t = tl.load(index_ptr + b).to(tl.int64)
    d = tl.arange(0, D)
    dst = slot * s_d_slot + h * s_d_h + t * s_d_t + d
    ty = dense_k_ptr.dtype.element_ty
    tl.store(dense_k_ptr + dst, tl.load(k_ptr + b * s_k_b + h * s_k_h + d).to(ty))
    tl.store(dense_v_ptr + dst, tl.load(v_ptr + b * s_v_b + h * s_v_h + d).to(ty))


def store_token(dense_k: Tensor, dense_v: Tensor, k: Tensor, v: Tensor, slots: Tensor, index: Tensor) -> None:
    """Write k, v [B, H, D] (any strides, unit last) of row b into dense_k/v[slots[b], :, index[b]]."""
    B, H, D = k.shape
    if dense_k.stride() != dense_v.stride() or dense_k.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("store_token needs unit last strides and dense K and V buffers of one layout")
    if D & (D - 1):
        raise ValueError(f"store_token needs a power-of-2 head dim, got {D}")
    _store_token_kernel[(B * H,)](k, v, dense_k, dense_v, slots, index, H, k.stride(0), k.stride(1),
                                  v.stride(0), v.stride(1), dense_k.stride(0), dense_k.stride(1), dense_k.stride(2),
                                  D=D, num_warps=1, **kernel_options(k.device))


INTERPRETED = isinstance(_rms_norm_kernel, InterpretedFunction)
