#!/usr/bin/env bash
# nanokv beside llama.cpp on the same GPU, the same model shape and the same workloads.
#
#   scripts/vs_llamacpp.sh prepare              where pip works: the pinned llama.cpp source (trimmed,
#                                               gzipped) and the gguf wheel into .peers/dist/ (~4 MB)
#   scripts/vs_llamacpp.sh [run] [STAGE ...]    on the GPU machine (no network needed); default stages:
#                                               build gguf llama nanokv table
#
# Stages (also settable as STAGES="..."; each has a timeout and logs to files, and a failing one
# does not stop the others):
#   build          llama-bench + llama-batched-bench from .peers/dist/llama.cpp-VER.tar.gz into
#                  .peers/build (~4 min on 16 cores; skipped when that tarball's build is already there)
#   gguf           random-weight F16 GGUF of bench.py's --config shape (.peers/models, cached by size);
#                  runs alongside the build when both are asked for
#   llama          = llama-bench (-p PROMPT -n NEW -d 0,PROMPT,DEPTH, one call per KV type)
#                    + llama-batched-bench (-npp PROMPT -ntg NEW -npl 1,16)
#   llama-bench, batched-bench   one of the two alone
#   nanokv         bench.py speed on the same shapes (--kv NANOKV_KV)
#   table          one markdown table, both engines and the ratios (scripts/peers_table.py)
#
# Output: $OUT (or results/): vs_llamacpp.md (the table), vs_llamacpp.json (every parsed row, both
# engines), vs_llamacpp_raw.tgz (raw JSON/markdown outputs and logs of every command).
#
# Knobs (environment): CONFIG=llama3-8b  KV_TYPES="f16 q8_0 q4_0"  PROMPT=512  NEW=128  DEPTH=32000
#   REPS=2  BATCHED_KV=f16  BATCHED_NPL=1,16  BATCHED_CTX=12288  NANOKV_KV=fp16,kitty
#   NANOKV_SHAPES="1,16:PROMPT 1:DEPTH" (batches:prompt per bench.py process)  CUDA_ARCH (from nvidia-smi)
#   LLAMA_CUDA=ON  JOBS=$(nproc)  BUDGET_S=540 (whole run; stage timeouts are cut to what is left)
#   T_BUILD=420 T_GGUF=300 T_LLAMA=180 (each llama-bench call) T_BATCHED=150 T_NANOKV=300 (each call)
#   GGUF_ARGS (extra make_gguf.py arguments, e.g. a tiny shape for a CPU smoke test)  PEERS=.peers
#
# On this project's GPU machine (the device tool): carry [".peers/dist"] only -- not ".peers", which
# would replace the machine's .peers/build and .peers/models (the caches a warm machine keeps) -- and
# give the command timeout_s 600:   scripts/vs_llamacpp.sh
# CPU smoke test of the whole chain on a tiny shape (no GPU, nanokv stage left out):
#   LLAMA_CUDA=OFF GGUF=/tmp/tiny.gguf GGUF_ARGS="--layers 2 --hidden 256 --ffn 512 --heads 4 --kv-heads 2
#   --vocab 1000" PROMPT=32 NEW=16 DEPTH=256 BATCHED_CTX=1024 scripts/vs_llamacpp.sh build gguf llama table
set -uo pipefail
cd "$(dirname "$0")/.."

LLAMA_CPP_PY_VERSION=${LLAMA_CPP_PY_VERSION:-0.3.36}
GGUF_SPEC=${GGUF_SPEC:-gguf==0.19.0}
PEERS=${PEERS:-.peers}
DIST=$PEERS/dist  # what travels (carry it); everything else under $PEERS is made on the GPU machine
TARBALL=$DIST/llama.cpp-$LLAMA_CPP_PY_VERSION.tar.gz
PY=${PYTHON:-python3}

# ---- prepare (where pip works) ------------------------------------------------------------------

# What llama-bench and llama-batched-bench need from vendor/llama.cpp (the rest of the 77 MB sdist
# is other tools, tests, backends and models).
KEEP=(CMakeLists.txt cmake include src common vendor licenses LICENSE
      ggml/CMakeLists.txt ggml/cmake ggml/include ggml/src/CMakeLists.txt ggml/src/ggml-version.h.in
      ggml/src/ggml-cpu ggml/src/ggml-cuda tools/llama-bench tools/batched-bench)

prepare() {
  set -e
  mkdir -p "$DIST"
  local tmp; tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  echo "== pip download llama-cpp-python==$LLAMA_CPP_PY_VERSION (sdist)"
  "$PY" -m pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$LLAMA_CPP_PY_VERSION"
  local sdist; sdist=$(ls "$tmp"/llama_cpp_python-*.tar.gz)
  tar xzf "$sdist" -C "$tmp"
  local top="$tmp/llama_cpp_python-$LLAMA_CPP_PY_VERSION" name="llama.cpp-$LLAMA_CPP_PY_VERSION"
  local src="$top/vendor/llama.cpp" stage="$tmp/stage/$name"
  mkdir -p "$stage"
  (cd "$src" && cp -a --parents "${KEEP[@]}" ggml/src/*.c ggml/src/*.cpp ggml/src/*.h "$stage/")
  mkdir -p "$stage/tools"
  cat > "$stage/tools/CMakeLists.txt" <<'EOF'
# trimmed by nanokv scripts/vs_llamacpp.sh prepare: only the two benchmark tools
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(batched-bench)
add_subdirectory(llama-bench)
EOF
  local commit ggml_version
  commit=$(cat "$top/.git/modules/vendor/llama.cpp/HEAD" 2>/dev/null || echo unknown)
  ggml_version=$(sed -n 's/^set(GGML_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\))$/\2/p' "$src/ggml/CMakeLists.txt" | paste -sd.)
  cat > "$stage/PEERS_SOURCE" <<EOF
source=llama-cpp-python==$LLAMA_CPP_PY_VERSION sdist, vendor/llama.cpp
sdist_sha256=$(sha256sum "$sdist" | cut -d' ' -f1)
llama_cpp_commit=$commit
ggml_version=$ggml_version
EOF
  tar czf "$TARBALL.tmp" -C "$tmp/stage" "$name" && mv "$TARBALL.tmp" "$TARBALL"
  echo "== pip download $GGUF_SPEC (wheel)"
  rm -f "$DIST"/gguf-*.whl
  "$PY" -m pip download -q --no-deps --only-binary :all: -d "$DIST" "$GGUF_SPEC"
  cat "$stage/PEERS_SOURCE"
  ls -l "$DIST"
  du -sh "$DIST"
}

if [ "${1:-}" = prepare ]; then
  prepare
  exit
fi
[ "${1:-}" = run ] && shift

# ---- run (the GPU machine) ----------------------------------------------------------------------

STAGES=${*:-${STAGES:-build gguf llama nanokv table}}
CONFIG=${CONFIG:-llama3-8b}
KV_TYPES=${KV_TYPES:-f16 q8_0 q4_0}
PROMPT=${PROMPT:-512}
NEW=${NEW:-128}
DEPTH=${DEPTH:-32000}
REPS=${REPS:-2}
BATCHED_KV=${BATCHED_KV:-f16}
BATCHED_NPL=${BATCHED_NPL:-1,16}
BATCHED_CTX=${BATCHED_CTX:-12288}
NANOKV_KV=${NANOKV_KV:-fp16,kitty}
NANOKV_SHAPES=${NANOKV_SHAPES:-1,16:$PROMPT 1:$DEPTH}
LLAMA_CUDA=${LLAMA_CUDA:-ON}
JOBS=${JOBS:-$(nproc)}
BUDGET_S=${BUDGET_S:-540}
GGUF_ARGS=${GGUF_ARGS:-}
FINAL=${OUT:-results}
mkdir -p "$FINAL"
W=$(mktemp -d)  # every raw output and log; tarred into $FINAL at the end
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
START=$SECONDS

has() { [[ " $STAGES " == *" $1 "* ]]; }
left() { echo $((BUDGET_S - (SECONDS - START))); }
run() {  # run NAME SECONDS CMD...: stdout -> W/NAME.out, stderr -> W/NAME.err; the timeout is cut to the budget
  local name=$1 secs=$2 l; shift 2
  l=$(( $(left) - 15 ))
  if [ "$l" -lt 20 ]; then echo "!! $name skipped: the ${BUDGET_S}s budget is spent"; return 1; fi
  [ "$secs" -gt "$l" ] && secs=$l
  echo "== $name (<= ${secs}s, at $((SECONDS - START))s): $*"
  local t0=$SECONDS rc=0
  timeout -k 10 "$secs" "$@" > "$W/$name.out" 2> "$W/$name.err" || rc=$?
  if [ $rc -ne 0 ]; then
    echo "!! $name failed (rc $rc$([ $rc -eq 124 ] && echo ", timed out")) after $((SECONDS - t0))s: $(tail -3 "$W/$name.err" | tr '\n' ' ')"
  else
    echo "   $name done in $((SECONDS - t0))s"
  fi
  return $rc
}

finish() {
  trap - EXIT INT TERM
  echo "== stages took $((SECONDS - START))s"
  tar czf "$FINAL/vs_llamacpp_raw.tgz" -C "$W" . 2>/dev/null
  rm -rf "$W"
}
trap finish EXIT
trap 'echo "!! interrupted"; exit 130' INT TERM

# the GPU, named in the table
{ nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>/dev/null \
    || echo "no nvidia-smi"; } > "$W/gpu.txt"
GPU=$(head -1 "$W/gpu.txt")
echo "GPU: $GPU   stages: $STAGES   config: $CONFIG"

NAME=$(basename "$CONFIG" .json)
GGUF=${GGUF:-$PEERS/models/$NAME-f16.gguf}
SRC=$PEERS/src/llama.cpp-$LLAMA_CPP_PY_VERSION
BUILD=$PEERS/build
BIN=$BUILD/bin

build() {
  if [ ! -f "$TARBALL" ]; then echo "no $TARBALL: run 'scripts/vs_llamacpp.sh prepare' where pip works, and carry $DIST"; return 1; fi
  local sum; sum=$(sha256sum "$TARBALL" | cut -d' ' -f1)
  if [ "$(cat "$SRC/.tarball_sha256" 2>/dev/null)" != "$sum" ]; then  # unpack only a new tarball: mtimes kept for ninja
    rm -rf "$SRC" "$BUILD"; mkdir -p "$PEERS/src"
    tar xzf "$TARBALL" -C "$PEERS/src" || return 1
    echo "$sum" > "$SRC/.tarball_sha256"
  fi
  local arch=${CUDA_ARCH:-}
  if [ -z "$arch" ]; then  # 9.0 -> 90a (Hopper), 8.6 -> 86, ...
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
    [ "$arch" = 90 ] && arch=90a
    arch=${arch:-90a}
  fi
  local stamp="$sum cuda=$LLAMA_CUDA arch=$arch"  # a build is reused only for the same source and settings
  if [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-batched-bench" ] && [ "$(cat "$BUILD/.stamp" 2>/dev/null)" = "$stamp" ]; then
    echo "   build cached: $BIN ($stamp)"; return 0
  fi
  command -v nvcc >/dev/null || { [ -x /usr/local/cuda/bin/nvcc ] && export PATH=$PATH:/usr/local/cuda/bin; }
  local commit; commit=$(sed -n 's/^llama_cpp_commit=//p' "$SRC/PEERS_SOURCE" | cut -c1-7)
  local gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  run llama_configure 120 cmake -S "$SRC" -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA="$LLAMA_CUDA" -DCMAKE_CUDA_ARCHITECTURES="$arch" -DGGML_NATIVE=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_COMMIT="${commit:-unknown}" -DLLAMA_BUILD_NUMBER=0 \
    || return 1
  run llama_build "${T_BUILD:-420}" cmake --build "$BUILD" -j "$JOBS" --target llama-bench llama-batched-bench || return 1
  echo "$stamp" > "$BUILD/.stamp"
}

gguf() {
  local site=$PEERS/site
  if ! PYTHONPATH=$site "$PY" -c "import gguf" 2>/dev/null; then
    local whl; whl=$(ls "$DIST"/gguf-*.whl 2>/dev/null | head -1)
    if [ -z "$whl" ]; then echo "no gguf wheel in $DIST: run 'scripts/vs_llamacpp.sh prepare' and carry $DIST"; return 1; fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$whl" > "$W/gguf_install.log" 2>&1 \
      || "$PY" -m zipfile -e "$whl" "$site" || return 1
  fi
  # shellcheck disable=SC2086
  run gguf "${T_GGUF:-300}" env PYTHONPATH="$site" "$PY" scripts/make_gguf.py --config "$CONFIG" --out "$GGUF" $GGUF_ARGS
  local rc=$?; cat "$W/gguf.out"; return $rc
}

llama_bench() {
  [ -x "$BIN/llama-bench" ] || { echo "!! no $BIN/llama-bench (build stage)"; return 1; }
  [ -f "$GGUF" ] || { echo "!! no $GGUF (gguf stage)"; return 1; }
  local t
  # tg at depth PROMPT is where nanokv's batch-1 decode runs (positions PROMPT..PROMPT+NEW); tg at depth 0
  # is llama-bench's usual figure; pp PROMPT at depth 0 the prefill. One model load per KV type: lists in
  # -ctk/-ctv would run every K x V pair.
  for t in $KV_TYPES; do
    run "llama_bench_$t" "${T_LLAMA:-180}" "$BIN/llama-bench" -m "$GGUF" -ngl 99 -fa 1 -p "$PROMPT" -n "$NEW" \
      -d "0,$PROMPT,$DEPTH" -ctk "$t" -ctv "$t" -r "$REPS" -o json
  done
}

batched_bench() {
  [ -x "$BIN/llama-batched-bench" ] || { echo "!! no $BIN/llama-batched-bench (build stage)"; return 1; }
  [ -f "$GGUF" ] || { echo "!! no $GGUF (gguf stage)"; return 1; }
  local t
  for t in $BATCHED_KV; do
    run "batched_bench_$t" "${T_BATCHED:-150}" "$BIN/llama-batched-bench" -m "$GGUF" -ngl 99 -fa on \
      -c "$BATCHED_CTX" -b 2048 -ub 512 -npp "$PROMPT" -ntg "$NEW" -npl "$BATCHED_NPL" -ctk "$t" -ctv "$t"
  done
}

nanokv() {
  local shape batches prompt
  for shape in $NANOKV_SHAPES; do
    batches=${shape%%:*} prompt=${shape##*:}
    run "nanokv_b${batches//,/-}_p$prompt" "${T_NANOKV:-300}" "$PY" bench.py speed --config "$CONFIG" --kv "$NANOKV_KV" \
      --batch "$batches" --prompt "$prompt" --new "$NEW" --json "$W/nanokv.jsonl"
  done
}

table() {
  local args=(--gpu "$GPU" --config "$CONFIG" --depth "$DEPTH" --prompt "$PROMPT" --new "$NEW"
              --source "$SRC/PEERS_SOURCE" --md "$FINAL/vs_llamacpp.md" --json "$FINAL/vs_llamacpp.json")
  local f t
  for t in $KV_TYPES; do [ -s "$W/llama_bench_$t.out" ] && args+=(--llama-bench "$W/llama_bench_$t.out"); done
  for t in $BATCHED_KV; do [ -s "$W/batched_bench_$t.out" ] && args+=(--batched-bench "$t=$W/batched_bench_$t.out"); done
  [ -s "$W/nanokv.jsonl" ] && args+=(--nanokv "$W/nanokv.jsonl")
  "$PY" scripts/peers_table.py "${args[@]}"
}

if has build && has gguf; then  # the GGUF (one core, disk) is written while the build compiles
  gguf > "$W/gguf_stage.log" 2>&1 &
  gpid=$!
  build
  wait $gpid
  cat "$W/gguf_stage.log"
else
  has build && build
  has gguf && gguf
fi
if has llama || has llama-bench; then llama_bench; fi
if has llama || has batched-bench; then batched_bench; fi
has nanokv && nanokv
if has table; then
  echo "== table"
  table 2> "$W/table.err" || echo "!! table failed: $(tail -3 "$W/table.err")"
fi
