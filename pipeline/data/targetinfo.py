"""What the planner and preflight need to know about a target, read from its config.json (the
weights' own, or the profile's `target.config` copy where the weights are not on this machine), and
the EAGLE-3 draft derived from it. No torch: plain JSON."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeline.data.target import resolve_layer_ids, text_config
from pipeline.profile import Profile

MLA_KEYS = ("kv_lora_rank", "q_lora_rank")


@dataclass(frozen=True)
class TargetInfo:
    source: str  # the config.json read
    architecture: str
    model_type: str
    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    intermediate: int
    attention: str  # "MLA" / "GQA" / "MHA"
    experts: int = 0
    head_dim: int = 0  # as transformers reports it (DeepSeek-V3/Kimi: qk_rope_head_dim); speculators' draft uses it
    kv_lora_rank: int = 0  # MLA: the latent the KV cache holds, plus the decoupled rope part
    qk_rope_head_dim: int = 0
    rope_type: str = ""  # "default", "yarn", … (rope_parameters or the older rope_scaling)
    int4_group_size: int = 0  # compressed-tensors W4A16 weights (Kimi's routed experts): their group size
    experts_per_token: int = 0
    quantization: str = ""
    params: int = 0  # every weight, as transformers holds them dense (INT4 experts decompressed): what loads here
    notes: list[str] = field(default_factory=list)

    def dense_bytes(self, dtype: str) -> int:
        """The target loaded in transformers in `dtype` (compressed-tensors INT4 weights become dense)."""
        return self.params * (4 if dtype == "float32" else 2)


def param_count(t: dict) -> int:
    """Parameters of a decoder-only text config (Llama/Qwen, DeepSeek-V3/Kimi with MLA and MoE): embeddings
    and lm_head, attention (MLA's low-rank q and kv with the decoupled rope part), the dense MLPs of the
    first layers and the routed + shared experts with their router; norms are negligible."""
    h, layers, vocab = int(t["hidden_size"]), int(t["num_hidden_layers"]), int(t["vocab_size"])
    heads = int(t.get("num_attention_heads") or max(1, h // 128))
    kv_heads = int(t.get("num_key_value_heads") or heads)
    if t.get("kv_lora_rank"):
        rope, nope = int(t.get("qk_rope_head_dim") or 0), int(t.get("qk_nope_head_dim") or 0)
        v, kv_lora, q_lora = int(t.get("v_head_dim") or nope), int(t["kv_lora_rank"]), int(t.get("q_lora_rank") or 0)
        q = (h * q_lora + q_lora * heads * (nope + rope)) if q_lora else h * heads * (nope + rope)
        attn = q + h * (kv_lora + rope) + kv_lora * heads * (nope + v) + heads * v * h
    else:
        head_dim = int(t.get("head_dim") or h // heads)
        attn = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim
    dense_mlp = 3 * h * int(t.get("intermediate_size") or 4 * h)
    experts = int(t.get("n_routed_experts") or t.get("num_local_experts") or 0)
    if experts:
        moe_inter = int(t.get("moe_intermediate_size") or t.get("intermediate_size") or 4 * h)
        shared = int(t.get("n_shared_experts") or 0)
        moe = (experts + shared) * 3 * h * moe_inter + h * experts
        dense_layers = int(t.get("first_k_dense_replace") or 0)
        mlps = dense_layers * dense_mlp + (layers - dense_layers) * moe
    else:
        mlps = layers * dense_mlp
    embeddings = vocab * h * (1 if t.get("tie_word_embeddings") else 2)
    return embeddings + layers * attn + mlps


class TargetInfoError(ValueError):
    pass


def config_path(profile: Profile) -> Path | None:
    """The weights' config.json when present, else the profile's planning copy, else None."""
    t = profile.target
    if t.source != "path":
        return None
    weights = Path(t.model_path) / "config.json"
    return weights if weights.is_file() else (Path(t.config) if t.config else None)


def from_config(path: Path) -> TargetInfo:
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TargetInfoError(f"{path}: cannot read the target's config.json: {exc}") from None
    return _read(cfg, str(path))


def _read(cfg: dict, source: str) -> TargetInfo:
    text = text_config(cfg)
    try:
        hidden, layers, vocab = int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"])
    except KeyError as exc:
        raise TargetInfoError(f"{source}: key {exc.args[0]!r} missing (hidden_size, num_hidden_layers and "
                              f"vocab_size are required)") from None
    heads = int(text.get("num_attention_heads", 0))
    kv = int(text.get("num_key_value_heads", heads) or heads)
    attention = "MLA" if any(text.get(k) for k in MLA_KEYS) else ("GQA" if kv and kv < heads else "MHA")
    quant = text.get("quantization_config") or cfg.get("quantization_config") or {}
    bits, group, act_bits = quant_weights(quant)
    if bits:
        qdesc = f"{quant.get('quant_method', '')} W{bits}A{act_bits or 16}" + (f" group {group}" if group else "")
    else:  # GPTQ, AWQ, fp8 …: their own keys
        qdesc = (f"{quant.get('quant_method', '')} {quant.get('bits', '')}-bit".replace(" -bit", "").strip()
                 if quant else "")
    arch = (cfg.get("architectures") or text.get("architectures") or ["?"])[0]
    return TargetInfo(source=source, architecture=arch, model_type=str(cfg.get("model_type", "")),
                      hidden=hidden, layers=layers, vocab=vocab, heads=heads, kv_heads=kv,
                      intermediate=int(text.get("intermediate_size", 4 * hidden)), attention=attention,
                      experts=int(text.get("n_routed_experts") or text.get("num_local_experts") or 0),
                      experts_per_token=int(text.get("num_experts_per_tok") or 0), quantization=qdesc,
                      head_dim=int(text.get("head_dim") or (text.get("qk_rope_head_dim") if attention == "MLA" else 0)
                                   or (hidden // heads if heads else 0)),
                      kv_lora_rank=int(text.get("kv_lora_rank") or 0),
                      qk_rope_head_dim=int(text.get("qk_rope_head_dim") or 0) if attention == "MLA" else 0,
                      rope_type=str((text.get("rope_parameters") or text.get("rope_scaling") or {}).get("rope_type")
                                    or (text.get("rope_scaling") or {}).get("type") or "default"),
                      int4_group_size=(group if (bits, act_bits) == (4, 0)
                                       and quant.get("quant_method") == "compressed-tensors" else 0),
                      params=param_count(text))


def quant_weights(quant: dict) -> tuple[int, int, int]:
    """(weight bits, group size, activation bits) of a compressed-tensors scheme (Kimi-K2.5: 4, 32, 0 =
    activations not quantized), or zeros."""
    groups = quant.get("config_groups") or {}
    scheme: dict = next((g for g in groups.values() if g.get("weights")), {})
    weights, acts = scheme.get("weights") or {}, scheme.get("input_activations") or {}
    return int(weights.get("num_bits") or 0), int(weights.get("group_size") or 0), int(acts.get("num_bits") or 0)


def demo_info(profile: Profile) -> TargetInfo:
    """The demo target described as a config.json, read as any target's."""
    d = profile.demo_target
    mla = d.architecture != "llama"
    arch, model_type = {"llama": ("LlamaForCausalLM", "llama"), "deepseek_v3": ("DeepseekV3ForCausalLM", "deepseek_v3"),
                        "kimi_k25": ("KimiK25ForConditionalGeneration", "kimi_k25")}[d.architecture]
    config: dict[str, Any] = {
        "architectures": [arch], "model_type": model_type, "hidden_size": d.hidden_size,
        "num_hidden_layers": d.num_layers, "vocab_size": d.vocab_size, "num_attention_heads": d.num_heads,
        "num_key_value_heads": d.num_heads if mla else d.num_kv_heads, "intermediate_size": d.intermediate_size}
    if mla:
        config.update(kv_lora_rank=d.kv_lora_rank, q_lora_rank=d.q_lora_rank, qk_rope_head_dim=d.qk_rope_head_dim,
                      qk_nope_head_dim=d.qk_nope_head_dim, v_head_dim=d.v_head_dim, n_routed_experts=d.n_routed_experts,
                      n_shared_experts=d.n_shared_experts, moe_intermediate_size=d.moe_intermediate_size,
                      first_k_dense_replace=d.first_k_dense_replace, num_experts_per_tok=d.num_experts_per_tok,
                      rope_scaling={"rope_type": "yarn" if d.yarn_factor else "default"})
    if d.quantization == "w4a16":
        config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {
            "group_0": {"weights": {"num_bits": 4, "group_size": d.quant_group_size}}}}
    info = _read(config, "profile [demo_target]")
    return info if mla else replace(info, rope_type="")  # a Llama demo names no rope type


def target_info(profile: Profile) -> TargetInfo:
    if profile.target.source == "demo":
        return demo_info(profile)
    path = config_path(profile)
    if path is None:
        raise TargetInfoError(f"no config.json at target.model_path {profile.target.model_path!r} and no "
                              f"target.config to plan from")
    return from_config(path)


@dataclass(frozen=True)
class DraftPlan:
    layer_ids: list[int]  # vLLM-style, last = final layer
    trainer_layer_ids: list[int]  # what `speculators train --target-layer-ids` gets
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    draft_vocab: int
    target_vocab: int
    num_layers: int
    ttt_steps: int
    trainable_params: int
    frozen_params: int


def draft_plan(info: TargetInfo, profile: Profile, layers: int | None = None) -> DraftPlan:
    """speculators' EAGLE-3 Llama draft on this target: fc over the aux states, `num_layers` decoder
    layers whose first attention reads [embedding, hidden] (2H wide), lm_head over the draft vocabulary;
    the target's embeddings are loaded and frozen. Heads, KV heads, head_dim and the MLP width are the
    verifier's as transformers reports them (speculators' create_transformer_layer_config): an MLA
    target gives head_dim = qk_rope_head_dim and every head a KV head."""
    ids = resolve_layer_ids(profile.extract.layer_ids, info.layers)
    h, n_aux = info.hidden, len(ids) - 1
    n_layers = layers or profile.train.num_layers  # `layers`: a warm start's head's own (planning.steps)
    heads = info.heads or max(1, h // 128)
    kv_heads = info.kv_heads or heads
    head_dim = info.head_dim or h // heads
    d = min(profile.vocab.draft_vocab_size, info.vocab)
    attn = 2 * h * heads * head_dim + 2 * (2 * h * kv_heads * head_dim) + heads * head_dim * h  # q, k, v read 2H; o
    mlp = 3 * h * info.intermediate
    layer = attn + mlp + 3 * h
    trainable = n_aux * h * h + n_aux * h + n_layers * layer + d * h + h  # fc, its input norm, …
    return DraftPlan(layer_ids=ids, trainer_layer_ids=ids[:-1], hidden=h, heads=heads, kv_heads=kv_heads,
                     head_dim=head_dim, intermediate=info.intermediate, draft_vocab=d, target_vocab=info.vocab,
                     num_layers=n_layers, ttt_steps=profile.train.ttt_steps,
                     trainable_params=trainable, frozen_params=info.vocab * h)
