"""Triton paged decode attention over the three tiers (FP16 sink, quantized pages, FP16 recent).

One program per (batch row, kv head, split, block of q rows). Splits 0 .. num_splits-1 each walk a
contiguous range of the row's pages (split-K over the context); the last two splits attend over
the FP16 sink and recent tiers. Every program serves all q heads of its kv head (GQA) and all
queries of the row as the M rows of one tile (blocks of 64 rows when a long query block makes M
larger), so each page is read once per kv head (and row block). The softmax is online (base 2);
each program writes its normalized partial output and log-sum-exp, and a second tiny kernel
merges them. Only those partials, never logits or dequantized K/V, go through global memory.

How a page is read (kernels/layout.py describes every format with one set of constants): every
format decodes as x = (level(code) * scale + zero) * mult, with scale/zero along one axis (channel
or token) and mult along the other. Those factors are never applied to the [tokens, D] tile:
channel factors fold into q (keys) or the output row (values) once per page, token factors into
the logits (keys) or the softmax weights (values) once per block, so the only per-element work is
turning codes into levels, which for RTN codes on the GPU is a few bit operations per four codes
(_UNPACK_ASM). The levels go to tl.dot (tensor cores) against the folded q and weights.

The cache's extras: `slots` (batch row b reads slot slots[b] of the page table and the dense
buffers), a sliding `window` (tokens older than a query's window are masked, whole pages of
them skipped) and `return_lse` (the merge also writes each query's log-sum-exp).
Rotated formats (KVarN): the page splits use fmt.rotate(q) and rotate their partial output
back (one [M, D] x [D, D] product per program) before the merge.
The torch oracle with the same signature is kernels/reference.py.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from torch import Tensor

from quant import PAGE_TOKENS

from .layout import Layout, layout, nf4_levels

LOG2E = 1.4426950408889634


# A packed byte's code of one slot -> float16 without an int->float conversion instruction (on
# Hopper those issue at a quarter of the ALU rate, and a 2-bit page needs one per element): shift
# the slot's bits down, spread bytes 0,1 and 2,3 of the 32-bit word into the 16-bit halves of two
# registers, keep the code bits and OR in the exponent of 1024.0, so each half reads as the fp16
# number 1024 + code ((a & b) | c is one lop3, truth table 0xea); subtracting 1024 two halves at
# a time leaves the code, exactly.
# Operands: $0, $1 the four fp16 results; $2 four packed bytes; $3..$6 the shift; $7..$10 the mask.
_UNPACK_ASM = tl.constexpr("""{
.reg .b32 w, lo, hi, magic;
mov.b32 magic, 0x64006400;
shr.b32 w, $2, $3;
prmt.b32 lo, w, 0, 0x4140;
prmt.b32 hi, w, 0, 0x4342;
lop3.b32 lo, lo, $7, magic, 0xea;
lop3.b32 hi, hi, $7, magic, 0xea;
sub.f16x2 $0, lo, magic;
sub.f16x2 $1, hi, magic;
}""")


@triton.jit
def _plane_rows(CODES, page, h, rows, d, H: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr):
    """Raw rows [len(rows), D] of kv head h's code plane (fp16 values when unquantized) in page `page` (int64)."""
    return tl.load(CODES + page * (H * ROWS * D) + h * (ROWS * D) + rows[:, None] * D + d[None, :])


@triton.jit
def _high_rows(HIGH, page, h, rows, r, H: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr):
    """Kitty: raw rows [len(rows), NB_PAD] of the sparse high plane [H, ROWS, NB] (columns past NB read 0)."""
    return tl.load(HIGH + page * (H * ROWS * NB) + h * (ROWS * NB) + rows[:, None] * NB + r[None, :],
                   mask=r[None, :] < NB, other=0)


@triton.jit
def _levels(raw, t0, t, LEVELS, BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_T: tl.constexpr,
            NF4: tl.constexpr, ASM: tl.constexpr):
    """level(code) [BLOCK_T, cols] of tokens t = t0 + arange(BLOCK_T), given their code rows raw
    (rows t % ROWS; the fp16 values themselves when BITS == 16): float16 or float32."""
    mask = (1 << BITS) - 1
    if BITS == 16:
        x = raw
    elif ASM and (ROWS % BLOCK_T == 0) and (not NF4) and (BITS != 3):
        # the block lies in one slot of its rows: one shift for the whole tile
        x = tl.inline_asm_elementwise(
            _UNPACK_ASM, "=r,=r,r,r,r,r,r,r,r,r,r",
            [raw, tl.full(raw.shape, BITS * (t0 // ROWS), tl.int32), tl.full(raw.shape, mask | mask << 16, tl.int32)],
            dtype=tl.float16, is_pure=True, pack=4)
    else:
        if ROWS % BLOCK_T == 0:
            code = (raw.to(tl.int32) >> (BITS * (t0 // ROWS))) & mask
        else:  # 3-bit words hold 10 tokens, or a block spans slots: each row has its own shift
            code = (raw.to(tl.int32) >> (BITS * (t // ROWS))[:, None]) & mask
        if NF4:
            x = tl.load(LEVELS + code)
        else:
            x = code.to(tl.float32)
    return x


@triton.jit
def _token_factor(PTR, page, h, t, S_PAGE: tl.constexpr, S_HEAD: tl.constexpr, S_TOK: tl.constexpr,
                  HDIV: tl.constexpr):
    """Float32 [len(t)]: a per-token factor of kv head h (scale, zero or KVarN's key multiplier)."""
    return tl.load(PTR + page * S_PAGE + (h // HDIV) * S_HEAD + t * S_TOK).to(tl.float32)


@triton.jit
def _channel_factor(PTR, page, h, d, S_PAGE: tl.constexpr, S_HEAD: tl.constexpr):
    """Float32 [D]: a per-channel factor of kv head h (scale, zero or KVarN's value multiplier)."""
    return tl.load(PTR + page * S_PAGE + h * S_HEAD + d).to(tl.float32)


@triton.jit
def _grouped(x, SCALE, ZERO, page, h, t, d, S_PAGE: tl.constexpr, S_HEAD: tl.constexpr, S_TOK: tl.constexpr,
             HDIV: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr):
    """level * scale + zero for scales per (token, group of channels), which do not fold into q or
    p: decoded element by element (options only, e.g. v_group=16; no preset uses them)."""
    off = page * S_PAGE + (h // HDIV) * S_HEAD + t[:, None] * S_TOK + d[None, :] // GROUP
    x = x.to(tl.float32) * tl.load(SCALE + off).to(tl.float32)
    if HAS_ZERO:
        x += tl.load(ZERO + off).to(tl.float32)
    return x


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Fold a block of base-2 logits s [M, N] into the running max m and sum l; returns them with
    the factor alpha for the old accumulator and the block's weights p. A row whose logits are
    all -inf so far (sliding window) keeps m = -inf, l = 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # avoids -inf - -inf = NaN
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def _split_kernel(
    Q, QP, UNROT, LEVELS, SLOTS, PT, NPAGES, SINK_K, SINK_V, NSINK, REC_K, REC_V, NREC, O_PART, LSE_PART,
    K_CODES, K_SCALE, K_ZERO, K_MULT, K_HIGH, K_IDS,
    V_CODES, V_SCALE, V_ZERO, V_MULT, V_HIGH, V_IDS,
    qk_scale, num_splits, pages_per_split, M, n_queries, q_pos_offset, window, s_pt_b, s_pt_p,
    s_sink_b, s_sink_h, s_sink_t, s_rec_b, s_rec_h, s_rec_t,
    H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, PAGE_T: tl.constexpr, BLOCK_T: tl.constexpr,
    ROTATED: tl.constexpr, NB_PAD: tl.constexpr, HAS_SLOTS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    ASM: tl.constexpr, UNROLL: tl.constexpr,
    K_BITS: tl.constexpr, K_ROWS: tl.constexpr, K_PER_TOKEN: tl.constexpr, K_S_PAGE: tl.constexpr,
    K_S_HEAD: tl.constexpr, K_S_TOK: tl.constexpr, K_HDIV: tl.constexpr, K_GROUP: tl.constexpr,
    K_HAS_ZERO: tl.constexpr, K_MULT_KIND: tl.constexpr, K_NF4: tl.constexpr, K_N_HIGH: tl.constexpr,
    V_BITS: tl.constexpr, V_ROWS: tl.constexpr, V_PER_TOKEN: tl.constexpr, V_S_PAGE: tl.constexpr,
    V_S_HEAD: tl.constexpr, V_S_TOK: tl.constexpr, V_HDIV: tl.constexpr, V_GROUP: tl.constexpr,
    V_HAS_ZERO: tl.constexpr, V_MULT_KIND: tl.constexpr, V_NF4: tl.constexpr, V_N_HIGH: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    h = bh % H
    dt = Q.dtype.element_ty  # tl.dot operand type: fp16 on the GPU path, fp32 for exact tests
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # this program's q rows of the kv head
    row_ok = rows < M
    d = tl.arange(0, D)
    q_off = (bh * M + rows)[:, None] * D + d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if HAS_SLOTS:  # batch row b lives in slot SLOTS[b] of the page table and the dense buffers
        slot = tl.load(SLOTS + b).to(tl.int64)
    else:
        slot = b.to(tl.int64)
    n_sink = tl.load(NSINK + b).to(tl.int32)
    n_pg = tl.load(NPAGES + b).to(tl.int32)
    n_rec = tl.load(NREC + b).to(tl.int32)
    # positions: sink token i -> i, page p token t -> n_sink + PAGE_T p + t, recent token i -> after the pages;
    # query row m (head-major, query-minor) sits at q_pos; with a window it sees pos only while q_pos - pos < window
    q_pos = n_sink + n_pg * PAGE_T + n_rec + q_pos_offset + rows % n_queries
    if split < num_splits:
        # quantized pages [p0, p1) of this row, q in the pages' (maybe rotated) domain
        q = tl.load(QP + q_off, mask=row_ok[:, None], other=0.0)  # kept in dt: fewer live registers
        p0 = split * pages_per_split
        p1 = tl.minimum(p0 + pages_per_split, n_pg)
        if HAS_WINDOW:  # skip the pages older than every query's window
            lo = tl.min(tl.where(row_ok, q_pos, 2**30), 0) - window - n_sink - (PAGE_T - 2)
            p0 = tl.maximum(p0, tl.where(lo > 0, (lo + PAGE_T - 1) // PAGE_T, 0))
        r = tl.arange(0, NB_PAD)
        rb = tl.arange(0, BLOCK_T)
        for p in range(p0, p1):
            page = tl.load(PT + slot * s_pt_b + p * s_pt_p).to(tl.int64)
            # Keys decode as k[t, d] = (level * scale + zero) * mult, scale/zero along one axis and
            # mult along the other. Channel factors fold into q once per page and token factors
            # scale the logits, so the tile itself is only the levels:
            #   per channel: s = mult_t * ((q * scale) . level_t + q . zero)
            #   per token:   s = scale_t * ((q * mult) . level_t) + zero_t * sum(q * mult)
            if K_PER_TOKEN or (K_BITS == 16):  # (fp16 pages: the values themselves)
                k_fold = tl.full([D], qk_scale, tl.float32)
                if K_MULT_KIND == 2:
                    k_fold *= _channel_factor(K_MULT, page, h, d, H * D, D)
            else:
                k_fold = _channel_factor(K_SCALE, page, h, d, K_S_PAGE, K_S_HEAD) * qk_scale
            qk = q * k_fold.to(dt)[None, :]
            if K_PER_TOKEN and K_HAS_ZERO:
                q_zero = tl.sum(qk.to(tl.float32), 1)
            elif K_HAS_ZERO and (K_BITS != 16) and (not K_PER_TOKEN):
                zero_fold = _channel_factor(K_ZERO, page, h, d, K_S_PAGE, K_S_HEAD) * qk_scale
                q_zero = tl.sum(q.to(tl.float32) * zero_fold[None, :], 1)
            if K_N_HIGH > 0:
                # Kitty: a boosted channel's level is low + 4 high, so q.k gains sum_r (4 q[id_r] scale[id_r]) high_r:
                # the sparse high plane is a second small product with q gathered at the boosted ids
                r_ok = r < K_N_HIGH
                ids = tl.load(K_IDS + page * (H * K_N_HIGH) + h * K_N_HIGH + r, mask=r_ok, other=0).to(tl.int32)
                s_hi = tl.load(K_SCALE + page * K_S_PAGE + h * K_S_HEAD + ids, mask=r_ok, other=0.0).to(tl.float32)
                q_hi = tl.load(QP + (bh * M + rows)[:, None] * D + ids[None, :],
                               mask=row_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
                q_hi = (q_hi * (4.0 * qk_scale) * s_hi[None, :]).to(dt)
            if V_PER_TOKEN and (V_MULT_KIND == 2):
                v_mult = _channel_factor(V_MULT, page, h, d, H * D, D)
            if (not V_PER_TOKEN) and (V_BITS != 16):
                v_scale = _channel_factor(V_SCALE, page, h, d, V_S_PAGE, V_S_HEAD)
                if V_HAS_ZERO:
                    v_zero = _channel_factor(V_ZERO, page, h, d, V_S_PAGE, V_S_HEAD)
            # a plane with exactly BLOCK_T rows holds every block of the page in the same rows (one
            # slot each): load it once per page and only shift per block
            if K_ROWS == BLOCK_T:
                k_raw = _plane_rows(K_CODES, page, h, rb, d, H, D, K_ROWS)
            if V_ROWS == BLOCK_T:
                v_raw = _plane_rows(V_CODES, page, h, rb, d, H, D, V_ROWS)
            if (K_N_HIGH > 0) and (K_ROWS == BLOCK_T):
                hi_raw = _high_rows(K_HIGH, page, h, rb, r, H, K_ROWS, K_N_HIGH)
            for t0 in tl.range(0, PAGE_T, BLOCK_T, loop_unroll_factor=UNROLL):
                t = t0 + rb
                if K_ROWS != BLOCK_T:
                    k_raw = _plane_rows(K_CODES, page, h, t % K_ROWS, d, H, D, K_ROWS)
                k = _levels(k_raw, t0, t, LEVELS, K_BITS, K_ROWS, BLOCK_T, K_NF4, ASM)
                if K_PER_TOKEN and (K_GROUP < D):
                    k = _grouped(k, K_SCALE, K_ZERO, page, h, t, d, K_S_PAGE, K_S_HEAD, K_S_TOK, K_HDIV,
                                 K_GROUP, K_HAS_ZERO)
                s = tl.dot(qk, tl.trans(k.to(dt)))
                if K_N_HIGH > 0:
                    if K_ROWS != BLOCK_T:
                        hi_raw = _high_rows(K_HIGH, page, h, t % K_ROWS, r, H, K_ROWS, K_N_HIGH)
                    hi = _levels(hi_raw, t0, t, LEVELS, 2, K_ROWS, BLOCK_T, False, False)
                    s += tl.dot(q_hi, tl.trans(hi.to(dt)))
                if K_BITS == 16:
                    pass
                elif K_PER_TOKEN:
                    if K_GROUP == D:
                        s *= _token_factor(K_SCALE, page, h, t, K_S_PAGE, K_S_HEAD, K_S_TOK, K_HDIV)[None, :]
                        if K_HAS_ZERO:
                            k_zero = _token_factor(K_ZERO, page, h, t, K_S_PAGE, K_S_HEAD, K_S_TOK, K_HDIV)
                            s += q_zero[:, None] * k_zero[None, :]
                else:
                    if K_HAS_ZERO:
                        s += q_zero[:, None]
                    if K_MULT_KIND == 1:
                        s *= _token_factor(K_MULT, page, h, t, H * PAGE_T, PAGE_T, 1, 1)[None, :]
                if HAS_WINDOW:
                    s = tl.where(q_pos[:, None] - (n_sink + p * PAGE_T + t)[None, :] < window, s, float("-inf"))
                m_i, l_i, alpha, w = _softmax_step(s, m_i, l_i)
                # values, folded the other way: token factors scale the weights w, channel factors the sum
                #   per token:   o = mult_d * ((w * scale) @ level + sum(w * zero))
                #   per channel: o = scale_d * ((w * mult) @ level) + zero_d * sum(w * mult)
                if V_ROWS != BLOCK_T:
                    v_raw = _plane_rows(V_CODES, page, h, t % V_ROWS, d, H, D, V_ROWS)
                v = _levels(v_raw, t0, t, LEVELS, V_BITS, V_ROWS, BLOCK_T, V_NF4, ASM)
                if V_BITS == 16:
                    pv = tl.dot(w.to(dt), v.to(dt))
                elif V_PER_TOKEN:
                    if V_GROUP < D:
                        v = _grouped(v, V_SCALE, V_ZERO, page, h, t, d, V_S_PAGE, V_S_HEAD, V_S_TOK, V_HDIV,
                                     V_GROUP, V_HAS_ZERO)
                        pv = tl.dot(w.to(dt), v.to(dt))
                    else:
                        v_scale = _token_factor(V_SCALE, page, h, t, V_S_PAGE, V_S_HEAD, V_S_TOK, V_HDIV)
                        pv = tl.dot((w * v_scale[None, :]).to(dt), v.to(dt))
                        if V_HAS_ZERO:
                            v_zero = _token_factor(V_ZERO, page, h, t, V_S_PAGE, V_S_HEAD, V_S_TOK, V_HDIV)
                            pv += tl.sum(w * v_zero[None, :], 1)[:, None]
                    if V_MULT_KIND == 2:
                        pv *= v_mult[None, :]
                else:
                    if V_MULT_KIND == 1:
                        w *= _token_factor(V_MULT, page, h, t, H * PAGE_T, PAGE_T, 1, 1)[None, :]
                    pv = tl.dot(w.to(dt), v.to(dt)) * v_scale[None, :]
                    if V_HAS_ZERO:
                        pv += tl.sum(w, 1)[:, None] * v_zero[None, :]
                acc = acc * alpha[:, None] + pv
        if ROTATED:  # back from the rotated domain (linear, so before normalizing is fine)
            acc = tl.dot(acc, tl.load(UNROT + d[:, None] * D + d[None, :]))
    else:
        # FP16 tiers: split num_splits = sink, num_splits + 1 = recent
        q_dense = (tl.load(Q + q_off, mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale).to(dt)
        if split == num_splits:
            k_base = SINK_K + slot * s_sink_b + h * s_sink_h
            v_base = SINK_V + slot * s_sink_b + h * s_sink_h
            s_t = s_sink_t
            n = n_sink
            first = n_sink * 0  # a tensor like the other branch's (compiled ifs need matching types)
        else:
            k_base = REC_K + slot * s_rec_b + h * s_rec_h
            v_base = REC_V + slot * s_rec_b + h * s_rec_h
            s_t = s_rec_t
            n = n_rec
            first = n_sink + n_pg * PAGE_T
        for t0 in range(0, n, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            ok = t < n
            off = t[:, None] * s_t + d[None, :]
            k = tl.load(k_base + off, mask=ok[:, None], other=0.0).to(dt)
            seen = ok[None, :]
            if HAS_WINDOW:
                seen = seen & (q_pos[:, None] - (first + t)[None, :] < window)
            s = tl.where(seen, tl.dot(q_dense, tl.trans(k)), float("-inf"))
            m_i, l_i, alpha, w = _softmax_step(s, m_i, l_i)
            v = tl.load(v_base + off, mask=ok[:, None], other=0.0).to(dt)
            acc = acc * alpha[:, None] + tl.dot(w.to(dt), v)
    # an empty split (no pages in range, empty tier) writes o = 0, lse = -inf: it drops out of the merge
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    part = (bh * (num_splits + 2) + split) * M + rows
    tl.store(O_PART + part[:, None] * D + d[None, :], o, mask=row_ok[:, None])
    tl.store(LSE_PART + part, lse, mask=row_ok)


@triton.jit
def _merge_kernel(O_PART, LSE_PART, OUT, LSE_OUT, n_parts, M, D: tl.constexpr, PARTS_PAD: tl.constexpr,
                  RETURN_LSE: tl.constexpr):
    """out[bh, m] = sum over splits of o_s * 2^lse_s / sum 2^lse_s (0 if no split saw a token),
    and optionally the total log-sum-exp in natural log."""
    bh = tl.program_id(0)
    m = tl.program_id(1)
    s = tl.arange(0, PARTS_PAD)
    ok = s < n_parts
    d = tl.arange(0, D)
    part = (bh * n_parts + s) * M + m
    lse = tl.load(LSE_PART + part, mask=ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)
    total = tl.sum(w, 0)
    o = tl.load(O_PART + part[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.maximum(total, 1e-30)
    tl.store(OUT + (bh * M + m) * D + d, out.to(OUT.dtype.element_ty))
    if RETURN_LSE:
        lse_all = tl.where(total > 0, top + tl.log2(tl.maximum(total, 1e-30)), float("-inf"))
        tl.store(LSE_OUT + bh * M + m, lse_all * 0.6931471805599453)  # base 2 -> natural log


# True when TRITON_INTERPRET=1 was set at import: the kernels then run on CPU tensors
INTERPRETED = isinstance(_split_kernel, InterpretedFunction)


def _scratch(shape: tuple[int, ...], device: torch.device) -> Tensor:
    """Partial-output workspace (tests replace this to poison it)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=None)
def _unrotation(fmt, head_dim: int, device: torch.device) -> Tensor:
    """U [D, D] with fmt.unrotate(x) = x @ U (unrotate is linear along the last dim)."""
    return fmt.unrotate(torch.eye(head_dim, device=device)).float().contiguous()


@functools.lru_cache(maxsize=None)
def _layouts(fmt, heads: int, head_dim: int) -> tuple[Layout, Layout]:
    return layout(fmt.k, heads, head_dim, PAGE_TOKENS), layout(fmt.v, heads, head_dim, PAGE_TOKENS)


# Launch defaults, measured on an H100 (bench.py kernels --variants auto,u4,w1-t16,w2-t16,w2): with
# enough programs to fill the GPU (batch 16 and 64, or long contexts) one warp per program and
# 16-token steps were the fastest for every format (kitty, batch 64, 32k: 2.2 ms against 3.5 ms
# for four warps and 32-token steps): one warp keeps the softmax reductions inside the warp (no
# barriers), and the register file, not the instruction count, limits how many programs an SM
# holds. With few programs (batch 1, 4k: 64 programs) four warps, steps of a plane's rows and an
# unrolled step loop were faster (kitty 0.024 ms against 0.041 ms).
BLOCK_T = 16
DECODE_WARPS = 1
FEW_PROGRAMS_PER_SM = 2


def _plane_block(*layouts: Layout) -> int:
    """Tokens per step when there are few programs: the row count of the packed planes (each plane
    loaded once per page, one slot per step), 16..64."""
    rows = [lay.rows for lay in layouts if lay.bits != 16 and lay.rows & (lay.rows - 1) == 0]
    return max(16, min(min(rows, default=64), 64))


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def default_splits(n_cols: int, programs: int, device: torch.device) -> int:
    """Splits over a page table of n_cols columns: about 4 programs per SM (a program walks its
    pages one after the other, so more programs in flight hide more memory latency), but at
    least 4 pages per split so that the partials stay small next to the pages."""
    if n_cols == 0:
        return 0
    return max(1, min(-(-n_cols // 4), -(-4 * _sm_count(device) // programs)))


def decode_attention(q: Tensor, fmt, k_pages: dict[str, Tensor], v_pages: dict[str, Tensor],
                     page_table: Tensor, n_pages: Tensor,
                     sink_k: Tensor, sink_v: Tensor, n_sink: Tensor,
                     recent_k: Tensor, recent_v: Tensor, n_recent: Tensor,
                     scale: float, *, slots: Tensor | None = None, window: int | None = None,
                     return_lse: bool = False, out: Tensor | None = None, num_splits: int | None = None,
                     block_t: int | None = None, block_m: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, asm: bool | None = None, unroll: int | None = None,
                     maxnreg: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Triton version of kernels.reference.decode_attention (same arguments and results).

    q [B, Hq, D] or [B, Hq, T, D] (every query sees every stored token); slots, window,
    return_lse as in the reference. out: optional result buffer shaped like q (contiguous).
    num_splits: page splits per (row, kv head); default fills the GPU. block_t: tokens per
    inner step (a power of 2 from 16 to 128, default BLOCK_T, or the planes' rows when there are
    few programs; a plane whose row count equals it is loaded once per page). block_m: q rows per
    program (a power of 2 >= 16, the tl.dot minimum; default all of them up to 64). num_warps / num_stages / maxnreg: Triton launch options of the
    split kernel (default: DECODE_WARPS for one 16-row block and many programs, else 4). asm: unpack 2- and 4-bit
    codes with the PTX of _UNPACK_ASM (default: whenever the kernel is compiled, i.e. not under
    the interpreter). unroll: unroll factor of the loop over a page's steps (default 1; fully
    unrolled when there are few programs: unrolling costs registers, which only pays off then).
    """
    single = q.dim() == 3
    q4 = (q[:, :, None] if single else q).contiguous()
    B, Hq, Tq, D = q4.shape
    H = sink_k.shape[1]
    M = (Hq // H) * Tq  # q rows per kv head: its G heads times the queries
    if D & (D - 1) or D < 16:
        raise ValueError(f"the Triton attention needs a power-of-2 head dim >= 16, got {D}")
    for a, b_ in ((sink_k, sink_v), (recent_k, recent_v)):
        if a.stride() != b_.stride() or a.stride(-1) != 1:
            raise ValueError("sink/recent K and V views must share strides with a unit last stride")
    kl, vl = _layouts(fmt, H, D)
    P = page_table.shape[1]
    if num_splits is None:
        num_splits = default_splits(P, B * H, q.device)
    few = B * H * num_splits < FEW_PROGRAMS_PER_SM * _sm_count(q.device)
    block_t = block_t or (_plane_block(kl, vl) if few else BLOCK_T)
    if block_t & (block_t - 1) or PAGE_TOKENS % block_t or block_t < 16:
        raise ValueError(f"block_t must be a power of 2 from 16 to {PAGE_TOKENS}, got {block_t}")
    if block_m is None:
        block_m = min(64, max(16, triton.next_power_of_2(M)))
    elif block_m & (block_m - 1) or block_m < 16:
        raise ValueError(f"block_m must be a power of 2 >= 16, got {block_m}")
    if asm and INTERPRETED:
        raise ValueError("asm=True needs the compiled kernel (the Triton interpreter cannot run PTX)")
    qp = fmt.rotate(q4).contiguous() if fmt.rotated else q4
    unrot = _unrotation(fmt, D, q.device) if fmt.rotated else q4
    per_split = max(1, -(-P // max(num_splits, 1)))
    num_splits = -(-P // per_split)  # drop splits that could never get a page
    n_parts = num_splits + 2
    o_part = _scratch((B * H, n_parts, M, D), q.device)
    lse_part = _scratch((B * H, n_parts, M), q.device)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q's strides
    elif not out.is_contiguous():
        raise ValueError("out must be contiguous")
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device) if return_lse else out
    if num_warps is None:  # (a long query block, many rows, needs more threads for its accumulator)
        num_warps = DECODE_WARPS if block_m == 16 and not few else 4
    launch = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages), ("maxnreg", maxnreg))
              if v is not None}
    _split_kernel[(B * H, n_parts, triton.cdiv(M, block_m))](
        q4, qp, unrot, nf4_levels(q.device), n_pages if slots is None else slots,  # (SLOTS unread without slots)
        page_table, n_pages, sink_k, sink_v, n_sink,
        recent_k, recent_v, n_recent, o_part, lse_part,
        **kl.pointers(k_pages, "K_"), **vl.pointers(v_pages, "V_"),
        qk_scale=scale * LOG2E, num_splits=num_splits, pages_per_split=per_split, M=M, n_queries=Tq,
        q_pos_offset=-1 if single else 0, window=window or 0,
        s_pt_b=page_table.stride(0), s_pt_p=page_table.stride(1),
        s_sink_b=sink_k.stride(0), s_sink_h=sink_k.stride(1), s_sink_t=sink_k.stride(2),
        s_rec_b=recent_k.stride(0), s_rec_h=recent_k.stride(1), s_rec_t=recent_k.stride(2),
        H=H, D=D, BLOCK_M=block_m, PAGE_T=PAGE_TOKENS, BLOCK_T=block_t,
        ROTATED=fmt.rotated, NB_PAD=max(16, triton.next_power_of_2(kl.n_high)),
        HAS_SLOTS=slots is not None, HAS_WINDOW=window is not None, ASM=not INTERPRETED if asm is None else asm,
        UNROLL=unroll or (PAGE_TOKENS // block_t if few else 1),
        **kl.constexprs("K_"), **vl.constexprs("V_"), **launch,
    )
    _merge_kernel[(B * H, M)](o_part, lse_part, out, lse, n_parts, M, D=D,
                              PARTS_PAD=max(2, triton.next_power_of_2(n_parts)), RETURN_LSE=return_lse)
    return (out, lse) if return_lse else out
