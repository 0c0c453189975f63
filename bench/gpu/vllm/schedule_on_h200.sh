#!/usr/bin/env bash
# On one H200 with vLLM 0.26.0 (bench/gpu/vllm/README.md's parts): bench/gpu/schedule_cost.py — a k per batch
# size served under each candidate configuration, and two instances of the target alone (issue 42;
# NOTES.md "k per batch size"). Carry .vl3 .vls .whl .tok after two calls that brought .vl1 and .vl2:
#   VARIANTS="base base2 k3" bash bench/gpu/vllm/schedule_on_h200.sh
#   VARIANTS="sched-v1 k3-v1 sched-pw" bash bench/gpu/vllm/schedule_on_h200.sh
#   SIZE=mla VARIANTS="k3-sw k3 base" …   (the Kimi-class target: MLA + MoE, bench/gpu/step_cost.py SIZES)
# .tok: a tokenizer directory (config.json + tokenizer.json), e.g. a demo run's target (run.cache_dir/demo-target-*).
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
for d in .vl1 .vl2 .vl3; do [ -d "$d" ] && mkdir -p /tmp/vlparts && cp "$d"/* /tmp/vlparts/; done
[ -d .vls ] && { rm -rf /tmp/vlroot/.vls; mkdir -p /tmp/vlroot && cp -r .vls /tmp/vlroot/; }
[ -d .tok ] && { rm -rf /tmp/tok; cp -r .tok /tmp/tok; }
[ -d .whl ] && { [ -f /tmp/site2/.done ] || { python3 -m pip install -q --no-index --no-deps --no-compile \
  --target /tmp/site2 .whl/*.whl && touch /tmp/site2/.done; }; }
[ "$(ls /tmp/vlparts 2>/dev/null | wc -l)" = 3 ] || { echo "parts here: $(ls /tmp/vlparts 2>/dev/null)"; exit 0; }
here=$PWD; cd /tmp/vlroot || exit 1
# shellcheck source=/dev/null
source .vls/install_on_device.sh || exit 1
cd "$here" || exit 1
# INFO: each server's log says where its start went (weights, torch.compile, graph capture, engine init)
export PYTHONPATH="$PWD:/tmp/site:/tmp/site2" VLLM_LOGGING_LEVEL=INFO CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader
read -ra variants <<< "${VARIANTS:-base base2 k3}"
# OVERLAP="base k3 base": bench/gpu/overlap_cost.py instead (the next server started while this one is measured)
[ -n "${OVERLAP:-}" ] && { read -ra servers <<< "$OVERLAP"
  timeout "${SC_TIMEOUT:-540}" python3 -u bench/gpu/overlap_cost.py --tokenizer /tmp/tok --size 0.8b \
    --servers "${servers[@]}" --rounds "${ROUNDS:-3}" --work /tmp/oc 2>&1 | grep -v '^\[' | tee -a "$OUT/overlap-cost.txt"; }
# PLACEMENT=1: bench/gpu/placement_cost.py instead (one server's processes moved between CPU sets while measured)
[ -n "${PLACEMENT:-}" ] && { timeout "${SC_TIMEOUT:-540}" python3 -u bench/gpu/placement_cost.py --tokenizer /tmp/tok \
    --instances "${INSTANCES:-3}" --work /tmp/pc 2>&1 | grep -v '^\[' | tee -a "$OUT/placement-cost.txt"; exit 0; }
[ -n "${OVERLAP:-}" ] || timeout "${SC_TIMEOUT:-540}" python3 -u bench/gpu/schedule_cost.py --tokenizer /tmp/tok --size "${SIZE:-0.8b}" \
  --variants "${variants[@]}" --rounds "${ROUNDS:-3}" --prompts "${PROMPTS:-32}" --work /tmp/sc 2>&1 | grep -v '^\[' | tee -a "$OUT/schedule-cost.txt"
for f in /tmp/sc/server-*.log /tmp/oc/server-*.log; do [ -f "$f" ] || continue; echo "# start of $(basename "$f" .log):"
  grep -aE "Loading weights took|Model loading took|torch.compile take|Graph capturing finished|init engine|\
Dynamo bytecode transform|Directly load|Starting vLLM|startup complete|Available KV cache|[Ss]liding|[Hh]ybrid|cudagraph_mode|KV cache groups" "$f" \
    | sed -E 's/^.*(INFO|WARNING) [0-9-]+ [0-9:]+ //' | cut -c1-200 | tail -14
done | tee -a "$OUT/schedule-cost.txt"
ls "$OUT" | head -8
