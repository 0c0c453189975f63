#!/usr/bin/env bash
# The Kimi-class demo target (tiny DeepSeek-V3: MLA + MoE, YaRN) through the pipeline's own stages with
# vLLM 0.26.0 on one H200, no network. Run on the GPU box in the repository, after the vLLM parts were
# copied to /tmp/vlparts (README.md beside this file) and with .whl/ from bench/gpu/fetch_wheels.sh:
#   bash bench/gpu/vllm/mla_on_h200.sh probe      # install, ask vLLM about MLA/INT4, run until extract
#   bash bench/gpu/vllm/mla_on_h200.sh rest       # train, evaluate offline, serve with the new head
#   bash bench/gpu/vllm/mla_on_h200.sh int4       # demo-int4 (INT4 routed experts) through every stage
# Results go to $OUT (or ./out): the probe answers, preflight, state.json, online.json, the comparison.
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s]"; }
source .vls/install_on_device.sh || exit 1   # vLLM into /tmp/site (idempotent while the machine is warm)
[ -f /tmp/site2/.done ] || { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl \
  && touch /tmp/site2/.done; } || exit 1
# vLLM's own pins first, then speculators' extra needs, then this repository
export PYTHONPATH="$PWD:/tmp/site:/tmp/site2" HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=WARNING
RUN=/tmp/gpu-mla; CACHE=/tmp/gpu-cache
SETS=(--set "run.cache_dir=\"$CACHE\"" --set 'server.dtype="bfloat16"' --set 'train.epochs=8'
      --set 'server.gpu_memory_utilization=0.5')
echo "$(el) python $(python3 -c 'import vllm, torch, transformers; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)' 2>&1 | tail -1)"

case "${1:-probe}" in
probe)
  for q in '{"hidden": 128, "layers": 4, "aux_ids": [1,2,3,4], "kv_lora_rank": 512, "qk_rope_head_dim": 64, "dtype": "bfloat16", "int4_group_size": 32, "rope_type": "yarn"}' \
           '{"hidden": 128, "layers": 4, "aux_ids": [1,2,3,4], "kv_lora_rank": 512, "qk_rope_head_dim": 64, "dtype": "float32"}' \
           '{"hidden": 7168, "layers": 61, "aux_ids": [2,30,58,61], "kv_lora_rank": 512, "qk_rope_head_dim": 64, "dtype": "bfloat16", "int4_group_size": 32, "rope_type": "yarn"}'; do
    python3 -m pipeline.compat.vllm_extract_probe "$q" 2>"$OUT/probe.err" | tail -1 | tee -a "$OUT/probe.jsonl"
  done
  echo "$(el) probes done"
  python3 -m pipeline preflight demo-mla "${SETS[@]}" | tee "$OUT/preflight-demo-mla.txt"
  python3 -m pipeline preflight demo-int4 "${SETS[@]}" | grep -E "int4|mla" | tee "$OUT/preflight-demo-int4.txt"
  python3 -m pipeline preflight kimi-k2.5-rtx6000x8-lowered | grep -E " mla | int4 " | tee "$OUT/preflight-kimi.txt"
  echo "$(el) run until extract"
  python3 -m pipeline run demo-mla --no-tui --run-dir "$RUN" "${SETS[@]}" --until extract 2>&1 | grep -v server_wait | tail -12
  python3 - "$RUN" <<'PY' 2>&1 | tail -3 | tee "$OUT/compare.txt"
import sys, torch
from pathlib import Path
from datasets import load_from_disk
from safetensors.torch import load_file
from pipeline.data import target
from pipeline.layout.rundir import RunDir
from pipeline.stages.extract import extract
run = RunDir.open(Path(sys.argv[1]))
tdir = run.stage_state("build-target")["figures"]["target_dir"]
figs = run.stage_state("extract")["figures"]
for dtype in ("float32", "bfloat16"):
    out = Path(f"/tmp/hf-{dtype}")
    extract(target.load_model(Path(tdir), dtype), load_from_disk(str(run.prepared_dir)), out, figs["layer_ids"], 8, 16384, 2)
    worst = [0.0] * len(figs["layer_ids"])
    for i in range(figs["samples"]):
        a = load_file(str(run.hidden_states_dir / f"hs_{i}.safetensors")); b = load_file(str(out / f"hs_{i}.safetensors"))
        assert torch.equal(a["token_ids"].cpu(), b["token_ids"].cpu())
        d = (a["hidden_states"].float().cpu() - b["hidden_states"].float().cpu()).abs().amax(dim=(0, 2)).tolist()
        worst = [max(w, x) for w, x in zip(worst, d)]
    print(f"vLLM (bf16) vs transformers {dtype}: max |diff| per layer id {figs['layer_ids']}: "
          + ", ".join(f"{w:.2e}" for w in worst), f"({figs['samples']} files, {figs['tokens']} tokens)")
PY
  cp "$RUN"/state.json "$OUT/state-extract.json" 2>/dev/null
  tail -c 20000 "$RUN"/logs/server-extraction.log | grep -a -E "backend|Using|MLA|MoE|ERROR|Error" | cut -c1-250 | tail -15
  ;;
int4)
  python3 -m pipeline.compat.vllm_extract_probe '{"hidden": 7168, "layers": 61, "aux_ids": [2,30,58,61], "kv_lora_rank": 512, "qk_rope_head_dim": 64, "dtype": "bfloat16", "int4_group_size": 32, "rope_type": "yarn"}' 2>"$OUT/probe.err" | tail -1 | tee "$OUT/probe-int4.jsonl"
  python3 -m pipeline run demo-int4 --no-tui --run-dir /tmp/gpu-int4 "${SETS[@]}" --set 'train.epochs=4' \
    --set 'data.num_conversations=48' 2>&1 | grep -v -E "server_wait|^\[train\] [0-9]|^\[regenerate\] [0-9]" | tail -24
  cp /tmp/gpu-int4/state.json "$OUT/state-int4.json"; cp /tmp/gpu-int4/eval/online.json "$OUT/online-int4.json" 2>/dev/null
  cp /tmp/gpu-int4/preflight.json "$OUT/preflight-int4.json" 2>/dev/null
  tail -c 30000 /tmp/gpu-int4/logs/server-extraction.log 2>/dev/null | grep -a -E "WNA16|Marlin|MoE|backend|ERROR|Error" | cut -c1-250 | tail -8
  ;;
rest)
  python3 -m pipeline run --resume "$RUN" --no-tui 2>&1 | grep -v -E "server_wait|^\[train\] [0-9]" | tail -20
  cp "$RUN"/state.json "$OUT/state.json"; cp "$RUN"/eval/online.json "$RUN"/eval/offline.json "$OUT/" 2>/dev/null
  tail -c 20000 "$RUN"/logs/server-speculative.log 2>/dev/null | grep -a -E "backend|Using|ERROR|Error" | cut -c1-250 | tail -8
  ;;
esac
echo "$(el) done"
