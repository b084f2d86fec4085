"""Kernels against their oracles.

- kernels/reference.py (the torch tiered attention) against a naive per-row softmax over the
  concatenated, decoded tokens of every tier;
- the Triton attention and encode kernels against the torch reference on fresh random inputs:
  every format, head dim 64 and 128, GQA groups 1, 4 and 7, lengths that are not multiples of
  128, shuffled pool pages behind strided page-table and tier views, batch rows of very
  different lengths, several queries per row, split-K with empty splits; every output and
  workspace poisoned with NaN (attention) or garbage (pages) first;
- the Triton RMSNorm, RoPE, SiLU-gate and RoPE+K/V-store kernels against their torch expressions, on
  strided views and sizes that are not powers of two, in float32 and (rounding order) float16;
- the Triton GEMV (every tile shape the engine may pick, split-K, bias, 1 to 16 rows) and, on a
  GPU, the per-shape kernel choice of kernels.linear, against F.linear;
- the attention's PTX for unpacking codes (RTN slots, swapped or not, and NF4 lookups), run by a
  small model of its instructions, against the values the codes stand for.

Without a GPU the kernels run under the Triton interpreter in float32 (relative error < 1e-3);
with one they are compiled and fed fp16 operands (< 1e-2). TRITON_INTERPRET must be set
before the kernel modules are imported, hence the order below.
"""

import os
import struct
import zlib

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import quant  # noqa: E402
from quant.kvmix import kvmix_format  # noqa: E402

import kernels  # noqa: E402
from kernels import attention, elementwise, gemv, greedy, matmul, pdl, quantize, reference  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.float16 if CUDA else torch.float32  # q / dot operand type
# Relative to the output's scale. The kernel's 2-bit levels carry offsets up to 2^10 code steps
# that cancel algebraically after the dot products, so even fp32 leaves ~1e-4..1e-3 of rounding.
TOL = 1e-2 if CUDA else 1e-3
T = quant.PAGE_TOKENS
SINK = 32


def get_format(name: str) -> quant.KVFormat:
    """A preset, or 'kvmix:KvV' for one KVmix layer with K bits K and V bits V, or 'preset:opt=val'."""
    if name.startswith("kvmix:"):
        k_bits, v_bits = name[6:].split("v")
        plan = {"layers": [{"k_bits": int(k_bits), "v_bits": int(v_bits), "window_ratio": 0.1}]}
        return kvmix_format("kvmix", plan).for_layer(0)
    if ":" in name:
        preset, opt = name.split(":")
        key, value = opt.split("=")
        return quant.get_format(preset, **{key: int(value) if value.isdigit() else value})
    return quant.get_format(name)


def random_tiles(n: int, heads: int, head_dim: int, gen: torch.Generator) -> torch.Tensor:
    """[n, H, T, D] with per-channel scales and offsets, like keys with outlier channels."""
    x = torch.randn(n, heads, T, head_dim, generator=gen)
    return x * (0.2 + 3 * torch.rand(head_dim, generator=gen)) + torch.randn(head_dim, generator=gen)


def make_cache(fmt, heads: int, head_dim: int, n_sink: list[int], n_pages: list[int], n_recent: list[int],
               gen: torch.Generator, slots: bool = False) -> dict:
    """Tiers of a batch of rows: pages encoded with the torch codecs into a shuffled pool, a page
    table (a strided view) whose unused entries are garbage, and sink/recent tiers as strided views.
    slots: the rows live in shuffled slots of larger buffers (c["slots"][b] = slot of row b)."""
    B, H, D = len(n_sink), heads, head_dim
    n_rows = B + 2 if slots else B
    slot_of = torch.randperm(n_rows, generator=gen)[:B] if slots else torch.arange(B)
    n_pool = sum(n_pages) + 3
    pool = torch.randperm(n_pool, generator=gen).int()  # page j of row b is a random pool page
    cols = max(n_pages) + 2
    table = torch.randint(-(2**20), 2**20, (n_rows, 2 * cols), generator=gen, dtype=torch.int32)
    used = 0
    for b, n in enumerate(n_pages):
        table[slot_of[b], :n] = pool[used:used + n]
        used += n
    k_pages = {n: f.to(DEVICE) for n, f in fmt.k.encode(random_tiles(n_pool, H, D, gen)).items()}
    v_pages = {n: f.to(DEVICE) for n, f in fmt.v.encode(random_tiles(n_pool, H, D, gen)).items()}
    recent_cap = max(n_recent) + 5

    def tier(length: int) -> torch.Tensor:  # [rows, H, length, D] view of a wider buffer
        return torch.randn(n_rows, H, length + 7, D, generator=gen).half().to(DEVICE)[:, :, :length]

    i32 = dict(dtype=torch.int32, device=DEVICE)
    return dict(
        fmt=fmt, k_pages=k_pages, v_pages=v_pages,
        page_table=table.to(DEVICE)[:, :cols], n_pages=torch.tensor(n_pages, **i32),
        sink_k=tier(SINK), sink_v=tier(SINK), n_sink=torch.tensor(n_sink, **i32),
        recent_k=tier(recent_cap), recent_v=tier(recent_cap), n_recent=torch.tensor(n_recent, **i32),
        slots=slot_of.to(DEVICE) if slots else None, recent_grows=False,
    )


def call(fn, q: torch.Tensor, c: dict, scale: float, **kw) -> torch.Tensor:
    return fn(q, c["fmt"], kernels.Tiers(**{name: c[name] for name in kernels.Tiers._fields}), scale, **kw)


# rows: (n_sink, n_pages, n_recent) per batch row: a short prompt living in the sink alone, a long
# row, a row with pages but an empty recent tier; totals 13, 32+5*128+77, 32+2*128, ... not multiples of 128
ROWS = {
    "mixed": ([13, SINK, SINK], [0, 5, 2], [0, 77, 0]),
    "long": ([SINK, SINK], [6, 1], [131, 200]),
}

# (format, head_dim, gqa group, queries per row, rows, kv heads, splits, extras): every format
# once, the other axes spread over them so each value of each axis is hit. extras: rows in
# shuffled slots, a sliding window (small enough to skip pages, mask the sink, or leave a query
# of a block nothing stored to see), the log-sum-exp output.
CASES = [
    ("fp16", 64, 1, 1, "mixed", 2, None, ""),
    ("fp16", 128, 4, 2, "mixed", 2, 2, "slots,window=150,lse"),
    ("kivi-k2v2", 128, 4, 1, "mixed", 2, 3, ""),
    ("kivi-k2v2", 64, 4, 1, "long", 2, 3, "slots"),
    ("kivi-k4v4", 64, 7, 1, "long", 2, None, ""),
    ("kivi-k4v4", 64, 4, 3, "mixed", 2, None, "window=2,lse"),
    ("kivi-k2v2:v_group=16", 64, 4, 1, "mixed", 1, 2, ""),
    ("kitty", 128, 7, 3, "mixed", 2, 4, ""),
    ("kitty", 64, 1, 3, "long", 2, 2, "window=300,lse"),
    ("kitty-pro", 64, 4, 1, "long", 2, 3, ""),
    ("kvarn", 128, 1, 1, "mixed", 2, 2, ""),
    ("kvarn", 64, 4, 1, "long", 2, 3, "window=700"),
    ("kvarn-k4v2", 64, 4, 2, "long", 2, None, ""),
    ("kitty-qh", 64, 4, 1, "mixed", 2, 2, "lse"),  # rotated values only: q stays, the output turns back
    ("nqkv", 64, 7, 1, "mixed", 3, 3, ""),  # H*D = 192: each NF4 block spans the 3 heads
    ("nqkv:block=32", 64, 1, 1, "long", 2, None, ""),  # blocks narrower than a head
    ("kvmix:3v3", 64, 4, 1, "mixed", 2, 3, ""),
    ("kvmix:2v4", 128, 1, 1, "long", 1, None, ""),
    ("kvmix:4v3", 64, 7, 2, "long", 2, 2, ""),
    ("kvmix:3v2", 128, 4, 1, "long", 2, 3, "window=300,step=32"),  # 3-bit keys' top bits at two slots a step
    ("kitty-pro", 64, 7, 11, "mixed", 1, 2, "window=60,lse"),  # 77 q rows per kv head: two row blocks
    # steps per softmax update other than the default (_softmax_steps: 4, a whole page but at 3-bit keys
    # beside other values in 16-token steps; windows mask whole groups): one a step with a window, a
    # 4-bit block's 2, and the 3-bit planes' page of 8 16-token steps in two groups of one block of rows
    ("kitty", 64, 4, 1, "long", 2, 3, "window=200,softmax_steps=1"),
    ("kvarn-k4v2", 64, 4, 2, "long", 2, None, "softmax_steps=2"),
    ("kvmix:3v3", 64, 4, 1, "mixed", 2, 3, "softmax_steps=4"),
    ("kvmix:3v3", 128, 4, 1, "long", 1, 3, "page_stages=2"),  # 16-token steps pipelined (on a GPU)
    ("nqkv", 128, 4, 1, "long", 2, 2, "page_stages=2"),  # NF4 pipelined at two warps a program (on a GPU)
    # the page loop software-pipelined (three pages for the first split of the long row's six; one
    # program over all five of a row), Kitty's boosted plane then padded to 32 columns
    ("kitty", 128, 4, 1, "long", 2, 2, "page_stages=2"),
    ("kivi-k2v2", 64, 4, 2, "mixed", 2, None, "window=150,page_stages=2"),
    ("kvarn", 64, 4, 1, "long", 2, 2, "lse,page_stages=2"),
    # as if on a GPU of 4 SMs: (row, kv head) pairs for half the SMs or more, so one recent-tier program
    # a row, and splits whose programs all fit the 32 resident slots (_starts_together): on a GPU the
    # next page prefetched into the L2 instead of a pipeline
    ("kitty", 128, 4, 1, "long", 2, 3, "sms=4"),
    ("kvarn", 64, 4, 1, "mixed", 2, 3, "sms=4"),
    ("kivi-k2v2", 64, 4, 1, "long", 2, 2, "sms=4"),
]


@pytest.mark.parametrize("name,queries,window", [("kivi-k2v2", 1, None), ("kvarn", 3, None), ("kitty", 3, 200),
                                                 ("fp16", 1, 300)])
def test_reference_matches_naive_attention(name: str, queries: int, window: int | None):
    """Per row: decode the pages, concatenate all tiers in position order, plain softmax (GQA by
    repeating K/V heads; the window masks positions by distance to each query's position)."""
    gen = torch.Generator().manual_seed(1)
    fmt, H, G, D = get_format(name), 2, 3, 64
    n_sink, n_pages, n_recent = ROWS["mixed"]
    c = make_cache(fmt, H, D, n_sink, n_pages, n_recent, gen)
    q = torch.randn(len(n_sink), H * G, queries, D, generator=gen).to(DEVICE)
    out = call(reference.decode_attention, q[:, :, 0] if queries == 1 else q, c, 0.125, window=window)
    for b in range(len(n_sink)):
        ids = c["page_table"][b, : n_pages[b]].long()
        # decoded pages back in the original domain (KVarN stores x @ Hd), in position order
        k_pg, v_pg = (codec.unrotate(codec.decode({n: f[ids] for n, f in pages.items()})).transpose(0, 1)
                      for codec, pages in ((fmt.k, c["k_pages"]), (fmt.v, c["v_pages"])))
        k_pg, v_pg = k_pg.reshape(H, -1, D), v_pg.reshape(H, -1, D)
        k = torch.cat((c["sink_k"][b, :, : n_sink[b]].float(), k_pg, c["recent_k"][b, :, : n_recent[b]].float()), 1)
        v = torch.cat((c["sink_v"][b, :, : n_sink[b]].float(), v_pg, c["recent_v"][b, :, : n_recent[b]].float()), 1)
        k, v = k.repeat_interleave(G, 0), v.repeat_interleave(G, 0)
        logits = q[b] @ k.transpose(-1, -2) * 0.125
        if window is not None:  # a decode step's query is the last stored token; a block's follow them
            q_pos = torch.arange(queries, device=DEVICE) + (k.shape[1] - 1 if queries == 1 else k.shape[1])
            distance = q_pos[:, None] - torch.arange(k.shape[1], device=DEVICE)
            logits = logits.masked_fill(distance >= window, float("-inf"))
        want = torch.softmax(logits, -1) @ v
        torch.testing.assert_close(out[b] if queries > 1 else out[b, :, None], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,head_dim,group,queries,rows,heads,splits,extras", CASES,
                         ids=[f"{c[0]}-{c[7]}" if c[7] else c[0] for c in CASES])
def test_triton_attention_matches_reference(name, head_dim, group, queries, rows, heads, splits, extras,
                                            monkeypatch):
    gen = torch.Generator().manual_seed(zlib.crc32((name + extras).encode()))
    opts = dict(e.split("=") if "=" in e else (e, True) for e in extras.split(",") if e)
    n_sink, n_pages, n_recent = ROWS[rows]
    c = make_cache(get_format(name), heads, head_dim, n_sink, n_pages, n_recent, gen, slots="slots" in opts)
    shape = (len(n_sink), heads * group) + ((queries,) if queries > 1 else ()) + (head_dim,)
    q = torch.randn(shape, generator=gen).to(DEVICE, DTYPE)
    if queries > 1:  # as the model hands it over: [B, T, Hq, D] transposed, not contiguous
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    kw = dict(window=int(opts["window"]) if "window" in opts else None, return_lse="lse" in opts)
    if "sms" in opts:
        monkeypatch.setattr(attention, "_sm_count", lambda device: int(opts["sms"]))
    want = call(reference.decode_attention, q, c, head_dim**-0.5, **kw)
    # poison every buffer the kernels write: an element they skip shows up as NaN
    monkeypatch.setattr(attention, "_scratch", lambda shape, device: torch.full(shape, float("nan"), device=device))
    # a single query: into a given (poisoned) buffer; a block: the kernel allocates the result itself
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEVICE) if queries == 1 else None
    softmax_steps = int(opts["softmax_steps"]) if "softmax_steps" in opts else None  # None: the default
    page_stages = int(opts["page_stages"]) if "page_stages" in opts else None
    step = int(opts["step"]) if "step" in opts else None
    launch = attention.Launch(num_splits=splits, softmax_steps=softmax_steps, page_stages=page_stages, step=step)
    got = call(attention.decode_attention, q, c, head_dim**-0.5, out=out, launch=launch, **kw)
    if kw["return_lse"]:
        (got, lse), (want, want_lse) = got, want
        torch.testing.assert_close(lse, want_lse, rtol=TOL, atol=TOL)
    assert out is None or got is out
    want = want.float()
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert err < TOL, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("name", ["kivi-k2v2", "kivi-k4v4", "kitty", "kvmix:3v3", "nqkv", "fp16"])
def test_triton_attention_rescales_what_the_offsets_left(name: str):
    """Logits so large that the running max jumps by more than LAZY_MAX on later pages: every
    rescale must also shrink what the value offsets (or zeros) have left in corr so far, for the
    formats that leave something there (kernels.attention._corrects), against the reference."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    n_sink, n_pages, n_recent = ROWS["long"]
    c = make_cache(get_format(name), 2, 64, n_sink, n_pages, n_recent, gen)
    q = (30 * torch.randn(len(n_sink), 8, 64, generator=gen)).to(DEVICE, DTYPE)
    want = call(reference.decode_attention, q, c, 64**-0.5).float()
    for splits in (0, 2):  # one program walks every page, or two
        got = call(attention.decode_attention, q, c, 64**-0.5, launch=attention.Launch(num_splits=splits)).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < TOL, f"{name}, {splits} splits: relative error {err:.2e}"


# (format, gqa group, queries per row, rows, splits, extras) for the Gluon split kernel: Kitty's 16
# and kitty-pro's 32 boosted channels and none, 1 to 8 q rows a kv head, rows in slots, the lse,
# more splits than a row has pages, a row longer than 32 pages (two pages a split), and logits so
# large ("big": q x 30) that the running max jumps on later pages and the rescale must be exact
GLUON_CASES = [
    ("kitty", 4, 1, "mixed", 3, "slots,lse"),
    ("kitty-pro", 8, 1, "long", 2, ""),
    ("kivi-k2v2", 1, 1, "mixed", 7, "slots"),
    ("kitty", 4, 2, "long", 4, "lse"),
    ("kitty", 4, 1, ([SINK], [45], [100]), 16, ""),
    ("kitty", 4, 1, "long", 2, "big,lse"),
]


@pytest.mark.skipif(not CUDA, reason="the Gluon split kernel runs compiled only (no interpreter)")
@pytest.mark.parametrize("name,group,queries,rows,splits,extras", GLUON_CASES)
def test_gluon_split_matches_reference(name, group, queries, rows, splits, extras, monkeypatch):
    """kernels/gluon_attention.py against the torch reference, through decode_attention asked for it
    (which must run it: its launches are counted), every partial buffer poisoned with NaN."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the Gluon split kernel is used on compute capability 9.0+ only")
    from kernels import gluon_attention

    gen = torch.Generator().manual_seed(zlib.crc32((name + extras + str(splits)).encode()))
    opts = set(extras.split(","))
    n_sink, n_pages, n_recent = ROWS[rows] if isinstance(rows, str) else rows
    c = make_cache(get_format(name), 2, 128, n_sink, n_pages, n_recent, gen, slots="slots" in opts)
    shape = (len(n_sink), 2 * group) + ((queries,) if queries > 1 else ()) + (128,)
    q = ((30 if "big" in opts else 1) * torch.randn(shape, generator=gen)).to(DEVICE, DTYPE)
    want = call(reference.decode_attention, q, c, 128**-0.5, return_lse="lse" in opts)
    monkeypatch.setattr(attention, "_scratch", lambda shape, device: torch.full(shape, float("nan"), device=device))
    launches = []
    monkeypatch.setattr(gluon_attention, "launch", lambda *a, _run=gluon_attention.launch: (launches.append(1), _run(*a)))
    got = call(attention.decode_attention, q, c, 128**-0.5, return_lse="lse" in opts,
               launch=attention.Launch(num_splits=splits, gluon=True))
    assert launches, "decode_attention did not run the Gluon split kernel"
    if "lse" in opts:
        (got, lse), (want, want_lse) = got, want
        torch.testing.assert_close(lse, want_lse, rtol=TOL, atol=TOL)
    want = want.float()
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert err < TOL, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("name", ["kitty", "kvarn-k4v2", "kvmix:3v2", "nqkv"])
def test_tile_options_do_not_change_the_result(name: str):
    """16-token steps (planes read in blocks of rows), 32- and 4-row query blocks (4: two blocks of a
    kv head's 8 rows), 1, 2 and 4 warps, pipelined page loads, one softmax update per 4 or 8 steps
    and codes unpacked unswapped give the torch reference's result, as the default does; a step that would cross slots, or a
    group of steps that is not a power of 2, is refused."""
    gen = torch.Generator().manual_seed(11)
    c = make_cache(get_format(name), 2, 64, *ROWS["mixed"], gen)
    q = torch.randn(3, 16, 64, generator=gen).to(DEVICE, DTYPE)
    want = call(reference.decode_attention, q, c, 0.125).float()
    for opts in (dict(), dict(step=16, num_warps=4), dict(block_n=32, num_warps=1), dict(block_n=4),
                 dict(num_warps=2, num_stages=3), dict(softmax_steps=4), dict(step=16, softmax_steps=8),
                 dict(step=32), dict(swap=False)):
        got = call(attention.decode_attention, q, c, 0.125, launch=attention.Launch(num_splits=2, **opts)).float()
        # relative to the output's scale, as TOL is (the products' offset cancellation leaves
        # rounding that moves with the tile shapes)
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < TOL, f"{name} {opts}: relative error {err:.2e}"
    with pytest.raises(ValueError, match="step must"):
        call(attention.decode_attention, q, c, 0.125, launch=attention.Launch(step=128))
    with pytest.raises(ValueError, match="softmax_steps must"):
        call(attention.decode_attention, q, c, 0.125, launch=attention.Launch(softmax_steps=3))


def _run_ptx(asm: str, word: int, outputs: int = 2, lane: int = 0) -> list[int]:
    """Our reading of the few PTX b32 instructions the unpack asm uses (mov, and, or, shl, shr,
    lop3, prmt in its default and sign-replicate modes; the lane masks of lane `lane`), run on one
    input word (the register after the outputs): the outputs $0 .. The interpreter cannot run PTX,
    so this is what checks the asm strings on CPU."""
    regs = {f"${outputs}": word, "%lanemask_lt": (1 << lane) - 1, "%lanemask_gt": 0xFFFFFFFF & ~((2 << lane) - 1)}
    for line in asm.replace("{", "").replace("}", "").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        a = [regs[x] if x in regs else int(x, 0) for x in src]
        if op == "mov.b32":
            r = a[0]
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "or.b32":
            r = a[0] | a[1]
        elif op == "shl.b32":
            r = (a[0] << a[1]) & 0xFFFFFFFF
        elif op == "shr.b32":  # logical for .b32
            r = a[0] >> a[1]
        elif op == "lop3.b32":  # bit i of the result: bit (a_i b_i c_i) of the truth table
            r = sum((a[3] >> ((a[0] >> i & 1) << 2 | (a[1] >> i & 1) << 1 | (a[2] >> i & 1)) & 1) << i
                    for i in range(32))
        elif op == "prmt.b32":  # result byte i = byte (nibble_i & 7) of {a[1], a[0]}; nibble bit 3: its sign
            pool, r = a[1] << 32 | a[0], 0
            for i in range(4):
                n = a[2] >> 4 * i & 0xF
                byte = pool >> 8 * (n & 7) & 0xFF
                r |= (0xFF * (byte >> 7) if n & 8 else byte) << 8 * i
        else:
            raise AssertionError(f"no model of {op}")
        regs[dst] = r
    return [regs[f"${i}"] for i in range(outputs)]


def _halves(r0: int, r1: int) -> list[float]:
    """The four fp16 numbers of two 32-bit registers, low half first."""
    return list(struct.unpack("<4e", struct.pack("<2I", r0, r1)))


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("later", [0, 1])
def test_unpack_asm_gives_offset_plus_code(bits: int, swap: bool, later: int):
    """Slot s of four packed bytes (bits-wide codes at bits [bits*s, bits*(s+1)) of each) comes out
    as the fp16 numbers 2^(10 - bits*s) + code, byte i as element i, or swapped: bytes 0 2 1 3;
    told that the codes sit `later` slots on (a 3-bit code's top bit in a 32-token step), the codes
    of slot s + later, with slot s's offset."""
    gen = torch.Generator().manual_seed(5)
    words = [0, 0xFFFFFFFF] + torch.randint(0, 2**32, (200,), generator=gen, dtype=torch.int64).tolist()
    order = [0, 2, 1, 3] if swap else [0, 1, 2, 3]
    for slot in range(8 // bits - later):
        asm = attention._slot_asm(bits, slot, swap, later)
        for w in words:
            codes = [(w >> 8 * i >> bits * (slot + later)) & ((1 << bits) - 1) for i in order]
            assert _halves(*_run_ptx(asm, w)) == [2.0 ** (10 - bits * slot) + c for c in codes], (slot, hex(w))


def test_nf4_asm_gives_the_levels():
    """Both slots (the low and the high nibble of each byte) of four packed bytes come out as the
    fp16 NF4 levels of those codes, slot 0 then slot 1, byte i as element i of each."""
    gen = torch.Generator().manual_seed(6)
    words = [0, 0xFFFFFFFF, 0x76543210, 0xFEDCBA98, 0x8F8F8F8F, 0xF8F8F8F8] + torch.randint(
        0, 2**32, (400,), generator=gen, dtype=torch.int64).tolist()
    levels = quant.NF4_LEVELS.half().tolist()
    asm = attention._nf4_lookup_asm()
    for n, w in enumerate(words):
        r = _run_ptx(asm, w, outputs=4, lane=n % 32)
        for slot in range(2):
            want = [levels[w >> 8 * i >> 4 * slot & 0xF] for i in range(4)]
            assert _halves(*r[2 * slot:2 * slot + 2]) == want, (slot, hex(w))


def test_fp16_page_steps_do_not_change_the_result():
    """FP16 pages read a whole page a step with 4 warps (the default in a launch of few programs),
    half a page with 2, or 32 tokens with one warp (the default otherwise): the same result, and
    that of the torch reference."""
    gen = torch.Generator().manual_seed(12)
    c = make_cache(get_format("fp16"), 2, 64, *ROWS["mixed"], gen)
    q = torch.randn(3, 8, 64, generator=gen).to(DEVICE, DTYPE)
    want = call(attention.decode_attention, q, c, 0.125, launch=attention.Launch(num_splits=2, step=32, num_warps=1))
    expect = call(reference.decode_attention, q, c, 0.125).float()
    assert (want.float() - expect).abs().max() < TOL * expect.abs().max()
    for opts in (dict(step=128, num_warps=4), dict(step=64, num_warps=2), dict(num_splits=0), dict()):
        got = call(attention.decode_attention, q, c, 0.125, launch=attention.Launch(**{"num_splits": 2, **opts}))
        torch.testing.assert_close(got.float(), want.float(), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("name,window,lse,short_pages", [
    ("kitty", None, False, 32), ("kitty", None, False, 0), ("kitty", 300, True, 32), ("kitty", 300, True, 0),
    ("kvarn", None, False, 32),  # rotated: every split un-rotates its own partial
])
def test_split_count_does_not_change_the_result(name, window, lse, short_pages, monkeypatch):
    """1, 2, 7 and 20 splits, the recent tier split over 3 programs with one-page splits, and a
    single program per row that walks every tier itself and writes
    the result without the merge kernel (num_splits=0), on rows of very different lengths: the
    same output and log-sum-exp. Splits past a row's last page write nothing and the merge must
    not read them (the partials start as NaN); the merge reads 4 partials at a time, so it takes
    several chunks and rescales its sums when a later chunk raises the max.
    short_pages 0: every row takes the long rows' two-page minimum per split."""
    monkeypatch.setattr(attention, "MERGE_CHUNK", 4)
    monkeypatch.setattr(attention, "SHORT_ROW_PAGES", short_pages)
    monkeypatch.setattr(attention, "_scratch", lambda shape, device: torch.full(shape, float("nan"), device=device))
    gen = torch.Generator().manual_seed(7)
    c = make_cache(get_format(name), 2, 64, *ROWS["long"], gen)
    q = torch.randn(2, 8, 64, generator=gen).to(DEVICE, DTYPE)
    launches = [attention.Launch(num_splits=s) for s in (1, 2, 7, 20)]
    # the recent tier over 3 programs (chunks past its end are empty), one-page splits
    launches += [attention.Launch(num_splits=7, recent_parts=3, min_pages=1), attention.Launch(num_splits=0)]
    outs = [call(attention.decode_attention, q, c, 0.125, window=window, return_lse=lse, launch=launch)
            for launch in launches]
    outs = [o if lse else (o, None) for o in outs]
    for o, l in outs[1:]:
        # relative to the output's scale, as in the tile options test: the offsets' cancellation
        # leaves rounding that moves with the order of the sums (splits, swapped unpacking)
        err = ((o.float() - outs[0][0].float()).abs().max() / outs[0][0].float().abs().max()).item()
        assert err < TOL, f"relative difference {err:.2e} between split counts"
        if lse:
            torch.testing.assert_close(l, outs[0][1], rtol=TOL, atol=TOL)
    want = call(reference.decode_attention, q, c, 0.125, window=window).float()
    err = ((outs[-1][0].float() - want).abs().max() / want.abs().max()).item()
    assert err < TOL, f"relative error {err:.2e}"


@pytest.mark.parametrize("sms,recent_parts", [(132, 5), (4, 1)])
def test_long_recent_tier_gets_a_program_per_part_of_its_view(sms, recent_parts, monkeypatch):
    """A recent tier of 700 and 1100 tokens (KVmix keeps a share of the context there) in a view of
    1105: one program per RECENT_PART_TOKENS of the view, 5, instead of the usual 4 (on 132 SMs);
    on 4 SMs, where the launch is crowded, still one. The result is the reference's."""
    monkeypatch.setattr(attention, "_sm_count", lambda device: sms)
    parts = []

    def poisoned(shape, device):  # records the partials' parts: splits + sink + recent chunks
        parts.append(shape[1])
        return torch.full(shape, float("nan"), device=device)

    monkeypatch.setattr(attention, "_scratch", poisoned)
    gen = torch.Generator().manual_seed(11)
    c = make_cache(get_format("kvmix:3v3"), 2, 64, [SINK, SINK], [3, 1], [1100, 700], gen)
    c["recent_grows"] = True
    q = torch.randn(2, 8, 64, generator=gen).to(DEVICE, DTYPE)
    got = call(attention.decode_attention, q, c, 0.125, launch=attention.Launch(num_splits=2))
    assert c["recent_k"].shape[2] == 1105 and parts[0] == 2 + 1 + recent_parts
    want = call(reference.decode_attention, q, c, 0.125).float()
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert err < TOL, f"relative error {err:.2e}"


@pytest.mark.skipif(not CUDA, reason="counts compiled kernels (the interpreter compiles none)")
def test_a_longer_recent_tier_compiles_no_new_kernel(monkeypatch):
    """KVmix's recent tier grows with the context (Tiers.recent_grows), and with it the launch's tier
    count: 4, 5 and 10 recent-tier parts for views of 205, 1105 and 2405 tokens. The split and merge
    kernels take that count at run time and the merge's chunk does not follow it, so a longer tier
    reuses the compiled kernels instead of compiling them mid-decode. The results are the reference's.
    (Counts Triton's compiled variants: JITFunction.device_caches.)"""
    monkeypatch.setattr(attention, "_sm_count", lambda device: 132)
    device = torch.cuda.current_device()
    kernels_ = {"split": attention._split_kernel, "merge": attention._merge_kernel}
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(2, 8, 64, generator=gen).to(DEVICE, DTYPE)
    counts = []
    for recent in ([200, 150], [1100, 700], [2400, 700]):
        c = make_cache(get_format("kvmix:3v3"), 2, 64, [SINK, SINK], [3, 1], recent, gen)
        c["recent_grows"] = True
        got = call(attention.decode_attention, q, c, 0.125, launch=attention.Launch(num_splits=2))
        want = call(reference.decode_attention, q, c, 0.125).float()
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        assert err < TOL, f"relative error {err:.2e} with a {c['recent_k'].shape[2]}-token view"
        counts.append({name: len(k.device_caches[device][0]) for name, k in kernels_.items()})
    assert counts[1] == counts[0] == counts[2], f"compiled variants after each view: {counts}"


@pytest.mark.parametrize("batch,pages,want", [
    (1, 256, 128),   # 32k: 2 pages a split at least; 8 x 128 programs are one wave
    (1, 512, 132),   # 64k: 256 of 2 pages are 2 waves x (2 + 1) = 6; 132 of 4 (128 live) one wave, 5
    (1, 1024, 132),  # 128k: 512 of 2: 4 x 3 = 12; 132 of 8: 1 x 9 = 9
    (16, 256, 8),    # 33 (32 live) of 8 pages: 4096 programs, 4 waves x (8 + 1) = 36; 8 of 32: one wave, 33
    (16, 30, 6),     # 4k: 29 of 2 (15 live), 2 waves x 3 = 6; 8 of 4 would be 5, but 128 pairs need 8 pages;
                     # _makespan (in pages, each program + 1.5; the sink 0.25, the recent tier 3): 6 of 5 and
                     # the two tiers are 1024 programs, all at once, 6.5; 8 of 4 (the last of 2) are 1280:
                     # 96 of the 7th split start when the sinks end (1.75 + 5.5), and 96 of the 8th when the
                     # recent tier ends (4.5 + 3.5 = 8.0); 29 of 2 8.75, so 6.5 is more than 5% shorter
    (24, 30, 4),     # 4 of 8 (the last of 6), 192 pairs: 960 programs at once end at 9.5, 96 of the last split
                     # start at 1.75 and end at 9.25; 5 of 6: 96 of the 5th split wait for the recent tier,
                     # 4.5 + 7.5 = 12.0; 22 of 2 12.25
    (12, 14, 5),     # 2k, 96 pairs: 14 of 1 (one page a split in short rows) are 1536 programs; the 480 past
                     # the slots start when the sinks (1.75) and the first splits (2.5) end: 5.0; 5 of 3 (the
                     # last of 2) are 672 programs at once, as long as the recent tier, 4.5
    (111, 30, 5),    # 888 pairs aim at 5; lockstep: 5 of 6 are 4440 programs, 5 waves x 7 = 35 (8 of 4 also 35,
                     # further from 5); the one wave is 1 split, one program a pair, which _makespan may not pick
    (40, 30, 3),     # 3 of 10 (one wave by the lockstep rule, 960 of 1056 slots, 320 pairs); _makespan: 1 of
                     # 30 is 31.5, 2 of 15 18.25 (224 of the 2nd split start at 1.75), 3 of 10 16.0 (224 of
                     # the 3rd wait for the recent tier, 4.5 + 11.5): the same count
    (52, 64, 10),    # 10 of 7: 3744 programs, 4 x 8 = 32; one wave (2 of 32) 33
    (37, 62, 15),    # 15 of 5 (13 live): 3848 programs, 4 x 6 = 24; 3 of 21 would be 22, but 888 programs
    (64, 256, 8),    # 9 of 29 pages: 4608 programs, 5 waves x (29 + 1) = 150; 8 of 32: 4096, 4 x 33 = 132;
                     # one wave (2 of 128) 129, not ONE_WAVE_MARGIN below 132
    (296, 64, 4),    # 2 of 32: 4736, 5 x 33 = 165; 3 of 22: 7 x 23 = 161; 4 of 16: 9472, 9 x 17 = 153
    (5, 62, 26),     # 8k, 40 pairs (few): 31 of 2 are 1240 programs, 2 waves x 3 = 6; 26 (21 live) of 3 are 840,
                     # one wave, 4: taken though they fill 80% of the slots (the fill rule is for many pairs)
    (1, 270, 132),   # 34k: 135 of 2 are 1080 programs, 2 waves x 3 = 6; 132 (90 live) of 3, 720, one wave, 4
    (8, 1022, 51),   # 128k, 64 pairs: 51 (49 live) of 21 are 3136 programs, 3 waves x 22 = 66; one wave (16 of
                     # 64) 65, not 5% shorter
])
def test_default_splits_fill_the_waves(batch, pages, want, monkeypatch):
    """The split rule on an H100's 132 SMs (8 resident one-warp programs each, 1056 in all) for
    Llama-3-8B's 8 kv heads: the counts worked out by hand from the lockstep-wave arithmetic
    (waves x (pages a split + one page of fixed cost)), the one-wave count taken where it is 5%
    shorter and, in launches of many pairs, fills 90% of the slots and walks 8 pages or more; then,
    in launches of many pairs, the count of at most one wave whose slot-by-slot schedule with the
    FP16 tiers' programs (_makespan) is 5% shorter still; NF4 formats keep the plain count (9)."""
    monkeypatch.setattr(attention, "_sm_count", lambda device: 132)
    assert attention.default_splits(pages, batch * 8, torch.device("cpu")) == want
    if batch == 64:
        assert attention.default_splits(pages, batch * 8, torch.device("cpu"), fill_waves=False) == 9


@pytest.mark.parametrize("name,batch,pages,want", [
    ("kitty", 16, 256, 2),      # 8 splits of 32 pages, 128 (row, kv head) pairs
    ("kitty-pro", 296, 64, 2),  # 4 splits of 16
    ("kvarn", 64, 256, 2),      # 8 splits of 32
    ("kivi-k2v2", 16, 256, 2),
    ("kitty", 1, 256, 1),       # 128 splits of 2 pages: too few to overlap
    ("kitty", 1, 1024, 1),      # 132 of 8, but 8 pairs: the L2 prefetch instead
    ("kitty", 4, 256, 1),       # 33 of 8, 32 pairs
    ("kitty", 16, 30, 1),       # a short row: 6 splits of 5 pages, which start together
    ("kitty", 24, 30, 1),       # 4 splits of 8, 192 pairs: 960 programs and the recent tier's start together
    ("kitty", 28, 30, 2),       # 4 splits of 8, 224 pairs: 1120 programs, more than 1056 slots
    ("kitty", 48, 30, 2),       # 9 splits of 4, 384 pairs
    ("kivi-k4v4", 16, 256, 1),  # 4-bit planes are read a block of rows at a time
    ("kvmix:3v2", 16, 256, 2),  # 3-bit keys: a 2-bit plane of one step's rows, the top bits' read whole
    ("kvmix:3v2", 1, 256, 1),
    ("kvmix:3v3", 16, 256, 2),  # 3-bit keys and values: 16-token steps, the 2-bit planes a block of rows at a time
    ("kvmix:3v3", 1, 256, 1),
    ("nqkv", 16, 256, 2),  # NF4 at two warps a program
    ("nqkv", 1, 256, 1),
    ("fp16", 16, 256, 1),
])
def test_page_loop_pipelined_where_it_pays(name, batch, pages, want, monkeypatch):
    """The pipelining rule on an H100 (132 SMs, the split counts of the test above) for Llama-3-8B's
    shape: 2-bit RTN planes of one step's rows, at least PIPELINE_MIN_PAGES pages a split, and page
    programs that do not all start at once (those take the L2 prefetch instead)."""
    monkeypatch.setattr(attention, "_sm_count", lambda device: 132)
    kl, vl = attention._layouts(get_format(name), 8, 128)
    step, per, together = _launch_of(kl, vl, batch, pages)
    assert attention._page_stages(kl, vl, step, per, together) == want


@pytest.mark.parametrize("name,whole_pages,want", [
    ("nqkv", False, 2),  # NF4 lookups: two warps share each tile
    ("kitty", False, 1),
    ("kivi-k4v4", False, 1),
    ("kvmix:3v3", False, 1),
    ("kvarn", False, 1),
    ("fp16", False, 1),
    ("fp16", True, 4),  # a whole FP16 page a step (few programs)
])
def test_split_program_warps(name, whole_pages, want):
    """Warps a split program gets by default: one, but NF4 pages two and whole FP16 pages four."""
    kl, vl = attention._layouts(get_format(name), 8, 128)
    assert attention._split_warps(kl, vl, whole_pages) == want


@pytest.mark.parametrize("name,step,want", [
    ("kitty", 32, 4),       # a whole page
    ("kivi-k4v4", 32, 4),
    ("kvmix:3v3", 16, 8),   # a whole page of 16-token steps
    ("kvmix:3v2", 16, 4),   # half a page: one block of rows a group
    ("fp16", 128, 4),       # (capped at the page's one step by the launch)
])
def test_softmax_steps(name, step, want):
    """Steps per softmax update by default: 4, except a whole page of 16-token steps for 3-bit keys and values."""
    kl, vl = attention._layouts(get_format(name), 8, 128)
    assert attention._softmax_steps(kl, vl, step) == want


def _launch_of(kl, vl, batch: int, pages: int) -> tuple[int, int, bool]:
    """decode_attention's step, pages a split and _starts_together for Llama-3-8B's 8 kv heads and 4 q
    rows a kv head: a split launch has the sink's program and 1 recent-tier program a pair where
    the pairs are at least half the SMs, else 4."""
    pairs = batch * 8
    splits = attention.default_splits(pages, pairs, torch.device("cpu"))
    per = attention._split_pages(pages, splits, attention._least_pages(pages, None))
    tier_parts = 1 + (1 if 2 * pairs >= 132 else 4)
    together = attention._starts_together(pairs, -(-pages // per), tier_parts, torch.device("cpu"))
    return attention._step(kl, vl, per, together), per, together


@pytest.mark.parametrize("name,batch,pages,want", [
    ("kivi-k2v2", 1, 256, 32),
    ("kvmix:4v2", 16, 256, 32),
    ("kvmix:3v2", 16, 256, 32),  # pipelined: the top bits' 16 rows at two slots a step
    ("kvmix:3v2", 1, 256, 16),   # not pipelined: one slot a step
    ("kvmix:3v4", 1, 256, 32),   # beside 4-bit values
    ("kvmix:3v3", 16, 256, 16),  # 3-bit keys and values
])
def test_three_bit_step(name, batch, pages, want, monkeypatch):
    """Tokens per step on an H100 for Llama-3-8B's shape: 32 where planes have 32 rows or more, but
    16 for 3-bit keys and values, and for 3-bit codes beside 2-bit ones in a loop not pipelined."""
    monkeypatch.setattr(attention, "_sm_count", lambda device: 132)
    kl, vl = attention._layouts(get_format(name), 8, 128)
    assert _launch_of(kl, vl, batch, pages)[0] == want


@pytest.mark.parametrize("pairs,live,tier_parts,want", [
    (8, 128, 5, True),     # batch 1: fewer pairs than half the SMs
    (128, 6, 2, True),     # 128 x (6 + 1) = 896 programs past the sinks' fit 1056 slots
    (96, 10, 2, True),     # 96 x 11 = 1056: just
    (128, 8, 2, False),    # 1152
    (448, 2, 2, False),    # 1344
    (1024, 1, 1, True),    # one program a pair (no splits, no tier programs): 1024
])
def test_programs_start_together(pairs, live, tier_parts, want, monkeypatch):
    """_starts_together on an H100 (132 SMs, 8 resident programs each): few pairs, or every live
    split's and every recent-tier part's program resident at once (the sink's end first)."""
    monkeypatch.setattr(attention, "_sm_count", lambda device: 132)
    assert attention._starts_together(pairs, live, tier_parts, torch.device("cpu")) == want


@pytest.mark.parametrize("name,batch,pages,want", [
    ("kitty", 1, 256, True),        # 128 splits of 2 pages, 8 (row, kv head) pairs
    ("kitty", 1, 1024, True),       # a CUDA graph's table for 128k positions: 132 splits of 8
    ("kitty", 4, 256, True),        # 33 splits of 8, 32 pairs
    ("kitty-pro", 1, 256, True),
    ("kivi-k2v2", 1, 256, True),
    ("kvarn", 1, 256, True),
    ("kitty", 1, 32, False),        # a short row: one page a split, no next page
    ("kitty", 16, 256, False),      # pipelined (and 128 pairs: their splits do not start together)
    ("kitty", 16, 30, True),        # 6 splits of 5 pages, 128 pairs, whose programs start together
    ("kitty", 28, 30, False),       # 4 splits of 8, 224 pairs: pipelined
    ("kivi-k4v4", 1, 256, False),   # 4-bit planes are read a block of rows at a time
    ("nqkv", 1, 256, False),
    ("fp16", 1, 256, False),
])
def test_next_page_prefetched_where_it_pays(name, batch, pages, want, monkeypatch):
    """The L2 prefetch rule on an H100 (132 SMs) for Llama-3-8B's shape: whole 2-bit planes, splits
    of more than one page that are not pipelined, and page programs that start together."""
    monkeypatch.setattr(attention, "_sm_count", lambda device: 132)
    kl, vl = attention._layouts(get_format(name), 8, 128)
    step, per, together = _launch_of(kl, vl, batch, pages)
    stages = attention._page_stages(kl, vl, step, per, together)
    assert attention._prefetches(kl, vl, step, per, stages, together) == want


ENCODE_FORMATS = ["fp16", "kivi-k2v2", "kivi-k4v4", "kivi-k2v2:v_group=16", "kitty", "kitty-pro",
                  "kitty:score=range", "kitty:score=q-aware", "kitty-qh", "kvarn", "kvarn-k4v2", "nqkv", "nqkv:block=32", "kvmix:3v3", "kvmix:4v2"]


@pytest.mark.parametrize("name", ENCODE_FORMATS)
@pytest.mark.parametrize("side", ["k", "v"])
def test_triton_encode_matches_reference(name: str, side: str):
    """Pages written in place equal quant's torch encode bit for bit; rotated codecs (KVarN, whose
    Sinkhorn exp/log may round differently, and kitty-qh's values: the kernel rotates by a matmul,
    quant by butterflies) are compared on decoded values instead."""
    gen = torch.Generator().manual_seed(3)
    fmt = get_format(name)
    codec = getattr(fmt, side)
    heads, head_dim = (3, 64) if name.startswith("nqkv") else (2, 128 if "kitty" in name else 64)
    n_pool, n = 9, 4
    # tiles as a strided view (the oldest T tokens of a wider recent buffer), fp16 as the cache holds them
    x = random_tiles(n, heads, head_dim, gen).half()
    x = torch.cat((x, x[:, :, :9]), 2).to(DEVICE)[:, :, :T]
    page_ids = torch.randperm(n_pool, generator=gen)[:n].int().to(DEVICE)
    specs = codec.field_specs(heads, head_dim)

    def poisoned_pool() -> dict[str, torch.Tensor]:
        return {f: torch.randint(0, 120, (n_pool, *shape), generator=gen).to(dtype).to(DEVICE)
                for f, (shape, dtype) in specs.items()}

    want = poisoned_pool()
    got = {f: t.clone() for f, t in want.items()}  # the same garbage outside the written pages
    # q-aware Kitty: a mean |q| per channel that disagrees with the keys' own ranking
    query_weight = torch.rand(n, heads, head_dim, generator=gen).to(DEVICE) if codec.needs_queries else None
    reference.encode_pages_reference(codec, x, want, page_ids, query_weight)
    quantize.encode_pages(codec, x, got, page_ids, query_weight)
    if not codec.rotated:
        for f in specs:
            where = (got[f] != want[f]).nonzero().tolist()[:8]
            assert torch.equal(got[f], want[f]), f"{name} {side}: field {f} differs at {where}"
        return
    for f in specs:  # untouched pages stay untouched
        keep = torch.ones(n_pool, dtype=torch.bool, device=DEVICE)
        keep[page_ids.long()] = False
        assert torch.equal(got[f][keep], want[f][keep])
    ids = page_ids.long()
    dec_got = codec.decode({f: t[ids] for f, t in got.items()})
    dec_want = codec.decode({f: t[ids] for f, t in want.items()})
    truth = quant.hadamard.fwht(x.float())
    err_got, err_want = (dec_got - truth).pow(2).mean(), (dec_want - truth).pow(2).mean()
    assert err_got < 1.05 * err_want, f"{name} {side}: reconstruction mse {err_got:.4g} vs reference {err_want:.4g}"
    close = (dec_got - dec_want).abs() <= 1e-3 * truth.abs().max()
    assert close.float().mean() > 0.95, f"{name} {side}: only {close.float().mean():.3f} of decoded values agree"


@pytest.mark.parametrize("name", ["fp16", "kivi-k2v2", "kitty", "kitty:score=q-aware", "nqkv", "kvmix:3v3"])
@pytest.mark.parametrize("side", ["k", "v"])
def test_triton_encode_reads_rows_in_place(name: str, side: str):
    """With rows, the encoder reads tile n at x[rows[n]] of a wider buffer (the cache's recent tier,
    a flush's tokens in place): the pages equal quant's torch encode of those tiles gathered first."""
    gen = torch.Generator().manual_seed(4)
    codec = getattr(get_format(name), side)
    heads, head_dim = (3, 64) if name.startswith("nqkv") else (2, 128 if "kitty" in name else 64)
    slots, n_pool = 5, 7
    buffer = torch.cat([random_tiles(slots, heads, head_dim, gen)] * 2, 2).half().to(DEVICE)  # [slots, H, 256, D]
    x = buffer[:, :, 32:32 + quant.PAGE_TOKENS]  # the tiles start past a sink, as in the cache
    rows = torch.tensor([3, 0, 4], device=DEVICE)
    page_ids = torch.tensor([6, 1, 2], dtype=torch.int32, device=DEVICE)
    query_weight = torch.rand(3, heads, head_dim, generator=gen).to(DEVICE) if codec.needs_queries else None
    specs = codec.field_specs(heads, head_dim)
    want = {f: torch.zeros((n_pool, *shape), dtype=dtype, device=DEVICE) for f, (shape, dtype) in specs.items()}
    got = {f: t.clone() for f, t in want.items()}
    reference.encode_pages_reference(codec, x[rows].contiguous(), want, page_ids, query_weight)
    quantize.encode_pages(codec, x, got, page_ids, query_weight, rows=rows)
    for f in specs:
        assert torch.equal(got[f], want[f]), f"{name} {side}: field {f} differs"


def test_encode_then_attend_end_to_end():
    """Triton-encoded pages read by the Triton attention = torch-encoded pages read by the reference."""
    gen = torch.Generator().manual_seed(5)
    fmt, H, D = get_format("kitty"), 2, 64
    c = make_cache(fmt, H, D, [SINK, SINK], [2, 1], [40, 3], gen)
    tiles = random_tiles(3, H, D, gen).to(DEVICE)
    ids = c["page_table"][:, :2].flatten()[:3].contiguous()
    q = torch.randn(2, 4 * H, D, generator=gen).to(DEVICE, DTYPE)
    for side in ("k", "v"):
        kernels.encode_pages(getattr(fmt, side), tiles, c[f"{side}_pages"], ids, backend="triton")
    got = call(kernels.decode_attention, q, c, 0.125, backend="triton").float()
    for side in ("k", "v"):
        kernels.encode_pages(getattr(fmt, side), tiles, c[f"{side}_pages"], ids, backend="torch")
    want = call(kernels.decode_attention, q, c, 0.125, backend="torch").float()
    assert ((got - want).abs().max() / want.abs().max()).item() < TOL


def test_backend_choice():
    assert kernels.pick_backend(torch.device("cpu")) == "torch"
    assert kernels.pick_backend(torch.device("cuda")) == "triton"
    assert kernels.pick_backend(torch.device("cpu"), "triton") == "triton"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        kernels.pick_backend(torch.device("cpu"), "cuda")


ELEMENTWISE_DTYPES = [torch.float16] if CUDA else [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80])
def test_elementwise_kernels_match_torch(dtype, head_dim):
    """One kernel each for the model's RMSNorm, RoPE and SiLU gate, equal to the torch expressions
    they replace up to one rounding of the output (float32: op order only)."""
    g = torch.Generator().manual_seed(11)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype)

    x, w = rand(3, 5, 100), rand(100)  # rows of a size that is not a power of two
    torch.testing.assert_close(elementwise.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), **tol)
    h = rand(3, 5, 100)
    for got, expect in zip(elementwise.add_rms_norm(x, h, w, 1e-6), reference.add_rms_norm(x, h, w, 1e-6)):
        torch.testing.assert_close(got, expect, **tol)

    B, H, T = 2, 3, 4
    q = rand(B, T, H, head_dim).transpose(1, 2)  # the projection's view: heads not outermost
    angles = torch.rand(B, 1, T, head_dim // 2, generator=g).to(DEVICE) * 6
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = elementwise.apply_rope(q, cos, sin)
    assert got.is_contiguous()
    torch.testing.assert_close(got, reference.apply_rope(q, cos, sin), **tol)

    gate, up = rand(3, 2500), rand(3, 2500)  # more than one block, a partial last one
    torch.testing.assert_close(elementwise.silu_mul(gate, up), reference.silu_mul(gate, up), **tol)
    gate, up = rand(2, 3, 2 * 1100).split(1100, dim=-1)  # halves of one fused gate+up output
    torch.testing.assert_close(elementwise.silu_mul(gate, up), reference.silu_mul(gate, up), **tol)


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
@pytest.mark.parametrize("rotate", [True, False])
def test_rope_store_matches_torch(dtype, rotate):
    """A decode step's q and k rotated and its K and V stored by one kernel: the rotated q, and
    the buffers after the store, equal the torch rotation and index-put, from strided views (heads
    of one fused projection, GQA); nothing else in the buffers changes. rotate=False: a model
    without rotary embedding (OPT), q returned as it is, k and v stored bit for bit."""
    g = torch.Generator().manual_seed(5)
    slots_n, Hq, H, T, D, B = 5, 4, 2, 12, 32, 3
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    dense = [torch.randn(slots_n, H, T, D, generator=g).to(DEVICE, dtype) for _ in range(4)]  # ours k, v; reference k, v
    dense[2].copy_(dense[0]), dense[3].copy_(dense[1])
    qkv = torch.randn(B, 1, Hq + 2 * H, D, generator=g).to(DEVICE, dtype).transpose(1, 2)
    q, k, v = qkv[:, :Hq, 0], qkv[:, Hq:Hq + H, 0], qkv[:, Hq + H:, 0]
    angles = torch.rand(B, D // 2, generator=g).to(DEVICE) * 6
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = (angles.cos().to(dtype), angles.sin().to(dtype)) if rotate else (None, None)
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    index = torch.tensor([11, 0, 7], dtype=torch.int32, device=DEVICE)
    got = elementwise.rope_store(q, k, v, cos, sin, dense[0], dense[1], slots, index)
    expect = reference.rope_store(q, k, v, cos, sin, dense[2], dense[3], slots, index)
    assert got.is_contiguous() and got.shape == q.shape
    torch.testing.assert_close(got, expect, **tol)
    torch.testing.assert_close(dense[0], dense[2], **tol)
    assert torch.equal(dense[1], dense[3])
    written = torch.zeros(slots_n, T, dtype=torch.bool)
    written[slots.cpu(), index.long().cpu()] = True
    assert torch.equal(dense[0].transpose(1, 2)[~written.to(DEVICE)], dense[2].transpose(1, 2)[~written.to(DEVICE)])
    if not rotate:
        assert torch.equal(got, q) and torch.equal(dense[0], dense[2])
    else:  # the rotation happened at all: row 0's k differs from the unrotated one
        assert not torch.allclose(dense[0][4, :, 11], k[0], **tol)


TILES = sorted(set(matmul.ONE_ROW_TILES + matmul.MULTI_ROW_TILES), key=str)


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("tile", TILES[:2] + [gemv.GemvConfig(16, 64, split_k=3)], ids=str)
def test_gemv_matches_linear(rows, tile):
    """x @ W^T + b for channel and K counts that are not multiples of the tile (masked edges),
    with and without split-K (fp32 atomics), from a strided x."""
    g = torch.Generator().manual_seed(rows)
    N, K = 3 * tile.block_n + 5, 2 * tile.block_k + 40
    x = torch.randn(rows, 2 * K, generator=g)[:, :K].to(DEVICE, DTYPE)  # row stride 2K
    w = torch.randn(N, K, generator=g).to(DEVICE, DTYPE) / K**0.5
    b = torch.randn(N, generator=g).to(DEVICE, DTYPE)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    for bias in (None, b):
        got = gemv.gemv(x, w, bias, tile)
        assert got.dtype == DTYPE and got.shape == (rows, N)
        expect = ref if bias is not None else ref - b.float()
        assert (got.float() - expect).abs().max() < TOL * expect.abs().max()


@pytest.mark.skipif(not CUDA, reason="the per-shape choice times kernels on a GPU")
@pytest.mark.parametrize("rows", [1, 4, 16, 17])
def test_linear_picks_a_kernel_that_matches_f_linear(rows):
    """Whatever kernels.linear measures fastest (17 rows: always cuBLAS) computes F.linear."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, rows, 512, generator=g).to(DEVICE, DTYPE)[:1]
    w = (torch.randn(1000, 512, generator=g) / 512**0.5).to(DEVICE, DTYPE)
    ref = torch.nn.functional.linear(x.float(), w.float())
    got = kernels.linear(x, w)
    assert got.shape == (1, rows, 1000)
    assert (got.float() - ref).abs().max() < TOL * ref.abs().max()
    if rows <= matmul.MAX_ROWS:
        assert matmul._key(rows, w) in matmul._chosen


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
def test_argmax_matches_torch_with_ties(dtype):
    """Each row's first maximum, as torch.argmax: rows of several chunks and a partial last one,
    a maximum repeated inside a chunk, in two chunks, at the last column, from a strided view."""
    g = torch.Generator().manual_seed(9)
    n = 2 * greedy.CHUNK + 123
    x = torch.randn(5, n + 7, generator=g)[:, :n].to(DEVICE, dtype)
    x[1, [5, 17]] = 9.0  # two in one chunk: 5
    x[2, [greedy.CHUNK + 3, 2 * greedy.CHUNK + 1]] = 9.0  # two chunks: the first
    x[3, n - 1] = 9.0  # the last column (in the partial chunk)
    x[4] = 0.5  # all equal: 0
    got = greedy.argmax(x)
    assert got.dtype == torch.int64
    assert got.tolist() == x.argmax(-1).tolist() == [got[0].item(), 5, greedy.CHUNK + 3, n - 1, 0]


def captured(chain):
    """(CUDA graph of chain(), its outputs), compiled on a side stream first (not in the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    return graph, out


@pytest.mark.skipif(not CUDA, reason="programmatic dependent launch needs a GPU of compute capability 9.0+")
def test_pdl_chain_in_a_cuda_graph_matches_torch():
    """Kernels that start before their predecessor ends (pdl.py), captured in a CUDA graph and
    replayed on new inputs: a GEMV -> add+RMSNorm -> GEMV -> SiLU -> GEMV -> argmax chain whose
    every kernel reads the one before it equals the same chain in torch, replay after replay."""
    if not pdl.enabled(DEVICE):
        pytest.skip("PDL is off on this GPU (compute capability < 9.0 or NANOKV_PDL=0)")
    g = torch.Generator().manual_seed(2)
    D, F = 1024, 2816

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE, DTYPE)

    w_in, w_gate_up, w_down, norm = rand(D, D, scale=D**-0.5), rand(2 * F, D, scale=D**-0.5), rand(D, F, scale=F**-0.5), rand(D)
    x = torch.empty(1, D, device=DEVICE, dtype=DTYPE)
    tile = matmul.ONE_ROW_TILES[0]

    def chain():
        h = gemv.gemv(x, w_in, None, tile)
        total, normed = elementwise.add_rms_norm(h, x, norm, 1e-6)
        gate, up = gemv.gemv(normed, w_gate_up, None, tile).chunk(2, dim=-1)
        out = gemv.gemv(elementwise.silu_mul(gate, up), w_down, None, tile) + total
        return out, greedy.argmax(out)

    def torch_chain():
        h = (x.float() @ w_in.float().T).to(DTYPE)
        total, normed = reference.add_rms_norm(h, x, norm, 1e-6)
        gate, up = (normed.float() @ w_gate_up.float().T).to(DTYPE).chunk(2, dim=-1)
        return (reference.silu_mul(gate, up).float() @ w_down.float().T).to(DTYPE) + total

    x.copy_(rand(1, D))
    graph, (out, index) = captured(chain)
    for _ in range(20):
        x.copy_(rand(1, D))
        graph.replay()
        expect = torch_chain()
        assert (out.float() - expect.float()).abs().max() < 2e-2 * expect.float().abs().max()
        assert index.item() == out.argmax(-1).item()


@pytest.mark.skipif(not CUDA, reason="programmatic dependent launch needs a GPU of compute capability 9.0+")
@pytest.mark.parametrize("gluon", [False, True])
def test_pdl_attention_chain_in_a_cuda_graph_matches_torch(gluon):
    """The attention's part of a decode step as the engine runs it at batch 1, with PDL, in a CUDA
    graph replayed on new inputs: qkv GEMV -> rope_store (which releases the split kernel before its
    own wait) -> Kitty's split kernel (Triton or Gluon) -> merge (which releases the next GEMV
    before its wait) -> o GEMV. It equals torch's projections, reference.rope_store and
    reference.decode_attention, replay after replay, so no kernel read what its predecessor had
    not written yet."""
    if not pdl.enabled(DEVICE):
        pytest.skip("PDL is off on this GPU (compute capability < 9.0 or NANOKV_PDL=0)")
    g = torch.Generator().manual_seed(7)
    H, group, D, dim = 2, 4, 128, 512
    c = make_cache(get_format("kitty"), H, D, [SINK], [40], [77], g)
    tiers = kernels.Tiers(**{name: c[name] for name in kernels.Tiers._fields})
    slots, index = torch.zeros(1, dtype=torch.long, device=DEVICE), torch.full((1,), 76, dtype=torch.int32, device=DEVICE)
    w_qkv = (torch.randn((group + 2) * H * D, dim, generator=g) * dim**-0.5).to(DEVICE, DTYPE)
    w_o = (torch.randn(dim, group * H * D, generator=g) * (group * H * D)**-0.5).to(DEVICE, DTYPE)
    x = torch.empty(1, dim, device=DEVICE, dtype=DTYPE)
    cos, sin = torch.empty(1, D, device=DEVICE, dtype=DTYPE), torch.empty(1, D, device=DEVICE, dtype=DTYPE)
    tile = matmul.ONE_ROW_TILES[0]
    launch = attention.Launch(num_splits=8, gluon=gluon)

    def heads(qkv):  # [1, (group + 2) * H * D] -> q [1, group * H, D], k, v [1, H, D]
        qkv = qkv.view(1, (group + 2) * H, D)
        return qkv[:, :group * H], qkv[:, group * H:(group + 1) * H], qkv[:, (group + 1) * H:]

    def chain():
        q = elementwise.rope_store(*heads(gemv.gemv(x, w_qkv, None, tile)), cos, sin, tiers.recent_k, tiers.recent_v,
                                   slots, index)
        o = attention.decode_attention(q, c["fmt"], tiers, D**-0.5, launch=launch)
        return gemv.gemv(o.view(1, -1), w_o, None, tile)

    def new_inputs():
        x.copy_(torch.randn(1, dim, generator=g))
        angles = torch.rand(1, D // 2, generator=g).repeat(1, 2).to(DEVICE) * 6
        cos.copy_(angles.cos()), sin.copy_(angles.sin())

    def torch_chain():
        recent_k, recent_v = tiers.recent_k.clone(), tiers.recent_v.clone()
        q, k, v = heads((x.float() @ w_qkv.float().T).to(DTYPE))
        q = reference.rope_store(q, k, v, cos, sin, recent_k, recent_v, slots, index)
        o = reference.decode_attention(q, c["fmt"], tiers._replace(recent_k=recent_k, recent_v=recent_v), D**-0.5)
        return (o.view(1, -1).float() @ w_o.float().T).to(DTYPE)

    new_inputs()
    graph, out = captured(chain)
    for _ in range(20):
        new_inputs()
        graph.replay()
        expect = torch_chain()
        assert (out.float() - expect.float()).abs().max() < 2e-2 * expect.float().abs().max()
