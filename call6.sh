#!/usr/bin/env bash
# session 22 call 6: GPU tests + memcheck on a72b8e0, the full kernel table in one process, batch 1 / 4 prefetch A/B
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
T="python3 -m pytest -q -p no:cacheprovider"
timeout 300 $T tests/test_kernels.py -k "triton_attention or page_loop_pipelined or prefetched" > $OUT/t_attn.log 2>&1 &
timeout 300 $T tests/test_kernels.py -k "encode or split_count or default_splits" > $OUT/t_enc.log 2>&1 &
timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 $T tests/test_kernels.py -k "(triton_attention and (kitty or kivi-k2v2 or kvarn or nqkv)) or split_count or encode" > $OUT/t_mem.log 2>&1 &
NANOKV_TEST_DEVICE=cuda timeout 300 $T tests/test_engine.py -k "match_hf or triton_kernels or batched_equals or pages_run_out" > $OUT/t_eng.log 2>&1 &
timeout 300 $T tests/test_kernels.py -k "tile_options or fp16_page or end_to_end or gemv or linear or rope or elementwise or argmax or pdl or unpack or nf4_asm" > $OUT/t_misc.log 2>&1 &
wait
for f in t_attn t_enc t_mem t_eng t_misc; do echo "$f: $(tail -1 $OUT/$f.log) $(grep -c 'ERROR SUMMARY: 0 errors' $OUT/$f.log)"; grep -E "FAILED|ERROR SUMMARY: [1-9]|SKIPPED" $OUT/$f.log | head -5; done
timeout 280 python3 bench.py kernels --kv fp16,kivi-k2v2,kivi-k4v4,kitty,kitty-pro,kvmix,kvarn,nqkv --batch 1,16,64 --ctx 4096,32768 --no-encode --json $OUT/table.jsonl > $OUT/table.log 2>&1 || echo "table failed: $(tail -3 $OUT/table.log)"
timeout 150 python3 bench.py kernels --kv fp16,kitty,kitty-pro,kivi-k2v2,kvarn --batch 1,4 --ctx 32768 --no-encode --variants auto,nopf,auto --json $OUT/ab.jsonl > $OUT/ab.log 2>&1 || echo "ab failed: $(tail -3 $OUT/ab.log)"
python3 - <<'PY'
import json, os, collections
out = os.environ["OUT"]
rows = [json.loads(l) for l in open(f"{out}/table.jsonl")]
fp = {(r["batch"], r["context"]): r["ms"] for r in rows if r["kv"] == "fp16"}
print("| kv | batch | 4k us | 32k us | 32k x fp16 | 32k bw |")
by = collections.defaultdict(dict)
for r in rows: by[(r["kv"], r["batch"])][r["context"]] = r
for (kv, b), c in by.items():
    a, z = c.get(4096), c.get(32768)
    print(f"| {kv} | {b} | {a['ms']*1e3:.1f} | {z['ms']*1e3:.1f} | {fp[(b, 32768)]/z['ms']:.2f} | {100*z['copy_fraction']:.1f}% |")
t = collections.defaultdict(list)
for r in map(json.loads, open(f"{out}/ab.jsonl")):
    t[(r["kv"], r["batch"])].append(f"{r['variant']} {r['ms']*1e3:.1f}")
for k, v in t.items(): print(k, v)
PY
