"""Triton kernels for the model's per-token arithmetic between the matmuls: RMSNorm (alone or
after the residual add), RoPE and the SiLU gate, each one kernel instead of the 2 to 8 that the
torch expressions launch, and, at a decode step, the rotation of q and k together with the store of the new K and V into the
cache's dense tier (one kernel, in place of a rotation and two index-put kernels with their
index arithmetic).

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

from .pdl import kernel_options, release_then_wait, wait_then_release


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
def _halves(x_ptr, cos_ptr, sin_ptr, ROPE: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """The halves (x1, x2) of one head's row at x_ptr, float32; with ROPE rotated by cos/sin
    (rotate_half convention: channel i pairs with i + HALF), else as loaded."""
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    x1 = tl.load(x_ptr + i, mask=mask).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + i, mask=mask).to(tl.float32)
    if ROPE:
        c1, c2 = tl.load(cos_ptr + i, mask=mask).to(tl.float32), tl.load(cos_ptr + HALF + i, mask=mask).to(tl.float32)
        s1, s2 = tl.load(sin_ptr + i, mask=mask).to(tl.float32), tl.load(sin_ptr + HALF + i, mask=mask).to(tl.float32)
        x1, x2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    return x1, x2


@triton.jit
def _store_halves(ptr, x1, x2, HALF: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    ty = ptr.dtype.element_ty
    tl.store(ptr + i, x1.to(ty), mask=i < HALF)
    tl.store(ptr + HALF + i, x2.to(ty), mask=i < HALF)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, T, sx_b, sx_h, sx_t, sc_b, sc_t, HALF: tl.constexpr,
                 PDL: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # one (batch, head, token) row
    wait_then_release(PDL)
    t, h, b = pid % T, (pid // T) % H, pid // (T * H)
    x1, x2 = _halves(x_ptr + b * sx_b + h * sx_h + t * sx_t, cos_ptr + b * sc_b + t * sc_t,
                      sin_ptr + b * sc_b + t * sc_t, True, HALF, BLOCK)
    _store_halves(out_ptr + pid * 2 * HALF, x1, x2, HALF, BLOCK)


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
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, dense_k_ptr, dense_v_ptr, slots_ptr,
                       index_ptr, HQ, s_q_b, s_q_h, s_k_b, s_k_h, s_v_b, s_v_h, s_c_b, s_d_slot, s_d_h, s_d_t,
                       ROPE: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads 0 .. HQ-1, then the kv heads
    release_then_wait(PDL)  # the attention's split kernel launches now (pdl.py)
    cos, sin = cos_ptr + b * s_c_b, sin_ptr + b * s_c_b
    if head < HQ:
        q1, q2 = _halves(q_ptr + b * s_q_b + head * s_q_h, cos, sin, ROPE, HALF, HALF)
        _store_halves(q_out_ptr + (b * HQ + head) * 2 * HALF, q1, q2, HALF, HALF)
    else:
        h = head - HQ
        dst = tl.load(slots_ptr + b).to(tl.int64) * s_d_slot + h * s_d_h + tl.load(index_ptr + b).to(tl.int64) * s_d_t
        k1, k2 = _halves(k_ptr + b * s_k_b + h * s_k_h, cos, sin, ROPE, HALF, HALF)
        _store_halves(dense_k_ptr + dst, k1, k2, HALF, HALF)
        v1, v2 = _halves(v_ptr + b * s_v_b + h * s_v_h, cos, sin, False, HALF, HALF)
        _store_halves(dense_v_ptr + dst, v1, v2, HALF, HALF)


def rope_store(q: Tensor, k: Tensor, v: Tensor, cos: Tensor | None, sin: Tensor | None, dense_k: Tensor,
               dense_v: Tensor, slots: Tensor, index: Tensor) -> Tensor:
    """A decode step's rotary embedding and K/V store in one kernel: q [B, Hq, D] and k [B, H, D]
    rotated by cos/sin [B, D] (None: not rotated), the rotated k and v written into
    dense_k/v[slots[b], :, index[b]]; returns the rotated q, contiguous. Inputs: any strides with a
    unit last one."""
    B, Hq, D = q.shape
    H = k.shape[1]
    rope = cos is not None
    if dense_k.stride() != dense_v.stride() or any(t.stride(-1) != 1 for t in (q, k, v, dense_k)):
        raise ValueError("rope_store needs unit last strides and dense K and V buffers of one layout")
    if rope and (cos.stride(-1) != 1 or cos.stride() != sin.stride()):
        cos, sin = cos.contiguous(), sin.contiguous()
    if D & (D - 1) or D < 2:
        raise ValueError(f"rope_store needs a power-of-2 head dim, got {D}")
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    _rope_store_kernel[(B, Hq + H)](q, k, v, cos if rope else q, sin if rope else q, out, dense_k, dense_v, slots,
                                    index, Hq, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                                    v.stride(1), cos.stride(0) if rope else 0, dense_k.stride(0), dense_k.stride(1),
                                    dense_k.stride(2), ROPE=rope, HALF=D // 2, num_warps=1,
                                    **kernel_options(q.device))
    return out


INTERPRETED = isinstance(_rms_norm_kernel, InterpretedFunction)
