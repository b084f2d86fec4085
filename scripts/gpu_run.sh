#!/usr/bin/env bash
# One device call: GPU tests, then benchmarks. Everything lands in one results.tgz under $OUT
# (the device tool returns few files); the markdown tables are printed last.
# usage: scripts/gpu_run.sh [tests] [kernels] [ab] [ncu] [speed] [speed4k] [configs] [capacity] [tp] [tp70b]
# (default: all but ab, ncu, tp and tp70b; the last two need two GPUs: the nvidia-h200-x2 kind)
set -uo pipefail
FINAL=${OUT:-results}; mkdir -p "$FINAL"
LOG=$(mktemp -d)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
stages=${*:-tests kernels speed speed4k configs capacity}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast (KINDS.md)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$LOG/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> "$LOG/gpu.txt"
cat "$LOG/gpu.txt"
run() {  # run NAME SECONDS CMD...: stdout -> NAME.md, stderr -> NAME.err
  local name=$1 secs=$2; shift 2
  echo "== $name: $*" >&2
  timeout "$secs" "$@" > "$LOG/$name.md" 2> "$LOG/$name.err" || echo "!! $name failed (rc $?): $(tail -3 "$LOG/$name.err")"
}
for s in $stages; do
  case $s in
    tests)
      NANOKV_TEST_DEVICE=cuda run tests_engine ${T_TESTS:-300} python3 -m pytest -q tests/test_engine.py -p no:cacheprovider
      run tests_kernels ${T_TESTS:-300} python3 -m pytest -q tests/test_kernels.py -p no:cacheprovider ;;
    kernels)  # the whole table in one process (bench.py syncs before each timing), encode timings included
      run kernels ${T_KERNELS:-300} python3 bench.py kernels --kv ${KERNEL_KV:-fp16,kivi-k2v2,kivi-k4v4,kitty,kitty-pro,kvmix,kvarn,nqkv} \
        --batch ${KERNEL_BATCH:-1,16,64} --ctx ${KERNEL_CTX:-4096,32768} --variants ${KERNEL_VARIANTS:-auto} ${KERNEL_ARGS:-} \
        --json "$LOG/kernels.jsonl" ;;
    ab)  # versions of the attention kernel timed back to back on the same cells, one process each:
      # the tree's own kernels/attention.py first, then each file of AB_FILES (carried with the tree,
      # e.g. a copy kept from `git show REV:kernels/attention.py`: the machine's .git may be older)
      cp kernels/attention.py "$LOG/ab_tree.py"
      for f in "$LOG/ab_tree.py" ${AB_FILES:-}; do
        v=$(basename "$f" .py); cp "$f" kernels/attention.py
        run ab_$v ${T_AB:-90} python3 bench.py kernels --kv ${AB_KV:-fp16,kitty,kivi-k2v2} --batch ${AB_BATCH:-1,16,64} \
          --ctx ${AB_CTX:-32768} --no-encode --json "$LOG/ab_$v.jsonl"
      done
      cp "$LOG/ab_tree.py" kernels/attention.py
      python3 -c "import json, sys
runs = {f.split('/')[-1][3:-6]: {(r['kv'], r['batch'], r['context']): r['ms'] for r in map(json.loads, open(f))} for f in sys.argv[1:]}
print('| kv | batch | context | ' + ' | '.join(f'{v} us' for v in runs) + ' |')
print('|---|---|---|' + '---|' * len(runs))
for k in runs['tree']:
    print(f'| {k[0]} | {k[1]} | {k[2]} | ' + ' | '.join(f'{r[k] * 1e3:.1f}' if r.get(k) else '-' for r in runs.values()) + ' |')" \
        "$LOG"/ab_*.jsonl > "$LOG/ab.md" ;;
    ncu)  # where the attention's page loop stalls: one profiled launch a variant, clocks left alone as
      # METHOD.md asks; the cycles between a warp's instructions by reason, instructions and active cycles
      # (session 16: what showed a version with fewer instructions losing to shared-memory waits)
      for v in ${NCU_VARIANTS:-u4-n4 u4-n4-r168}; do
        run ncu_$v ${T_NCU:-100} ncu --clock-control none -k regex:_split_kernel --launch-skip 3 --launch-count 1 \
          --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,smsp__cycles_active.avg,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active' \
          python3 bench.py kernels --kv ${NCU_KV:-kitty} --batch ${NCU_BATCH:-16} --ctx ${NCU_CTX:-32768} --variants $v --no-encode
      done ;;
    speed)
      run speed ${T_SPEED:-420} python3 bench.py speed --config llama3-8b --kv ${SPEED_KV:-fp16,kivi-k2v2,kitty} --batch ${SPEED_BATCH:-1,16} \
        --prompt 512 --new 128 --vs-hf ${SPEED_ARGS:-} --json "$LOG/speed.jsonl" --plot "$FINAL/speed.png" ;;
    speed4k)
      run speed4k ${T_SPEED:-420} python3 bench.py speed --config llama3-8b --kv ${SPEED4K_KV:-fp16,kitty} --batch 32 \
        --prompt 4096 --new 128 --vs-hf --json "$LOG/speed4k.jsonl" ;;
    configs)  # the other built-in shapes, without HF
      for c in qwen3-8b mistral-7b opt-6.7b; do
        run speed_$c ${T_SPEED:-420} python3 bench.py speed --config $c --kv ${CONFIGS_KV:-fp16,kitty} --batch 1,16 \
          --prompt 512 --new 128 --json "$LOG/speed_$c.jsonl"
      done ;;
    tp)  # tensor parallelism on two GPUs: the CPU suite's checks over NCCL with CUDA graphs, then tp 1 vs 2
      NANOKV_TEST_DEVICE=cuda run tests_tp ${T_TESTS:-300} python3 -m pytest -q tests/test_tp.py -k "not gguf_slices" -p no:cacheprovider
      # bf16, the engine's default dtype on CUDA
      run speed_tp1 ${T_SPEED:-420} python3 bench.py speed --config llama3-8b --kv ${TP_KV:-fp16,kitty} --batch 1,16 \
        --prompt 512 --new 128 --dtype bfloat16 --json "$LOG/speed_tp.jsonl"
      run speed_tp2 ${T_SPEED:-420} torchrun --nproc-per-node 2 bench.py speed --config llama3-8b --kv ${TP_KV:-fp16,kitty} \
        --batch 1,16 --prompt 512 --new 128 --dtype bfloat16 --tp 2 --json "$LOG/speed_tp.jsonl" ;;
    tp70b)  # a Llama-3-70B shape split over two H200s: sequences at 8k and decode there
      run capacity_70b ${T_SPEED:-540} torchrun --nproc-per-node 2 bench.py capacity --config llama3-70b --tp 2 --dtype bfloat16 \
        --budget-gb ${CAP70_GB:-50} --ctx 8192 --new 32 --kv ${TP_KV:-fp16,kitty} --json "$LOG/capacity_70b.jsonl" ;;
    capacity)
      run capacity 300 python3 bench.py capacity --config llama3-8b --budget-gb ${CAP_GB:-54} --ctx 8192 --new 32 \
        --kv ${CAP_KV:-fp16,kivi-k2v2,kitty,kitty-pro} --json "$LOG/capacity.jsonl" --plot "$FINAL/capacity.png" ;;
  esac
done
tar czf "$FINAL/results.tgz" -C "$LOG" .
echo "== summary"
for f in "$LOG"/*.md; do echo "# $(basename "$f")"; grep -v '^$' "$f" | tail -60; done
