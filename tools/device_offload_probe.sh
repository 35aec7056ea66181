#!/usr/bin/env bash
# The offload part of a GPU session, after tools/device_check.sh found the in-jit fetch
# slow (one host round trip per fetch chunk, suspected) and the engine's admission
# warm-up failing on XLA:GPU. One call, <= 4 minutes: scattered-row fetch per path and
# chunk size, both engine fetch paths on the tiny model (tokens compared), generate with
# offload on vs off (tokens compared), and the real-shape decode at 32K with one fetch
# chunk vs 2048-row chunks. Logs and JSON go to $OUT/probe (tarred as probe.tgz by the
# caller when files must come back).
#
#   OUT=out/probe tools/device_offload_probe.sh          # PYTHON=python3 on the GPU box
set -u
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
OUT=${OUT:-out/probe}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
source "$REPO/tools/device_shapes.sh"
SMALL=${PROBE_SMALL:-0}
step() {  # step NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  local t0=$(date +%s)
  timeout --kill-after=5 "$t" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"
}
if [ "$SMALL" = 1 ]; then
  FETCH=(--rows=64,512 --pool_rows=20000 --iters=2); CTX=1024
  DEC=(--small); SETS="model__num_attention_heads=8,cache__kv_format=fp8"
else
  FETCH=(--rows=512,2048,16384 --iters=5); CTX=32768
  DEC=(--layers=2 --topk=2048 --batch=8 --steps=5 --warmup=2)
  SETS=$REAL_HEADS
fi
step fetch 60 "$PY" tools/bench_fetch.py "${FETCH[@]}" --paths=in_jit:0,in_jit:256,in_jit:2048,host_driven:0 --out="$OUT"
step fetch_path 60 "$PY" tools/bench_fetch_path.py --steps=10 --warmup=4 --out="$OUT"
for off in offload nooffload; do
  step "gen_$off" 60 "$PY" -m jlco.generate --random_prompt=300 --max_new_tokens=12 --$off --json
done
"$PY" - "$OUT" <<'PY' | tee -a "$OUT/steps.txt"
import json, sys
def toks(n):
    try:
        lines = open(f"{sys.argv[1]}/gen_{n}.log").read().splitlines()
        return json.loads(next(l for l in lines if l.startswith("{")))["tokens"]
    except Exception as e:
        return f"unreadable ({type(e).__name__})"
a, b = toks("offload"), toks("nooffload")
print("generate offload on == off:", isinstance(a, list) and a == b, a, b)
PY
for c in 0 2048; do
  step "decode_chunk$c" 75 "$PY" tools/bench_decode.py "${DEC[@]}" "--set=$SETS,cache__fetch_chunk_rows=$c" \
    --impl=auto --sweep_contexts=$CTX --out="$OUT/decode_chunk$c"
done
