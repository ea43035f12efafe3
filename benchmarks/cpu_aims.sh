#!/usr/bin/env bash
# Issue 30's CPU aims on this machine in one run, against llama.cpp built here from the source vendored in
# llama-cpp-python's sdist (natively: -DGGML_NATIVE=ON), then one summary of every ratio against its aim:
#
#   decode   benchmarks/inference_decode.py  int4 compiled batch-1 decode vs llama.cpp Q4_1 (same GGUF),
#            1 and 2 threads                 aims >= 1.5x at 1 thread, >= 1.2x at 2
#   serve    benchmarks/serve.py --llama-cpp  vs llama-server (continuous batching, -np = seats), 1/4/16 streams
#                                            aims tokens/s >= 1.5x, TTFT p50 and ITL p50 <= llama.cpp's (<= 1x)
#   offline  benchmarks/inference_serving.py 16 seats, 128 and 32 requests: aims continuous >= 3x the batch-1
#                                            compiled decoder, >= 2x static batching on the same kernels
#
#   bash benchmarks/cpu_aims.sh                  # everything (~25 min on a 2-vCPU Xeon, more on a slower core)
#   STEPS="decode serve" bash benchmarks/cpu_aims.sh
#
# Run it on a quiet machine, nothing else in the background (the figures are wall-clock, one torch thread but
# the 2-thread decode). Logs and summary.txt go to $OUT (default /tmp/cpu_aims); the llama.cpp build to
# $LLAMA_DIR (default /tmp/llama_cpu_aims, reused when there): its shared libraries for llama-cpp-python's
# bindings (the Python package copied beside them, its one dependency diskcache installed there with pip) and
# llama-server. On a CPU with AMX the native llama.cpp build takes an AMX path for Q4_1 that has died with SIGILL
# on `tilezero` (a VM that never granted the tile state), so there both llama.cpp runs skip it
# (--llama-no-repack, llama-server -nr) and say so. Which kernels lmstack ran is in each log's header.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-$ROOT/.venv/bin/python}
OUT=${OUT:-/tmp/cpu_aims}
LLAMA_DIR=${LLAMA_DIR:-/tmp/llama_cpu_aims}
LLAMA_VERSION=${LLAMA_VERSION:-0.3.36}
STEPS=${STEPS:-decode serve offline}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

[ -x "$PY" ] || { echo "no $PY: run 'make install-test' first (or set PY)"; exit 2; }

# --- the machine -----------------------------------------------------------------------------------------
say "# issue 30 CPU aims, $(date -u '+%Y-%m-%d %H:%M UTC'), main $(git rev-parse --short HEAD 2>/dev/null)"
say "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $(nproc) vCPUs; $("$PY" -c \
  'import torch; from lmstack.cpu import cpu_features as f; c = f(); print("torch capability", torch.backends.cpu.get_cpu_capability() + ";", "avx512_vnni" if "avx512_vnni" in c.flags else "no avx512_vnni", "avx2" if "avx2" in c.flags else "no avx2", "amx_tile" if "amx_tile" in c.flags else "")')"
NO_REPACK=() SERVER_ARGS=()
if grep -qw amx_tile /proc/cpuinfo; then
  NO_REPACK=(--llama-no-repack) SERVER_ARGS=(--llama-server-args=-nr)
  say "AMX present: llama.cpp runs without its AMX repacked weights (--llama-no-repack, llama-server -nr)"
fi
say "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"

# --- llama.cpp, built once ---------------------------------------------------------------------------------
SRC=$LLAMA_DIR/llama_cpp_python-$LLAMA_VERSION
BUILD=$SRC/vendor/llama.cpp/build
if [ ! -x "$BUILD/bin/llama-server" ] || [ ! -e "$BUILD/bin/libllama.so" ] || [ ! -d "$LLAMA_DIR/py/llama_cpp" ]; then
  echo "building llama.cpp $LLAMA_VERSION (llama-cpp-python's vendored source) in $LLAMA_DIR: a few minutes"
  mkdir -p "$LLAMA_DIR"
  if [ ! -d "$SRC" ]; then
    "$PY" -m pip download -q "llama-cpp-python==$LLAMA_VERSION" --no-binary :all: --no-deps -d "$LLAMA_DIR" &&
      tar xzf "$LLAMA_DIR/llama_cpp_python-$LLAMA_VERSION.tar.gz" -C "$LLAMA_DIR" ||
      { echo "could not fetch llama-cpp-python's sdist"; exit 3; }
  fi
  cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF >"$OUT/llama_cmake.log" 2>&1 &&
    ninja -C "$BUILD" -j"$(nproc)" llama-server llama >"$OUT/llama_build.log" 2>&1 ||
    { echo "llama.cpp build failed: $OUT/llama_cmake.log, $OUT/llama_build.log"; exit 3; }
  mkdir -p "$LLAMA_DIR/py" && cp -r "$SRC/llama_cpp" "$LLAMA_DIR/py/" &&
    "$PY" -m pip install -q --target "$LLAMA_DIR/py" diskcache ||
    { echo "could not set up llama-cpp-python's bindings in $LLAMA_DIR/py"; exit 3; }
fi
export LLAMA_CPP_LIB_PATH=$BUILD/bin
export PYTHONPATH=$ROOT/src:$LLAMA_DIR/py${PYTHONPATH:+:$PYTHONPATH}
say "llama.cpp: $BUILD/bin (native build of llama-cpp-python $LLAMA_VERSION's vendored source)"

run() {  # name, then the command: its output in $OUT/name.log
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  say "$name: rc $rc, $((SECONDS - t0)) s, log $OUT/$name.log"
  return $rc
}

# --- the three measurements --------------------------------------------------------------------------------
for step in $STEPS; do
  case $step in
    decode)
      for T in 1 2; do
        run "decode_t$T" "$PY" benchmarks/inference_decode.py --threads "$T" --repeats 3 --new-tokens 32 \
          --lmstack int4+compile --hf "" --llama-threads "$T" "${NO_REPACK[@]}"
      done ;;
    serve)
      run serve "$PY" benchmarks/serve.py --concurrency 1,4,16 --requests 16 --max-seqs 16 --threads 1 \
        --llama-cpp --llama-server "$BUILD/bin/llama-server" "${SERVER_ARGS[@]}" ;;
    offline)
      for N in 128 32; do
        run "offline_$N" "$PY" benchmarks/inference_serving.py --dtype auto --compile --batch1 --skip-hf \
          --skip-prefix --threads 1 --kv-dtype fp16 --admission-batch 4 --requests "$N" --lengths exponential
      done ;;
    *) echo "unknown step $step (decode, serve, offline)"; exit 2 ;;
  esac
done

# --- the summary: each ratio against its aim ---------------------------------------------------------------
verdict() {  # value, aim, ">=" or "<="
  awk -v v="$1" -v a="$2" -v op="$3" 'BEGIN { ok = (op == ">=") ? v >= a : v <= a; print (ok ? "met" : "NOT met") }'
}
say ""
say "## against the aims"
for T in 1 2; do
  f=$OUT/decode_t$T.log
  [ -f "$f" ] || continue
  aim=$([ "$T" = 1 ] && echo 1.5 || echo 1.2)
  r=$(grep -m1 ' decode .*llama.cpp' "$f" | grep -o 'llama.cpp[^:]*: [0-9.]*x' | grep -o '[0-9.]*x$' | tr -d x)
  k=$(grep -m1 '^lmstack int4' "$f" | grep -o '\[[a-z0-9_+]*\]')
  [ -n "$r" ] && say "decode, $T thread(s): lmstack int4 compiled $k / llama.cpp = ${r}x (aim >= ${aim}x: $(verdict "$r" "$aim" '>='))" \
    || say "decode, $T thread(s): no ratio in $f"
done
if [ -f "$OUT/serve.log" ]; then
  while read -r line; do
    rate=$(echo "$line" | cut -d: -f1)
    tok=$(echo "$line" | grep -o 'tokens/s [0-9.]*x' | grep -o '[0-9.]*' | tail -1)
    ttft=$(echo "$line" | grep -o 'TTFT p50 [0-9.]*x' | grep -o '[0-9.]*' | tail -1)
    itl=$(echo "$line" | grep -o 'ITL p50 [0-9.]*x' | grep -o '[0-9.]*' | tail -1)
    say "serve, $rate: tokens/s ${tok}x (aim >= 1.5x: $(verdict "$tok" 1.5 '>=')), TTFT p50 ${ttft}x ($(verdict "$ttft" 1 '<=')), ITL p50 ${itl}x ($(verdict "$itl" 1 '<='))"
  done < <(grep 'lmstack / llama.cpp tokens/s' "$OUT/serve.log")
fi
for N in 128 32; do
  f=$OUT/offline_$N.log
  [ -f "$f" ] || continue
  b1=$(grep -o 'continuous/batch-1 = [0-9.]*x' "$f" | grep -o '[0-9.]*x' | tr -d x)
  st=$(grep -o 'continuous/static = [0-9.]*x' "$f" | head -1 | grep -o '[0-9.]*x' | tr -d x)
  say "offline, $N requests: continuous / batch-1 compiled ${b1:-?}x (aim >= 3x: $([ -n "$b1" ] && verdict "$b1" 3 '>=')), continuous / static ${st:-?}x (aim >= 2x: $([ -n "$st" ] && verdict "$st" 2 '>='))"
done
say "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "summary: $SUMMARY"
