#!/usr/bin/env bash
# Issue 26 on one H200 with vLLM 0.26.0 and no network: a slice of Kimi-K2.5 at its real width, two device
# calls a depth: `measure` (bench/gpu/kimi_slice.py measure: bare prefill, decode at c = 1 / 8 / 64, the step
# with and without a k = 3 head; ≈ 6 min) and `extract` (the pipeline's own prepare and extract stages on the
# same slice through bench/gpu/kimi-slice.toml; ≈ 3 min): NOTES.md "Plans from a slice".
#   bash bench/gpu/gpu_demo_on_h200.sh part                  # carry .vl3 .vls .whl, then .vl1 (vLLM's parts)
#   bash bench/gpu/kimi_slice_on_h200.sh measure 6           # carry .vl2 on the first: vLLM unpacked
#   bash bench/gpu/kimi_slice_on_h200.sh extract 6 1,3,4,6
#   bash bench/gpu/kimi_slice_on_h200.sh measure 12; … extract 12 2,6,9,12
# KIMI_TOKENIZER: a directory in the working tree with a built demo target's tokenizer files (config.json,
# tokenizer.json, tokenizer_config.json, chat_template.jinja; the slice keeps Kimi's 163,840-row vocabulary).
# KIMI_ROWS (96) rows of 2,048 tokens for extraction; KIMI_SETS more KEY=VALUE for the stage's run;
# KIMI_CLIENT ("validate plain c64"): speculators' client alone after the stage (below). Results to $OUT: depth-N.json, the run's state.json,
# the servers' logs' tails, the prompt counter's samples (extract-N-*.rate). Then, here: python bench/gpu/kimi_slice.py calibrate depth-*.json --extract N=TOK_S …
set -uo pipefail
PHASE=${1:-}; N=${2:?layers}
case "$PHASE" in measure|extract) ;; *) echo "usage: $0 measure N | extract N IDS" >&2; exit 2 ;; esac
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s]"; }
bash bench/gpu/gpu_demo_on_h200.sh part | tail -2 || exit 1  # parts copied; vLLM unpacked once all are here
[ -f /tmp/site/.done ] || { echo "vLLM is not unpacked yet: carry .vl1, .vl2, .vl3 first"; exit 1; }
# shellcheck source=/dev/null
source /tmp/vlroot/.vls/env.sh
export PYTHONPATH="$PWD:/tmp/site:/tmp/site2" CUDA_VISIBLE_DEVICES=0 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=WARNING
W=/tmp/kimi-slice; mkdir -p "$W"
TOK=$W/tokenizer; rm -rf "$TOK"; cp -r "${KIMI_TOKENIZER:?a tokenizer directory}" "$TOK" || exit 1
if [ "$PHASE" = measure ]; then
timeout 560 python3 -u bench/gpu/kimi_slice.py measure --layers "$N" --tokenizer "$TOK" --work "$W" \
  --out "$W/depth-$N.json" 2>&1 | grep -v Traceback | cut -c1-400
echo "$(el) measure: exit ${PIPESTATUS[0]}"
cp "$W/depth-$N.json" "$OUT/" 2>/dev/null
for f in "$W"/server-"$N"-*.log; do [ -f "$f" ] && tail -c 1500 "$f" > "$OUT/$(basename "$f").tail"; done
exit 0
fi
IDS=${3:?extract layer ids, e.g. 1,3,4,6}
[ -f "$W/slice-$N/config.json" ] || python3 bench/gpu/kimi_slice.py slice --layers "$N" --tokenizer "$TOK" \
  -o "$W/slice-$N"
[ -f "$W/rows.jsonl" ] || python3 bench/gpu/kimi_slice.py rows --tokenizer "$TOK" --rows "${KIMI_ROWS:-96}" \
  -o "$W/rows.jsonl"
XSETS=(); for kv in ${KIMI_SETS:-}; do XSETS+=(--set "$kv"); done  # more KEY=VALUE for the run, space-separated
ST=st$(python3 -c "import safetensors as s; print(s.__version__)")  # below 0.8.0 vLLM's writers hold the GIL
R=$W/run-$N-$ST; rm -rf "$R" "$W/runs"
# where the stage's time goes: the busiest processes every 5 s (vLLM's engine core, speculators' client)
(while sleep 5; do echo "$(el) $(top -b -n1 -w 200 | sed -n 8,11p | awk '{printf "%s %s%% ", $12, $9}')"; done) \
  > "$OUT/top-$N-$ST.txt" & TOP=$!
# vLLM's prompt-token counter beside the stage: its window and its steady middle (bench/gpu/prompt_rate.py)
python3 bench/gpu/prompt_rate.py sample --out "$OUT/extract-$N-$ST.rate" & RATE=$!
# data.tokenize "local": the rows pass through either way, and no server is started for rendering (its first
# run here, before compat/vllm_flags.py knew, gave vLLM 0.26.0 the --enable-scale-out it does not have)
timeout "${KIMI_RUN_S:-270}" python3 -m pipeline run bench/gpu/kimi-slice.toml --until extract --no-tui --run-dir "$R" \
  --set "target.model_path=\"$W/slice-$N\"" --set "data.conversations=\"$W/rows.jsonl\"" \
  --set "extract.layer_ids=[$IDS]" --set data.tokenize=\"local\" --set "run.runs_dir=\"$W/runs\"" --set "run.cache_dir=\"$W/cache\"" \
  "${XSETS[@]}" \
  2>&1 | grep -vE '^\[[a-z-]+\] [0-9]+/[0-9]+ ' | cut -c1-400
echo "$(el) [$ST] run --until extract: exit ${PIPESTATUS[0]}"
kill "$TOP" "$RATE" 2>/dev/null
python3 bench/gpu/prompt_rate.py rate "$OUT/extract-$N-$ST.rate"
cp "$R/state.json" "$OUT/state-$N-$ST.json" 2>/dev/null
# speculators' own account per sample (its progress bar: the request's ms in vLLM, the move's ms)
tr '\r' '\n' < "$R/logs/extract.log" 2>/dev/null | grep -aE "rps|vllm=|write=" | tail -3 > "$OUT/extract-$N-$ST.tail"
cat "$OUT/extract-$N-$ST.tail"
python3 - "$R/state.json" "$ST" <<'PY'
import json, sys
try:
    s = json.load(open(sys.argv[1]))["stages"]
except OSError as exc:
    sys.exit(f"no state: {exc}")
for name in ("prepare", "extract"):
    print(f"[{sys.argv[2]}]", name, s.get(name, {}).get("status"), s.get(name, {}).get("figures"))
f = s.get("extract", {}).get("figures", {})
if f.get("tokens") and f.get("seconds"):  # the calibration's: the server's first prompt to its last
    print(f"[{sys.argv[2]}] extract_tokens_per_s {f.get('tokens_per_s') or f['tokens'] / f['seconds']:.1f} "
          f"(the server's window; client start {f.get('client_start_s')} s, tail {f.get('tail_s')} s; "
          f"over the stage's whole run {f['tokens'] / f['seconds']:.1f})")
PY
grep -a "safetensors" "$R/logs/server-extraction.log" 2>/dev/null | cut -c1-300 | tail -2
# KIMI_CLIENT ("validate plain c64 c8"): speculators' client alone, one run each against one extraction server
# of this run (the stage's own argv: validate = --validate-outputs at concurrency 32; plain = without it;
# cN = validated at concurrency N): what the client's checks and its concurrency cost, the CLI's start timed
if [ -n "${KIMI_CLIENT:-}" ] && [ -d "$R/data/prepared" ]; then
  timeout 240 python3 -m pipeline server start --run-dir "$R" --mode extraction 2>&1 | tail -1 | cut -c1-300
  for v in $KIMI_CLIENT; do
    case "$v" in validate) c=32; val=(--validate-outputs) ;; plain) c=32; val=() ;;
                 c[0-9]*) c=${v#c}; val=(--validate-outputs) ;; *) echo "KIMI_CLIENT: $v?"; continue ;; esac
    rm -rf "$W/hs-$v"; t=$(date +%s%N)
    timeout 150 python3 -m speculators generate-offline-data --endpoint "http://127.0.0.1:8811/v1" \
      --preprocessed-data "$R/data/prepared" --output "$W/hs-$v" --concurrency "$c" "${val[@]}" --fail-on-error \
      2>&1 | tr '\r' '\n' | grep -aE "rps=" | tail -1 | cut -c1-200
    echo "[client $v] $(( ($(date +%s%N) - t) / 1000000 )) ms, $(ls "$W/hs-$v" 2>/dev/null | wc -l) files"
    rm -rf "$W/hs-$v"
  done
  python3 -m pipeline server stop --run-dir "$R" 2>&1 | tail -1
fi
du -sh "$R" 2>/dev/null; rm -rf "$R"  # its states ≈ 57 KiB a token: the disk is 64 GiB
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | wc -l | sed 's/^/GPU processes after: /'
echo "$(el) depth $N done"
