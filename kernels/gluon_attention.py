"""The split kernel of decode attention for few-row launches of 2-bit pages, written in Gluon.

Same algorithm, inputs and partial outputs as kernels/attention.py's _split_kernel (which stays the
reference implementation, checked on CPU under the interpreter; this one runs only compiled, and
tests/test_kernels.py checks it on the GPU), for the case that sets batch 1's speed: Kitty and
KIVI-2 pages (2-bit keys per channel, optional boosted plane; 2-bit values per token), D = 128,
at most 8 query rows a kv head, no window. decode_attention runs it where attention._gluon_split
says (by default Kitty's pages in launches that fill the GPU) and runs the same merge kernel after it.

Why Gluon: at batch 1 the page loop is bound by each warp's instruction count and the latency
between dependent instructions (docs/benchmarks.md, session 25). Triton routes the codes through
shared memory on their way into the MMA operand layout, and re-pairs q's operand registers before
every key product. Gluon states the layouts, so nothing here touches shared memory:

- Codes load straight into MMA operand registers. The MMA's reduced axis is a free labelling: the
  key product may pair logical channel d with any physical channel as long as q uses the same
  pairing, and the value product may pair logical token k with any token as long as the weights
  use the same one. The labelling is picked so that each thread's bytes lie in whole runs of the
  page (two runs of 16 bytes a key row, _row_channel; 8 bytes a value channel): the plane is
  loaded in that physical order and reshaped into the operand layout (_key_operand,
  _value_operand: register renaming only).
- The softmax weights go from the logits' accumulator layout to the value product's B operand by
  movmatrix.trans, one per 8x8 block, in registers (_weights_operand). That transposes each block
  and fixes which logits row feeds which value token (_weights_position); so each logits row
  reads the plane row whose value sits at that position (_page_row).
- The per-page sums the offset folding needs (attention.py's module docstring) are small MMAs:
  sum_d qf[d] is an all-ones A against q's operand, sum_d q[d] zero[d] is the zero row against
  q; each comes out broadcast over 16 rows, already in the logits' layout.
The FP16 sink and recent tiers are small MMAs on the same layouts (_dense_tier).
Offline (scripts/sass.py's method): 1521 instructions a kitty page against _split_kernel's 1912.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .unpack import _slot_asm

D = gl.constexpr(128)
ROWS = gl.constexpr(32)  # code rows of a 2-bit plane, and tokens a step
PAGE = gl.constexpr(128)
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
# kWidth 4: a thread holds 4 consecutive elements of the reduced axis, one 32-bit word of codes
OPA = gl.constexpr(gl.DotOperandLayout(0, MMA, 4))
OPB = gl.constexpr(gl.DotOperandLayout(1, MMA, 4))
# Physical load layouts (one warp), each reshaped into OPA / OPB by register renaming:
# key rows [32 rows, 4 lane groups, 32 elements], 32 contiguous elements a thread and row
ROW_LOAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16], [8, 0, 0], [16, 0, 0]],
    lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]], warp_bases=[], block_bases=[],
    shape=[32, 4, 32]))
# q [4 lane groups, 32 channels, 8 q rows]
Q_LOAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0], [0, 16, 0]],
    lane_bases=[[1, 0, 0], [2, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]], warp_bases=[], block_bases=[],
    shape=[4, 32, 8]))
CHANNELS = gl.constexpr(gl.SliceLayout(2, Q_LOAD))  # [4, 32] per-channel factors, as q's channels
# channel-major value plane [128 channels, 4 lane groups, 8 bytes]
VALUE_LOAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [8, 0, 0], [16, 0, 0], [32, 0, 0], [64, 0, 0]],
    lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]], warp_bases=[], block_bases=[],
    shape=[128, 4, 8]))
# FP16 values [32 tokens, 8 lane rows, 16 channels]: 16 contiguous channels a thread and token
DENSE_VALUE_LOAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [1, 0, 0], [2, 0, 0], [16, 0, 0]],
    lane_bases=[[4, 0, 0], [8, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]], warp_bases=[], block_bases=[],
    shape=[32, 8, 16]))
COLS = gl.constexpr(gl.SliceLayout(0, MMA))  # per q row
ROWS_OF = gl.constexpr(gl.SliceLayout(1, MMA))  # per logits row / output channel
MOVMATRIX = gl.constexpr("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;")
PDL_ASM = gl.constexpr("griddepcontrol.wait;\ngriddepcontrol.launch_dependents;\nmov.u32 $0, 0;")


@gluon.jit
def _weights_position(m):
    """Which position of the value product's B operand logits row m lands in (_weights_operand):
    movmatrix gives column t rows (2t, 2t+1, 8+2t, 9+2t) of every 16, where kWidth 4 reads
    positions 4t..4t+3. (A bit permutation: bits 0, 3, 1, 2, 4 of m.)"""
    return (m & 1) | (((m >> 3) & 1) << 1) | (((m >> 1) & 1) << 2) | (((m >> 2) & 1) << 3) | (m & 16)


@gluon.jit
def _page_row(m):
    """The plane row (token of the slot) that logits row m of a page reads: the one whose value
    sits at its weight's position k' = 16 h + 4 t + i, i.e. byte 8 t + 4 h + (i1, i0) of what
    _value_operand loads (the swapped unpack exchanges i's two bits)."""
    return ((m >> 3) & 1) | ((m & 1) << 1) | (((m >> 4) & 1) << 2) | (((m >> 1) & 1) << 3) | (((m >> 2) & 1) << 4)


@gluon.jit
def _row_channel(t, j):
    """The physical channel of element j (of 32) of lane group t (of 4) in a key row, and of q's
    registers: two runs of 16, at 16 t and 64 + 16 t, so that the four lane groups of a row read
    whole 32-byte sectors with each 16-byte load (one run a load)."""
    # (// and %, not >> and &: Triton's contiguity analysis follows only the former, and with
    # shifts the loads fell apart into single bytes; offline sm_90, session 39)
    return (j // 16) * 64 + t * 16 + j % 16


@gluon.jit
def _arange3(n0: gl.constexpr, n1: gl.constexpr, n2: gl.constexpr, layout: gl.constexpr):
    """Index tensors of a [n0, n1, n2] layout, each expanded to rank 3."""
    i0 = gl.arange(0, n0, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
    i1 = gl.arange(0, n1, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    i2 = gl.arange(0, n2, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    return (gl.expand_dims(gl.expand_dims(i0, 1), 2), gl.expand_dims(gl.expand_dims(i1, 0), 2),
            gl.expand_dims(gl.expand_dims(i2, 0), 1))


@gluon.jit
def _q_scaled(Q, bh, M, qk_scale):
    """The M q rows of (row, kv head) bh times qk_scale, fp16 [4, 32, 8] in Q_LOAD (rows past M are 0)."""
    tq, jq, nq = _arange3(4, 32, 8, Q_LOAD)
    q = gl.load(Q + (bh * M + nq) * D + _row_channel(tq, jq), mask=nq < M, other=0.0)
    return (q.to(gl.float32) * qk_scale).to(gl.float16)


@gluon.jit
def _wait_then_release():
    """pdl.wait_then_release for Gluon: wait for the kernel ahead, then let the next one launch."""
    gl.inline_asm_elementwise(PDL_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _key_operand(rows):
    """[32, 4, 32] rows loaded in ROW_LOAD -> the key product's A operand [32, 128]: logical channel
    d = 16 jhi + 4 t + jlo is physical channel _row_channel(t, 4 jhi + jlo) of the row."""
    x = gl.reshape(gl.permute(gl.reshape(rows, [32, 4, 8, 4]), [0, 2, 1, 3]), [32, 128])
    return gl.convert_layout(x, OPA)


@gluon.jit
def _q_operand(x):
    """[4, 32, 8] in Q_LOAD -> the key product's B operand [128, 8], channels labelled as _key_operand's."""
    x = gl.reshape(gl.permute(gl.reshape(x, [4, 8, 4, 8]), [1, 0, 2, 3]), [128, 8])
    return gl.convert_layout(x, OPB)


@gluon.jit
def _value_operand(raw):
    """[128, 4, 8] value bytes in VALUE_LOAD -> the value product's A operand [128, 32]: logical
    token k' = 16 h + 4 t + i is byte 8 t + 4 h + i of the channel's plane row."""
    x = gl.reshape(gl.permute(gl.reshape(raw, [128, 4, 2, 4]), [0, 2, 1, 3]), [128, 32])
    return gl.convert_layout(x, OPA)


@gluon.jit
def _weights_operand(w):
    """w [32, 8] fp16 in the logits' layout -> the value product's B operand, by movmatrix.trans of
    each 8x8 block; logits row m lands in position _weights_position(m)."""
    y = gl.inline_asm_elementwise(MOVMATRIX, "=r,r", [w], dtype=gl.float16, is_pure=True, pack=2)
    y = gl.reshape(gl.permute(gl.reshape(y, [4, 8, 8]), [0, 2, 1]), [32, 8])  # undo the blocks' transpose
    y = gl.reshape(gl.permute(gl.reshape(y, [2, 2, 2, 2, 2, 8]), [0, 2, 3, 1, 4, 5]), [32, 8])
    return gl.convert_layout(y, OPB, assert_trivial=True)


@gluon.jit
def _twice(x):
    """A [16, 8] product (every row equal) as the [32, 8] logits' starting accumulator."""
    return gl.convert_layout(gl.reshape(gl.permute(gl.join(x, x), [2, 0, 1]), [32, 8]), MMA)


@gluon.jit
def _unpack(raw, SLOT: gl.constexpr):
    """offset + code of slot SLOT of the bytes, fp16, swapped (unpack._slot_asm)."""
    return gl.inline_asm_elementwise(_slot_asm(2, SLOT, True), "=r,=r,r", [raw], dtype=gl.float16, is_pure=True,
                                     pack=4)


@gluon.jit
def _softmax(s, m_i, l_tile, corr_tile, acc):
    """Raise the running max m_i [N] to cover the logits s [T, N], rescaling the sums, at every step.
    attention._pages raises it lazily (LAZY_MAX), which skips most rescales but puts a warp-wide test
    and a branch between a page's key and value products; without them kitty's page loop is 36
    instructions and 20 registers smaller and its batch-1 / 32k cell 2-4% faster (H100, session 40)."""
    m_new = gl.maximum(m_i, gl.max(s, 0))
    alpha = gl.expand_dims(gl.exp2(m_i - m_new), 0)  # m_i starts finite (-1e30): never -inf - -inf
    return m_new, l_tile * alpha, corr_tile * alpha, acc * alpha


@gluon.jit
def _dense_tier(q_b, K, V, s_t, n, m_i, l_tile, corr_tile, acc):
    """FP16 tokens [0, n) at K / V (token stride s_t). Values load as tokens in order, so logits row
    m reads the token of its weight's position (_weights_position); the accumulator's row m holds
    channel 16 (m % 8) + m // 8, so that a thread's 16 channels of a token are contiguous."""
    m_rows = gl.arange(0, 32, layout=ROWS_OF)
    for t0 in range(0, n, 32):
        rk, tk, jk = _arange3(32, 4, 32, ROW_LOAD)
        tok = t0 + _weights_position(rk)
        keys = gl.load(K + tok * s_t + _row_channel(tk, jk), mask=tok < n, other=0.0)
        tv, gv, cv = _arange3(32, 8, 16, DENSE_VALUE_LOAD)  # (values loaded with the keys: one memory latency a step)
        vals = gl.load(V + (t0 + tv) * s_t + gv * 16 + cv, mask=t0 + tv < n, other=0.0)
        s = mma_v2(_key_operand(keys), q_b, gl.zeros([32, 8], gl.float32, layout=MMA))
        s = gl.where(gl.expand_dims(t0 + _weights_position(m_rows) < n, 1), s, float("-inf"))
        m_i, l_tile, corr_tile, acc = _softmax(s, m_i, l_tile, corr_tile, acc)
        w = gl.exp2(s - gl.expand_dims(m_i, 0))
        l_tile += w
        v_a = gl.convert_layout(gl.reshape(gl.permute(vals, [2, 1, 0]), [128, 32]), OPA)
        acc = mma_v2(v_a, _weights_operand(w.to(gl.float16)), acc)
    return m_i, l_tile, corr_tile, acc


@gluon.jit
def _pages(PT, pt_row, p0, p1, bh, h, qk_scale, K_CODES, K_SCALE, K_ZERO, K_HIGH, K_IDS,
           V_CODES, V_SCALE, V_ZERO, Q, M, H: gl.constexpr, N_HIGH: gl.constexpr, PDL: gl.constexpr):
    """The pages [p0, p1): m [N], l [N], acc [D, N] (channel m in row m) and the offsets' correction [N]."""
    m_i = gl.full([8], -1e30, gl.float32, COLS)
    acc = gl.zeros([128, 8], gl.float32, layout=MMA)
    l_tile = gl.zeros([32, 8], gl.float32, layout=MMA)
    corr_tile = gl.zeros([32, 8], gl.float32, layout=MMA)
    # the physical channel of q's (and the channel factors') registers, as _q_operand labels them
    ch = _row_channel(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, CHANNELS)), 1),
                      gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, CHANNELS)), 0))
    ones = gl.full([16, 128], 1.0, gl.float16, OPA)
    tok = _page_row(gl.arange(0, 32, layout=ROWS_OF))
    if N_HIGH > 0:
        r = gl.arange(0, N_HIGH, layout=gl.SliceLayout(1, OPB))
        rank = (r & (N_HIGH - 4)) | ((r & 1) << 1) | ((r >> 1) & 1)  # the boosted column the swapped unpack puts at r
        n_b = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, OPB)), 0)
        ones_hi = gl.full([16, N_HIGH], 1.0, gl.float16, OPA)
    page_next = gl.load(PT + pt_row + p0)
    if N_HIGH > 0:  # Kitty's boosted channel ids, read a page ahead like the page ids: two gathers wait on them
        ids_next = gl.load(K_IDS + (page_next.to(gl.int64) * H + h) * N_HIGH + rank).to(gl.int32)
    # The page table and the pages change only between steps: read before the wait (pdl.py), so the
    # first page's loads go out as soon as rope_store has written q
    if PDL:
        _wait_then_release()
    q = _q_scaled(Q, bh, M, qk_scale)
    q_b = _q_operand(q)
    for p in range(p0, p1):
        page = page_next.to(gl.int64) * H + h  # (page, kv head)
        page_next = gl.load(PT + pt_row + p + 1, mask=p + 1 < p1, other=0)
        rk, tk, jk = _arange3(32, 4, 32, ROW_LOAD)
        k_raw = gl.load(K_CODES + page * (ROWS * D) + _page_row(rk) * D + _row_channel(tk, jk))
        cv, tv, jv = _arange3(128, 4, 8, VALUE_LOAD)
        v_raw = gl.load(V_CODES + page * (ROWS * D) + cv * ROWS + tv * 8 + jv)
        # keys: channel factors fold into q, the offsets' and zeros' sums are [16, 8] products
        qf_b = _q_operand(q * gl.expand_dims(gl.load(K_SCALE + page * D + ch), 2))
        zero = gl.reshape(gl.permute(gl.reshape(gl.load(K_ZERO + page * D + ch), [4, 8, 4]), [1, 0, 2]), [128])
        zero_a = gl.expand_dims(gl.convert_layout(zero, gl.SliceLayout(0, OPA)), 0).broadcast_to([16, 128])
        q_zero = mma_v2(zero_a, q_b, gl.zeros([16, 8], gl.float32, layout=MMA))
        q_sum = mma_v2(ones, qf_b, gl.zeros([16, 8], gl.float32, layout=MMA))
        if N_HIGH > 0:  # Kitty: + sum_r (4 q[id_r] scale[id_r]) high_r, one more small product a step
            ids = ids_next
            ids_next = gl.load(K_IDS + (page_next.to(gl.int64) * H + h) * N_HIGH + rank, mask=p + 1 < p1,
                               other=0).to(gl.int32)
            s_hi = gl.load(K_SCALE + page * D + ids).to(gl.float32) * (4.0 * qk_scale)
            q_hi = gl.load(Q + (bh * M + n_b) * D + gl.expand_dims(ids, 1), mask=n_b < M, other=0.0)
            q_hi = (q_hi.to(gl.float32) * gl.expand_dims(s_hi, 1)).to(gl.float16)
            q_sum = mma_v2(ones_hi, q_hi, q_sum)
            mh = gl.expand_dims(_page_row(gl.arange(0, 32, layout=gl.SliceLayout(1, OPA))), 1)
            hi_raw = gl.load(K_HIGH + page * (ROWS * N_HIGH) + mh * N_HIGH
                             + gl.expand_dims(gl.arange(0, N_HIGH, layout=gl.SliceLayout(0, OPA)), 0))
        k_a = _key_operand(k_raw)
        v_a = _value_operand(v_raw)
        logits = ()
        for i in gl.static_range(4):  # slot i: tokens 32 i + plane row
            s = mma_v2(_unpack(k_a, i), qf_b, _twice(q_zero - (1024.0 / 4**i) * q_sum))
            if N_HIGH > 0:
                s = mma_v2(_unpack(hi_raw, i), q_hi, s)
            logits = logits + (s,)
        s_max = gl.maximum(gl.maximum(logits[0], logits[1]), gl.maximum(logits[2], logits[3]))
        m_i, l_tile, corr_tile, acc = _softmax(s_max, m_i, l_tile, corr_tile, acc)
        for i in gl.static_range(4):
            w = gl.exp2(logits[i] - gl.expand_dims(m_i, 0))
            l_tile += w
            v_scale = gl.load(V_SCALE + page * PAGE + 32 * i + tok).to(gl.float32)
            v_zero = gl.load(V_ZERO + page * PAGE + 32 * i + tok).to(gl.float32)
            ww = (w * gl.expand_dims(v_scale, 1)).to(gl.float16)
            corr_tile = gl.fma(-w, gl.expand_dims(v_zero, 1), gl.fma(ww.to(gl.float32), 1024.0 / 4**i, corr_tile))
            acc = mma_v2(_unpack(v_a, i), _weights_operand(ww), acc)
    return m_i, gl.sum(l_tile, 0), acc, gl.sum(corr_tile, 0)


@gluon.jit
def gluon_split_kernel(Q, SLOTS, PT, NPAGES, SINK_K, SINK_V, NSINK, REC_K, REC_V, NREC, O_PART, LSE_PART,
                       K_CODES, K_SCALE, K_ZERO, K_HIGH, K_IDS, V_CODES, V_SCALE, V_ZERO,
                       qk_scale, num_splits, M, s_pt_b, s_sink_b, s_sink_h, s_sink_t, s_rec_b, s_rec_h, s_rec_t,
                       H: gl.constexpr, TIERS: gl.constexpr, MIN_PAGES: gl.constexpr, SHORT_PAGES: gl.constexpr,
                       N_HIGH: gl.constexpr, HAS_SLOTS: gl.constexpr, PDL: gl.constexpr):
    """attention._split_kernel's partials for one (row, kv head, part): parts below TIERS the FP16
    tiers (0 the sink, then chunks of the recent tier), the rest page splits (attention._page_split).
    TIERS stays a constant here: this kernel serves Kitty's fixed windows, whose tier count never
    changes in a run (the Triton kernel takes it at run time for KVmix's growing tier)."""
    bh = gl.program_id(0)
    part = gl.program_id(1)
    split = part - TIERS
    b = bh // H
    h = bh % H
    if HAS_SLOTS:
        slot = gl.load(SLOTS + b).to(gl.int64)
    else:
        slot = b.to(gl.int64)
    n_pg = gl.load(NPAGES + b)
    least = MIN_PAGES - (MIN_PAGES - 1) * (n_pg <= SHORT_PAGES).to(gl.int32)
    per = gl.maximum(gl.cdiv(n_pg, num_splits), least)
    n_live = gl.cdiv(n_pg, per)
    n_c = gl.arange(0, 8, layout=COLS)
    out_row = gl.expand_dims((bh * (num_splits + TIERS) + part) * M + n_c, 0)
    n_ok = n_c < M
    m_rows = gl.arange(0, 128, layout=ROWS_OF)
    if PDL:  # (pdl.wait_then_release; page programs wait in _pages, after their page table reads)
        if (part < TIERS) | (split >= n_live):
            _wait_then_release()
    if (part < TIERS) | (split < n_live):
        if part < TIERS:
            q_b = _q_operand(_q_scaled(Q, bh, M, qk_scale))
            m_i = gl.full([8], -1e30, gl.float32, COLS)
            l_tile = gl.zeros([32, 8], gl.float32, layout=MMA)
            corr_tile = gl.zeros([32, 8], gl.float32, layout=MMA)  # (FP16 tokens carry no offsets: stays 0)
            acc = gl.zeros([128, 8], gl.float32, layout=MMA)
            if part == 0:
                n_sink = gl.load(NSINK + b)
                m_i, l_tile, corr_tile, acc = _dense_tier(q_b, SINK_K + slot * s_sink_b + h * s_sink_h,
                                                          SINK_V + slot * s_sink_b + h * s_sink_h, s_sink_t, n_sink,
                                                          m_i, l_tile, corr_tile, acc)
            else:
                n_rec = gl.load(NREC + b)
                chunk = gl.cdiv(gl.cdiv(n_rec, TIERS - 1), 32) * 32
                r0 = (part - 1) * chunk
                m_i, l_tile, corr_tile, acc = _dense_tier(q_b, REC_K + slot * s_rec_b + h * s_rec_h + r0 * s_rec_t,
                                                          REC_V + slot * s_rec_b + h * s_rec_h + r0 * s_rec_t, s_rec_t,
                                                          gl.minimum(n_rec - r0, chunk), m_i, l_tile, corr_tile, acc)
            l_i = gl.sum(l_tile, 0)
            corr = gl.sum(corr_tile, 0)
            channel = 16 * (m_rows % 8) + m_rows // 8
        else:
            p0 = split * per
            m_i, l_i, acc, corr = _pages(PT, slot * s_pt_b, p0, gl.minimum(p0 + per, n_pg), bh, h, qk_scale,
                                         K_CODES, K_SCALE, K_ZERO, K_HIGH, K_IDS, V_CODES, V_SCALE, V_ZERO, Q, M, H,
                                         N_HIGH, PDL)
            channel = m_rows
        # as attention._split_kernel: an empty part writes o = 0, lse = -inf
        l_safe = gl.where(l_i > 0, l_i, 1.0)
        o = (acc - gl.expand_dims(corr, 0)) / gl.expand_dims(l_safe, 0)
        lse = gl.where(l_i > 0, m_i + gl.log2(l_safe), float("-inf"))
        gl.store(O_PART + out_row * D + gl.expand_dims(channel, 1), o, mask=gl.expand_dims(n_ok, 0))
        gl.store(LSE_PART + out_row, gl.expand_dims(lse, 0), mask=gl.expand_dims(n_ok, 0))


def launch(q4: torch.Tensor, kl, vl, k_pages: dict, v_pages: dict, page_table: torch.Tensor, n_pages: torch.Tensor,
           slots: torch.Tensor | None, sink: tuple, recent: tuple, o_part: torch.Tensor, lse_part: torch.Tensor,
           qk_scale: float, num_splits: int, n_parts: int, min_pages: int, short_pages: int, pdl: dict) -> None:
    """Run gluon_split_kernel over decode_attention's grid, with its arguments (checked there by
    attention._gluon_split); sink and recent are (k, v, counts) of the FP16 tiers."""
    (sink_k, sink_v, n_sink), (recent_k, recent_v, n_recent) = sink, recent
    B, Hq, _, _ = q4.shape
    H = sink_k.shape[1]
    kp, vp = kl.pointers(k_pages, "K_"), vl.pointers(v_pages, "V_")
    gluon_split_kernel[(B * H, n_parts)](
        q4, n_pages if slots is None else slots, page_table, n_pages, sink_k, sink_v, n_sink, recent_k, recent_v,
        n_recent, o_part, lse_part, kp["K_CODES"], kp["K_SCALE"], kp["K_ZERO"], kp["K_HIGH"], kp["K_IDS"],
        vp["V_CODES"], vp["V_SCALE"], vp["V_ZERO"], qk_scale, num_splits, Hq * q4.shape[2] // H, page_table.stride(0),
        sink_k.stride(0), sink_k.stride(1), sink_k.stride(2), recent_k.stride(0), recent_k.stride(1),
        recent_k.stride(2), H=H, TIERS=n_parts - num_splits, MIN_PAGES=min_pages, SHORT_PAGES=short_pages,
        N_HIGH=kl.n_high, HAS_SLOTS=slots is not None, num_warps=1, **pdl)
