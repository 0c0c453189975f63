#!/usr/bin/env bash
# Issue 26 item 4 on one H200 with vLLM 0.26.0: the extract stage against a bare prefill of the same rows on the
# 8B-class target (bench/gpu/vllm/eightb.py build-target, random weights, profile eightb.toml, servers eager),
# for the demo's short rows (≈ 110 tokens) and for rows of 2,048 tokens (bench/gpu/kimi_slice.py rows). Both
# sides through the pipeline's own server controller, vLLM's prompt-token counter sampled beside each
# (bench/gpu/prompt_rate.py): the stage's window against the prefill's.
#   bash bench/gpu/gpu_demo_on_h200.sh part                  # carry .vl3 .vls .whl, then .vl1 (vLLM's parts)
#   bash bench/gpu/vllm/eightb_ratio_on_h200.sh [short] [long]  # carry .vl2 on the first: vLLM unpacked
# EIGHTB_ROWS (160) long rows; a kind whose prefill result exists in $OUT is skipped. Results to $OUT
# (or ./out): extract-KIND.rate / prefill-KIND.rate (counter samples), state-KIND.json, prefill-KIND.json.
set -uo pipefail
KINDS=${*:-short long}
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s]"; }
bash bench/gpu/gpu_demo_on_h200.sh part | tail -2 || exit 1  # parts copied; vLLM unpacked once all are here
[ -f /tmp/site/.done ] || { echo "vLLM is not unpacked yet: carry .vl1, .vl2, .vl3 first"; exit 1; }
# shellcheck source=/dev/null
source /tmp/vlroot/.vls/env.sh
export PYTHONPATH="$PWD:/tmp/site:/tmp/site2" CUDA_VISIBLE_DEVICES=0 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=WARNING
W=/tmp/eightb; TARGET=/tmp/eightb-target; PORT=8791; mkdir -p "$W"
[ -f "$TARGET/eightb.json" ] || python3 bench/gpu/vllm/eightb.py build-target --out "$TARGET" --size 8b \
  --dtype bfloat16 2>&1 | tail -2
[ -f "$W/rows2k.jsonl" ] || python3 bench/gpu/kimi_slice.py rows --tokenizer "$TARGET" --rows "${EIGHTB_ROWS:-160}" \
  -o "$W/rows2k.jsonl"
BASE=(--set "target.model_path=\"$TARGET\"" --set "run.runs_dir=\"$W/runs\"" --set "run.cache_dir=\"$W/cache\""
      --set hardware.min_free_disk_gib=1)
LONG=(--set "data.conversations=\"$W/rows2k.jsonl\"" --set data.heldout=1 --set evaluate.num_prompts=1
      --set data.mean_sample_tokens=2048)
sampled() {  # sampled FILE CMD…: CMD (its output's tail shown) with the server's prompt counter sampled into FILE
  local file=$1; shift
  rm -f "$file"; python3 bench/gpu/prompt_rate.py sample --port "$PORT" --out "$file" & local rate=$!
  "$@" > "$file.log" 2>&1; local rc=$?
  kill "$rate" 2>/dev/null; wait "$rate" 2>/dev/null
  grep -vE '^\[[a-z-]+\] [0-9]+/[0-9]+ ' "$file.log" | tail -3 | cut -c1-300; echo "$(el) exit $rc"
  python3 bench/gpu/prompt_rate.py rate "$file"
}
for kind in $KINDS; do
  [ -f "$OUT/prefill-$kind.json" ] && { echo "$(el) $kind: done already"; continue; }
  R=$W/ratio-$kind; rm -rf "$R"
  extra=(); [ "$kind" = long ] && extra=("${LONG[@]}")
  sampled "$OUT/extract-$kind.rate" timeout 300 python3 -m pipeline run bench/gpu/vllm/eightb.toml --until extract \
    --no-tui --run-dir "$R" "${BASE[@]}" "${extra[@]}"
  cp "$R/state.json" "$OUT/state-$kind.json" 2>/dev/null
  python3 - "$R/state.json" "$kind" <<'PY'
import json, sys
try:
    f = json.load(open(sys.argv[1]))["stages"]["extract"]["figures"]
except (OSError, KeyError, ValueError) as exc:
    sys.exit(f"no extract figures: {exc}")
print(f"[{sys.argv[2]}] stage: {f.get('tokens')} tokens, tokens_per_s {f.get('tokens_per_s')} (the server's window),"
      f" client start {f.get('client_start_s')} s, tail {f.get('tail_s')} s, stage {f.get('seconds')} s")
PY
  rm -rf "$R/data/prepared/hidden_states"  # ≈ 32 KiB a token: the disk is 64 GiB
  sampled "$OUT/prefill-$kind.rate" timeout 300 python3 bench/gpu/vllm/eightb.py prefill --run-dir "$R" \
    --concurrency 32 --out "$OUT/prefill-$kind.json"
  python3 -m pipeline server stop --run-dir "$R" 2>&1 | tail -1
  echo "$(el) $kind: done"
done
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | wc -l | sed 's/^/GPU processes after: /'
