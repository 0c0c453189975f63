#!/usr/bin/env bash
# Online against offline training on one H200 with vLLM 0.26.0, through the pipeline's own stages: the tiny
# demo run offline with vLLM extraction, then bench/online_train.py retrains it offline and online (the
# extraction server on the same GPU, vLLM at half its memory) and evaluates both heads. Needs the vLLM parts
# in /tmp/vlparts and .whl/ (README.md beside this file). Results in $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s]"; }
source .vls/install_on_device.sh || exit 1
[ -f /tmp/site2/.done ] || { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl \
  && touch /tmp/site2/.done; } || exit 1
export PYTHONPATH="$PWD:/tmp/site:/tmp/site2" HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=WARNING
RUN=/tmp/gpu-online; rm -rf "$RUN"
echo "$(el) $(python3 -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>&1 | tail -1)"
python3 -m pipeline run tests/profiles/tiny.toml --no-tui --run-dir "$RUN" --set 'run.cache_dir="/tmp/gpu-cache"' \
  --set 'extract.backend="vllm"' --set 'server.dtype="bfloat16"' --set 'server.gpu_memory_utilization=0.5' \
  --set 'server.port=8791' --until evaluate-offline 2>&1 | grep -v -E "server_wait|^\[(train|regenerate)\] [0-9]" | tail -14
echo "$(el) offline run done; retraining offline and online"
python3 bench/online_train.py --run-dir "$RUN" 2>&1 | tail -16 | tee "$OUT/online_train.txt"
cp "$RUN/state.json" "$OUT/state.json" 2>/dev/null
echo "$(el) done"
