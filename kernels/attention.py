"""Triton paged decode attention over the three tiers (FP16 sink, quantized pages, FP16 recent).

One program per (batch row, kv head, part, block of query rows). Parts 0 and 1 attend over the
FP16 sink and recent tiers (first, so that they start with the first wave of programs instead of
trailing the last); parts 2 .. num_splits + 1 are page splits that share out the row's pages
(split-K over the context: each takes a contiguous run of ceil(pages / num_splits) of them, at
least MIN_PAGES_PER_SPLIT, counted from the row's own page count, so a short row is spread as
thinly as a long one and the splits past its end stay empty). A second small kernel
merges the splits' normalized partial outputs by their log-sum-exp. With a single program per
(row, kv head, query block), `num_splits=0` (the default wherever one split would do), that
program walks the pages, the sink and the recent tier itself and writes the final output: no
partials, no merge.

Orientation: tokens on M, query rows on N. Every q head of the kv head (GQA) and every query of
the row is a column of one [D, N] operand, so each page is read once per kv head and the matrix
products are [tokens, D] x [D, N] (logits, transposed) and [D, tokens] x [tokens, N] (output,
transposed); N is the query rows rounded up to the MMA's width, not to 16 rows of padding
in M.

Dequantization, in registers. Codes are packed along tokens in "slots" (quant/rtn.py): byte row
i of a 2-bit plane holds tokens i, i+32, i+64, i+96 at bits 0-1, 2-3, 4-5, 6-7. Each step takes
one slot of one block of rows. OR-ing the fp16 exponent of 2^(10 - bits*slot) into a 16-bit half
that holds the byte turns it, bit-exactly, into the number 2^(10 - bits*slot) + code (the code's
bits land at the bottom of the mantissa of that binade): one lop3 per two codes, after a prmt
that spreads four bytes over two registers (_slot_asm). The offset never gets subtracted from
the tile; it is removed algebraically from the products, which is cheap because it is constant
along the reduced axis:
    keys    sum_d qf[d] (off + c[t, d]) = (qf . c[t]) + off * sum_d qf[d]
    values  sum_t w[t] (off + c[t, d])  = (w . c[:, d]) + off * sum_t w[t]
with qf and w the fp16-rounded operands, so the subtraction cancels exactly what the tensor cores
added. NF4 levels come from byte-permute lookups in a split fp16 table, both nibbles of a byte
at once, so two steps' tiles per lookup (_nf4_lookup_asm).

Value planes are stored channel-major (quant.base.ChannelMajor): the value product reduces over
tokens, and Triton's fp16 operand layout for an 8-bit source holds four consecutive tokens of one
channel per thread, which a [D, rows] plane delivers as one aligned 32-bit word (a [rows, D] plane
took three byte permutes per word to transpose in registers). Their codes are unpacked "swapped"
(2-, 3- and 4-bit RTN, a tile that goes straight into the product): instead of the prmt that puts
bytes 0,1 into one register's halves, bytes 0,2 are taken as they lie and bytes 1,3 after one
shift, three instructions per four codes instead of four. Tokens 1 and 2 of every four then
trade places in the tile, so the key rows, the token factors and the window mask take the same
order (quantize.swapped) and the products still pair each weight with its value. The keys' codes
(2-, 3- and 4-bit RTN) are unpacked the same way, but there the exchange is undone in storage: their
planes keep the channels of every four in the order 0 2 1 3 (quant.base.SwappedColumns), so the
swapped unpack puts them back in order and q needs no reordering. The interpreter does the same
exchanges with reshapes (_swap_fours), so the CPU tests check this bookkeeping; the GPU tests
check that the operand layout holds. (The PTX strings themselves are checked on CPU too, by a
model of their instructions in tests/test_kernels.py.) Kitty batch 16 / 32k: 205 -> 200 us
channel-major, -> 187 swapped too; the keys swapped with q's channels reordered instead was
slower (H100, session 17); with swapped storage, kitty-pro 4-6% and kvarn 2-4% faster, the
others 0-3% (session 21).

3-bit codes (KVmix's K3 and V3 layers) are two planes (quant/rtn.py): their two low bits, a 2-bit
plane, and their top bit, a 1-bit plane of half as many rows. Each unpacks by the same OR (a 1-bit
slot reads 2^(10 - slot) + bit), and the top bit's tile is one more product, against 4 q (keys) or
4 w (values), exact since 4 is a power of two (_code_dot); its offset joins the low tile's in the
algebra above (_tile_offset). The 1-bit plane has 16 rows: a 16-token step takes one slot of them,
a 32-token step two, each half's tile unpacked on its own and the two joined along the rows in
registers (the second half's word shifted down one slot first, so both carry the same offset;
_step says which). Ten codes packed in a 32-bit word, unpacked a token at a time (shift, mask,
int-to-float), took at batch 1 / 16 and 32k 28.6 / 347 us for k3v2 pages and 56.0 / 800 for k3v3
(0.95x FP16 at batch 1); the two planes 19.4 / 169 and 23.7 / 247 (H100, session 49).

Scales never touch the tile either: every format decodes as x = (level * scale + zero) * mult
with scale/zero along one axis (channel or token) and mult along the other (quant/layout.py).
Channel factors fold into q (keys) or into the step's output (values); token factors scale the
logits (keys) or the softmax weights (values), each step's loaded straight into the logits' layout
by a pure asm load (_page_token_factors). Kitty's boosted channels add one more small
product per step: their high-bit plane against q gathered at the boosted ids (x 4 x scale).

Pipelining: in launches whose page programs come in more than one wave, where every packed plane
is one step's rows (the 2-bit RTN formats, and 3-bit codes in 32-token steps) and a split walks at least PIPELINE_MIN_PAGES pages, the
page loop alone runs with Triton's num_stages=2, which copies the next page's code planes, channel
scales and boosted plane into shared memory (cp.async) while this page computes (_page_stages). The
FP16 tiers' loops are never pipelined. Where every page program is resident at once (launches of few
pairs, batch 1 to 8 of Llama-3's 8 kv heads, and one-wave launches of more: _starts_together) the
loop is not pipelined, and every split loads its first page in the same burst; there, once a page's
keys have arrived, the next page's fields are prefetched into the L2 (cp.async.bulk.prefetch,
_prefetch_page), so that they stream in while this page computes instead of in a second burst
(PREFETCH).

The cache's extras: `slots` (batch row b reads slot slots[b] of the page table and the dense
buffers), a sliding `window` (tokens older than a query's window are masked, whole pages of
them skipped) and `return_lse` (also each query's log-sum-exp). Rotated formats (KVarN, kitty-qh's
values): the pages see q @ Hd and their partial output is rotated back before the merge, both by
the fast transform's butterflies in registers (_hadamard), so neither takes a kernel of its own.
The torch oracle with the same signature is kernels/reference.py.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import constexpr_function

from quant import NF4_LEVELS, PAGE_TOKENS
from quant.layout import Layout

from .pdl import kernel_options, release_then_wait, wait_then_release
from .quantize import swapped
from .reference import Tiers
from .unpack import _slot_asm

LOG2E = 1.4426950408889634
# The page loop lets the running max lag: weights are 2^(s - m) against a max m that is only
# raised (rescaling the accumulators) once a logit exceeds it by more than this many powers of
# two. Weights stay <= 2^LAZY_MAX (far inside fp16), and most steps of a long context skip the
# rescale of the [D, N] accumulator (the trick of FlashAttention-4). (gluon_attention.py rescales
# at every page instead: see its _softmax.)
LAZY_MAX = tl.constexpr(8.0)


@constexpr_function
def _slot_offset(bits, slot):
    """The number an RTN code of this slot reads as after the magic OR: level = offset + code."""
    return float(2 ** (10 - bits * slot))


@constexpr_function
def _tile_offset(bits, rows, t0, nf4):
    """The offset _tile's levels carry for the step starting at token t0 (0: plain values). 3-bit
    codes: what their two tiles carry together, the low bits' (a 2-bit plane of `rows` rows) plus 4
    times the top bit's (a 1-bit plane of rows / 2), as their products weigh them (_code_dot)."""
    if nf4 or bits == 16:
        return 0.0
    if bits == 3:
        return _slot_offset(2, t0 // rows) + 4 * _slot_offset(1, t0 // (rows // 2))
    return _slot_offset(bits, t0 // rows)


@constexpr_function
def _corrects(bits, rows, nf4, per_token, has_zero, group, head_dim, apart):
    """Whether the value products leave anything in corr (_pages): the offsets of packed RTN tiles
    (_tile_offset), or per-token zeros. NF4 pages, FP16 pages and values kept apart (V_APART) leave
    nothing, and their loop then keeps no corr tile (an all-zero tile still took registers, and a
    multiply at every rescale)."""
    offsets = _tile_offset(bits, rows, 0, nf4) != 0 and not (per_token and group < head_dim)  # (grouped: decoded)
    zeros = per_token and has_zero and bits != 16 and group == head_dim
    return not apart and (offsets or zeros)


@constexpr_function
def _step_token(i, slots, rows, step):
    """The first token of step i of a page's step loop: step i reads slot i % slots of block i // slots
    of `step` plane rows, i.e. tokens slot * rows + block * step + arange(step). (Called wherever a
    constexpr is needed: assigned to a local variable in the kernel, it would become a tensor.)"""
    return (i % slots) * rows + (i // slots) * step


@triton.jit
def _swap_fours(x, COLUMNS: tl.constexpr):
    """x [R, C] with rows (or COLUMNS) 1 and 2 of every four exchanged: what the swapped unpack
    does in registers along the packed axis, done with reshapes where the PTX cannot run
    (interpreter)."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    if COLUMNS:
        y = tl.reshape(tl.permute(tl.reshape(x, [R, C // 4, 2, 2]), [0, 1, 3, 2]), [R, C])
    else:
        y = tl.reshape(tl.permute(tl.reshape(x, [R // 4, 2, 2, C]), [0, 2, 1, 3]), [R, C])
    return y


def _nf4_lookup_asm() -> str:
    """PTX: four packed bytes -> the fp16 NF4 levels of both their nibbles (slot 0, the low ones, as
    $0 $1 and slot 1 as $2 $3; byte i as element i of each), by byte-permute lookups. prmt indexes
    8 bytes with 3 bits, so the low and high bytes of the 16 fp16 levels are four 8-entry tables
    (codes 0-7 and 8-15), and bit 3 of each code picks between two lookups (a byte mask made by
    prmt's sign-replicate mode). Both slots at once, the word's nibbles are the selectors as they
    lie: its low half indexes the codes of bytes 0 and 1, the high half (after one shift) those of
    bytes 2 and 3, and the last prmt of each output sorts the looked-up bytes into elements. Per
    eight codes 21 instructions; one slot at a time took 29 and two prmt more to gather each
    slot's four nibbles into one selector.

    SASS's PRMT takes at most one of its two table words as an immediate; the other must sit in a
    register. Constants are warp-uniform, so ptxas keeps them in uniform registers and copies one
    into a register before every lookup (8 copies per eight codes, a fifth of nqkv's page loop).
    The four register-side words are therefore built from lanemask_lt & lanemask_gt (zero in every
    lane, but not provably uniform): ptxas computes them once, hoisted out of the page loop, and
    keeps them in ordinary registers (nqkv's loop 4533 -> 3613 instructions, scripts/sass.py)."""
    bits = [int(b) & 0xFFFF for b in NF4_LEVELS.half().view(torch.int16).tolist()]
    lo, hi = [b & 0xFF for b in bits], [b >> 8 for b in bits]

    def word(table, first):  # bytes first..first+3 of a table, little-endian
        return sum(table[first + i] << (8 * i) for i in range(4))

    def lookups(sel, flags, lo_out, hi_out):  # the levels of sel's four 3-bit nibbles, bit 3 from flags
        return (
            f"prmt.b32 la, w0, {word(lo, 4):#x}, {sel};\n"
            f"prmt.b32 lb, w1, {word(lo, 12):#x}, {sel};\n"
            f"prmt.b32 ha, w2, {word(hi, 4):#x}, {sel};\n"
            f"prmt.b32 hb, w3, {word(hi, 12):#x}, {sel};\n"
            f"lop3.b32 {lo_out}, {flags}, lb, la, 0xca;\n"  # flags ? lb : la
            f"lop3.b32 {hi_out}, {flags}, hb, ha, 0xca;\n"
        )

    return (
        "{\n.reg .b32 s, t, u, m, n, la, lb, ha, hb, lo, hi, lo2, hi2, w0, w1, w2, w3;\n"
        "mov.b32 w0, %lanemask_lt;\n"
        "mov.b32 w1, %lanemask_gt;\n"
        "and.b32 w3, w0, w1;\n"  # 0, in registers
        f"or.b32 w0, w3, {word(lo, 0):#x};\n"
        f"or.b32 w1, w3, {word(lo, 8):#x};\n"
        f"or.b32 w2, w3, {word(hi, 0):#x};\n"
        f"or.b32 w3, w3, {word(hi, 8):#x};\n"
        "and.b32 s, $4, 0x77777777;\n"  # nibble k: code k's low 3 bits (bit 3 would switch prmt to sign mode)
        "shr.b32 t, s, 16;\n"
        # byte k = 0xFF where nibble k's bit 3 is set: bits 7 and 15 are the msbs of bytes 0 and 1,
        # bits 3 and 11 those of bytes 0 and 1 of the word shifted by 4 (likewise 19-31, bytes 2 and 3)
        "shl.b32 u, $4, 4;\n"
        "prmt.b32 m, $4, u, 0x9D8C;\n"
        "prmt.b32 n, $4, u, 0xBFAE;\n"
        + lookups("s", "m", "lo", "hi") + lookups("t", "n", "lo2", "hi2") +
        # lo/hi byte k: nibble k = slot k % 2 of byte k // 2 (lo2/hi2: of byte 2 + k // 2)
        "prmt.b32 $0, lo, hi, 0x6240;\n"
        "prmt.b32 $1, lo2, hi2, 0x6240;\n"
        "prmt.b32 $2, lo, hi, 0x7351;\n"
        "prmt.b32 $3, lo2, hi2, 0x7351;\n}"
    )


NF4_ASM = tl.constexpr(_nf4_lookup_asm())


@triton.jit
def _nf4_levels(raw, LEVELS, ASM: tl.constexpr):
    """The NF4 levels of both nibbles of the packed bytes `raw`: (slot 0, slot 1), fp16 (ASM) or fp32."""
    if ASM:
        low, high = tl.inline_asm_elementwise(NF4_ASM, "=r,=r,=r,=r,r", [raw], dtype=(tl.float16, tl.float16),
                                              is_pure=True, pack=4)
    else:
        code = raw.to(tl.int32)
        low, high = tl.load(LEVELS + (code & 15)), tl.load(LEVELS + (code >> 4))
    return low, high


@triton.jit
def _levels(raw, LEVELS, BITS: tl.constexpr, SLOT: tl.constexpr, NF4: tl.constexpr, ASM: tl.constexpr,
            SWAP: tl.constexpr, COLUMNS: tl.constexpr, LATER: tl.constexpr = 0):
    """fp16 (ASM) or fp32 values of slot SLOT of the packed bytes `raw`: offset + code for RTN codes
    (_slot_offset), the level itself for NF4. The compiled path is one pure asm per tile, so Triton
    keeps the result in registers as a dot operand. SWAP (RTN only): the values come out with
    elements 1 and 2 of every four exchanged along the packed axis: the tile's rows, or its COLUMNS
    for a plane stored [rows, D] (module docstring). LATER: the codes of slot SLOT + LATER instead, read
    as slot SLOT (shifted down first: the same offset)."""
    if NF4:  # (the page loop looks both slots up at once wherever it can: _pages' K_PAIRED, V_PAIRED)
        x = _nf4_levels(raw, LEVELS, ASM)[SLOT]
    elif ASM:
        x = tl.inline_asm_elementwise(_slot_asm(BITS, SLOT, SWAP, LATER), "=r,=r,r", [raw], dtype=tl.float16,
                                      is_pure=True, pack=4)
    else:
        x = ((raw.to(tl.int32) >> (BITS * (SLOT + LATER))) & ((1 << BITS) - 1)).to(tl.float32) + _slot_offset(BITS, SLOT)
        if SWAP:
            x = _swap_fours(x, COLUMNS)
    return x


@constexpr_function
def _prefetch_asm(nbytes):
    """PTX: thread 0 asks the L2 for the nbytes at $1, widened to whole 16-byte chunks as the bulk
    prefetch needs (the extra bytes are the neighbours' and harmless). It does not wait for them;
    $0 is a dummy result (Triton's inline asm must have one), and $2 is not read: as an operand it
    holds the prefetch back until it has been computed (_prefetch)."""
    return (
        "{\n.reg .pred p;\n.reg .b32 tid, n;\n.reg .b64 a, e;\n"
        "mov.u32 tid, %tid.x;\n"
        "setp.eq.u32 p, tid, 0;\n"
        "and.b64 a, $1, -16;\n"  # first chunk
        f"add.s64 e, $1, {nbytes + 15};\n"
        "and.b64 e, e, -16;\n"  # past the last chunk
        "sub.s64 e, e, a;\n"
        "cvt.u32.u64 n, e;\n"
        "@p cp.async.bulk.prefetch.L2.global [a], n;\n"
        "mov.u32 $0, 0;\n}"
    )


@triton.jit
def _prefetch(ptr, n: tl.constexpr, after):
    """Ask the L2 for the n elements at ptr, without waiting for them (_prefetch_asm); not before
    the float32 `after` has been computed."""
    tl.inline_asm_elementwise(_prefetch_asm(n * (ptr.dtype.element_ty.primitive_bitwidth // 8)), "=r,l,r",
                              [ptr, after.to(tl.int32, bitcast=True)], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_page(page, h, after, CODES, SCALE, ZERO, MULT, HIGH, H: tl.constexpr, D: tl.constexpr,
                   PAGE_TOKENS: tl.constexpr, BITS: tl.constexpr, ROWS: tl.constexpr, PER_TOKEN: tl.constexpr,
                   S_PAGE: tl.constexpr, S_HEAD: tl.constexpr, HDIV: tl.constexpr, HAS_ZERO: tl.constexpr,
                   MULT_KIND: tl.constexpr):
    """Prefetch one kv head's slice of every field of a page that _pages reads (codes, 3-bit codes'
    top bits, scale, zero, mult) into the L2, after `after` (_prefetch)."""
    _prefetch(CODES + page * (H * ROWS * D) + h * (ROWS * D), ROWS * D, after)
    if BITS == 3:
        _prefetch(HIGH + page * (H * (ROWS // 2) * D) + h * ((ROWS // 2) * D), (ROWS // 2) * D, after)
    if BITS != 16:
        if PER_TOKEN:
            _prefetch(SCALE + page * S_PAGE + (h // HDIV) * S_HEAD, S_HEAD, after)
            if HAS_ZERO:
                _prefetch(ZERO + page * S_PAGE + (h // HDIV) * S_HEAD, S_HEAD, after)
        else:
            _prefetch(SCALE + page * S_PAGE + h * S_HEAD, D, after)
            if HAS_ZERO:
                _prefetch(ZERO + page * S_PAGE + h * S_HEAD, D, after)
    if MULT_KIND == 1:
        _prefetch(MULT + page * (H * PAGE_TOKENS) + h * PAGE_TOKENS, PAGE_TOKENS, after)
    if MULT_KIND == 2:
        _prefetch(MULT + page * (H * D) + h * D, D, after)


@constexpr_function
def _load_asm(bits):
    """PTX: one read-only element of `bits` bits at the address $1 (_token_factor)."""
    return f"ld.global.nc.b{bits} $0, [$1];"


@triton.jit
def _token_factor(PTR, page, h, t, S_PAGE: tl.constexpr, S_HEAD: tl.constexpr, S_TOK: tl.constexpr,
                  HDIV: tl.constexpr, ASM: tl.constexpr):
    """Float32, shaped like the token indices t: a per-token factor of kv head h (scale, zero or a
    multiplier). ASM: loaded by a pure asm (_load_asm), which Triton places in the layout its use
    wants, where a tl.load keeps a layout of its own."""
    ptrs = PTR + page * S_PAGE + (h // HDIV) * S_HEAD + t * S_TOK
    if ASM:
        BITS: tl.constexpr = PTR.dtype.element_ty.primitive_bitwidth
        x = tl.inline_asm_elementwise(_load_asm(BITS), "=h,l" if BITS == 16 else "=r,l", [ptrs],
                                      dtype=PTR.dtype.element_ty, is_pure=True, pack=1)
    else:
        x = tl.load(ptrs)
    return x.to(tl.float32)


@triton.jit
def _prefetch_l1(ptrs):
    """Ask for the lines at ptrs to be brought into this SM's L1, without waiting for them."""
    tl.inline_asm_elementwise("prefetch.global.L1 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _page_token_factors(PTR, page, h, ts, USED: tl.constexpr, S_PAGE: tl.constexpr, S_HEAD: tl.constexpr,
                        S_TOK: tl.constexpr, HDIV: tl.constexpr, ROWS: tl.constexpr, STEP: tl.constexpr,
                        PAGE_TOKENS: tl.constexpr, DIRECT: tl.constexpr, ASM: tl.constexpr):
    """A page's per-token factor (scale, zero or multiplier) for each step i of _pages' step loop
    (i = block * slots + slot), in the steps' token order ts (zeros, never read, unless USED);
    _step_factor(factors, i) is step i's float32 [STEP] vector. Two ways to get there:
    - DIRECT: a tuple of the steps' vectors, each loaded (ASM: by a pure asm, _token_factor) in the layout
      of the logits it scales, 4 times the registers of a compact tile (each row is held by the 4
      threads that hold its logits); the page's factor is asked into the L1 at the page's start, so
      that the loads, which ptxas moves down to their use, find it there;
    - otherwise one float32 [steps, STEP] tile loaded at the page's start, whose step rows reach the
      logits' layout through shared memory (a select, a sum over the steps and a round trip a step).
    The direct loads take 6-9% of the instructions out of kitty's, kivi-k2v2's and kitty-pro's page
    loops (offline sm_90 SASS), and kitty-pro's spills (stack 56 -> 0 bytes at batch 16). bench.py
    kernels, us at 32k (H100, session 24): kitty batch 16 171.6 -> 161.9, batch 64 609.6 -> 585.4;
    kitty-pro 181.9 -> 172.0 and 649.5 -> 621.1, batch 1 19.3 -> 18.5; nqkv batch 1 29.9 -> 27.6.
    Without the L1 request they were slower at batch 1 (kivi-k2v2 16.6 -> 17.8, kvarn 19.1 -> 20.7)."""
    if DIRECT:
        factors = ()
        if USED and ASM:
            # one request a 128-byte line the factors touch, not one a token (3-11 fewer instructions a page)
            LINE: tl.constexpr = 1024 // PTR.dtype.element_ty.primitive_bitwidth  # elements a line
            APART: tl.constexpr = S_TOK if S_TOK > LINE else LINE
            lines = tl.arange(0, PAGE_TOKENS * S_TOK // APART) * APART
            _prefetch_l1(PTR + page * S_PAGE + (h // HDIV) * S_HEAD + lines)
        for i in tl.static_range(PAGE_TOKENS // STEP):
            f = tl.zeros([STEP], tl.float32)
            if USED:
                f = _token_factor(PTR, page, h, _step_token(i, PAGE_TOKENS // ROWS, ROWS, STEP) + ts, S_PAGE,
                                  S_HEAD, S_TOK, HDIV, ASM)
            factors = factors + (f,)
    else:
        i = tl.arange(0, PAGE_TOKENS // STEP)
        t = (i % (PAGE_TOKENS // ROWS) * ROWS + i // (PAGE_TOKENS // ROWS) * STEP)[:, None] + ts[None, :]
        factors = tl.zeros([PAGE_TOKENS // STEP, STEP], tl.float32)
        if USED:
            factors = _token_factor(PTR, page, h, t, S_PAGE, S_HEAD, S_TOK, HDIV, False)
    return factors


@triton.jit
def _step_factor(factors, i: tl.constexpr, DIRECT: tl.constexpr):
    """Step i's float32 [STEP] vector of a page's factors (_page_token_factors)."""
    if DIRECT:
        f = factors[i]
    else:  # row i of the tile: a select and a sum over the steps (no memory access)
        rows = tl.arange(0, factors.shape[0])
        f = tl.sum(tl.where(rows[:, None] == i, factors, 0.0), 0)
    return f


@triton.jit
def _hadamard(x, LOG2_C: tl.constexpr, KEEP_LAYOUT: tl.constexpr):
    """x [R, C] @ Hd along its last axis (C = 2^LOG2_C; quant/hadamard.py), in registers: the
    butterflies of quant's fwht, element i paired with i ^ h (h = 1, 2, 4, ...) as (a + b, a - b).
    A few hundred instructions a program, where a [D, D] matrix would not fit one warp's registers.
    Two ways to pair them, each the faster one where it is used (H100, session 20): KEEP_LAYOUT
    gathers every stage's partners in x's own layout, so the rotated q keeps the layout of its
    load through the page loop (KVarN batch 16 / 32k: 199 us, 214 with q split and joined);
    otherwise the pairs are split off a reshaped tile and joined back, which suits the output
    taken from the MMA's accumulator (kitty-qh batch 16 / 32k: 182 us, 193 gathered)."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    c = tl.arange(0, C)[None, :]
    for s in tl.static_range(LOG2_C):
        if KEEP_LAYOUT:
            partner = tl.gather(x, tl.broadcast_to(c ^ (1 << s), [R, C]), 1)
            x = tl.where((c & (1 << s)) == 0, x + partner, partner - x)
        else:
            a, b = tl.split(tl.permute(tl.reshape(x, [R, C // (2 << s), 2, 1 << s]), [0, 1, 3, 2]))
            x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [R, C])
    return x * (1.0 / tl.sqrt(C * 1.0))


@triton.jit
def _channel_factor(PTR, page, h, d, S_PAGE: tl.constexpr, S_HEAD: tl.constexpr):
    """Float32 [D]: a per-channel factor of kv head h (scale, zero or KVarN's value multiplier)."""
    return tl.load(PTR + page * S_PAGE + h * S_HEAD + d).to(tl.float32)


@triton.jit
def _rows(base, rows, c, c_ok, COLS: tl.constexpr, MASKED: tl.constexpr, CM: tl.constexpr):
    """Rows of a [ROWS, COLS] plane at columns c, or with CM > 0 of a channel-major [COLS, CM]
    plane (ChannelMajor), as a [len(rows), len(c)] tile; c_ok masks padded columns (Kitty's high
    plane, MASKED); full-width planes need no mask."""
    if CM > 0:
        off = rows[:, None] + c[None, :] * CM
    else:
        off = rows[:, None] * COLS + c[None, :]
    if MASKED:
        return tl.load(base + off, mask=c_ok[None, :], other=0)
    return tl.load(base + off)


@triton.jit
def _tile(base, t, c, c_ok, LEVELS, t0: tl.constexpr, STEP: tl.constexpr, COLS: tl.constexpr,
          MASKED: tl.constexpr, BITS: tl.constexpr, ROWS: tl.constexpr, NF4: tl.constexpr, ASM: tl.constexpr, raw,
          PRELOADED: tl.constexpr, SWAP: tl.constexpr, CM: tl.constexpr):
    """Tokens t = t0 + arange(STEP), columns c (c_ok: the ones that exist) of one kv head's [ROWS,
    COLS] plane of a page (at `base`) as a [STEP, len(c)] tile of levels carrying _tile_offset.
    With PRELOADED, `raw` holds the step's rows of the plane already. SWAP: see _levels. CM: see
    _rows. A step of 2 * ROWS tokens (a 1-bit plane of a 3-bit
    code's top bits) reads all ROWS rows at two slots, and t is its first half."""
    if BITS == 16:  # fp16 pages: rows are tokens (only K and V planes: no column mask)
        x = tl.load(base + t[:, None] * COLS + c[None, :])
    else:  # the step lies in one slot of a block of rows (decode_attention checks that ROWS % STEP == 0) or,
        # in a 1-bit plane of half its rows (3-bit codes' top bits), in two slots of them
        if not PRELOADED:
            raw = _rows(base, t % ROWS, c, c_ok, COLS, MASKED, CM)
        if STEP == 2 * ROWS:  # the halves' tiles, joined along the rows (in registers: no layout change)
            first = _levels(raw, LEVELS, BITS, t0 // ROWS, NF4, ASM, SWAP, CM == 0)
            second = _levels(raw, LEVELS, BITS, t0 // ROWS, NF4, ASM, SWAP, CM == 0, 1)
            x = tl.reshape(tl.permute(tl.join(first, second), [2, 0, 1]), [2 * ROWS, COLS])
        else:
            x = _levels(raw, LEVELS, BITS, t0 // ROWS, NF4, ASM, SWAP, CM == 0)
    return x


@triton.jit
def _top_tile(low, plane, raw, t0: tl.constexpr, order, d, LEVELS, STEP: tl.constexpr, D: tl.constexpr,
              ROWS: tl.constexpr, ASM: tl.constexpr, SWAP: tl.constexpr, CM: tl.constexpr, TOP: tl.constexpr):
    """With TOP (3-bit codes), the step's tile of their top bits: the 1-bit plane of ROWS rows at `plane`,
    read whole at the page's start (raw, rows in `order`); else `low`, the code tile (never used)."""
    if TOP:
        return _tile(plane, t0 + order, d, d, LEVELS, t0, STEP, D, False, 1, ROWS, False, ASM, raw, True, SWAP, CM)
    return low


@triton.jit
def _code_dot(x, x_top, y, acc, TOP: tl.constexpr):
    """x @ y + acc (acc None: x @ y), x a tile of code levels in the product's orientation; with TOP
    (3-bit codes) x holds their two low bits and x_top their top bit, which weighs 4: one more
    product, against 4 y (exact in fp16: a power of two)."""
    acc = tl.dot(x, y, acc)
    if TOP:
        acc = tl.dot(x_top, y * 4.0, acc)
    return acc


@triton.jit
def _grouped(x, SCALE, ZERO, page, h, t, d, S_PAGE: tl.constexpr, S_HEAD: tl.constexpr, S_TOK: tl.constexpr,
             HDIV: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, OFF: tl.constexpr):
    """(level - offset) * scale + zero for scales per (token, group of channels), which fold into
    neither operand: decoded element by element (options only, e.g. v_group=16; no preset)."""
    off = page * S_PAGE + (h // HDIV) * S_HEAD + t[:, None] * S_TOK + d[None, :] // GROUP
    x = (x.to(tl.float32) - OFF) * tl.load(SCALE + off).to(tl.float32)
    if HAS_ZERO:
        x += tl.load(ZERO + off).to(tl.float32)
    return x


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Fold a block of base-2 logits s [tokens, N] into the running max m [N] and sum l [N];
    returns them with the factor alpha for the old accumulator and the block's weights p. A
    column whose logits are all -inf so far (sliding window) keeps m = -inf, l = 0."""
    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # avoids -inf - -inf = NaN
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[None, :])
    return m_new, l_i * alpha + tl.sum(p, 0), alpha, p


@triton.jit
def _dense_tier(q, m_i, l_i, acc, k_base, v_base, s_t, n, first, q_pos, window, d, qk_scale, dt: tl.constexpr,
                HAS_WINDOW: tl.constexpr, STEP: tl.constexpr):
    """Attention over n FP16 tokens at k_base/v_base (token stride s_t) whose first sits at
    position `first`, folded into the running (m, l, acc [D, N])."""
    qf = (q * qk_scale).to(dt)
    for t0 in range(0, n, STEP):
        t = t0 + tl.arange(0, STEP)
        ok = t < n
        off = t[:, None] * s_t + d[None, :]
        k = tl.load(k_base + off, mask=ok[:, None], other=0.0).to(dt)
        v = tl.load(v_base + off, mask=ok[:, None], other=0.0).to(dt)  # issued with k: one memory latency per step
        seen = ok[:, None]
        if HAS_WINDOW:
            seen = seen & (q_pos[None, :] - (first + t)[:, None] < window)
        s = tl.where(seen, tl.dot(k, tl.trans(qf)), float("-inf"))
        m_i, l_i, alpha, p = _softmax_step(s, m_i, l_i)
        acc = tl.dot(tl.trans(v), p.to(dt), acc * alpha[None, :])
    return m_i, l_i, acc


@triton.jit
def _pages(q, p0, p1, first_page, PT, slot, s_pt_b, s_pt_p, Q, row_base, n_rows, n_ok, h, d, q_pos, window,
           pos0, qk_scale, LEVELS,
           K_CODES, K_SCALE, K_ZERO, K_MULT, K_HIGH, K_IDS, V_CODES, V_SCALE, V_ZERO, V_MULT, V_HIGH,
           dt: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_TOKENS: tl.constexpr,
           STEP: tl.constexpr, ROWS: tl.constexpr, NB_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr,
           ASM: tl.constexpr, K_BITS: tl.constexpr, K_ROWS: tl.constexpr, K_PER_TOKEN: tl.constexpr, K_S_PAGE: tl.constexpr,
           K_S_HEAD: tl.constexpr, K_S_TOK: tl.constexpr, K_HDIV: tl.constexpr, K_GROUP: tl.constexpr,
           K_HAS_ZERO: tl.constexpr, K_MULT_KIND: tl.constexpr, K_NF4: tl.constexpr, K_N_HIGH: tl.constexpr,
           V_BITS: tl.constexpr, V_ROWS: tl.constexpr, V_PER_TOKEN: tl.constexpr, V_S_PAGE: tl.constexpr,
           V_S_HEAD: tl.constexpr, V_S_TOK: tl.constexpr, V_HDIV: tl.constexpr, V_GROUP: tl.constexpr,
           V_HAS_ZERO: tl.constexpr, V_MULT_KIND: tl.constexpr, V_NF4: tl.constexpr, SOFTMAX_STEPS: tl.constexpr,
           V_SWAP: tl.constexpr, K_CHANNEL_MAJOR: tl.constexpr, V_CHANNEL_MAJOR: tl.constexpr,
           K_COLUMNS_SWAPPED: tl.constexpr, PAGE_STAGES: tl.constexpr, PREFETCH: tl.constexpr):
    """Attention of the query rows q [N, D] over the quantized pages [p0, p1) of a row: the running
    max m [N] (it may lag behind the true max, see LAZY_MAX), the sum l [N] of the weights, the
    unnormalized output acc [D, N] (transposed), and corr [N]: what acc still holds of the value
    offsets (and zeros), to subtract before normalizing. Sums over tokens are kept per [STEP, N]
    position and reduced once at the end. V_SWAP: the value codes are unpacked swapped, and a
    step's tokens taken in that order (module docstring)."""
    # finite start: a masked (-inf) logit then weighs exp2(-inf) = 0, never NaN
    m_i = tl.full([BLOCK_N], -1e30, tl.float32)
    acc = tl.zeros([D, BLOCK_N], tl.float32)
    l_tile = tl.zeros([STEP, BLOCK_N], tl.float32)
    corr_tile = tl.zeros([STEP, BLOCK_N], tl.float32)
    rs = tl.arange(0, STEP)
    # a step's tiles hold its tokens in this order: swapped values trade tokens inside fours, so
    # the keys' rows, the token factors and the window mask follow them
    ts = swapped(rs) if V_SWAP else rs
    r = tl.arange(0, NB_PAD)
    r_ok = r < K_N_HIGH
    # value factors that live outside the [D, N] accumulator's running sum: per-channel scales
    # (or KVarN's per-channel multiplier) differ from page to page, so those steps keep their product apart
    V_APART: tl.constexpr = (not V_PER_TOKEN and V_BITS != 16) or V_MULT_KIND == 2
    V_CORRECTS: tl.constexpr = _corrects(V_BITS, V_ROWS, V_NF4, V_PER_TOKEN, V_HAS_ZERO, V_GROUP, D, V_APART)
    # per-token factors loaded straight into the logits' layout (_page_token_factors), except in a
    # pipelined loop whose value products are kept apart (KVarN at batch 16 and 64), where the
    # compact tile was faster: kvarn batch 64 / 32k 630 against 655 us, batch 16 191 against 195
    # (H100, session 24)
    FACTORS_DIRECT: tl.constexpr = not (PAGE_STAGES > 1 and V_APART)
    K_CM: tl.constexpr = K_ROWS if K_CHANNEL_MAJOR else 0  # (_rows)
    V_CM: tl.constexpr = V_ROWS if V_CHANNEL_MAJOR else 0
    SLOTS: tl.constexpr = PAGE_TOKENS // ROWS  # steps per block of rows
    # NF4 planes of ROWS rows hold two slots, steps i and i + 1 of a block, looked up together (_nf4_levels)
    K_PAIRED: tl.constexpr = K_NF4 and (K_ROWS == ROWS) and (ROWS % STEP == 0)
    V_PAIRED: tl.constexpr = V_NF4 and (V_ROWS == ROWS) and (ROWS % STEP == 0)
    tl.static_assert((not K_COLUMNS_SWAPPED) or ((K_BITS == 2 or K_BITS == 3 or K_BITS == 4) and not K_NF4),
                     "swapped key columns are put back by the swapped unpack of 2-, 3- or 4-bit RTN codes")
    # 3-bit codes: the code plane holds their two low bits (a 2-bit plane) and the HIGH plane their top bit
    # (a 1-bit plane of half as many rows, quant/rtn.py), each unpacked like any other plane; the top bit's
    # tile is one more product (_code_dot)
    K_TOP: tl.constexpr = K_BITS == 3
    V_TOP: tl.constexpr = V_BITS == 3
    K_LOW_BITS: tl.constexpr = 2 if K_TOP else K_BITS
    V_LOW_BITS: tl.constexpr = 2 if V_TOP else V_BITS
    # the top bits' plane has PAGE_TOKENS / 8 rows, read whole at a page's start: a 16-token step takes
    # one slot of it, a 32-token step two (_tile), with the rows in the order of the step's first half
    TOP_ROWS: tl.constexpr = PAGE_TOKENS // 8
    tl.static_assert(((not K_TOP) or (K_ROWS == 2 * TOP_ROWS)) and ((not V_TOP) or (V_ROWS == 2 * TOP_ROWS)),
                     "3-bit codes: a 2-bit plane of PAGE_TOKENS / 4 rows and a top-bit plane of PAGE_TOKENS / 8")
    top_rs = tl.arange(0, TOP_ROWS)
    top_ts = swapped(top_rs) if V_SWAP else top_rs
    # scales per (token, group of channels): tiles decoded element by element (_grouped)
    K_GROUPED: tl.constexpr = K_PER_TOKEN and (K_GROUP < D)
    V_GROUPED: tl.constexpr = V_PER_TOKEN and (V_GROUP < D)
    STEPS: tl.constexpr = PAGE_TOKENS // STEP  # steps per page
    # with PREFETCH, page ids are read two pages ahead, so the next page's id is at hand during this
    # page, whose compute the next page's fields stream into the L2 under (_prefetch_page); they are
    # carried as int32 there (batch 1 and 4 / 32k 1-2.5% faster than int64), as int64 otherwise (int32 ids
    # made the pipelined loop 1-11% slower at batch 16 / 64; H100, session 22)
    page_next = first_page  # PT[slot, p0] (0 for no pages), read by the caller
    if PREFETCH:
        page_after = tl.load(PT + slot * s_pt_b + (p0 + 1) * s_pt_p, mask=p0 + 1 < p1, other=0)
    else:
        page_next = page_next.to(tl.int64)
    for p in tl.range(p0, p1, num_stages=PAGE_STAGES):
        page = page_next.to(tl.int64)  # the next page's id is read ahead: its codes' addresses are ready at once
        if PREFETCH:
            page_next = page_after
            page_after = tl.load(PT + slot * s_pt_b + (p + 2) * s_pt_p, mask=p + 2 < p1, other=0)
        else:
            page_next = tl.load(PT + slot * s_pt_b + (p + 1) * s_pt_p, mask=p + 1 < p1, other=0).to(tl.int64)
        # ---- keys: fold the channel factors into q once per page --------------------------------
        #   per channel: s = mult_t * ((q * scale) . level_t - off * sum(q * scale) + q . zero)
        #   per token:   s = scale_t * ((q * mult) . level_t - off * sum(q * mult)) + zero_t * sum(q * mult)
        if K_PER_TOKEN or (K_BITS == 16):
            k_fold = tl.full([D], qk_scale, tl.float32)
            if K_MULT_KIND == 2:
                k_fold *= _channel_factor(K_MULT, page, h, d, H * D, D)
        else:
            k_fold = _channel_factor(K_SCALE, page, h, d, K_S_PAGE, K_S_HEAD) * qk_scale
        qf = (q.to(tl.float32) * k_fold[None, :]).to(dt)
        q_sum = tl.sum(qf.to(tl.float32), 1)  # of the rounded operand: cancels the offsets exactly
        q_zero = tl.zeros([BLOCK_N], tl.float32)
        if (not K_PER_TOKEN) and K_HAS_ZERO and (K_BITS != 16):
            q_zero = tl.sum(q.to(tl.float32) * (_channel_factor(K_ZERO, page, h, d, K_S_PAGE, K_S_HEAD) * qk_scale)[None, :],
                            1)
        if K_N_HIGH > 0:
            # Kitty: a boosted channel's code is low + 4 * high, so q.k gains sum_r (4 q[id_r] scale[id_r]) high_r
            ids = tl.load(K_IDS + page * (H * K_N_HIGH) + h * K_N_HIGH + r, mask=r_ok, other=0).to(tl.int32)
            s_hi = tl.load(K_SCALE + page * K_S_PAGE + h * K_S_HEAD + ids, mask=r_ok, other=0.0).to(tl.float32)
            q_hi = tl.load(Q + (row_base + n_rows)[:, None] * D + ids[None, :], mask=n_ok[:, None] & r_ok[None, :],
                           other=0.0).to(tl.float32)
            q_hi = (q_hi * (4.0 * qk_scale) * s_hi[None, :]).to(dt)
            q_hi_sum = tl.sum(q_hi.to(tl.float32), 1)
            hi_plane = K_HIGH + page * (H * K_ROWS * K_N_HIGH) + h * (K_ROWS * K_N_HIGH)
            hi_raw = rs
            if K_ROWS == STEP:
                hi_raw = _rows(hi_plane, ts, r, r_ok, K_N_HIGH, K_N_HIGH < NB_PAD, 0)
        # ---- values: per-channel factors of the page --------------------------------------------
        if V_MULT_KIND == 2:
            v_chan = _channel_factor(V_MULT, page, h, d, H * D, D)
        if (not V_PER_TOKEN) and (V_BITS != 16):
            v_chan = _channel_factor(V_SCALE, page, h, d, V_S_PAGE, V_S_HEAD)
            if V_HAS_ZERO:
                v_zero_chan = _channel_factor(V_ZERO, page, h, d, V_S_PAGE, V_S_HEAD)
        # Steps walk blocks of STEP plane rows, and inside a block every slot of those rows (token
        # t0 = slot * ROWS + block * STEP), so each block of rows is loaded and spread once.
        # A plane with exactly STEP rows is loaded once per page.
        k_plane = K_CODES + page * (H * K_ROWS * D) + h * (K_ROWS * D)
        v_plane = V_CODES + page * (H * V_ROWS * D) + h * (V_ROWS * D)
        k_top_plane = K_HIGH + page * (H * (K_ROWS // 2) * D) + h * ((K_ROWS // 2) * D)  # (read with K_TOP only)
        v_top_plane = V_HIGH + page * (H * (V_ROWS // 2) * D) + h * ((V_ROWS // 2) * D)
        k_raw = rs
        v_raw = rs
        k_top_raw = rs
        v_top_raw = rs
        if K_ROWS == STEP:
            k_raw = _rows(k_plane, ts, d, d, D, False, K_CM)
        if V_ROWS == STEP:
            v_raw = _rows(v_plane, rs, d, d, D, False, V_CM)
        if K_TOP:
            k_top_raw = _rows(k_top_plane, top_ts, d, d, D, False, K_CM // 2)
        if V_TOP:
            v_top_raw = _rows(v_top_plane, top_rs, d, d, D, False, V_CM // 2)
        K_TOKEN_SCALED: tl.constexpr = K_PER_TOKEN and (K_GROUP >= D) and (K_BITS != 16)
        V_TOKEN_SCALED: tl.constexpr = V_PER_TOKEN and (V_GROUP >= D) and (V_BITS != 16)
        k_scales = _page_token_factors(K_SCALE, page, h, ts, K_TOKEN_SCALED, K_S_PAGE, K_S_HEAD, K_S_TOK, K_HDIV,
                                       ROWS, STEP, PAGE_TOKENS, FACTORS_DIRECT, ASM)
        k_zeros = _page_token_factors(K_ZERO, page, h, ts, K_TOKEN_SCALED and K_HAS_ZERO, K_S_PAGE, K_S_HEAD,
                                      K_S_TOK, K_HDIV, ROWS, STEP, PAGE_TOKENS, FACTORS_DIRECT, ASM)
        k_mults = _page_token_factors(K_MULT, page, h, ts, K_MULT_KIND == 1, H * PAGE_TOKENS, PAGE_TOKENS, 1, 1,
                                      ROWS, STEP, PAGE_TOKENS, FACTORS_DIRECT, ASM)
        v_scales = _page_token_factors(V_SCALE, page, h, ts, V_TOKEN_SCALED, V_S_PAGE, V_S_HEAD, V_S_TOK, V_HDIV,
                                       ROWS, STEP, PAGE_TOKENS, FACTORS_DIRECT, ASM)
        v_zeros = _page_token_factors(V_ZERO, page, h, ts, V_PER_TOKEN and V_HAS_ZERO and (V_BITS != 16), V_S_PAGE,
                                      V_S_HEAD, V_S_TOK, V_HDIV, ROWS, STEP, PAGE_TOKENS, FACTORS_DIRECT, ASM)
        v_mults = _page_token_factors(V_MULT, page, h, ts, V_MULT_KIND == 1, H * PAGE_TOKENS, PAGE_TOKENS, 1, 1,
                                      ROWS, STEP, PAGE_TOKENS, FACTORS_DIRECT, ASM)
        # Steps come in groups of SOFTMAX_STEPS: the group's logits first, then one update of the
        # running max (and, rarely, one rescale) for all of them, then their values. One reduction
        # and one branch per group, and the group's products do not wait on each other's softmax.
        for g0 in tl.static_range(0, STEPS, SOFTMAX_STEPS):
            logits = ()
            for i in tl.static_range(g0, g0 + SOFTMAX_STEPS):
                t = _step_token(i, SLOTS, ROWS, STEP) + ts
                # logits of the step's tokens, transposed: [STEP, N]
                if (K_ROWS != STEP) and (K_ROWS == ROWS) and (i % SLOTS == 0):  # a new block of rows
                    k_raw = _rows(k_plane, t, d, d, D, False, K_CM)
                    if K_N_HIGH > 0:
                        hi_raw = _rows(hi_plane, t, r, r_ok, K_N_HIGH, K_N_HIGH < NB_PAD, 0)
                if K_PAIRED and (i % SLOTS == 0):  # both slots of the rows: this step's and the next one's
                    k, k_next = _nf4_levels(k_raw, LEVELS, ASM)
                elif K_PAIRED:
                    k = k_next
                else:
                    # (columns swapped in storage: the swapped unpack puts the channels back in order)
                    k = _tile(k_plane, t, d, d, LEVELS, _step_token(i, SLOTS, ROWS, STEP), STEP, D, False, K_LOW_BITS,
                              K_ROWS, K_NF4, ASM, k_raw, (K_ROWS == STEP) or (K_ROWS == ROWS), K_COLUMNS_SWAPPED,
                              K_CM)
                k_top = _top_tile(k, k_top_plane, k_top_raw, _step_token(i, SLOTS, ROWS, STEP), top_ts, d, LEVELS, STEP, D,
                                  TOP_ROWS, ASM, K_COLUMNS_SWAPPED, K_CM // 2, K_TOP)
                k_off = _tile_offset(K_BITS, K_ROWS, _step_token(i, SLOTS, ROWS, STEP), K_NF4)
                if K_GROUPED:  # decoded in the tile: nothing left to correct after the product
                    if K_TOP:
                        k = k.to(tl.float32) + 4.0 * k_top.to(tl.float32)
                    k = _grouped(k, K_SCALE, K_ZERO, page, h, t, d, K_S_PAGE, K_S_HEAD, K_S_TOK, K_HDIV, K_GROUP,
                                 K_HAS_ZERO, k_off)
                if (not K_PER_TOKEN) and (K_BITS != 16):
                    # per-channel keys: one bias per query row (the zero term minus the offsets' terms,
                    # the boosted channels' included) is the products' starting accumulator, not a
                    # pass over the logits: kitty 5-7% faster at batch 16 / 64 (H100, session 16)
                    k_bias = q_zero - k_off * q_sum
                    if K_N_HIGH > 0:
                        k_bias -= _tile_offset(2, K_ROWS, _step_token(i, SLOTS, ROWS, STEP), False) * q_hi_sum
                    s = _code_dot(k.to(dt), k_top.to(dt), tl.trans(qf),
                                  tl.zeros([STEP, BLOCK_N], tl.float32) + k_bias[None, :], K_TOP)
                else:
                    s = _code_dot(k.to(dt), k_top.to(dt), tl.trans(qf), None,
                                  K_TOP and not K_GROUPED)
                if K_PER_TOKEN and (K_GROUP >= D) and (K_BITS != 16):
                    if k_off != 0.0:
                        s -= k_off * q_sum[None, :]
                    s *= _step_factor(k_scales, i, FACTORS_DIRECT)[:, None]
                    if K_HAS_ZERO:
                        k_zero = _step_factor(k_zeros, i, FACTORS_DIRECT)
                        s += k_zero[:, None] * q_sum[None, :]
                if K_N_HIGH > 0:  # (its offset is in k_bias)
                    tl.static_assert((not K_PER_TOKEN) and (K_BITS != 16), "boosted channels need per-channel keys")
                    hi = _tile(hi_plane, t, r, r_ok, LEVELS, _step_token(i, SLOTS, ROWS, STEP), STEP, K_N_HIGH, True, 2,
                               K_ROWS, False, ASM, hi_raw, (K_ROWS == STEP) or (K_ROWS == ROWS), False, 0)
                    s = tl.dot(hi.to(dt), tl.trans(q_hi), s)
                if K_MULT_KIND == 1:
                    s *= _step_factor(k_mults, i, FACTORS_DIRECT)[:, None]
                if HAS_WINDOW:
                    s = tl.where(q_pos[None, :] - (pos0 + p * PAGE_TOKENS + t)[:, None] < window, s, float("-inf"))
                logits = logits + (s,)
            s_max = logits[0]
            for i in tl.static_range(1, SOFTMAX_STEPS):
                s_max = tl.maximum(s_max, logits[i])
            m_new = tl.maximum(m_i, tl.max(s_max, 0))
            if PREFETCH and (g0 == 0):
                # after this page's keys have arrived (the asm waits on `after`), so that the next page's
                # bytes do not share the DRAM with them but stream in while this page computes
                after = tl.max(m_new, 0)
                if p + 1 < p1:  # a branch, so that the last page of a split issues none of it (kitty-pro batch 1 / 32k:
                    # 19.2-19.6 us without it, 18.3-18.6 with it, over five runs; H100, session 24)
                    page_next_id = page_next.to(tl.int64)
                    _prefetch_page(page_next_id, h, after, K_CODES, K_SCALE, K_ZERO, K_MULT, K_HIGH, H, D, PAGE_TOKENS,
                                   K_BITS, K_ROWS, K_PER_TOKEN, K_S_PAGE, K_S_HEAD, K_HDIV, K_HAS_ZERO, K_MULT_KIND)
                    _prefetch_page(page_next_id, h, after, V_CODES, V_SCALE, V_ZERO, V_MULT, V_HIGH, H, D, PAGE_TOKENS,
                                   V_BITS, V_ROWS, V_PER_TOKEN, V_S_PAGE, V_S_HEAD, V_HDIV, V_HAS_ZERO, V_MULT_KIND)
                    if K_N_HIGH > 0:
                        _prefetch(K_HIGH + page_next_id * (H * K_ROWS * K_N_HIGH) + h * (K_ROWS * K_N_HIGH),
                                  K_ROWS * K_N_HIGH, after)
                        _prefetch(K_IDS + page_next_id * (H * K_N_HIGH) + h * K_N_HIGH, K_N_HIGH, after)
            if tl.max(m_new - m_i, 0) > LAZY_MAX:  # raise the max and rescale (rare after the first pages)
                alpha = tl.exp2(m_i - m_new)
                acc *= alpha[None, :]
                l_tile *= alpha[None, :]
                if V_CORRECTS:
                    corr_tile *= alpha[None, :]
                m_i = m_new
            for i in tl.static_range(g0, g0 + SOFTMAX_STEPS):
                t = _step_token(i, SLOTS, ROWS, STEP) + rs
                w = tl.exp2(logits[i - g0] - m_i[None, :])
                l_tile += w
                # ---- values: token factors scale the weights w, channel factors the step's product ----
                #   per token:   o = mult_d * (sum_t (w scale_t) level_t - off * sum(w scale) + sum(w zero))
                #   per channel: o = scale_d * (sum_t (w mult_t) level_t - off * sum(w mult)) + zero_d * sum(w mult)
                if (V_ROWS != STEP) and (V_ROWS == ROWS) and (i % SLOTS == 0):
                    v_raw = _rows(v_plane, t, d, d, D, False, V_CM)
                if V_PAIRED and (i % SLOTS == 0):
                    v, v_next = _nf4_levels(v_raw, LEVELS, ASM)
                elif V_PAIRED:
                    v = v_next
                else:
                    v = _tile(v_plane, t, d, d, LEVELS, _step_token(i, SLOTS, ROWS, STEP), STEP, D, False, V_LOW_BITS,
                              V_ROWS, V_NF4, ASM, v_raw, (V_ROWS == STEP) or (V_ROWS == ROWS), V_SWAP, V_CM)
                v_top = _top_tile(v, v_top_plane, v_top_raw, _step_token(i, SLOTS, ROWS, STEP), top_rs, d, LEVELS, STEP, D,
                                  TOP_ROWS, ASM, V_SWAP, V_CM // 2, V_TOP)
                v_off = _tile_offset(V_BITS, V_ROWS, _step_token(i, SLOTS, ROWS, STEP), V_NF4)
                if V_GROUPED:
                    if V_TOP:
                        v = v.to(tl.float32) + 4.0 * v_top.to(tl.float32)
                    v = _grouped(v, V_SCALE, V_ZERO, page, h, t, d, V_S_PAGE, V_S_HEAD, V_S_TOK, V_HDIV, V_GROUP,
                                 V_HAS_ZERO, v_off)
                    v_off = 0.0  # decoded values: nothing left to correct
                    ww = w.to(dt)
                else:
                    if V_PER_TOKEN and (V_BITS != 16):
                        ww = (w * _step_factor(v_scales, i, FACTORS_DIRECT)[:, None]).to(dt)
                    elif V_MULT_KIND == 1:
                        ww = (w * _step_factor(v_mults, i, FACTORS_DIRECT)[:, None]).to(dt)
                    else:
                        ww = w.to(dt)
                if V_APART:  # per-channel factors: this step's product is scaled before it joins acc
                    off_w = v_off * tl.sum(ww.to(tl.float32), 0)
                    if V_PER_TOKEN and V_HAS_ZERO:
                        off_w -= tl.sum(w * _step_factor(v_zeros, i, FACTORS_DIRECT)[:, None], 0)
                    pv = v_chan[:, None] * (_code_dot(tl.trans(v.to(dt)), tl.trans(v_top.to(dt)), ww,
                                                      None, V_TOP and not V_GROUPED)
                                            - off_w[None, :])
                    if (not V_PER_TOKEN) and V_HAS_ZERO:
                        w_sum = tl.sum(w, 0)
                        if V_MULT_KIND == 1:
                            w_sum = tl.sum(w * _step_factor(v_mults, i, FACTORS_DIRECT)[:, None], 0)
                        pv += v_zero_chan[:, None] * w_sum[None, :]
                    acc += pv
                else:
                    acc = _code_dot(tl.trans(v.to(dt)), tl.trans(v_top.to(dt)), ww, acc, V_TOP and not V_GROUPED)
                    if (v_off != 0.0) or (V_PER_TOKEN and V_HAS_ZERO and (V_BITS != 16) and (V_GROUP == D)):
                        if v_off != 0.0:
                            corr_tile += v_off * ww.to(tl.float32)
                        if V_PER_TOKEN and V_HAS_ZERO and (V_BITS != 16) and (V_GROUP == D):
                            corr_tile -= w * _step_factor(v_zeros, i, FACTORS_DIRECT)[:, None]
    return m_i, tl.sum(l_tile, 0), acc, tl.sum(corr_tile, 0)


@triton.jit
def _page_split(n_pg, num_splits, MIN_PAGES: tl.constexpr, SHORT_PAGES: tl.constexpr):
    """Pages per split of a row of n_pg pages, and how many of its num_splits splits get any.
    A row of up to SHORT_PAGES pages gets one-page splits: it has few programs, and the
    longest chain of dependent steps sets its time. Longer rows take at least MIN_PAGES per split
    (a split's fixed cost, and the merge, outweigh the shorter chain there).
    the split kernel and the merge agree on both, so the splits past a row's end (most of them
    under a CUDA graph, whose split count is sized for the longest row the page table holds)
    neither compute nor write, and the merge never reads them."""
    least = tl.where(n_pg <= SHORT_PAGES, 1, MIN_PAGES)
    per = tl.maximum(tl.cdiv(n_pg, tl.maximum(num_splits, 1)), least)  # (num_splits = 0: one program)
    return per, tl.cdiv(n_pg, per)


# The tier count (the sink's part and the recent tier's): a growing recent tier (KVmix's, Tiers.recent_grows)
# gets more parts as the table widens, and as a constexpr that compiled the split and merge kernels again at
# each new width, mid-decode (two of each, ~8.5 s, at widths 127 and 255 of a 2-layer KVmix plan on an
# H100). So a growing tier's count comes as the run-time `tiers` (FIXED_TIERS = 0), left unspecialized
# (Triton would otherwise compile a variant for counts divisible by 16). A fixed window's count never
# changes in a run and stays a constant (FIXED_TIERS = tiers): read at run time it cost the FP16 kernel at
# batch 1 / 32k 0.8 us of 52 (session 48).
@triton.jit(do_not_specialize=["tiers"])
def _split_kernel(
    Q, LEVELS, SLOTS, PT, NPAGES, SINK_K, SINK_V, NSINK, REC_K, REC_V, NREC, O_PART, LSE_PART, OUT, LSE_OUT,
    K_CODES, K_SCALE, K_ZERO, K_MULT, K_HIGH, K_IDS,
    V_CODES, V_SCALE, V_ZERO, V_MULT, V_HIGH, V_IDS,
    qk_scale, num_splits, tiers, M, n_queries, q_pos_offset, window, s_pt_b, s_pt_p,
    s_sink_b, s_sink_h, s_sink_t, s_rec_b, s_rec_h, s_rec_t,
    H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_TOKENS: tl.constexpr, STEP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, MIN_PAGES: tl.constexpr, SHORT_PAGES: tl.constexpr, DENSE_STEP: tl.constexpr,
    FIXED_TIERS: tl.constexpr, LOG2_D: tl.constexpr, NB_PAD: tl.constexpr, HAS_SLOTS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, ASM: tl.constexpr, ONE_PROGRAM: tl.constexpr, RETURN_LSE: tl.constexpr,
    K_BITS: tl.constexpr, K_ROWS: tl.constexpr, K_PER_TOKEN: tl.constexpr, K_S_PAGE: tl.constexpr,
    K_S_HEAD: tl.constexpr, K_S_TOK: tl.constexpr, K_HDIV: tl.constexpr, K_GROUP: tl.constexpr,
    K_HAS_ZERO: tl.constexpr, K_MULT_KIND: tl.constexpr, K_NF4: tl.constexpr, K_N_HIGH: tl.constexpr,
    K_CHANNEL_MAJOR: tl.constexpr, K_COLUMNS_SWAPPED: tl.constexpr, K_ROTATE: tl.constexpr,
    V_BITS: tl.constexpr, V_ROWS: tl.constexpr, V_PER_TOKEN: tl.constexpr, V_S_PAGE: tl.constexpr,
    V_S_HEAD: tl.constexpr, V_S_TOK: tl.constexpr, V_HDIV: tl.constexpr, V_GROUP: tl.constexpr,
    V_HAS_ZERO: tl.constexpr, V_MULT_KIND: tl.constexpr, V_NF4: tl.constexpr, V_N_HIGH: tl.constexpr,
    V_CHANNEL_MAJOR: tl.constexpr, V_COLUMNS_SWAPPED: tl.constexpr, V_ROTATE: tl.constexpr,
    PDL: tl.constexpr, SOFTMAX_STEPS: tl.constexpr, V_SWAP: tl.constexpr, PAGE_STAGES: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    tl.static_assert(not V_COLUMNS_SWAPPED, "value planes are stored channel-major, never with swapped columns")
    bh = tl.program_id(0)
    part = tl.program_id(1)
    if FIXED_TIERS > 0:
        tiers = FIXED_TIERS
    split = part - tiers  # page split >= 0; part 0: the sink; parts 1 .. tiers-1: chunks of the recent tier
    b = bh // H
    h = bh % H
    dt = Q.dtype.element_ty  # tl.dot operand type: fp16 on the GPU path, fp32 for exact tests
    n_rows = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)  # this program's q rows of the kv head
    n_ok = n_rows < M
    d = tl.arange(0, D)
    q_off = (bh * M + n_rows)[:, None] * D + d[None, :]
    m_i = tl.full([BLOCK_N], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([D, BLOCK_N], tl.float32)  # the output, transposed
    if HAS_SLOTS:  # batch row b lives in slot SLOTS[b] of the page table and the dense buffers
        slot = tl.load(SLOTS + b).to(tl.int64)
    else:
        slot = b.to(tl.int64)
    n_sink = tl.load(NSINK + b).to(tl.int32)
    n_pg = tl.load(NPAGES + b).to(tl.int32)
    n_rec = tl.load(NREC + b).to(tl.int32)
    # positions: sink token i -> i, page p token t -> n_sink + PAGE_TOKENS p + t, recent token i -> after the pages;
    # query row n (head-major, query-minor) sits at q_pos; with a window it sees pos only while q_pos - pos < window
    q_pos = n_sink + n_pg * PAGE_TOKENS + n_rec + q_pos_offset + n_rows % n_queries
    per, n_live = _page_split(n_pg, num_splits, MIN_PAGES, SHORT_PAGES)
    # quantized pages [p0, p1) of this row
    if ONE_PROGRAM:
        p0 = 0
        p1 = n_pg
    else:
        p0 = split * per
        p1 = tl.minimum(p0 + per, n_pg)
    if HAS_WINDOW:  # skip the pages older than every query's window
        lo = tl.min(tl.where(n_ok, q_pos, 2**30), 0) - window - n_sink - (PAGE_TOKENS - 2)
        p0 = tl.maximum(p0, tl.where(lo > 0, (lo + PAGE_TOKENS - 1) // PAGE_TOKENS, 0))
    has_pages = ONE_PROGRAM or ((split >= 0) and (split < n_live))
    # The slots, counts and page table change only between steps, so with PDL the first page's id is
    # read before the wait: its codes' loads go out as soon as q is written (engine, batch 1 / 32k:
    # fp16 0.4% faster). Without PDL it is read after q's load, as before: read first, batch-1 cells
    # of kitty, kivi-k2v2, kvarn and nqkv were 1-3% slower (H100, session 35).
    if PDL:
        first_page = tl.load(PT + slot * s_pt_b + p0 * s_pt_p, mask=(p0 < p1) & has_pages, other=0)
    wait_then_release(PDL)  # every program, the empty splits too (pdl.py)
    if has_pages:
        # q in the pages' (maybe rotated) domain
        q = tl.load(Q + q_off, mask=n_ok[:, None], other=0.0)  # kept in dt: fewer live registers
        if not PDL:
            first_page = tl.load(PT + slot * s_pt_b + p0 * s_pt_p, mask=p0 < p1, other=0)
        if K_ROTATE:  # rounded to dt after the rotation, as fmt.rotate does
            tl.static_assert(K_N_HIGH == 0, "boosted channels are gathered from the un-rotated q")
            q = _hadamard(q.to(tl.float32), LOG2_D, True).to(dt)
        m_i, l_i, acc, corr = _pages(
            q, p0, p1, first_page, PT, slot, s_pt_b, s_pt_p, Q, bh * M, n_rows, n_ok, h, d, q_pos, window,
            n_sink, qk_scale, LEVELS, K_CODES, K_SCALE, K_ZERO, K_MULT, K_HIGH, K_IDS, V_CODES, V_SCALE, V_ZERO,
            V_MULT, V_HIGH, dt, H, D, BLOCK_N, PAGE_TOKENS, STEP, BLOCK_ROWS, NB_PAD, HAS_WINDOW, ASM,
            K_BITS, K_ROWS, K_PER_TOKEN, K_S_PAGE, K_S_HEAD, K_S_TOK, K_HDIV, K_GROUP, K_HAS_ZERO, K_MULT_KIND,
            K_NF4, K_N_HIGH, V_BITS, V_ROWS, V_PER_TOKEN, V_S_PAGE, V_S_HEAD, V_S_TOK, V_HDIV, V_GROUP,
            V_HAS_ZERO, V_MULT_KIND, V_NF4, SOFTMAX_STEPS, V_SWAP, K_CHANNEL_MAJOR, V_CHANNEL_MAJOR,
            K_COLUMNS_SWAPPED, PAGE_STAGES, PREFETCH)
        acc -= corr[None, :]
        if V_ROTATE:  # back from the rotated domain (o Hd; linear, so before normalizing and merging)
            acc = tl.trans(_hadamard(tl.trans(acc), LOG2_D, False))
    if ONE_PROGRAM or split < 0:
        # FP16 tiers: part 0 = sink, parts 1.. = the recent tier in equal chunks of whole steps (at a
        # short context these chains of dependent steps, not the pages, are the longest program;
        # one program: all of it, after the pages)
        q = tl.load(Q + q_off, mask=n_ok[:, None], other=0.0).to(tl.float32)
        if ONE_PROGRAM or part == 0:
            m_i, l_i, acc = _dense_tier(q, m_i, l_i, acc, SINK_K + slot * s_sink_b + h * s_sink_h,
                                        SINK_V + slot * s_sink_b + h * s_sink_h, s_sink_t, n_sink, 0, q_pos, window,
                                        d, qk_scale, dt, HAS_WINDOW, DENSE_STEP)
        if ONE_PROGRAM or part > 0:
            chunk = tl.cdiv(tl.cdiv(n_rec, tiers - 1), DENSE_STEP) * DENSE_STEP
            r0 = 0 if ONE_PROGRAM else (part - 1) * chunk
            n_chunk = n_rec if ONE_PROGRAM else tl.minimum(n_rec - r0, chunk)
            m_i, l_i, acc = _dense_tier(q, m_i, l_i, acc, REC_K + slot * s_rec_b + h * s_rec_h + r0 * s_rec_t,
                                        REC_V + slot * s_rec_b + h * s_rec_h + r0 * s_rec_t, s_rec_t, n_chunk,
                                        n_sink + n_pg * PAGE_TOKENS + r0, q_pos, window, d, qk_scale, dt, HAS_WINDOW,
                                        DENSE_STEP)
    # an empty split (no pages in its window, an empty tier) writes o = 0, lse = -inf: it drops out of
    # the merge; a split past the row's last page writes nothing
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[None, :]  # [D, N]
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    if ONE_PROGRAM:
        tl.store(OUT + (bh * M + n_rows)[None, :] * D + d[:, None], o.to(OUT.dtype.element_ty), mask=n_ok[None, :])
        if RETURN_LSE:
            tl.store(LSE_OUT + bh * M + n_rows, lse * 0.6931471805599453, mask=n_ok)  # base 2 -> natural log
    elif split < n_live:
        row = (bh * (num_splits + tiers) + part) * M + n_rows
        tl.store(O_PART + row[None, :] * D + d[:, None], o, mask=n_ok[None, :])
        tl.store(LSE_PART + row, lse, mask=n_ok)


@triton.jit(do_not_specialize=["tiers"])
def _merge_kernel(O_PART, LSE_PART, OUT, LSE_OUT, NPAGES, num_splits, tiers, M, H: tl.constexpr, D: tl.constexpr,
                  D_BLOCK: tl.constexpr, MIN_PAGES: tl.constexpr, SHORT_PAGES: tl.constexpr, FIXED_TIERS: tl.constexpr,
                  CHUNK: tl.constexpr, RETURN_LSE: tl.constexpr, PDL: tl.constexpr):
    """out[bh, m] = sum over the row's written partials of o_s * 2^lse_s / sum 2^lse_s (0 if no
    split saw a token), and optionally the total log-sum-exp in natural log. The partials are the
    FP16 tiers' `tiers` parts and the row's live page splits (_page_split), read CHUNK at a time in
    one pass: a chunk's log-sum-exps and outputs are loaded together (every live partial is
    written, an empty one as o = 0, lse = -inf), and the running sums are rescaled when a chunk
    raises the max, so a row of up to CHUNK partials costs one memory latency. Each program merges
    D_BLOCK channels (at batch 1 there are few rows, so channels give the parallelism)."""
    bh = tl.program_id(0)
    m = tl.program_id(1)
    d = tl.program_id(2) * D_BLOCK + tl.arange(0, D_BLOCK)
    # (the page counts are written between steps, never by a decode kernel: read before the wait)
    _, n_live = _page_split(tl.load(NPAGES + bh // H).to(tl.int32), num_splits, MIN_PAGES, SHORT_PAGES)
    release_then_wait(PDL)  # the o_proj GEMV behind launches now (pdl.py)
    if FIXED_TIERS > 0:
        tiers = FIXED_TIERS
    n_read = n_live + tiers
    top = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    out = tl.zeros([D_BLOCK], tl.float32)
    for s0 in range(0, n_read, CHUNK):
        s = s0 + tl.arange(0, CHUNK)
        ok = s < n_read
        part = (bh * (num_splits + tiers) + s) * M + m
        lse = tl.load(LSE_PART + part, mask=ok, other=float("-inf"))
        o = tl.load(O_PART + part[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        new_top = tl.maximum(top, tl.max(lse, 0))
        ref = tl.where(new_top == float("-inf"), 0.0, new_top)  # avoids -inf - -inf = NaN
        keep = tl.exp2(top - ref)  # what the sums so far are worth against the new max
        w = tl.exp2(lse - ref)
        total = total * keep + tl.sum(w, 0)
        out = out * keep + tl.sum(w[:, None] * o, 0)
        top = new_top
    total_sum = tl.sum(total, 0)
    tl.store(OUT + (bh * M + m) * D + d, (out / tl.maximum(total_sum, 1e-30)).to(OUT.dtype.element_ty))
    if RETURN_LSE and tl.program_id(2) == 0:
        top_sum = tl.sum(top, 0)
        lse_all = tl.where(total_sum > 0, top_sum + tl.log2(tl.maximum(total_sum, 1e-30)), float("-inf"))
        tl.store(LSE_OUT + bh * M + m, lse_all * 0.6931471805599453)  # base 2 -> natural log


# True when TRITON_INTERPRET=1 was set at import: the kernels then run on CPU tensors
INTERPRETED = isinstance(_split_kernel, InterpretedFunction)


@dataclass(frozen=True)
class Launch:
    """How decode_attention is launched; None = the default.

    num_splits: page splits per (row, kv head), 0 = one program walks everything (no merge);
    default: default_splits. programs_per_sm: what the default split count aims at
    (PROGRAMS_PER_SM). min_pages: fewest pages per split (MIN_PAGES_PER_SPLIT). recent_parts:
    programs the FP16 recent tier is split over (RECENT_PARTS, more for a long tier: RECENT_PART_TOKENS). step: tokens per inner step (a power of 2, 16..PAGE_TOKENS; default
    _step). block_n: query rows per program (a power of 2 >= 4, which tl.dot pads to the MMA's 8
    itself; default the rows rounded up to BLOCK_N_MIN). num_warps / num_stages / maxnreg: Triton
    launch options (defaults NUM_WARPS, FP16_PAGE_WARPS or NF4_WARPS, NUM_STAGES). asm:
    unpack codes with PTX (default whenever compiled). softmax_steps: steps whose logits are all
    computed before one update of the running max (a power of 2, capped at a page's steps;
    default _softmax_steps). swap: unpack the values' codes swapped where _swappable allows
    (default SWAP). page_stages: Triton num_stages of the page loop alone, 1 = not pipelined
    (default _page_stages). prefetch: prefetch the next page into the L2 (default _prefetches).
    gluon: run the split kernel in Gluon (kernels/gluon_attention.py) where it applies (default
    _gluon_split's rule)."""

    num_splits: int | None = None
    programs_per_sm: int | None = None
    min_pages: int | None = None
    recent_parts: int | None = None
    step: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    maxnreg: int | None = None
    asm: bool | None = None
    pdl: bool | None = None
    softmax_steps: int | None = None
    swap: bool | None = None
    page_stages: int | None = None
    prefetch: bool | None = None
    gluon: bool | None = None


def _scratch(shape: tuple[int, ...], device: torch.device) -> Tensor:
    """Partial-output workspace (tests replace this to poison it)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=None)
def _layouts(fmt, heads: int, head_dim: int) -> tuple[Layout, Layout]:
    return fmt.k.kernel_layout(heads, head_dim, PAGE_TOKENS), fmt.v.kernel_layout(heads, head_dim, PAGE_TOKENS)


@functools.lru_cache(maxsize=None)
def nf4_levels(device: torch.device) -> Tensor:
    """The NF4 table as a float32 tensor on `device` (the kernels look levels up in it)."""
    return NF4_LEVELS.to(device)


@functools.lru_cache(maxsize=None)
def _hopper(device: torch.device) -> bool:
    """Compute capability 9.0 or newer (cached: decode_attention asks once a layer and step when eager)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


# Programs per SM the split rule aims at: each program walks its pages one after the other, so
# the number in flight is what hides memory latency. One warp per program (NF4 pages: NF4_WARPS), no
# software pipelining of the whole kernel: the fastest launch of a sweep of warps and stages for the
# 2-bit and 4-bit formats (docs/benchmarks.md, sessions 6 and 15; the page loop alone is pipelined
# where that pays, PIPELINE_STAGES). With a [D, N] accumulator and a page's codes live a warp
# needs ~255 registers, so an SM keeps 8 programs resident and queues the rest.
PROGRAMS_PER_SM = 32
# NF4 pages take two warps a program: Triton spreads each tile over both, so a warp's page takes 1872 instructions
# instead of 3597 and 133 registers instead of 255 with 72 bytes of stack (scripts/sass.py), and an SM holds
# 14 warps instead of 8 to hide the lookups' latency. Llama-3-8B shape, H100, session 51, us, one warp ->
# two: batch 1 / 4k 11.9 -> 10.6, 32k 28.7 -> 26.0; batch 4 / 4k 19.8 -> 18.3, 32k 97.0 -> 80.6; batch 16
# / 4k 64.0 -> 54.0, 32k 325.5 -> 274.9; batch 64 / 4k 193.8 -> 173.3, 32k 1216 -> 1023. (maxnreg 128, 16
# warps an SM, was 0.5-2% slower.) The other formats' loops are bound by their bytes, not their issue: two
# warps made them 8-73% slower at batch 16 and 64 (kvarn, kivi-k2v2, kitty, kivi-k4v4), and kivi-k4v4 28%
# slower at batch 1 / 32k.
NF4_WARPS = 2
# every one-warp split kernel compiles to ~255 registers (scripts/sass.py); NF4's two-warp programs fit 7 an SM
# (5 pipelined), but their launch aims at PROGRAMS_PER_SM, several waves wherever it has many pairs
RESIDENT_PER_SM = 8
MIN_PAGES_PER_SPLIT = 2
# One wave of longer splits instead of the counts near PROGRAMS_PER_SM (many short splits in several
# waves) where the lockstep model (_wave_pages) makes it ONE_WAVE_MARGIN shorter and either the launch
# has few (row, kv head) pairs or it fills at least ONE_WAVE_MIN_FILL of the resident slots with splits
# of ONE_WAVE_MIN_PAGES pages or more. Llama-3-8B shape, H100, session 43, us, before ->
# after: batch 1 / 64k kitty 30.3 -> 27.0 (2 pages a split -> 4), 128k 56.1 -> 45.7 (2 -> 8); batch 2 / 32k
# kitty 31.2 -> 28.2 (4 pages, not pipelined: PIPELINE_MIN_PAGES); batch 8 / 8k kvarn 39.2 -> 34.6; batch
# 16 / 32k kvarn 191 -> 167 (8 -> 32); batch 64 / 4k kivi-k2v2 104 -> 97 (5 -> 15); batch 128 / 4k kitty
# 207 -> 178. Where it lost: batch 24 / 4k, 5 splits of 6 pages, kitty 51.9 -> 54.8 and batch 16 / 4k, 8 of
# 4 pipelined, kitty 37.8 -> 39.2 (so many-pair launches need the longer splits; not pipelined that cell
# gained, 36.9, but 3-4 page splits in several waves need the pipeline); batch 37 / 8k, 3 of 21 (888 of 1056
# slots), kitty 113.5 -> 116.5, kivi-k2v2 101.7 -> 104.6 but kvarn 134.3 -> 124.6, and batch 48 / 8k, 2 of 31
# (768 slots), kitty 140.5 -> 159.1 (the fill); batch 64 / 32k, 2 of 127 against 8 of 32 (3% by the model),
# kitty-pro +0.5-0.8% (the margin). Launches of few pairs need no fill: there two waves of short splits
# lost to one wave of longer ones at 57-89% of the slots in every cell timed (session 45, us, old -> new,
# kitty / kivi-k2v2 / kvarn / fp16): batch 1 / 34816 tokens, 135 of 2 -> 132 (90 live) of 3, 22.6 -> 19.2,
# 20.4 -> 18.1, 26.1 -> 22.0, 62.1 -> 55.3; batch 1 / 75776, 37.8 -> 30.8, 33.1 -> 26.6, 42.4 -> 32.4, 116.8
# -> 109.1; batch 2 / 37888, 37.5 -> 30.1; batch 3 / 12288, 24.3 -> 20.8; batch 5 / 8k, 31 of 2 -> 26 (21
# live) of 3, 26.6 -> 22.0, 23.6 -> 20.3, 29.5 -> 24.4, 69.0 -> 63.3; batch 7 / 14336, 45.3 -> 41.8; batch 8
# / 3072, 20.4 -> 18.9. Of 32 such cells x 4 formats only batch 8 / 7168 was level (kitty 30.2, kivi-k2v2
# 27.0 -> 27.2).
ONE_WAVE_MIN_FILL = 0.9
ONE_WAVE_MARGIN = 0.95
ONE_WAVE_MIN_PAGES = 8
# In a launch of many pairs the split programs share the slots with the FP16 tiers' programs, one a pair
# for the recent tier (up to 255 tokens, at four times a 2-bit page's bytes a token) and one for the sink,
# and the block scheduler hands out slots in launch order: the tiers first, then split by split. So a
# count whose splits alone fill one wave leaves the last split's programs waiting a whole program.
# _makespan schedules the programs that way, each costing its pages plus PROGRAM_PAGES (the recent tier
# RECENT_TIER_PAGES, the sink SINK_PAGES), and the launch takes the count of at most one wave that it
# makes shortest where that is ONE_WAVE_MARGIN shorter than the rule above's. Fitted to 22 pairs of counts
# timed against each other (batches 12-64, 4k-32k, sessions 43-44): it makes the other count 5% shorter
# exactly where that measured faster, leaving aside pairs within 2%. Checked against the rule above in one
# process (Llama-3-8B shape, H100, session 44, us, kitty / kivi-k2v2 / kvarn / fp16, before -> after):
# batch 9 / 4k, 30 splits of 1 -> 10 of 3 (not pipelined: _starts_together), 26.8 -> 23.1, 26.0 -> 23.1,
# 30.8 -> 25.4, 62.3 -> 58.4; batch 12 / 4k, 30 of 1 -> 8 of 4, 32.9 -> 28.5, 32.0 -> 25.9, 38.4 -> 31.8,
# 79.2 -> 76.7; batch 12 / 8k, 31 of 2 -> 9 of 7, 48.1 -> 42.2, 48.4 -> 37.3, 54.2 -> 45.5; batch 14 /
# 32000, 30 of 9 -> 9 of 28, 138.1 -> 136.4, 121.7 -> 117.5, 161.6 -> 143.6; batch 32 / 32k, 16 of 16 -> 4
# of 64, 298.9 -> 295.9, 266.8 -> 259.4, 332.6 -> 312.6; batch 10 / 128k, 53 of 20 -> 13 of 79, 358.0 ->
# 353.6, 313.3 -> 304.8, 396.5 -> 369.6; and where it lost, batch 52 / 4k, 11 of 3 -> 2 of 15 (79% of the
# slots), 97.3 -> 98.8, 89.9 -> 91.3, but 114.1 -> 107.4 and 312.2 -> 306.8. It keeps the rule above's
# count at batch 40 / 4k (3 of 10; 2 of 15 measured 76.6 -> 83.4 us for kitty), 24 / 8k (5 of 13; 4 of 16
# 75.5 -> 81.1) and 48 / 8k (11 of 6; 2 of 31 140.5 -> 159.1).
PROGRAM_PAGES = 1.5
RECENT_TIER_PAGES = 3.0
SINK_PAGES = 0.25
# Short rows (up to 4k tokens) split one page per program, and the FP16 recent tier (up to 255
# tokens) is split over 4 programs, so that no program walks more than ~4 dependent steps: a
# short context is latency-bound, and this halved batch 1 at 512 tokens (README); long rows keep
# at least 2 pages a split, which is faster at 32k (`bench.py kernels --variants` measures both).
SHORT_ROW_PAGES = 32
RECENT_PARTS = 4
# ... unless the launch has (row, kv head) pairs for at least half the SMs: then its page programs
# come in several waves, the tier's chain is not the longest, and one program a row takes the
# whole tier. Llama-3-8B shape, H100, session 18: batch 16 / 32k kitty 188.7 -> 186.5 us,
# kitty-pro 216.6 -> 214.0; batch 296 / 8k kitty 873 -> 856; batch 64 / 32k level; at batch 1 /
# 32k one program was 5-18% slower. (Between batch 1 and 16 the threshold is not measured.)
# Where a launch is not crowded, a long recent tier gets a program per RECENT_PART_TOKENS of the view it
# comes in (about a 2-page split's tokens): a fixed window is a few hundred tokens, but KVmix keeps a
# share of the context there (10-20%, thousands of tokens at 32k), and a program walks its chunk 32
# tokens a memory latency. The cache passes a view as long as the step's longest row can need
# (KVCache.recent_view_tokens), so a default window (a 256-token view), and any fixed window up to 896
# tokens, keeps 4 programs. Llama-3.1-8B shape with a 32-layer KVmix plan, H100, session 47: batch 1 /
# 32k 121-135 -> 158.6 tok/s (FP16 145.9). A crowded launch keeps its one program: at batch 16 / 4000,
# 3-4 parts took 63.3 us a layer against 61.5, and at batch 10 / 32k (3200-6400 tokens a row), parts of
# 2048 tokens were level (566.4 tok/s against 563.8; session 48).
RECENT_PART_TOKENS = 256
NUM_WARPS = 1
# FP16 pages have no codes to unpack. In a launch of few programs (at most FEW_PROGRAMS_PER_SM
# per SM, i.e. latency-bound: batch 1 up to ~4k tokens) they take a whole page per step (up to
# 16k elements a tile) with 4 warps, one memory latency a page instead of four: at batch 1 a
# layer's attention went from 11.9 to 7.8 us at 640 tokens and from 13.8 to 12.6 us at 4096. With
# more programs one warp and 32-token steps stay faster (batch 1 at 32k: 40.3 against 44.1 us;
# batch 16 at 640 tokens: 20.2 against 21.3). bench.py kernels --variants auto,w1-s32, H200.
FP16_PAGE_WARPS = 4
FP16_PAGE_TILE = 2**14
FEW_PROGRAMS_PER_SM = 4
NUM_STAGES = 1
# Steps per softmax update (Launch.softmax_steps): a group's logits first, then one update of the
# running max, then their value products. 4 (a whole 2-bit page) beat 1 in every cell of the
# kernel table (H100, session 15; with BLOCK_N_MIN 4, kitty at batch 16 / 32k went from 274 to 218
# us); 3-bit keys and values take a whole page of 16-token steps (_softmax_steps). NANOKV_SOFTMAX_STEPS
# sets it for every launch.
SOFTMAX_STEPS = int(os.environ.get("NANOKV_SOFTMAX_STEPS", "0"))
# Values unpacked swapped (module docstring), Launch.swap: NANOKV_SWAP=0 turns it off for every launch.
SWAP = os.environ.get("NANOKV_SWAP", "1") != "0"
# Software pipelining of the page loop alone (Triton's num_stages on that loop, not on the FP16 tiers'
# loops, where it was 2.5x slower): the next page's code planes, channel scales and boosted plane are
# copied into shared memory (cp.async) while this page computes. It pays where every packed plane is
# one step's rows (the 2-bit RTN formats: kitty, kitty-pro, kivi-k2v2, kvarn; the 4-bit planes, read a
# block of rows at a time, and NF4 at one warp a program were 2-16% slower) and a split walks enough pages to overlap them
# (at 2 pages a split kitty was 1.5-3% slower). Llama-3-8B shape, H100, session 19, us at 32k in one
# process: batch 16 kitty 185.1 -> 173.8, kitty-pro 213.1 -> 183.4, kivi-k2v2 155.7 -> 148.4, kvarn
# 227.8 -> 219.7; batch 64 kitty 655.6 -> 625.4, kitty-pro 756.0 -> 654.2. Launch.page_stages overrides it.
PIPELINE_STAGES = 2
# L2 prefetch of the next page (_prefetches, Launch.prefetch; NANOKV_PREFETCH=0 turns it off): at batch
# 1 / 32k every split walks 2 pages and starts with the others, so without it the pages come in two
# bursts with compute between (ncu, kitty: 31% of the split kernel's warp samples wait on global loads,
# 20% at the code planes' first use). Issued once a page's keys have arrived, not at the page's top:
# there it shared the DRAM with this page's own loads and every format got slower (kitty 19.4 -> 20.6
# us). H100, session 22, us at batch 1 / 32k: kitty 19.4 -> 18.3, kvarn 20.3 -> 19.5, kivi-k2v2 17.2 ->
# 16.8, kitty-pro 20.1 -> 19.8; batch 4 / 32k kitty 63.5 -> 59. It lost where programs come in several
# waves (batch 16 / 4k, 2 pages a split: kitty +3%, kvarn +10%), for 4-bit planes read a block of rows
# at a time (kivi-k4v4 / kvmix +6-13%), NF4 (+14%) and FP16 pages (32 KB a head: +27%, and +71% at
# batch 64 where they overflow the L2).
PREFETCH = os.environ.get("NANOKV_PREFETCH", "1") != "0"
# Splits pipelined from this many pages, and only in launches whose page programs do not all start at
# once (_starts_together): where they do, the L2 prefetch beat the pipeline at every split length
# (Llama-3-8B shape, H100, us, pipelined -> not. Session 43, few pairs: batch 2 / 32k, 4 pages a split:
# kitty 31.8 -> 28.2, kitty-pro 33.5 -> 29.3, kvarn 35.0 -> 31.0, kivi-k2v2 27.2 -> 26.1; batch 8 / 32k, 16
# pages: kitty 83.6 -> 81.7, kivi-k2v2 74.9 -> 70.9; batch 1 / 128k, 8 pages: kvarn 51.6 -> 46.4. Session
# 44, many pairs in one wave, kitty / kivi-k2v2 / kvarn: batch 16 / 8k, 9 pages: 54.8 -> 53.2, 47.6 ->
# 47.1, 60.7 -> 56.8; batch 14 / 8k, 8 pages: 49.5 -> 47.5, 42.9 -> 42.4, 55.0 -> 51.6). Launches in
# several waves pipeline from 3 pages (batch 52 / 4k, 3 pages, not pipelined: kivi-k2v2 89.4 -> 97.9).
PIPELINE_MIN_PAGES = 3
# Partials the merge reads per load: at batch 1 its few programs are latency-bound, so a row's
# splits (133 parts at 32k) should take one round.
MERGE_CHUNK = 256
# Programmatic dependent launch (pdl.py) for the attention's kernels up to this batch: at batch 1
# the step gained 4-5% with it (Llama-3-8B shape, H100), while at batch 16 kitty's step lost 2-4%
# with it on the attention and was level with it off (docs/benchmarks.md, session 11).
PDL_MAX_BATCH = 4
# The Gluon split kernel (kernels/gluon_attention.py) by default for Kitty's pages (boosted channels) in
# launches of up to this many (row, kv head) pairs whose splits walk 2 pages or more and whose programs fill
# at least GLUON_MIN_FILL of the resident slots (RESIDENT_PER_SM an SM). There the page loop's instruction
# count sets the compute phases between the DRAM bursts, and Gluon's loop is 20% shorter; in lighter
# launches the Triton kernel's L2 prefetch of the next page pays, and Gluon lost. Llama-3-8B shape, H100,
# us, Gluon / Triton, two runs in one process (`bench.py kernels --variants gl,nogl`):
# - batch 1 / 32k (8 x 132 programs; session 27): kitty 17.28-17.31 / 17.66-17.70, kitty-pro 17.55 /
#   18.30-18.33, kivi-k2v2 16.25-16.29 / 16.21-16.31;
# - batch 1 / 20k to 28k (5.1 to 7 programs an SM; session 28): kitty level (20k: 15.48-15.57 /
#   15.36-15.42), kitty-pro 1.5-3% faster (28k: 16.79 / 17.29-17.33), kivi-k2v2 2-4% slower (24k:
#   15.12-15.25 / 14.51-14.66), so KIVI's pages stay on Triton;
# - batch 1 / 16k (4 programs an SM; session 27): kitty 14.85-14.93 / 14.80-14.86, kitty-pro 15.19-15.39 /
#   15.24-15.29, kivi-k2v2 13.93-13.96 / 13.39-13.55;
# - batch 1 / 8k: kitty 13.55 / 13.09-13.28, kivi-k2v2 12.51-12.55 / 11.65-11.77.
# Session 26: batch 1 / 4k (one page a split) level or slower, batch 4 / 32k mixed. (default_splits gives
# the engine's batch-1 / 32000-token launch, a 249-page table, 8 x 130 programs.)
GLUON_MAX_PAIRS = 8
GLUON_MIN_FILL = 0.75
# Query rows per program at least 4: Llama-3's 4 query heads a kv head then fill the accumulator
# and probability tiles, where 8 kept half of them (registers and softmax work) for padding rows;
# tl.dot pads the MMA's N to 8 itself. Faster than 8 in every quantized cell of the kernel table,
# FP16 level or faster (H100, session 15).
BLOCK_N_MIN = 4


def default_splits(max_pages: int, programs: int, device: torch.device, per_sm: int | None = None,
                   min_pages: int | None = None, fill_waves: bool = True) -> int:
    """Page splits per (row, kv head) for rows of up to max_pages pages and `programs` (row, kv head,
    query block) triples: about enough programs to fill the GPU PROGRAMS_PER_SM times, at least
    MIN_PAGES_PER_SPLIT pages each, and with fill_waves, of the counts near that the one whose
    waves of resident programs are fullest (_wave_pages), or one wave of longer splits where that
    pays (ONE_WAVE_MIN_FILL). Splits divide each row's own pages, so max_pages (e.g. the page table's
    width under a CUDA graph) only caps the count."""
    if max_pages == 0:
        return 1
    sms = _sm_count(device)
    return _split_count(max_pages, programs, -(-(per_sm or PROGRAMS_PER_SM) * sms // programs),
                        _least_pages(max_pages, min_pages), RESIDENT_PER_SM * sms if fill_waves else 0,
                        _few_rows(programs, device))


def _few_rows(pairs: int, device: torch.device) -> bool:
    """Whether a launch of `pairs` (row, kv head, query block) triples has fewer than half as many as
    SMs: their splits all start together, which decides the split rule, the recent tier's programs
    and (through _starts_together) pipelining and the L2 prefetch."""
    return 2 * pairs < _sm_count(device)


def _least_pages(max_pages: int, min_pages: int | None) -> int:
    """Fewest pages a split takes in rows of up to max_pages pages (as _page_split)."""
    return 1 if max_pages <= SHORT_ROW_PAGES else (min_pages or MIN_PAGES_PER_SPLIT)


def _split_pages(pages: int, splits: int, least: int) -> int:
    """Pages each split of a row of `pages` pages walks (as _page_split; 0 splits: one program, all of them)."""
    return max(-(-pages // max(splits, 1)), least)


@functools.lru_cache(maxsize=4096)
def _split_count(max_pages: int, programs: int, want: int, least: int, resident: int, few_rows: bool) -> int:
    """default_splits for `want` splits aimed at and `resident` programs at once (0: no wave
    search) in a launch of few (row, kv head) pairs or not, cached: the search tries up to ~130
    counts (and in launches of many pairs schedules up to ~16 with _makespan, under 1 ms), and an
    eager launch (no CUDA graph) asks once a layer and step (60 us a call at batch 1 with a 1024-page
    table)."""
    most = -(-max_pages // least)
    if not resident:
        return max(1, min(want, most))
    near = range(max(1, min(most, -(-3 * want // 4))), min(most, 2 * want) + 1)
    best = min(near, key=lambda s: (_wave_pages(s, max_pages, least, programs, resident), abs(s - want)))
    one_wave = max(1, min(most, resident // programs))  # the most splits whose programs all fit at once
    per = _split_pages(max_pages, one_wave, least)
    if ((few_rows or (programs * -(-max_pages // per) >= ONE_WAVE_MIN_FILL * resident
                      and per >= ONE_WAVE_MIN_PAGES))
            and _wave_pages(one_wave, max_pages, least, programs, resident)
            <= ONE_WAVE_MARGIN * _wave_pages(best, max_pages, least, programs, resident)):
        best = one_wave
    # (never 1 split by _makespan: one program a pair walks its tiers too and skips the merge, a
    # launch the model was not fitted to; the rule above keeps it where it had it, which is only
    # where one wave is 1 split: want <= 1 means more programs than resident slots)
    if few_rows or one_wave < 2:
        return best
    span = functools.partial(_makespan, pages=max_pages, least=least, programs=programs, resident=resident)
    shortest = min(range(2, one_wave + 1), key=span)
    return shortest if span(shortest) <= ONE_WAVE_MARGIN * span(best) else best


def _wave_pages(splits: int, pages: int, least: int, programs: int, resident: int) -> int:
    """How long a launch of `splits` splits a row lasts if the resident programs ran in lockstep
    waves: the waves times a program's length, its pages plus about one page of fixed cost.
    Aiming at a program count alone can leave the last wave nearly empty (Llama-3-8B shape, batch
    64 / 32k: 9 splits of 29 pages are 4.4 waves, 8 of 32 are 3.9: kitty 698 -> 652 us,
    kivi-k2v2 583 -> 546, FP16 2817 -> 2791; batch 296 / 8k, kitty: 2 splits 888, 3 869, 4 873;
    and FP16 at batch 52 / 8k, 11 splits 589 against 22 splits 602, the fixed cost's case.
    H100, session 18)."""
    per = _split_pages(pages, splits, least)
    live = -(-pages // per)
    waves = -(-programs * live // resident)
    return waves * (per + 1)


def _makespan(splits: int, pages: int, least: int, programs: int, resident: int) -> float:
    """How long a launch of many pairs with `splits` splits a row lasts, in pages, if each program
    takes the resident slot that frees first, in launch order (every pair's sink program, every
    pair's recent-tier program, then the first split of every pair, the second, ...), and costs
    its pages (the sink SINK_PAGES, the recent tier RECENT_TIER_PAGES) plus PROGRAM_PAGES. For 2
    splits or more (one split is one program a pair, which walks its tiers itself)."""
    per = _split_pages(pages, splits, least)
    live = -(-pages // per)
    costs = [SINK_PAGES, RECENT_TIER_PAGES] + [per] * (live - 1) + [pages - (live - 1) * per]
    free = {0.0: resident}  # the time a slot frees -> how many slots free then
    end = 0.0
    for cost in costs:
        waiting = programs
        while waiting:
            start = min(free)
            taken = min(waiting, free[start])
            free[start] -= taken
            if not free[start]:
                del free[start]
            waiting -= taken
            done = start + cost + PROGRAM_PAGES
            free[done] = free.get(done, 0) + taken
            end = max(end, done)
    return end


def _starts_together(pairs: int, live_splits: int, tier_parts: int, device: torch.device) -> bool:
    """Whether a launch's page programs all start at once: it has few (row, kv head) pairs
    (_few_rows), or its live splits' and recent-tier parts' programs fit the resident slots (the
    sink's programs end first; a launch of one program a pair has 1 live split and 1 tier part,
    both in that program). There the L2 prefetch of the next page beats the pipeline."""
    resident = RESIDENT_PER_SM * _sm_count(device)
    return _few_rows(pairs, device) or pairs * (live_splits + tier_parts - 1) <= resident


def _block_rows(kl: Layout, vl: Layout, step: int) -> int:
    """Rows of the tallest plane read one slot per step (fp16 pages: one slot of PAGE_TOKENS
    rows); steps go over its blocks of `step` rows, and over every slot of a block in turn."""
    rows = [lay.rows for lay in (kl, vl) if lay.rows % step == 0 and lay.rows & (lay.rows - 1) == 0]
    return max(rows + [step])


def _swappable(lay: Layout, step: int, head_dim: int) -> bool:
    """Whether a value plane's tiles may be unpacked swapped: RTN codes of 2, 3 or 4 bits read one slot
    per step (_slot_asm), whose tile goes straight into the product (so the exchanged elements are
    four consecutive tokens, its reduced axis, where the weights' matching order undoes them).
    Tiles decoded element by element first (scales per group of channels) are not."""
    return lay.bits in (2, 3, 4) and not lay.nf4 and lay.rows % step == 0 and not (lay.per_token and lay.group < head_dim)


def _step(kl: Layout, vl: Layout, pages_per_split: int, together: bool) -> int:
    """Tokens per step: the row count of the packed planes when they have 32 or fewer rows (each
    plane loaded once per page, one slot per step), else 32. 3-bit codes count their 2-bit plane's
    rows (a 32-token step reads two slots of their top bits' 16 rows, _tile), but take 16-token
    steps where keys and values both have them (two joined top tiles of 32 rows spilled), and beside
    a plane of 32 rows where the page loop is not pipelined (_page_stages at 32-token steps). H100,
    session 49, us at batch 1 / 16 and 32k, 32- against 16-token steps: k3v3 35.6 / 476 against 23.8
    / 246; k3v2 20.1 / 170 (pipelined) against 19.3 / 194; k3v4 21.9 / 211 against 27.0 / 258."""
    step = min([32] + [lay.rows for lay in (kl, vl) if lay.bits != 16])
    if kl.bits == vl.bits == 3 or (3 in (kl.bits, vl.bits) and step == 32 and max(kl.rows, vl.rows) == 32
                                   and _page_stages(kl, vl, step, pages_per_split, together) == 1):
        return 16
    return step


def _softmax_steps(kl: Layout, vl: Layout, step: int) -> int:
    """Steps per softmax update (SOFTMAX_STEPS where set): 4, a whole page at 32-token steps, but a whole page of
    16-token steps (8) for 3-bit keys and values. In two groups of 4 their page asked for each group's key block
    only after the previous group's value products (scripts/sass.py --loads); one group asks for both at the top.
    H100, session 52, us, 4 -> 8 steps: k3v3 batch 1 / 16 / 64 at 4k 11.3 / 49.3 / 144 -> 10.7 / 45.1 / 130.7, at
    32k 23.9 / 226-231 / 867-908 -> 21.5-21.7 / 205 / 805-810; k3v2's 16-token steps (batch 1, batch 16 / 4k) were
    mixed (batch 1 / 32k 19.3 -> 18.9, batch 16 / 4k 39.1 -> 39.7), so they keep 4."""
    if SOFTMAX_STEPS:
        return SOFTMAX_STEPS
    return PAGE_TOKENS // step if kl.bits == vl.bits == 3 else 4


def _whole_planes(kl: Layout, vl: Layout, step: int) -> bool:
    """Whether every packed plane is one step's rows (the 2-bit RTN formats; 3-bit codes in 32-token steps,
    whose top bits' plane is read whole too), read whole at a page's start."""
    return all(lay.bits != 16 and not lay.nf4 and lay.rows == step for lay in (kl, vl))


def _split_warps(kl: Layout, vl: Layout, whole_pages: bool) -> int:
    """Warps a split program: FP16_PAGE_WARPS for whole FP16 pages a step, NF4_WARPS for NF4 pages (their
    lookups bind the loop's issue), else NUM_WARPS."""
    if whole_pages:
        return FP16_PAGE_WARPS
    return NF4_WARPS if (kl.nf4 or vl.nf4) else NUM_WARPS


def _page_stages(kl: Layout, vl: Layout, step: int, pages_per_split: int, together: bool) -> int:
    """Triton num_stages for the page loop (PIPELINE_STAGES where it pays, else 1: not pipelined);
    together: the launch's page programs start together (_starts_together; there the L2 prefetch pays)."""
    # 3-bit keys and values take 16-token steps (_step): their 2-bit planes are read a block of 16 rows at a
    # time, their top bits whole, and pipelined that loop is faster (k3v3, H100, session 51, us, before ->
    # after: batch 16 / 32k 249.0 -> 227.9, batch 64 / 32k 958 -> 881, batch 64 / 4k 152.7 -> 145.7, batch
    # 16 / 4k level at 49.3; 3-bit keys with 2-bit values, which this leaves alone, level in every cell)
    three_bit = kl.bits == vl.bits == 3 and step == 16
    # NF4 pages at two warps a program (NF4_WARPS) have the registers for it (180 a thread pipelined, no
    # spill), and pipelined they are faster (nqkv, H100, session 51, us, interleaved in one process, not ->
    # pipelined: batch 16 / 32k 273.6-275.6 -> 268.1-270.2 in six pairs; batch 64 / 32k 1005-1078 -> 973-1013,
    # with one 1109 and one 1155; at 4k and at batch 1 / 4 the rule leaves their launches as they were)
    nf4 = kl.nf4 or vl.nf4  # (the pages _split_warps gives two warps)
    pays = (_whole_planes(kl, vl, step) or three_bit or nf4) and pages_per_split >= PIPELINE_MIN_PAGES and not together
    return PIPELINE_STAGES if pays else 1


def _prefetches(kl: Layout, vl: Layout, step: int, pages_per_split: int, page_stages: int, together: bool) -> bool:
    """Whether the page loop prefetches the next page into the L2 (PREFETCH): in a launch whose page
    programs start together, for loops over more than one page of whole planes (_whole_planes) that are
    not pipelined."""
    return PREFETCH and together and page_stages == 1 and pages_per_split > 1 and _whole_planes(kl, vl, step)


def _gluon_split(kl: Layout, vl: Layout, k_pages: dict[str, Tensor], q: Tensor, head_dim: int, rows: int,
                 pairs: int, pages_per_split: int, programs: int, windowed: bool, one_block_split: bool,
                 wanted: bool | None) -> bool:
    """Whether the split kernel runs in Gluon: compiled on a Hopper GPU, for the pages it covers (2-bit
    RTN keys per channel in 32 rows, swapped columns, fp16 factors, up to 32 boosted channels; 2-bit
    values per token, channel-major), D 128, up to 8 q rows a kv head, no window, a split launch of one block of rows;
    by default (wanted None) only where it measured faster (GLUON_MAX_PAIRS). programs: the launch's."""
    keys = (kl.bits == 2 and kl.rows == 32 and not kl.per_token and kl.columns_swapped and kl.has_zero
            and not (kl.nf4 or kl.mult_kind or kl.rotate or kl.channel_major) and kl.n_high in (0, 16, 32)
            and all(k_pages[kl.fields[i]].dtype == torch.float16 for i in (1, 2)))
    values = (vl.bits == 2 and vl.rows == 32 and vl.per_token and vl.group == head_dim and vl.has_zero
              and vl.channel_major and not (vl.nf4 or vl.mult_kind or vl.rotate or vl.n_high))
    supported = (not INTERPRETED and q.is_cuda and q.dtype == torch.float16 and keys and values and head_dim == 128
                 and rows <= 8 and not windowed and one_block_split and _hopper(q.device))
    faster = (kl.n_high > 0 and pairs <= GLUON_MAX_PAIRS and pages_per_split >= MIN_PAGES_PER_SPLIT
              and programs >= GLUON_MIN_FILL * RESIDENT_PER_SM * _sm_count(q.device))
    return supported and (faster if wanted is None else wanted)


def decode_attention(q: Tensor, fmt, tiers: Tiers, scale: float, *, window: int | None = None,
                     return_lse: bool = False, out: Tensor | None = None,
                     launch: Launch = Launch()) -> Tensor | tuple[Tensor, Tensor]:
    """Triton version of kernels.reference.decode_attention (same arguments and results).

    q [B, Hq, D] or [B, Hq, T, D] (every query sees every stored token); tiers, window and
    return_lse as in the reference. out: optional result buffer shaped like q (contiguous).
    launch: tuning knobs (Launch); the defaults fill the GPU.
    """
    (sink_k, sink_v, n_sink, k_pages, v_pages, page_table, n_pages, recent_k, recent_v, n_recent, slots,
     recent_grows) = tiers
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
    block_n = launch.block_n or min(64, max(BLOCK_N_MIN, triton.next_power_of_2(M)))
    if block_n & (block_n - 1) or block_n < 4:
        raise ValueError(f"block_n must be a power of 2 >= 4, got {block_n}")
    n_blocks = triton.cdiv(M, block_n)
    num_splits = launch.num_splits
    # NF4 pages keep the plain launch (split count and four recent-tier programs): their loop is
    # bound by its lookups' issue, and neither rule below paid for them (nqkv at batch 64 / 32k:
    # 8 splits 1700 us against 9 splits 1652; one recent-tier program: batch 64 / 4k 239 -> 266,
    # batch 16 / 32k 445 -> 518; H100, session 18). With the paired lookup (8 fewer instructions per
    # eight codes) still not: both rules on, batch 64 / 32k 1290-1329 -> 1354-1362 us, 4k 201 -> 217,
    # batch 16 level (session 21). They aim at PROGRAMS_PER_SM as the others do. At one warp a program
    # they took 64, shorter splits (nqkv at 32k batch 16 387 -> 360 us, batch 64 1325 -> 1287; session
    # 21); at two warps (NF4_WARPS) 32 is faster where 64 gave splits of 2-4 pages (session 52, us, 64 ->
    # 32: batch 16 / 16k 153.2 -> 144.3, batch 64 / 4k 172 -> 164, 8k 287-292 -> 284) and level elsewhere
    # at batch 4-64 and 4k-32k; batch 1 is capped by its pages either way.
    plain = kl.nf4 or vl.nf4
    if num_splits is None:
        num_splits = default_splits(page_table.shape[1], B * H * n_blocks, q.device, launch.programs_per_sm,
                                    launch.min_pages, fill_waves=not plain)
        num_splits = 0 if num_splits == 1 else num_splits  # one split: no partials, no merge
    one = num_splits == 0
    # (row, kv head) pairs for at least half the SMs: their splits may come in several waves
    many_rows = not _few_rows(B * H * n_blocks, q.device)
    crowded = many_rows and not plain
    recent_parts = 1 if crowded else max(RECENT_PARTS, triton.cdiv(recent_k.shape[2], RECENT_PART_TOKENS))
    tier_parts = 1 + (launch.recent_parts or recent_parts)
    n_parts = 1 if one else num_splits + tier_parts
    # a growing tier's part count is read at run time (see _split_kernel), and the merge's chunk is sized
    # without it, so that a longer tier compiles neither kernel again (more parts take more chunks)
    fixed_tiers = 0 if recent_grows else tier_parts
    chunk = min(MERGE_CHUNK, triton.next_power_of_2(num_splits + 1 + RECENT_PARTS if recent_grows else n_parts))
    few_programs = B * H * n_blocks * n_parts <= FEW_PROGRAMS_PER_SM * _sm_count(q.device)
    whole_pages = kl.bits == vl.bits == 16 and few_programs
    max_pages = page_table.shape[1]  # the longest row the table holds: what the split count was sized for
    pages_per_split = _split_pages(max_pages, num_splits, _least_pages(max_pages, launch.min_pages))
    together = _starts_together(B * H * n_blocks, -(-max_pages // pages_per_split), n_parts - num_splits, q.device)
    step = launch.step or (min(PAGE_TOKENS, FP16_PAGE_TILE // D) if whole_pages
                           else _step(kl, vl, pages_per_split, together))
    packed = [lay.rows for lay in (kl, vl) if lay.bits in (2, 3, 4)]
    if step & (step - 1) or PAGE_TOKENS % step or step < 16 or any(r % step for r in packed):
        raise ValueError(f"step must be a power of 2 >= 16 that divides {PAGE_TOKENS} and the row count of every "
                         f"packed code plane ({packed}), got {step}")
    asm = launch.asm
    if asm and INTERPRETED:
        raise ValueError("asm=True needs the compiled kernel (the Triton interpreter cannot run PTX)")
    softmax_steps = launch.softmax_steps or _softmax_steps(kl, vl, step)
    if softmax_steps & (softmax_steps - 1) or softmax_steps < 1:
        raise ValueError(f"softmax_steps must be a power of 2 >= 1, got {softmax_steps}")
    swap = SWAP if launch.swap is None else launch.swap
    stages = launch.page_stages or _page_stages(kl, vl, step, pages_per_split, together)
    min_pages = launch.min_pages or MIN_PAGES_PER_SPLIT
    prefetch = (not INTERPRETED) and (_prefetches(kl, vl, step, pages_per_split, stages, together)
                                      if launch.prefetch is None else launch.prefetch)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q's strides
    elif not out.is_contiguous():
        raise ValueError("out must be contiguous")
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device) if return_lse else out
    o_part = out if one else _scratch((B * H, n_parts, M, D), q.device)
    lse_part = lse if one else _scratch((B * H, n_parts, M), q.device)
    warps = launch.num_warps or _split_warps(kl, vl, whole_pages)
    options = dict(num_warps=warps, num_stages=launch.num_stages or NUM_STAGES)
    if launch.maxnreg:
        options["maxnreg"] = launch.maxnreg
    pdl = kernel_options(q.device, B <= PDL_MAX_BATCH if launch.pdl is None else launch.pdl)
    if _gluon_split(kl, vl, k_pages, q, D, M, B * H, pages_per_split, B * H * n_blocks * n_parts, window is not None,
                    not one and n_blocks == 1, launch.gluon):
        from . import gluon_attention  # (imported here: Gluon's API differs between Triton versions, and CPUs never need it)

        gluon_attention.launch(q4, kl, vl, k_pages, v_pages, page_table, n_pages, slots, (sink_k, sink_v, n_sink),
                               (recent_k, recent_v, n_recent), o_part, lse_part, scale * LOG2E, num_splits, n_parts,
                               min_pages, SHORT_ROW_PAGES, pdl)
    else:
        _split_kernel[(B * H, n_parts, n_blocks)](
            q4, nf4_levels(q.device), n_pages if slots is None else slots,  # (SLOTS unread without slots)
            page_table, n_pages, sink_k, sink_v, n_sink,
            recent_k, recent_v, n_recent, o_part, lse_part, out, lse,
            **kl.pointers(k_pages, "K_"), **vl.pointers(v_pages, "V_"),
            qk_scale=scale * LOG2E, num_splits=num_splits, tiers=tier_parts, M=M, n_queries=Tq,
            q_pos_offset=-1 if single else 0, window=window or 0,
            s_pt_b=page_table.stride(0), s_pt_p=page_table.stride(1),
            s_sink_b=sink_k.stride(0), s_sink_h=sink_k.stride(1), s_sink_t=sink_k.stride(2),
            s_rec_b=recent_k.stride(0), s_rec_h=recent_k.stride(1), s_rec_t=recent_k.stride(2),
            H=H, D=D, BLOCK_N=block_n, PAGE_TOKENS=PAGE_TOKENS, STEP=step, BLOCK_ROWS=_block_rows(kl, vl, step),
            MIN_PAGES=min_pages, SHORT_PAGES=SHORT_ROW_PAGES, DENSE_STEP=32, FIXED_TIERS=fixed_tiers,
            # Kitty's boosted plane, padded to whole MMA steps: rows of 32 bytes at least when pipelined, since Triton
            # copies 16-byte rows through registers instead (kitty batch 16 / 32k: 193 us with 16, 173 with 32)
            LOG2_D=D.bit_length() - 1, NB_PAD=max(32 if stages > 1 else 16, triton.next_power_of_2(kl.n_high)),
            HAS_SLOTS=slots is not None, HAS_WINDOW=window is not None, ASM=not INTERPRETED if asm is None else asm,
            ONE_PROGRAM=one, RETURN_LSE=return_lse,
            **kl.constexprs("K_"), **vl.constexprs("V_"),
            SOFTMAX_STEPS=min(softmax_steps, PAGE_TOKENS // step), **options, **pdl,
            V_SWAP=swap and _swappable(vl, step, D), PAGE_STAGES=stages, PREFETCH=prefetch,
        )
    if not one:
        d_block = min(D, 32)
        _merge_kernel[(B * H, M, D // d_block)](
            o_part, lse_part, out, lse, n_pages, num_splits, tier_parts, M, H=H, D=D, D_BLOCK=d_block,
            MIN_PAGES=min_pages, SHORT_PAGES=SHORT_ROW_PAGES, FIXED_TIERS=fixed_tiers, CHUNK=chunk,
            RETURN_LSE=return_lse, **pdl)
    return (out, lse) if return_lse else out
