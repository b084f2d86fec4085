#!/usr/bin/env bash
# One device call: GPU tests, then benchmarks; logs and JSON to $OUT (or ./results), tables last.
# usage: scripts/gpu_run.sh [tests] [kernels] [speed] [capacity]   (default: all)
set -uo pipefail
FINAL=${OUT:-results}; OUT=$(mktemp -d); mkdir -p "$FINAL"  # work here, pack into $FINAL at the end (the device tool returns few files)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
stages=${*:-tests kernels speed capacity}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
for s in $stages; do
  case $s in
    tests)
      NANOKV_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -x tests/test_engine.py -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/tests_engine.txt"
      timeout 240 python3 -m pytest -q tests/test_kernels.py -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/tests_kernels.txt" ;;
    kernels)
      timeout 300 python3 bench.py kernels --kv fp16,kivi-k2v2,kitty,kitty-pro,kvarn,nqkv --batch 1,16,64 --ctx 4096,32768 \
        --json "$OUT/kernels.jsonl" 2>"$OUT/kernels.err" | tee "$OUT/kernels.md" ;;
    speed)
      t=${SPEED_TAG:-}
      timeout 400 python3 bench.py speed --config llama3-8b --kv ${SPEED_KV:-fp16,kitty} --batch ${SPEED_BATCH:-1,16} \
        --prompt ${SPEED_PROMPT:-512} --new 128 ${SPEED_ARGS:---vs-hf} --json "$OUT/speed$t.jsonl" --plot "$OUT/speed$t.png" \
        2>"$OUT/speed$t.err" | tee "$OUT/speed$t.md"; tail -3 "$OUT/speed$t.err" ;;
    capacity)
      timeout 300 python3 bench.py capacity --config llama3-8b --budget-gb ${CAP_GB:-54} --ctx 8192 --new 32 \
        --kv ${CAP_KV:-fp16,kivi-k2v2,kitty,kitty-pro} --json "$OUT/capacity.jsonl" --plot "$OUT/capacity.png" \
        2>"$OUT/capacity.err" | tee "$OUT/capacity.md"; tail -3 "$OUT/capacity.err" ;;
  esac
done
echo "== summary"; for f in "$OUT"/*.md "$OUT"/tests_*.txt; do [ -f "$f" ] && { echo "# $(basename "$f")"; cat "$f"; }; done
tar czf "$FINAL/results.tgz" -C "$OUT" . && cp "$OUT"/*.png "$FINAL"/ 2>/dev/null; true
