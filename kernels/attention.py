"""Triton paged decode attention over the three tiers (FP16 sink, quantized pages, FP16 recent).

One program per (batch row, kv head, split, block of q rows). Splits 0 .. num_splits-1 each walk a contiguous
range of the row's pages (split-K over the context); the last two splits attend over the
FP16 sink and recent tiers. Every program serves all q heads of its kv head (GQA) and all
queries of the row as the M rows of one tile (blocks of 64 rows when a long query block
makes M larger), so each page is read once per kv head (and row block); pages
are dequantized in registers (kernels/layout.py describes every format with one set of
constants) and fed to tl.dot; the softmax is online (base 2). Each program writes its
normalized partial output and log-sum-exp; a second tiny kernel merges them. Only those
partials, never logits or dequantized K/V, go through global memory.

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
def _dequant(raw, SCALE, ZERO, MULT, LEVELS, page, h, t, d,
             H: tl.constexpr, D: tl.constexpr, PAGE_T: tl.constexpr,
             BITS: tl.constexpr, ROWS: tl.constexpr, PER_TOKEN: tl.constexpr, S_PAGE: tl.constexpr,
             S_HEAD: tl.constexpr, S_TOK: tl.constexpr, HDIV: tl.constexpr, GROUP: tl.constexpr,
             HAS_ZERO: tl.constexpr, MULT_KIND: tl.constexpr, NF4: tl.constexpr):
    """Float32 values [len(t), D] of tokens t, given the code rows t % ROWS they sit in (raw)."""
    if BITS == 16:
        x = raw.to(tl.float32)
    else:
        # split layout: token t is slot t // ROWS of its row
        code = (raw.to(tl.int32) >> (BITS * (t // ROWS))[:, None]) & ((1 << BITS) - 1)
        if NF4:
            level = tl.load(LEVELS + code)
        else:
            level = code.to(tl.float32)
        if PER_TOKEN:
            off = page * S_PAGE + (h // HDIV) * S_HEAD
            if GROUP == D:  # one scale per token: load a column, not a broadcast tile
                off = (off + t * S_TOK)[:, None]
            else:
                off = off + t[:, None] * S_TOK + d[None, :] // GROUP
        else:
            off = (page * S_PAGE + h * S_HEAD + d)[None, :]
        x = level * tl.load(SCALE + off).to(tl.float32)
        if HAS_ZERO:
            x += tl.load(ZERO + off).to(tl.float32)
        if MULT_KIND == 1:  # per-token factor [H, T]
            x *= tl.load(MULT + page * (H * PAGE_T) + h * PAGE_T + t).to(tl.float32)[:, None]
        if MULT_KIND == 2:  # per-channel factor [H, D]
            x *= tl.load(MULT + page * (H * D) + h * D + d).to(tl.float32)[None, :]
    return x


@triton.jit
def _dot_nt(a, b, MMA: tl.constexpr):
    """a [M, K] times b [N, K] transposed -> float32 [M, N]. MMA: tl.dot on tensor cores (operands in
    the type the caller gave them); else CUDA-core FMAs on float32 registers, s = sum_k a[:, None, k] b[None, :, k]
    (no M >= 16 padding, no conversion of the operands to dot layouts)."""
    if MMA:
        return tl.dot(a, tl.trans(b))
    else:
        return tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], 2)


@triton.jit
def _dot_nn(a, b, MMA: tl.constexpr):
    """a [M, K] times b [K, N] -> float32 [M, N]; MMA as in _dot_nt (CUDA cores: sum_k a[:, k, None] b[None, k, :])."""
    if MMA:
        return tl.dot(a.to(b.dtype), b)
    else:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)


@triton.jit
def _online_softmax(s, v, m_i, l_i, acc, MMA: tl.constexpr):
    """Fold a block of base-2 logits s [M, N] and values v [N, D] into the running (m, l, acc).
    A row whose logits are all -inf so far (sliding window) keeps m = -inf, l = 0, acc = 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # avoids -inf - -inf = NaN
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot_nn(p, v, MMA)
    return m_new, l_i, acc


@triton.jit
def _split_kernel(
    Q, QP, UNROT, LEVELS, SLOTS, PT, NPAGES, SINK_K, SINK_V, NSINK, REC_K, REC_V, NREC, O_PART, LSE_PART,
    K_CODES, K_SCALE, K_ZERO, K_MULT, K_HIGH, K_IDS,
    V_CODES, V_SCALE, V_ZERO, V_MULT, V_HIGH, V_IDS,
    qk_scale, num_splits, pages_per_split, M, n_queries, q_pos_offset, window, s_pt_b, s_pt_p,
    s_sink_b, s_sink_h, s_sink_t, s_rec_b, s_rec_h, s_rec_t,
    H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, PAGE_T: tl.constexpr, BLOCK_T: tl.constexpr,
    ROTATED: tl.constexpr, NB_PAD: tl.constexpr, HAS_SLOTS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_MMA: tl.constexpr,
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
    if DOT_MMA:
        dt = Q.dtype.element_ty  # tl.dot operand type: fp16 on the GPU path, fp32 for exact tests
    else:
        dt = tl.float32  # CUDA-core products: every operand stays in float32 registers
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
        q = (tl.load(QP + q_off, mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale).to(dt)
        p0 = split * pages_per_split
        p1 = tl.minimum(p0 + pages_per_split, n_pg)
        if HAS_WINDOW:  # skip the pages older than every query's window
            lo = tl.min(tl.where(row_ok, q_pos, 2**30), 0) - window - n_sink - (PAGE_T - 2)
            p0 = tl.maximum(p0, tl.where(lo > 0, (lo + PAGE_T - 1) // PAGE_T, 0))
        r = tl.arange(0, NB_PAD)
        r_ok = r < K_N_HIGH
        for p in range(p0, p1):
            page = tl.load(PT + slot * s_pt_b + p * s_pt_p).to(tl.int64)
            if K_N_HIGH > 0:
                # Kitty: k = (low + 4 high) * scale + zero, so q.k = q.k_low + sum_r (4 q[id_r] scale[id_r]) high_r;
                # the sparse high plane becomes a second small dot with q gathered at the boosted ids.
                ids = tl.load(K_IDS + page * (H * K_N_HIGH) + h * K_N_HIGH + r, mask=r_ok, other=0).to(tl.int32)
                s_hi = tl.load(K_SCALE + page * K_S_PAGE + h * K_S_HEAD + ids, mask=r_ok, other=0.0).to(tl.float32)
                q_hi = tl.load(QP + (bh * M + rows)[:, None] * D + ids[None, :],
                               mask=row_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
                q_hi = (q_hi * (4.0 * qk_scale) * s_hi[None, :]).to(dt)
            # a plane with exactly BLOCK_T rows holds every block of the page in the same rows (one
            # slot each): load it once per page and only shift per block
            rb = tl.arange(0, BLOCK_T)
            if K_ROWS == BLOCK_T:
                k_raw = _plane_rows(K_CODES, page, h, rb, d, H, D, K_ROWS)
            if V_ROWS == BLOCK_T:
                v_raw = _plane_rows(V_CODES, page, h, rb, d, H, D, V_ROWS)
            if (K_N_HIGH > 0) and (K_ROWS == BLOCK_T):
                hi_raw = _high_rows(K_HIGH, page, h, rb, r, H, K_ROWS, K_N_HIGH)
            for t0 in tl.static_range(0, PAGE_T, BLOCK_T):
                t = t0 + rb
                if K_ROWS != BLOCK_T:
                    k_raw = _plane_rows(K_CODES, page, h, t % K_ROWS, d, H, D, K_ROWS)
                k = _dequant(k_raw, K_SCALE, K_ZERO, K_MULT, LEVELS, page, h, t, d, H, D, PAGE_T,
                             K_BITS, K_ROWS, K_PER_TOKEN, K_S_PAGE, K_S_HEAD, K_S_TOK, K_HDIV, K_GROUP,
                             K_HAS_ZERO, K_MULT_KIND, K_NF4)
                s = _dot_nt(q, k.to(dt), DOT_MMA)
                if K_N_HIGH > 0:
                    if K_ROWS != BLOCK_T:
                        hi_raw = _high_rows(K_HIGH, page, h, t % K_ROWS, r, H, K_ROWS, K_N_HIGH)
                    hi = (hi_raw.to(tl.int32) >> (2 * (t // K_ROWS))[:, None]) & 3
                    s += _dot_nt(q_hi, hi.to(dt), DOT_MMA)
                if HAS_WINDOW:
                    s = tl.where(q_pos[:, None] - (n_sink + p * PAGE_T + t)[None, :] < window, s, float("-inf"))
                if V_ROWS != BLOCK_T:
                    v_raw = _plane_rows(V_CODES, page, h, t % V_ROWS, d, H, D, V_ROWS)
                v = _dequant(v_raw, V_SCALE, V_ZERO, V_MULT, LEVELS, page, h, t, d, H, D, PAGE_T,
                             V_BITS, V_ROWS, V_PER_TOKEN, V_S_PAGE, V_S_HEAD, V_S_TOK, V_HDIV, V_GROUP,
                             V_HAS_ZERO, V_MULT_KIND, V_NF4)
                m_i, l_i, acc = _online_softmax(s, v.to(dt), m_i, l_i, acc, DOT_MMA)
        if ROTATED:  # back from the rotated domain (linear, so before normalizing is fine)
            acc = _dot_nn(acc, tl.load(UNROT + d[:, None] * D + d[None, :]), DOT_MMA)
    else:
        # FP16 tiers: split num_splits = sink, num_splits + 1 = recent
        q = (tl.load(Q + q_off, mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale).to(dt)
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
            s = tl.where(seen, _dot_nt(q, k, DOT_MMA), float("-inf"))
            v = tl.load(v_base + off, mask=ok[:, None], other=0.0).to(dt)
            m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, DOT_MMA)
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


def _default_block(*layouts: Layout) -> int:
    """Tokens per inner step: the row count of the packed planes (one slot per step), 16..64."""
    rows = [lay.rows for lay in layouts if lay.bits != 16 and lay.rows & (lay.rows - 1) == 0]
    return max(16, min(min(rows, default=64), 64))


# q rows per kv head (GQA group times queries) up to which the products run on CUDA cores
MMA_MIN_ROWS = 0


def use_mma(m: int) -> bool:
    """Tensor cores (tl.dot) for a tile of m q rows per kv head? Only past MMA_MIN_ROWS. The
    CUDA-core path avoids padding a decode step's few rows to 16 and converting dequantized
    tiles to dot layouts, but compiled for sm_90 it needs 2-4x the instructions (its D
    reductions become warp shuffles), so until a GPU timing says otherwise every tile uses
    tensor cores (MMA_MIN_ROWS = 0); bench.py kernels --variants mma,fma-w8 times both."""
    return m > MMA_MIN_ROWS


def default_splits(n_cols: int, programs: int, device: torch.device) -> int:
    """Splits over a page table of n_cols columns: about 4 programs per SM (a program walks its
    pages one after the other, so more programs in flight hide more memory latency), but at
    least 4 pages per split so that the partials stay small next to the pages."""
    if n_cols == 0:
        return 0
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return max(1, min(-(-n_cols // 4), -(-4 * sms // programs)))


def decode_attention(q: Tensor, fmt, k_pages: dict[str, Tensor], v_pages: dict[str, Tensor],
                     page_table: Tensor, n_pages: Tensor,
                     sink_k: Tensor, sink_v: Tensor, n_sink: Tensor,
                     recent_k: Tensor, recent_v: Tensor, n_recent: Tensor,
                     scale: float, *, slots: Tensor | None = None, window: int | None = None,
                     return_lse: bool = False, out: Tensor | None = None, num_splits: int | None = None,
                     block_t: int | None = None, mma: bool | None = None, block_m: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Triton version of kernels.reference.decode_attention (same arguments and results).

    q [B, Hq, D] or [B, Hq, T, D] (every query sees every stored token); slots, window,
    return_lse as in the reference. out: optional result buffer shaped like q (contiguous).
    num_splits: page splits per (row, kv head); default fills the GPU. block_t: tokens per
    inner step (a power of 2 dividing 128, >= 16 with mma; default: the rows of the packed planes,
    so that each plane is loaded once per page, at most 32 without mma).
    mma: inner products on tensor cores (tl.dot, q rows padded to >= 16) or, False, as float32
    broadcast-sums on CUDA cores (no padding, no operand layout conversions); default: use_mma.
    block_m: q rows per program (a power of 2; default all of
    them up to 64 with mma, 16 without). num_warps / num_stages: Triton launch options of the
    split kernel (default: Triton's).
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
    mma = use_mma(M) if mma is None else bool(mma)
    block_t = block_t or (_default_block(kl, vl) if mma else min(32, _default_block(kl, vl)))
    if block_t & (block_t - 1) or PAGE_TOKENS % block_t or (mma and block_t < 16):
        raise ValueError(f"block_t must be a power of 2 dividing {PAGE_TOKENS} (>= 16 with mma), got {block_t}")
    if block_m is None:
        block_m = min(64, max(16, triton.next_power_of_2(M))) if mma else min(16, triton.next_power_of_2(M))
    elif block_m & (block_m - 1) or (mma and block_m < 16):
        raise ValueError(f"block_m must be a power of 2 (>= 16 with mma), got {block_m}")
    qp = fmt.rotate(q4).contiguous() if fmt.rotated else q4
    unrot = _unrotation(fmt, D, q.device) if fmt.rotated else q4
    P = page_table.shape[1]
    if num_splits is None:
        num_splits = default_splits(P, B * H, q.device)
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
    launch = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
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
        ROTATED=fmt.rotated, NB_PAD=max(16 if mma else 1, triton.next_power_of_2(kl.n_high)),
        HAS_SLOTS=slots is not None, HAS_WINDOW=window is not None, DOT_MMA=mma,
        **kl.constexprs("K_"), **vl.constexprs("V_"), **launch,
    )
    _merge_kernel[(B * H, M)](o_part, lse_part, out, lse, n_parts, M, D=D,
                              PARTS_PAD=max(2, triton.next_power_of_2(n_parts)), RETURN_LSE=return_lse)
    return (out, lse) if return_lse else out
