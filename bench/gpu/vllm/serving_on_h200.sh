#!/usr/bin/env bash
# Server lifetimes and regeneration on one H200 with vLLM 0.26.0 (no network), through the pipeline's own CLI
# and server controller. Needs the vLLM parts in /tmp/vlparts and .whl/ (README.md beside this file).
#   bash bench/gpu/vllm/serving_on_h200.sh lifetimes
#     1. preflight of demo-mla with its three side-by-side servers at server.gpu_memory_utilization 0.5 (real NVML)
#     2. a second server that cannot fit beside a first: its failure line must be vLLM's own root cause
#     3. demo-mla end to end (regeneration through vLLM, the matrix planned one server at a time), then no
#        process left on the GPU
#   bash bench/gpu/vllm/serving_on_h200.sh regen [CONCURRENCY ...]   # default 64 256
#     the random 8B-class target: regeneration through the stage vs a bare client (bench/regenerate_ratio.py)
# Results and log tails go to $OUT (or ./out). Steps whose result exists are skipped (call again to finish).
set -uo pipefail
PHASE=${1:-}; [ $# -gt 0 ] && shift
case "$PHASE" in lifetimes|regen) ;; *) echo "usage: $0 lifetimes|regen [CONCURRENCY ...]" >&2; exit 2 ;; esac
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s]"; }
# shellcheck source=/dev/null
source .vls/install_on_device.sh || exit 1
[ -f /tmp/site2/.done ] || { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl \
  && touch /tmp/site2/.done; } || exit 1
export PYTHONPATH="$PWD:/tmp/site:/tmp/site2" HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=WARNING CUDA_VISIBLE_DEVICES=0
PY=python3
W=/tmp/serving; mkdir -p "$W"
C=(--set "run.runs_dir=\"$W/runs\"" --set "run.cache_dir=\"$W/cache\"")
M=(--set 'server.dtype="bfloat16"')  # the MLA demo in bf16 on the GPU: vLLM 0.26.0 has no float32 MLA backend
gpu_procs() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null; }

lifetimes() {
  echo "$(el) 1. preflight demo-mla (start_together 3, gpu_memory_utilization 0.5)"
  $PY -m pipeline preflight demo-mla "${C[@]}" "${M[@]}" --set server.gpu_memory_utilization=0.5 2>&1 \
    | tee "$OUT/preflight-demo-mla.txt" | grep -E "servers|evaluate|gpus|BLOCK"
  echo "$(el) 2. two servers that cannot share the GPU: the second's failure line"
  for r in a b; do
    grep -qs target_dir "$W/$r/state.json" || { rm -rf "$W/$r"; true; } && grep -qs target_dir "$W/$r/state.json" || $PY -m pipeline run demo-mla --no-tui --until build-target --run-dir "$W/$r" "${C[@]}" "${M[@]}" \
      --set "server.port=$([ $r = a ] && echo 8881 || echo 8882)" --set server.gpu_memory_utilization=0.6 > "$W/build-$r.out" 2>&1 || tail -3 "$W/build-$r.out"
  done
  timeout 400 $PY -m pipeline server start --run-dir "$W/a" --mode baseline 2>&1 | tail -1
  timeout 400 $PY -m pipeline server start --run-dir "$W/b" --mode baseline > "$OUT/second-server.txt" 2>&1
  echo "$(el) second server exit $?:"; head -3 "$OUT/second-server.txt"
  $PY -m pipeline server stop --run-dir "$W/a" 2>&1 | tail -1
  $PY -m pipeline server stop --run-dir "$W/b" 2>&1 | tail -1
  echo "$(el) GPU processes now: $(gpu_procs | wc -l)"
  echo "$(el) 3. demo-mla end to end (start_together 3, gpu_memory_utilization 0.5)"
  if [ -f "$W/mla/profile.toml" ]; then timeout 420 $PY -m pipeline run --resume "$W/mla" --no-tui > "$W/mla.out" 2>&1
  else timeout 420 $PY -m pipeline run demo-mla --no-tui --run-dir "$W/mla" "${C[@]}" "${M[@]}" --set server.gpu_memory_utilization=0.5 \
         --set server.port=8883 > "$W/mla.out" 2>&1; fi
  echo "$(el) demo-mla exit $?"; grep -vE '^\[[a-z-]+\] [0-9]' "$W/mla.out" | tail -25 | tee "$OUT/demo-mla.txt"
  grep -h "one at a time\|side by side\|stopped\|resume" "$W/mla/notes.jsonl" | cut -c1-300 | tee -a "$OUT/demo-mla.txt"
  cp "$W/mla/state.json" "$OUT/demo-mla-state.json" 2>/dev/null
  echo "$(el) GPU processes after the run: $(gpu_procs | wc -l)"; gpu_procs
}

regen() {
  local levels=("$@"); [ ${#levels[@]} -gt 0 ] || levels=(64 256)
  local target=/tmp/eightb-target
  [ -f "$target/eightb.json" ] || $PY bench/gpu/vllm/eightb.py build-target --out "$target" --size 8b --dtype bfloat16
  timeout 560 $PY bench/regenerate_ratio.py bench/gpu/vllm/regen-8b.toml --work "$W/regen" --no-again \
    --concurrency "${levels[@]}" --set "target.model_path=\"$target\"" "${C[@]}" 2>&1 | grep -vE "^(starting|stopping|reusing)" \
    | cut -c1-400 | tee "$OUT/regen-8b.txt"
  cp "$W/regen/regenerate-ratio.json" "$OUT/" 2>/dev/null
  echo "$(el) GPU processes after: $(gpu_procs | wc -l)"
}

"$PHASE" "$@"
echo "$(el) done"
