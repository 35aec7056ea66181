#!/usr/bin/env bash
# The one script a GPU session runs (NVIDIA H200, Python 3.12 + jax with CUDA preinstalled,
# no network, <= 8 minutes): environment, real-shape kernel tests, kernel / fetch / decode
# benchmarks. Installs nothing; runs the checkout through PYTHONPATH.
#
#   tools/device_check.sh                          # on the GPU machine
#   DEVICE_CHECK_DRY_RUN=1 tools/device_check.sh   # the same steps on CPU, tiny shapes (< 3 min)
#
# Everything goes under $OUT (default out/device_check): one log per step (NAME.log), each
# tool's JSON/PNG, and summary.json listing every step with its exit code. Each step runs
# under its own `timeout`; a failing step never stops the next one. The steps share a
# wall-clock budget ($DEVICE_CHECK_BUDGET_S, default 460 s): a step gets at most what is
# left, and one that cannot start any more is recorded as skipped (exit code 124).
# The script exits 0 when every step succeeded, 1 otherwise.
#
# Steps: a_nvidia_smi, a_jax_devices; b_pytest_accelerator (`pytest -m accelerator`; exit
# code 5 = no test ran counts as success); c_bench_kernels; d_bench_fetch,
# d_bench_fetch_path; e_bench_decode_32k, e_bench_decode_128k (real head shapes: 128 heads,
# kv_lora 512, rope 64, index 64 x 128, top-k 2048, fp8 rows and keys; hidden 7168, 2
# layers), plus e_bench_decode_32k_xla when the kernel run at 32K failed; f_prefetch_knobs
# (tools/tune.py: split attention and layer-ahead prefetch off/on on the host-driven path,
# with the prefetch health counters), before the 128K decode.

set -u
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
OUT=${OUT:-out/device_check}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
export OUT
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
DRY=${DEVICE_CHECK_DRY_RUN:-0}
BUDGET=${DEVICE_CHECK_BUDGET_S:-460}
START=$(date +%s)
STEPS_JSON=()
ALL_OK=1

write_summary() {
  local now body
  now=$(date +%s)
  body=$(IFS=,; echo "${STEPS_JSON[*]}")
  printf '{"dry_run": %s, "out": "%s", "budget_s": %s, "elapsed_s": %s, "all_ok": %s,\n "steps": [%s]}\n' \
    "$([ "$DRY" = 1 ] && echo true || echo false)" "$OUT" "$BUDGET" "$((now - START))" \
    "$([ "$ALL_OK" = 1 ] && echo true || echo false)" "$body" > "$OUT/summary.json.tmp"
  mv "$OUT/summary.json.tmp" "$OUT/summary.json"
}

# run_step NAME TIMEOUT_S OK_CODES CMD...   (OK_CODES: space-separated exit codes meaning success)
run_step() {
  local name=$1 limit=$2 ok_codes=$3
  shift 3
  local left=$((BUDGET - ($(date +%s) - START)))
  local rc raw ok=false t0 t1 secs note=""
  if ((left < 20)); then
    raw=124; note="skipped: the ${BUDGET} s budget is spent"; secs=0
    echo "$note" > "$OUT/$name.log"
  else
    ((limit > left - 5)) && limit=$((left - 5))
    echo "== $name (timeout ${limit} s): $*" | tee "$OUT/$name.log" >&2
    t0=$(date +%s%N)
    timeout --kill-after=10 "$limit" "$@" >> "$OUT/$name.log" 2>&1
    raw=$?
    t1=$(date +%s%N)
    secs=$(( (t1 - t0) / 1000000 ))
    secs="$((secs / 1000)).$(printf '%03d' $((secs % 1000)))"
    ((raw == 124 || raw == 137)) && note="timed out after ${limit} s"
  fi
  rc=$raw
  for c in $ok_codes; do
    if [ "$raw" = "$c" ]; then rc=0; ok=true; fi
  done
  [ "$ok" = true ] || ALL_OK=0
  echo "   $name: exit $raw ($([ "$ok" = true ] && echo ok || echo FAILED)) in ${secs} s" >&2
  STEPS_JSON+=("$(printf '\n  {"name": "%s", "exit_code": %s, "raw_exit_code": %s, "ok": %s, "seconds": %s, "timeout_s": %s, "log": "%s.log", "note": "%s"}' \
    "$name" "$rc" "$raw" "$ok" "$secs" "$limit" "$name" "$note")")
  write_summary
  LAST_OK=$ok
}

# ---- settings: real shapes on the GPU, tiny ones for the CPU dry run ----------------------
source "$REPO/tools/device_shapes.sh"
if [ "$DRY" = 1 ]; then
  KERNELS=(--small)
  FETCH=(--rows=64,512 --pool_rows=20000 --iters=2)
  FETCH_PATH=(--steps=3 --warmup=2)
  DECODE=(--small "--set=model__num_attention_heads=8,cache__kv_format=fp8"
          --impl=auto)
  CTX_A=1024; CTX_B=2048
  PYTEST_T=120; KERNELS_T=60; FETCH_T=60; FETCH_PATH_T=90; DECODE_T=90
  KNOBS_CONFIG=configs/tiny.py; KNOBS_PROMPT=96; KNOBS_REPEATS=1; KNOBS_T=240
else
  KERNELS=()
  FETCH=()
  FETCH_PATH=()
  DECODE=(--layers=2 --topk=2048 --batch=8 --steps=5 --warmup=2 "--set=$REAL_HEADS"
          --impl=auto)
  CTX_A=32768; CTX_B=131072
  PYTEST_T=100; KERNELS_T=80; FETCH_T=45; FETCH_PATH_T=60; DECODE_T=170
  KNOBS_CONFIG=configs/bench_mid.py; KNOBS_PROMPT=2048; KNOBS_REPEATS=2; KNOBS_T=90
fi

# (a) the machine
if command -v nvidia-smi > /dev/null; then
  run_step a_nvidia_smi 20 "0" nvidia-smi
elif [ "$DRY" = 1 ]; then
  run_step a_nvidia_smi 20 "0" echo "nvidia-smi not present (dry run on CPU)"
else
  run_step a_nvidia_smi 20 "0" nvidia-smi   # records 127: no driver tools on a GPU machine
fi
run_step a_jax_devices 60 "0" "$PY" -c \
  'import sys, jax; print(sys.version); print("jax", jax.__version__); print(jax.devices()); print(jax.devices()[0].device_kind)'

# (b) real-shape kernel tests (skipped on CPU: all skipped = exit 0; none collected = 5).
# Only the files that carry the marker are collected: faster, and a module whose import
# needs a package this machine lacks (e.g. the transformers reference) cannot break it.
mapfile -t ACC_FILES < <(grep -rlE "mark\.accelerator" tests --include='test_*.py' | sort)
((${#ACC_FILES[@]})) || ACC_FILES=(tests)
run_step b_pytest_accelerator "$PYTEST_T" "0 5" "$PY" -m pytest -q -p no:cacheprovider -ra \
  -m accelerator "${ACC_FILES[@]}"

# (c) kernels against their XLA references and the chip's peaks
run_step c_bench_kernels "$KERNELS_T" "0" "$PY" tools/bench_kernels.py ${KERNELS[@]+"${KERNELS[@]}"} \
  --out="$OUT"

# (d) scattered-row host->device fetches per path, then both fetch paths in the engine
run_step d_bench_fetch "$FETCH_T" "0" "$PY" tools/bench_fetch.py ${FETCH[@]+"${FETCH[@]}"} --out="$OUT"
run_step d_bench_fetch_path "$FETCH_PATH_T" "0" "$PY" tools/bench_fetch_path.py \
  ${FETCH_PATH[@]+"${FETCH_PATH[@]}"} --out="$OUT"

# (e) decode, offload vs on-device, against the roofline; one context per run so a timeout
# at the longer one keeps the shorter one's results
run_step e_bench_decode_32k "$DECODE_T" "0" "$PY" tools/bench_decode.py "${DECODE[@]}" \
  --sweep_contexts="$CTX_A" --out="$OUT/decode_$CTX_A"
if [ "$LAST_OK" != true ]; then
  DECODE_XLA=("${DECODE[@]/--impl=auto/--impl=xla}")
  run_step e_bench_decode_32k_xla "$DECODE_T" "0" "$PY" tools/bench_decode.py \
    "${DECODE_XLA[@]}" --sweep_contexts="$CTX_A" --out="$OUT/decode_${CTX_A}_xla"
fi
# (f) the prefetch scheduler's knobs on the host-driven path against on-demand fetch:
# split attention and layer-ahead prefetch off/on, fetch chunk and depth "auto" (what they
# resolved to, TPOT, and the health counters: rows hit / prefetched used and unused / on
# demand, fetch-wait seconds, prediction accuracy), tokens checked against offload off
run_step f_prefetch_knobs "$KNOBS_T" "0" "$PY" tools/tune.py --config="$KNOBS_CONFIG" \
  --fetch_path=host_driven --split_attention=false,true --prefetch_ahead=false,true \
  --fetch_chunk_rows=auto --prefetch_depth=auto --hot_buffer_rows=1x --eviction=lru \
  --max_trials=4 --repeats="$KNOBS_REPEATS" --num_requests=4 --prompt_len="$KNOBS_PROMPT" \
  --gen_len=16 --json
run_step e_bench_decode_128k "$DECODE_T" "0" "$PY" tools/bench_decode.py "${DECODE[@]}" \
  --sweep_contexts="$CTX_B" --out="$OUT/decode_$CTX_B"

write_summary
echo "summary: $OUT/summary.json ($(( $(date +%s) - START )) s)" >&2
[ "$ALL_OK" = 1 ]
