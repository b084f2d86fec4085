"""Kernel timings for `python bench.py kernels` (GPU only): decode attention, SDPA, encode, copy.

Each function builds its inputs on the GPU, times one call with CUDA events (the median of
triton.testing.do_bench; the attention also inside a CUDA graph, which hides Python launch
overhead the way the engine's decode loop would) and returns a dict of plain numbers.
Bytes are what a call must move at least: every stored byte of the pages it reads (codes,
scales, ids), the FP16 tiers, q and the output. The pages of every batch row are distinct
pool pages, and the attention is timed over a ring of input sets larger than L2 (ring_size),
so nothing is served from L2 that a real cache would read from HBM.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

import quant
from config import EngineConfig
from kernels import Tiers, attention, quantize
from kvcache.tiers import Window, tier_counts
from quant import PAGE_TOKENS


def copy_bandwidth(device: torch.device | str = "cuda", nbytes: int = 2 << 30) -> float:
    """Device copy bandwidth in bytes/s, counting the read and the write: the ceiling a kernel's
    achieved bandwidth is judged against."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def _pool(codec, n_pages: int, heads: int, head_dim: int, device, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """n_pages distinct pages: 64 really encoded random tiles, copied round the pool."""
    base = codec.encode(torch.randn(min(64, n_pages), heads, PAGE_TOKENS, head_dim, device=device, generator=gen))
    reps = -(-n_pages // base[next(iter(base))].shape[0])
    return {n: f.repeat(reps, *[1] * (f.dim() - 1))[:n_pages].contiguous() for n, f in base.items()}


def attention_inputs(kv: str, batch: int, context: int, q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                     sink: int = EngineConfig.sink, window: int = EngineConfig.window, device="cuda",
                     seed: int = 0) -> tuple[tuple, int]:
    """Positional arguments of decode_attention (q, fmt, tiers, scale) for `batch` rows of
    `context` tokens, and the bytes a call moves. The format's own sink overrides `sink`."""
    gen = torch.Generator(device).manual_seed(seed)
    preset = quant.get_format(kv)
    fmt = preset.for_layer(0)
    n_sink, n_pages, n_recent = tier_counts(context, preset.sink_tokens(sink), Window(window))
    total = max(1, batch * n_pages)
    k_pages = _pool(fmt.k, total, kv_heads, head_dim, device, gen)
    v_pages = _pool(fmt.v, total, kv_heads, head_dim, device, gen)
    table = torch.randperm(total, device=device, generator=gen)[: batch * n_pages].view(batch, n_pages).int()
    i32 = dict(dtype=torch.int32, device=device)

    def dense(n: int) -> torch.Tensor:
        return torch.randn(batch, kv_heads, max(n, 1), head_dim, device=device, generator=gen).half()

    q = torch.randn(batch, q_heads, head_dim, device=device, generator=gen).half()
    tiers = Tiers(dense(n_sink), dense(n_sink), torch.full((batch,), n_sink, **i32),
                  k_pages, v_pages, table, torch.full((batch,), n_pages, **i32),
                  dense(n_recent), dense(n_recent), torch.full((batch,), n_recent, **i32))
    args = (q, fmt, tiers, head_dim**-0.5)
    nbytes = (batch * n_pages * fmt.page_bytes(kv_heads, head_dim)  # pages, every field
              + batch * (n_sink + n_recent) * kv_heads * head_dim * 2 * 2  # FP16 sink + recent, K and V
              + table.numel() * 4 + 2 * q.numel() * 2)  # page table, q in, o out
    # do_bench_cudagraph times on a stream of its own, which does not wait for this one: without
    # the sync its first call could read a page table not written yet (stale ids, an illegal
    # address some cells later: the old "fault after the batch-16 x 4k cells")
    if q.is_cuda:
        torch.cuda.synchronize(device)
    return args, nbytes


# Kernel variants timed side by side: "auto" (the default launch rule) or a compact launch spec,
# dash-separated fields of attention.Launch: w<num_warps> s<step> p<num_stages> n<block_n>
# k<num_splits> m<programs_per_sm> g<min_pages per split> t<recent_parts> r<maxnreg>
# u<softmax_steps: steps per softmax update> l<page_stages: the page loop's own num_stages, 1 = not
# pipelined>, "noasm" (Triton's integer ops instead of the PTX unpack), "nopf" / "pf" (no L2 prefetch of the next page /
# the prefetch wherever the kernel can issue it, whatever the default rule says)
# and "gl" / "nogl" (the Gluon split kernel wherever it applies / never: attention.Launch.gluon),
# e.g. "w2-s32-p3" or "n8-u1". Every variant is launched without programmatic dependent
# launch (kernels/pdl.py), so that a timed call never overlaps the one before it in the ring.
_FIELDS = {"w": "num_warps", "s": "step", "p": "num_stages", "n": "block_n", "k": "num_splits", "m": "programs_per_sm",
           "g": "min_pages", "t": "recent_parts", "r": "maxnreg", "u": "softmax_steps", "l": "page_stages"}


def variant(spec: str) -> attention.Launch:
    """The Launch of a variant name (see above)."""
    if spec == "auto":
        return attention.Launch(pdl=False)
    fields = {}
    for part in spec.split("-"):
        if part == "noasm":
            fields["asm"] = False
        elif part in ("pf", "nopf"):
            fields["prefetch"] = part == "pf"
        elif part in ("gl", "nogl"):
            fields["gluon"] = part == "gl"
        elif part[:1] in _FIELDS and part[1:].isdigit():
            fields[_FIELDS[part[0]]] = int(part[1:])
        else:
            raise ValueError(f"unknown kernel variant field {part!r} in {spec!r} "
                             f"(fields: {', '.join(_FIELDS)}, noasm, pf, nopf, gl, nogl)")
    return attention.Launch(pdl=False, **fields)


def ring_size(nbytes: int, device: torch.device | str = "cuda") -> int:
    """How many copies of a call's inputs to cycle through so that together they span twice the
    L2 cache: a layer's cache is read once per decode step, after the other layers (and the
    weights) have passed through L2, so a timing that rereads one small input set from L2
    would flatter short contexts and small formats."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if torch.device(device).type == "cuda" else 0
    return max(1, -(-2 * l2 // max(nbytes, 1)))


def bench_attention(kv: str, batch: int, context: int, variants=("auto",), **shape) -> list[dict]:
    """Triton decode attention over the tiers, once per variant (same inputs): ms per call (graph
    and eager), bytes, bytes/s. Each timed call cycles through `ring` input sets (ring_size),
    and the time is per set. A variant that fails (e.g. out of resources) gets an `error`."""
    args, nbytes = attention_inputs(kv, batch, context, **shape)
    ring = [args] + [attention_inputs(kv, batch, context, seed=i, **shape)[0] for i in range(1, ring_size(nbytes))]
    rows = []
    for name in variants:
        launch = variant(name)
        r = {"kv": kv, "variant": name, "batch": batch, "context": context, "bytes": nbytes, "ring": len(ring)}

        def fn():
            for a in ring:
                attention.decode_attention(*a, launch=launch)

        try:
            fn()
            ms = do_bench_cudagraph(fn, return_mode="median") / len(ring)
            r.update(ms=ms, ms_eager=do_bench(fn, return_mode="median") / len(ring), bytes_per_s=nbytes / (ms * 1e-3))
        except Exception as e:  # noqa: BLE001 - report and go on with the other variants
            r.update(ms=None, ms_eager=None, bytes_per_s=None, error=f"{type(e).__name__}: {e}"[:200])
        rows.append(r)
    return rows


def bench_sdpa(batch: int, context: int, q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
               device="cuda") -> dict:
    """torch SDPA of one query over contiguous FP16 K/V [batch, kv_heads, context, head_dim] (GQA)."""
    # The G q heads of a kv head as G queries of one head: the same math as GQA decode, on a
    # plain multi-head SDPA that reads each K/V byte once.
    q = torch.randn(batch, kv_heads, q_heads // kv_heads, head_dim, device=device, dtype=torch.float16)
    k = torch.randn(batch, kv_heads, context, head_dim, device=device, dtype=torch.float16)
    v = torch.randn_like(k)
    fn = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    ms = do_bench(fn, return_mode="median")
    nbytes = 2 * k.numel() * 2 + 2 * q.numel() * 2
    return {"kv": "sdpa", "batch": batch, "context": context, "ms": ms, "bytes": nbytes,
            "bytes_per_s": nbytes / (ms * 1e-3)}


def bench_encode(kv: str, batch: int, kv_heads: int = 8, head_dim: int = 128, device="cuda") -> dict:
    """Encode one 128-token page of K and of V for each of `batch` sequences (one layer, one flush)."""
    fmt = quant.get_format(kv).for_layer(0)
    x = torch.randn(batch, kv_heads, PAGE_TOKENS, head_dim, device=device, dtype=torch.float16)
    pools = [{n: torch.empty((batch, *s), dtype=dt, device=device)
              for n, (s, dt) in codec.field_specs(kv_heads, head_dim).items()} for codec in (fmt.k, fmt.v)]
    ids = torch.arange(batch, dtype=torch.int32, device=device)

    def fn():
        quantize.encode_pages(fmt.k, x, pools[0], ids)
        quantize.encode_pages(fmt.v, x, pools[1], ids)

    fn()
    return {"kv": kv, "batch": batch, "ms_per_flush": do_bench(fn, return_mode="median")}


def kernel_table(kvs=("fp16", "kivi-k2v2", "kivi-k4v4", "kitty", "kitty-pro", "kvmix", "kvarn", "nqkv"), batches=(1, 16, 64),
                 contexts=(4096, 32768), q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                 variants=("auto",), encode: bool = True) -> list[dict]:
    """The kernel table (Llama-3-8B attention shape by default): every (kv, variant, batch, context)
    with its share of copy bandwidth and its speedup over our FP16 paged kernel (kvs must start
    with fp16 for that; vs_fp16 compares with fp16 under the same variant) and over SDPA; then
    the encode cost per flush of every kv and batch. variants: launch specs (see `variant`), all
    timed on the same inputs."""
    shape = dict(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim)
    copy = copy_bandwidth()
    rows = []
    for kv in kvs if encode else ():
        for batch in batches:
            rows.append({**bench_encode(kv, batch, kv_heads, head_dim), "copy_bytes_per_s": copy})
            print(rows[-1], file=sys.stderr, flush=True)  # partial results survive a later failure
    for batch in batches:
        for context in contexts:
            sdpa = bench_sdpa(batch, context, **shape)
            fp16 = {}
            for kv in kvs:
                for r in bench_attention(kv, batch, context, variants, **shape):
                    if kv == "fp16":
                        fp16[r["variant"]] = r
                    base = fp16.get(r["variant"], {}).get("ms")
                    ok = r["ms"] is not None
                    r.update(copy_fraction=r["bytes_per_s"] / copy if ok else None,
                             vs_sdpa=sdpa["ms"] / r["ms"] if ok else None,
                             vs_fp16=base / r["ms"] if ok and base else None, sdpa_ms=sdpa["ms"])
                    rows.append(r)
                    print(r, file=sys.stderr, flush=True)
                torch.cuda.empty_cache()
    return rows
