#!/usr/bin/env bash
# Online against offline training on one H200 with vLLM 0.26.0, through the pipeline's own stages: the tiny
# demo run offline with vLLM extraction, then bench/online_train.py retrains it offline and online (the
# extraction server on the same GPU, vLLM at half its memory) at each ONLINE_REQUESTS (train.requests_per_worker,
# "1 8"; 1 = speculators as released) and evaluates every head. vLLM's parts first, as for the slice:
#   bash bench/gpu/gpu_demo_on_h200.sh part     # carry .vl3 .vls .whl, then .vl1; this script carries .vl2
# ONLINE_SETS: more --set for the first run (e.g. "data.num_conversations=160"); ONLINE_SIDE_SETS: for every
# side ("train.num_workers=4" unless set: the real profiles read with workers). The first run stops after
# vocab (the sides train). A second call finishes what the first's time limit cut (the run and each side's
# figures are kept in /tmp; ONLINE_DEADLINE_S, 575 s from the start, ends the call in time). Results in $OUT.
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s]"; }
bash bench/gpu/gpu_demo_on_h200.sh part | tail -2 || exit 1  # parts copied; vLLM unpacked once all are here
[ -f /tmp/site/.done ] || { echo "vLLM is not unpacked yet: carry .vl1, .vl2, .vl3 first"; exit 1; }
# shellcheck source=/dev/null
source /tmp/vlroot/.vls/env.sh
export PYTHONPATH="$PWD:/tmp/site:/tmp/site2" CUDA_VISIBLE_DEVICES=0 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=WARNING
RUN=/tmp/gpu-online
echo "$(el) $(python3 -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>&1 | tail -1)"
XSETS=(); for kv in ${ONLINE_SETS:-}; do XSETS+=(--set "$kv"); done
vocab_done() { python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['stages']; \
sys.exit(0 if s.get('vocab', {}).get('status') == 'done' else 1)" "$RUN/state.json" 2>/dev/null; }
if ! vocab_done; then
  rm -rf "$RUN"
  python3 -m pipeline run tests/profiles/tiny.toml --no-tui --run-dir "$RUN" --set 'run.cache_dir="/tmp/gpu-cache"' \
    --set 'extract.backend="vllm"' --set 'server.dtype="bfloat16"' --set 'server.gpu_memory_utilization=0.5' \
    --set 'server.port=8791' "${XSETS[@]}" --until vocab 2>&1 \
    | grep -v -E "server_wait|^\[(train|regenerate)\] [0-9]" | tail -14
fi
echo "$(el) the run is ready for training; training offline and online"
SSETS=(); for kv in ${ONLINE_SIDE_SETS:-train.num_workers=4}; do SSETS+=(--set "$kv"); done
# shellcheck disable=SC2086
timeout "$(( ${ONLINE_DEADLINE_S:-575} - $(date +%s) + T0 ))" python3 bench/online_train.py --run-dir "$RUN" --work /tmp/gpu-online-sides \
  --requests ${ONLINE_REQUESTS:-1 8} "${SSETS[@]}" 2>&1 | tail -16 | tee "$OUT/online_train.txt"
cp /tmp/gpu-online-sides/*.json "$OUT/" 2>/dev/null
cp "$RUN/state.json" "$OUT/state.json" 2>/dev/null
echo "$(el) done"
