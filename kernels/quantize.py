"""Triton encode of K or V tiles straight into their pool pages, for every format.

One program per (tile, kv head): it loads the head's [T, D] tile in "slot-major" order,
[T/rows, rows, D] with token t = slot * rows + row, which is the order of the packed code
planes (quant/rtn.py), so packing is a shift and a sum over the slot axis. Between load and
store the same stages as quant/'s torch codecs run, switched by the codec's constants
(codec.kernel_layout: quant/layout.py, encode-only fields included):

    rotate (KVarN: x @ Hd)  ->  Sinkhorn balance (KVarN)  ->  per-channel or per-token-group
    range (RTN min/max, NF4 absmax over its block, Kitty: rank channels by mean |x|, 4 bits
    for the top ones)  ->  codes  ->  pack into the code plane(s)  ->  scales, zeros, ids.

The torch codecs are the oracle. RTN, Kitty and NF4 reproduce them bit for bit (fp16
rounding of ranges is done with explicit floor/ceil, divisions are IEEE round-to-nearest,
rounding is half-to-even like torch.round); KVarN's Sinkhorn uses exp/log/sqrt whose last
bits differ between implementations, so its codes may differ by one step on values that sit
on a rounding boundary (tests compare decoded values there).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from torch import Tensor

from quant.hadamard import hadamard
from quant.kvarn import STD_CLAMP
from quant.nqkv import NF4_LEVELS

STD_LO = tl.constexpr(STD_CLAMP[0])
STD_HI = tl.constexpr(STD_CLAMP[1])


@triton.jit
def swapped(i):
    """i with bits 0 and 1 exchanged (0 1 2 3 -> 0 2 1 3 in every four; an involution): where the
    swapped unpack of kernels/attention.py takes element i from, and so where key channel i is
    stored (quant.base.SwappedColumns)."""
    return (i & ~3) | ((i & 1) << 1) | ((i >> 1) & 1)


@triton.jit
def _f16_floor(x):
    """Largest fp16 <= x (fp16 conversion rounds to nearest; step down one ulp if it went up)."""
    h = x.to(tl.float16)
    b = h.to(tl.int16, bitcast=True)
    down = tl.where(h > 0, b - 1, tl.where(h < 0, b + 1, -32767)).to(tl.int16)  # -32767 = 0x8001 = -min subnormal
    return tl.where(h.to(tl.float32) > x, down.to(tl.float16, bitcast=True), h)


@triton.jit
def _f16_ceil(x):
    """Smallest fp16 >= x."""
    h = x.to(tl.float16)
    b = h.to(tl.int16, bitcast=True)
    up = tl.where(h >= 0, b + 1, b - 1).to(tl.int16)
    return tl.where(h.to(tl.float32) < x, up.to(tl.float16, bitcast=True), h)


@triton.jit
def _round_half_even(q):
    """torch.round: nearest integer, ties to even."""
    r = tl.floor(q)
    f = q - r
    odd = (r.to(tl.int32) & 1) == 1
    return tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r)


@triton.jit
def _rtn(x, lo, hi, levels):
    """quant.rtn.quantize: int32 codes of x and the fp16 (scale, zero) of the range [lo, hi]."""
    zero = _f16_floor(lo)
    # products with IEEE reciprocals, exactly as quant/rtn.py spells its divisions
    scale = _f16_ceil((hi - zero.to(tl.float32)) * tl.math.div_rn(1.0, levels))
    s = scale.to(tl.float32)
    inv = tl.where(s > 0, tl.math.div_rn(1.0, tl.where(s > 0, s, 1.0)), 0.0)  # scale 0 (constant group): code 0
    code = tl.minimum(_round_half_even(tl.maximum((x - zero.to(tl.float32)) * inv, 0.0)), levels)
    return code.to(tl.int32), scale, zero


@triton.jit
def _col_std(z, valid, T: tl.constexpr):
    """Population std [D] of every channel over the T valid tokens of z [S, R, D], clamped like quant.kvarn."""
    zv = tl.where(valid, z, 0.0)
    dev = tl.where(valid, zv - (tl.sum(tl.sum(zv, 0), 0) / T)[None, None, :], 0.0)
    return tl.clamp(tl.sqrt(tl.sum(tl.sum(dev * dev, 0), 0) / T), STD_LO, STD_HI)


@triton.jit
def _row_std(z, D: tl.constexpr):
    """Population std [S, R] of every token over its D channels, clamped."""
    dev = z - (tl.sum(z, 2) / D)[:, :, None]
    return tl.clamp(tl.sqrt(tl.sum(dev * dev, 2) / D), STD_LO, STD_HI)


@triton.jit
def _imbalance(z, valid, T: tl.constexpr, D: tl.constexpr):
    """quant.kvarn.imbalance of one tile: max/min column std + max/min row std (valid rows only)."""
    col = _col_std(z, valid, T)
    row = _row_std(z, D)
    row_ok = tl.sum(valid.to(tl.int32), 2) > 0
    row_max = tl.max(tl.max(tl.where(row_ok, row, 0.0), 1), 0)
    row_min = tl.min(tl.min(tl.where(row_ok, row, float("inf")), 1), 0)
    return tl.max(col, 0) / tl.min(col, 0) + row_max / row_min


@triton.jit
def _plane_offsets(page, h, rows, c, H: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                   CHANNEL_MAJOR: tl.constexpr, COLUMNS_SWAPPED: tl.constexpr):
    """Offsets of rows [R, 1] x channels c [D] of kv head h's [ROWS, D] code plane in a page: stored
    [D, ROWS] if CHANNEL_MAJOR (quant.base.ChannelMajor), else [ROWS, D] with channel c in column
    0 2 1 3 of its four if COLUMNS_SWAPPED (quant.base.SwappedColumns)."""
    if CHANNEL_MAJOR:
        return page * (H * ROWS * D) + h * (ROWS * D) + rows + c[None, :] * ROWS
    return page * (H * ROWS * D) + h * (ROWS * D) + rows * D + (swapped(c) if COLUMNS_SWAPPED else c)[None, :]


@triton.jit
def _encode_kernel(
    X, ROW_IDS, PAGE_IDS, HAD, MIDS, QW, CODES, SCALE, ZERO, MULT, HIGH, IDS,
    sx_n, sx_h, sx_t,
    H: tl.constexpr, D: tl.constexpr, T: tl.constexpr, SLOTS: tl.constexpr, SLOTS_PAD: tl.constexpr,
    ROWS_PAD: tl.constexpr, SINKHORN: tl.constexpr, SCORE: tl.constexpr,
    BITS: tl.constexpr, ROWS: tl.constexpr, PER_TOKEN: tl.constexpr, S_PAGE: tl.constexpr, S_HEAD: tl.constexpr,
    S_TOK: tl.constexpr, HDIV: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, MULT_KIND: tl.constexpr,
    NF4: tl.constexpr, N_HIGH: tl.constexpr, CHANNEL_MAJOR: tl.constexpr, COLUMNS_SWAPPED: tl.constexpr,
    ROTATE: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    page = tl.load(PAGE_IDS + n).to(tl.int64)
    j = tl.arange(0, SLOTS_PAD)[:, None, None]
    i = tl.arange(0, ROWS_PAD)[None, :, None]
    c = tl.arange(0, D)
    d = c[None, None, :]
    t = j * ROWS + i  # [S, R, 1]: slot-major, the packing order
    valid = (j < SLOTS) & (i < ROWS) & (t < T)
    x_row = X + tl.load(ROW_IDS + n).to(tl.int64) * sx_n + t * sx_t + d
    x = tl.load(x_row + h * sx_h, mask=valid, other=0.0).to(tl.float32)
    if BITS == 16:
        tl.store(CODES + page * (H * T * D) + h * (T * D) + t * D + d, x.to(tl.float16), mask=valid)
    else:
        if ROTATE:  # KVarN: x @ Hd (IEEE fp32, as close as a matmul gets to quant's butterflies)
            x = tl.reshape(tl.dot(tl.reshape(x, [SLOTS_PAD * ROWS_PAD, D]), tl.load(HAD + c[:, None] * D + c[None, :]),
                                  input_precision="ieee"), [SLOTS_PAD, ROWS_PAD, D])
        if SINKHORN > 0:
            log_r = tl.zeros([SLOTS_PAD, ROWS_PAD], tl.float32)
            log_c = tl.zeros([D], tl.float32)
            best = _imbalance(x, valid, T, D)
            best_r = log_r
            best_c = log_c
            for _ in range(SINKHORN):
                log_c += tl.log(_col_std(x * tl.exp(-log_r[:, :, None] - log_c[None, None, :]), valid, T))
                log_r += tl.log(_row_std(x * tl.exp(-log_r[:, :, None] - log_c[None, None, :]), D))
                score = _imbalance(x * tl.exp(-log_r[:, :, None] - log_c[None, None, :]), valid, T, D)
                better = score < best
                best = tl.where(better, score, best)
                best_r = tl.where(better, log_r, best_r)
                best_c = tl.where(better, log_c, best_c)
            # the stored factor, fp16 in its normal range; RTN then runs on x / factor
            if MULT_KIND == 1:
                kept = tl.clamp(tl.exp(best_r), 2.0**-14, 6e4).to(tl.float16)[:, :, None]
                tl.store(MULT + page * (H * T) + h * T + t, kept, mask=valid)
            else:
                kept = tl.clamp(tl.exp(best_c), 2.0**-14, 6e4).to(tl.float16)[None, None, :]
                tl.store(MULT + page * (H * D) + h * D + d, kept)
            x = tl.math.div_rn(x, kept.to(tl.float32))
        if PER_TOKEN:
            # one range per (token, group of GROUP channels): view the tile as [S, R, D/GROUP, GROUP]
            xg = tl.reshape(x, [SLOTS_PAD, ROWS_PAD, D // GROUP, GROUP])
            g = tl.arange(0, D // GROUP)[None, None, :]
            s_off = page * S_PAGE + (h // HDIV) * S_HEAD + t * S_TOK + g
            s_ok = valid
            if NF4:
                if HDIV > 1:  # the block spans HDIV heads: absmax over all of them
                    amax = tl.zeros([SLOTS_PAD, ROWS_PAD], tl.float32)
                    for hh in tl.static_range(HDIV):
                        xo = tl.load(x_row + ((h // HDIV) * HDIV + hh) * sx_h, mask=valid, other=0.0)
                        amax = tl.maximum(amax, tl.max(tl.abs(xo.to(tl.float32)), 2))
                    amax = amax[:, :, None]
                    # one program of the block writes its scale (h + 0 * t: a tensor, as the interpreter
                    # rejects a scalar & tensor mask)
                    s_ok = valid & ((h + 0 * t) % HDIV == 0)
                else:
                    amax = tl.max(tl.abs(xg), 3)
                scale = amax.to(tl.float16)
                s = scale.to(tl.float32)[:, :, :, None]
                y = tl.math.div_rn(xg, tl.where(s > 0, s, 1.0))  # an all-zero block stays zero
                code = tl.zeros([SLOTS_PAD, ROWS_PAD, D // GROUP, GROUP], tl.int32)
                for k in tl.static_range(15):  # nearest level = number of midpoints below y
                    code += (y > tl.load(MIDS + k)).to(tl.int32)
            else:
                code, scale, zero = _rtn(xg, tl.min(xg, 3)[:, :, :, None], tl.max(xg, 3)[:, :, :, None],
                                         tl.full([1, 1, 1, 1], (1 << BITS) - 1, tl.float32))
                scale = tl.reshape(scale, [SLOTS_PAD, ROWS_PAD, D // GROUP])
                tl.store(ZERO + s_off, tl.reshape(zero, [SLOTS_PAD, ROWS_PAD, D // GROUP]), mask=s_ok)
            tl.store(SCALE + s_off, scale, mask=s_ok)
            code = tl.reshape(code, [SLOTS_PAD, ROWS_PAD, D])
        else:
            # one range per channel over the page's tokens
            lo = tl.min(tl.min(tl.where(valid, x, float("inf")), 0), 0)
            hi = tl.max(tl.max(tl.where(valid, x, float("-inf")), 0), 0)
            levels = tl.full([1, 1, D], (1 << BITS) - 1, tl.float32)
            if N_HIGH > 0:
                # Kitty: rank channels by score (rank = how many beat it; ties by channel id), top N_HIGH get 4 bits
                if SCORE == 0:  # mean |x|
                    score = tl.sum(tl.sum(tl.abs(tl.where(valid, x, 0.0)), 0), 0) / T
                elif SCORE == 1:  # range over the page's tokens
                    score = hi - lo
                else:  # q-aware: range x the mean |q| of the channel, QW [N, H, D]
                    score = (hi - lo) * tl.load(QW + (n * H + h) * D + c)
                other = score[None, :]
                mine = score[:, None]
                beats = (other > mine) | ((other == mine) & (c[None, :] < c[:, None]))
                rank = tl.sum(beats.to(tl.int32), 1)
                boosted = rank < N_HIGH
                levels = tl.where(boosted, 15.0, 3.0)[None, None, :]
                tl.store(IDS + page * (H * N_HIGH) + h * N_HIGH + rank, c.to(tl.int16), mask=boosted)
            code, scale, zero = _rtn(x, lo[None, None, :], hi[None, None, :], levels)
            s_off = page * S_PAGE + h * S_HEAD + d
            tl.store(SCALE + s_off, scale)
            tl.store(ZERO + s_off, zero)
        code = tl.where(valid, code, 0)  # slots past T stay zero
        shift = (2 if BITS == 3 else BITS) * j  # (3-bit codes: the two low bits here, the high bit below)
        rows = tl.arange(0, ROWS_PAD)[:, None]
        row_ok = rows < ROWS
        plane = _plane_offsets(page, h, rows, c, H, D, ROWS, CHANNEL_MAJOR, COLUMNS_SWAPPED)
        if N_HIGH > 0:
            # dense plane: the 2 low bits of every channel; sparse plane: the 2 high bits of boosted ones at their rank
            packed = tl.sum((code & 3) << shift, 0)
            tl.store(CODES + plane, packed.to(CODES.dtype.element_ty), mask=row_ok)
            high = tl.sum((code >> 2) << shift, 0)
            hi_off = page * (H * ROWS * N_HIGH) + h * (ROWS * N_HIGH) + rows * N_HIGH + rank[None, :]
            tl.store(HIGH + hi_off, high.to(HIGH.dtype.element_ty), mask=row_ok & boosted[None, :])
        else:
            packed = tl.sum(((code & 3) if BITS == 3 else code) << shift, 0)  # disjoint bit fields: the sum is their OR
            tl.store(CODES + plane, packed.to(CODES.dtype.element_ty), mask=row_ok)
            if BITS == 3:
                tl.static_assert(ROWS == ROWS_PAD, "3-bit pages need a power-of-2 token count")
                # the high bits as 1-bit codes in ROWS / 2 rows: token t = slot * ROWS + row sits in
                # row t % (ROWS / 2), slot t // (ROWS / 2) = 2 * slot + row // (ROWS / 2)
                high = tl.reshape(code >> 2, [2 * SLOTS_PAD, ROWS_PAD // 2, D])
                high = tl.sum(high << tl.arange(0, 2 * SLOTS_PAD)[:, None, None], 0)
                half = tl.arange(0, ROWS_PAD // 2)[:, None]
                tl.store(HIGH + _plane_offsets(page, h, half, c, H, D, ROWS // 2, CHANNEL_MAJOR, COLUMNS_SWAPPED),
                         high.to(HIGH.dtype.element_ty), mask=half < ROWS // 2)


# True when TRITON_INTERPRET=1 was set at import: the kernels then run on CPU tensors
INTERPRETED = isinstance(_encode_kernel, InterpretedFunction)


@functools.lru_cache(maxsize=None)
def _constants(device: torch.device, head_dim: int) -> tuple[Tensor, Tensor]:
    """The Walsh-Hadamard matrix and the 15 NF4 decision midpoints on `device`."""
    mids = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2
    return hadamard(head_dim).to(device), mids.to(device)


def encode_pages(codec, x: Tensor, pool_fields: dict[str, Tensor], page_ids: Tensor,
                 query_weight: Tensor | None = None, rows: Tensor | None = None) -> None:
    """Encode tiles x [N, H, T, D] (any float dtype, unit last stride) with `codec` into pool
    pages page_ids [N] (int), in place: pool_fields[name] is [num_pages, *field_shape].
    query_weight [N, H, D]: the mean |q| per channel, for a codec that needs_queries.
    rows [N] (int): tile n is x[rows[n]] instead, so that tiles are read where they lie (the
    cache's recent tier) rather than gathered into a copy first."""
    _, H, T, D = x.shape
    N = page_ids.shape[0]
    if (x.shape[0] if rows is None else rows.shape[0]) != N:
        raise ValueError(f"{x.shape[0] if rows is None else rows.shape[0]} tiles for {N} page ids")
    if N == 0:
        return
    if x.stride(-1) != 1 or D & (D - 1):
        raise ValueError(f"encode needs a unit last stride and a power-of-2 head dim, got D={D}")
    lay = codec.kernel_layout(H, D, T)
    if lay.encode_unsupported:
        raise ValueError(lay.encode_unsupported)
    if codec.needs_queries:  # no queries: every channel weighs the same, as in quant
        query_weight = (torch.ones(N, H, D, device=x.device) if query_weight is None
                         else query_weight.float().contiguous())
    slots = -(-T // lay.rows)
    had, mids = _constants(x.device, D)
    rows = torch.arange(N, device=x.device) if rows is None else rows
    _encode_kernel[(N, H)](
        x, rows, page_ids, had, mids, query_weight if codec.needs_queries else had, **lay.pointers(pool_fields, ""),
        sx_n=x.stride(0), sx_h=x.stride(1), sx_t=x.stride(2),
        H=H, D=D, T=T, SLOTS=slots, SLOTS_PAD=triton.next_power_of_2(slots),
        ROWS_PAD=triton.next_power_of_2(lay.rows), SINKHORN=lay.sinkhorn_iters,
        SCORE=lay.channel_score,
        **lay.constexprs(""), num_warps=8,
    )
