"""One markdown table of nanokv beside llama.cpp on the same GPU and model shape, from the raw
outputs that scripts/vs_llamacpp.sh collects:

  --llama-bench FILE     llama-bench -o json (a JSON list; a file cut short by a crash still reads)
  --batched-bench KV=FILE  llama-batched-bench stdout (its markdown table, or --output-format jsonl)
  --nanokv FILE          bench.py speed --json rows (JSON lines)

Workloads, each compared at the same positions in the sequence:
  batch 1, PROMPT-token prompt: llama-bench tg NEW @ depth PROMPT (prefill: pp PROMPT), and
      batched-bench's B=1 row; nanokv --batch 1 --prompt PROMPT
  batch 1, DEPTH tokens of context: llama-bench tg NEW @ depth DEPTH; nanokv --batch 1 --prompt DEPTH
  batch B>1: batched-bench's S_TG t/s at B (each sequence its own PROMPT-token prompt);
      nanokv --batch B --prompt PROMPT
Ratios: a row's decode tok/s / llama.cpp's f16 KV decode tok/s in the same workload (and / the
fastest llama.cpp KV type there). llama-bench's tg excludes the prompt; bench.py's decode_tok_s
is decode tokens over the time after prefill: the two are comparable.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

BATCHED_COLUMNS = ["pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed"]


def parse_llama_bench(text: str) -> list[dict]:
    """llama-bench -o json output: '[ {..}, {..} ]'. A run killed midway leaves '[ {..},' or a
    half-written object: keep every complete object."""
    text = text.strip()
    if not text:
        return []
    try:
        rows = json.loads(text)
        return rows if isinstance(rows, list) else [rows]
    except json.JSONDecodeError:
        pass
    rows, dec, i = [], json.JSONDecoder(), text.find("{")
    while i != -1:
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        if isinstance(obj, dict):
            rows.append(obj)
        i = text.find("{", end)
    return rows


def parse_batched_bench(text: str) -> list[dict]:
    """llama-batched-bench results: markdown rows '|   512 |    128 |    1 |    640 | ...' (the
    default) or JSON lines (--output-format jsonl), with the run's settings line if present."""
    rows, settings = [], {}
    m = re.search(r"n_kv_max = (\d+), n_batch = (\d+), n_ubatch = (\d+), flash_attn = (-?\d+)", text)
    if m:
        settings = dict(zip(["n_kv_max", "n_batch", "n_ubatch", "flash_attn"], map(int, m.groups())))
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "speed_tg" in obj:
                rows.append(obj)
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) != len(BATCHED_COLUMNS):
                continue
            try:
                vals = [float(c) for c in cells]
            except ValueError:  # the header and the separator line
                continue
            row = dict(zip(BATCHED_COLUMNS, vals))
            for k in ("pp", "tg", "pl", "n_kv"):
                row[k] = int(row[k])
            rows.append({**settings, **row})
    return rows


def read_jsonl(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def _kv_name(t: str) -> str:
    return t.lower()


def build_rows(llama: list[dict], batched: dict[str, list[dict]], nanokv: list[dict],
               prompt: int, new: int, depth: int) -> list[dict]:
    """The table's rows: one per (workload, engine, KV type)."""
    out = []

    def lb(kind: str, n_depth: int, kv: str | None = None) -> list[dict]:
        """llama-bench rows of one test: 'tg' (n_gen = new) or 'pp' (n_prompt = prompt) at n_depth."""
        n_prompt, n_gen = (0, new) if kind == "tg" else (prompt, 0)
        return [r for r in llama if r.get("n_prompt", 0) == n_prompt and r.get("n_gen", 0) == n_gen
                and r.get("n_depth", 0) == n_depth and (kv is None or _kv_name(r.get("type_k", "")) == kv)]

    def nk(batch: int, p: int) -> list[dict]:
        return [r for r in nanokv if r.get("bench", "speed") == "speed" and r.get("batch") == batch
                and r.get("prompt") == p and r.get("new", new) == new]

    def add(workload, engine, kv, decode, prefill=None, extra=None):
        out.append(dict(workload=workload, engine=engine, kv=kv, decode_tok_s=decode, prefill_tok_s=prefill, **(extra or {})))

    workloads = [(1, prompt, f"batch 1, prompt {prompt}, +{new}")]
    if depth and depth != prompt:
        workloads.append((1, depth, f"batch 1, context {depth}, +{new}"))
    batches = sorted({r["pl"] for rows in batched.values() for r in rows if r["pl"] > 1}
                     | {r["batch"] for r in nanokv if r.get("batch", 1) > 1 and r.get("prompt") == prompt})
    workloads += [(b, prompt, f"batch {b}, prompt {prompt}, +{new}") for b in batches]

    for batch, ctx, name in workloads:
        if batch == 1:  # llama-bench: tg at the depth where nanokv's decode starts
            seen = []
            for r in lb("tg", ctx):
                kv = _kv_name(r.get("type_k", "?"))
                if kv in seen:
                    continue
                seen.append(kv)
                pp = lb("pp", 0, kv) if ctx == prompt else []
                add(name, "llama.cpp llama-bench", kv, r.get("avg_ts"), pp[0].get("avg_ts") if pp else None,
                    dict(decode_std=r.get("stddev_ts"), source=f"tg{new} @ d{ctx}"))
        if ctx == prompt:  # batched-bench rows at this batch size
            for kv, rows in batched.items():
                for r in rows:
                    if r["pl"] == batch and r["pp"] == prompt and r["tg"] == new:
                        add(name, "llama.cpp batched-bench", _kv_name(kv), r["speed_tg"], r["speed_pp"],
                            dict(source=f"S_TG, B={batch}"))
                        break
        for r in nk(batch, ctx):
            prefill = batch * ctx / r["prefill_s"] if r.get("prefill_s") else None
            add(name, "nanokv", r.get("method"), r.get("decode_tok_s"), prefill,
                dict(step_ms=r.get("step_ms"), source="bench.py speed"))

    # ratios within a workload: against llama.cpp f16 KV (llama-bench first at batch 1) and the fastest llama.cpp row
    for name in dict.fromkeys(r["workload"] for r in out):
        rows = [r for r in out if r["workload"] == name]
        peers = [r for r in rows if r["engine"].startswith("llama.cpp") and r["decode_tok_s"]]
        base = next((r for r in peers if r["kv"] == "f16"), None)
        best = max(peers, key=lambda r: r["decode_tok_s"], default=None)
        for r in rows:
            if r["decode_tok_s"]:
                r["vs_llamacpp_f16"] = r["decode_tok_s"] / base["decode_tok_s"] if base else None
                r["vs_llamacpp_best"] = r["decode_tok_s"] / best["decode_tok_s"] if best else None
                r["best_llamacpp_kv"] = best["kv"] if best else None
    return out


def _f(x, digits=1) -> str:
    if x is None:
        return ""
    return f"{x:.{digits}f}"


def markdown(rows: list[dict], header: list[str]) -> str:
    lines = [*header, "",
             "| workload | engine | KV | decode tok/s | ÷ llama.cpp f16 | ÷ best llama.cpp | prefill tok/s | measured |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        best = f"{_f(r.get('vs_llamacpp_best'), 2)}" + (f" ({r['best_llamacpp_kv']})" if r.get("vs_llamacpp_best") else "")
        lines.append(f"| {r['workload']} | {r['engine']} | {r['kv']} | {_f(r['decode_tok_s'])} | "
                     f"{_f(r.get('vs_llamacpp_f16'), 2)} | {best} | {_f(r.get('prefill_tok_s'), 0)} | {r.get('source', '')} |")
    if not rows:
        lines.append("| (no results) | | | | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", action="append", default=[], metavar="FILE")
    ap.add_argument("--batched-bench", action="append", default=[], metavar="KV=FILE")
    ap.add_argument("--nanokv", action="append", default=[], metavar="FILE")
    ap.add_argument("--gpu", default="", help="the GPU, as nvidia-smi names it")
    ap.add_argument("--config", default="llama3-8b")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--depth", type=int, default=32000)
    ap.add_argument("--source", default=None, help="PEERS_SOURCE file of the llama.cpp tarball")
    ap.add_argument("--md", default=None, help="also write the table here")
    ap.add_argument("--json", default=None, help="write the table's rows and every parsed raw row here")
    a = ap.parse_args(argv)

    def read(path):
        try:
            return Path(path).read_text(errors="replace")
        except OSError as e:
            print(f"warning: {e}", file=sys.stderr)
            return ""

    llama = [r for f in a.llama_bench for r in parse_llama_bench(read(f))]
    batched = {}
    for spec in a.batched_bench:
        kv, _, path = spec.partition("=") if "=" in spec else ("f16", "", spec)
        batched[kv] = parse_batched_bench(read(path))
    nanokv = [r for f in a.nanokv for r in read_jsonl(read(f))]
    rows = build_rows(llama, batched, nanokv, a.prompt, a.new, a.depth)

    source = {}
    if a.source:
        for line in read(a.source).splitlines():
            k, _, v = line.partition("=")
            if v:
                source[k.strip()] = v.strip()
    commit = source.get("llama_cpp_commit", "")[:7] or next((r.get("build_commit") for r in llama), "?")
    lb = llama[0] if llama else {}
    gpus = {g for g in [a.gpu.split(",")[0].strip() or None, lb.get("gpu_info") or None,
                        *(r.get("device") for r in nanokv)] if g}
    header = [f"## nanokv vs llama.cpp: {a.config} shape, F16 weights (random), same GPU",
              "",
              f"GPU: {a.gpu or ', '.join(sorted(gpus)) or 'unknown'}",
              f"llama.cpp: {source.get('source', 'llama-cpp-python vendored llama.cpp')} (commit {commit}, "
              f"ggml {source.get('ggml_version', '?')}), backend {'/'.join(sorted({r.get('backends', '?') for r in llama})) or '?'}, "
              "-ngl 99, flash attention on, KV type via -ctk/-ctv"
              + (f", {len(lb.get('samples_ts', []))} repetitions" if lb else ""),
              "nanokv: bench.py speed --config " + a.config + " (decode_tok_s; prefill = batch x prompt / prefill_s)"]
    if len(gpus) > 1:
        header.append(f"WARNING: the outputs name different GPUs: {', '.join(sorted(gpus))}")
    missing = [n for n, v in [("llama-bench", llama), ("batched-bench", any(batched.values())), ("nanokv", nanokv)] if not v]
    if missing:
        header.append(f"missing (failed or skipped): {', '.join(missing)}")
    md = markdown(rows, header)
    print(md)
    if a.md:
        Path(a.md).write_text(md + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(gpu=a.gpu, config=a.config, prompt=a.prompt, new=a.new, depth=a.depth,
                                                source=source, table=rows, llama_bench=llama, batched_bench=batched,
                                                nanokv=nanokv), indent=1) + "\n")


if __name__ == "__main__":
    main()
