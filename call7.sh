#!/usr/bin/env bash
# session 22 call 7: the engine at batch 1 / 32000 (Llama-3-8B shape), with PDL and without
export PYTHONUNBUFFERED=1
timeout 330 python3 bench.py speed --config llama3-8b --kv fp16,kitty,kvarn --batch 1 --prompt 32000 --new 128 --profile 6 --json $OUT/speed.jsonl > $OUT/speed.log 2> $OUT/speed.err || echo "speed failed: $(tail -3 $OUT/speed.err)"
NANOKV_PDL=0 timeout 240 python3 bench.py speed --config llama3-8b --kv fp16,kitty --batch 1 --prompt 32000 --new 128 --profile 6 --json $OUT/speed_nopdl.jsonl > $OUT/speed_nopdl.log 2> $OUT/speed_nopdl.err || echo "nopdl failed: $(tail -3 $OUT/speed_nopdl.err)"
tail -8 $OUT/speed.log; tail -6 $OUT/speed_nopdl.log
