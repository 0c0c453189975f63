"""build-target (demo only): a tiny target (Llama, or a Kimi-class DeepSeek-V3 with MLA and MoE) and a
byte-level BPE tokenizer with a chat template, trained and built locally from offline text, cached by
their configuration."""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import psutil

from pipeline.compat import kimi_layout
from pipeline.data import demo_data, demo_pretrain
from pipeline.layout import atomicio
from pipeline.layout.results import BuildTargetResult
from pipeline.profile import DemoTargetSection, Profile
from pipeline.stages.base import Stage, StageContext, StageError

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
END_TOKEN_ID = 6
# Prefix-stable: rendering a conversation's first n turns yields a token prefix of rendering all of
# them, because every role marker and <|end|> is a special token that BPE never merges across.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
BUILD_VERSION = 1  # bump when the builder changes what it produces
# Kimi-K2.5's template opens a thinking block at every answer and renders earlier answers with an empty one
# (their reasoning stripped, up to "</think>"). The Kimi-class demo target carries the same shape, with
# <think> and </think> as plain added tokens (decoded as text, so the history can be stripped), so that
# regeneration keeps the thinking the target generates at serving time (docs/reference.md §9).
THINK_TOKENS = ["<think>", "</think>"]
THINKING_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "<|assistant|><think></think>{{ m['content'].split('</think>')[-1] }}<|end|>"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>{% endif %}"
)
TEMPLATE_VERSIONS = {"kimi_k25": 1}  # part of the cache key of the architectures whose template changed


LLAMA_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "max_position_embeddings", "tokenizer_source_files", "seed")
CORPUS_FIELDS = ("corpus_conversations", "corpus_seed", "corpus_steps", "corpus_lr", "corpus_batch", "corpus_seq",
                 "corpus_source_files", "corpus_dtype", "corpus_answers", "next_release_steps", "next_release_seed",
                 "next_release_lr")
# Fields added after targets were cached: at their defaults they leave a spec's key as it was.
DEFAULTS_KEPT_OUT = {"corpus_source_files": 0, "corpus_dtype": "float32", "corpus_device": "auto",
                     "corpus_answers": "docstring", "next_release_steps": 0, "next_release_seed": 1,
                     "next_release_lr": 0.0}
PRETRAIN_RECORD = "pretrain.json"  # what teaching the target its corpus measured, kept with the weights


def cache_key(spec: DemoTargetSection) -> str:
    """Content hash of what the builder produces: only the fields the architecture uses count, so a
    Llama target keeps its key when DeepSeek-V3 fields are added or changed."""
    fields = spec.__dict__ if spec.architecture != "llama" else {f: getattr(spec, f)
                                                                 for f in LLAMA_FIELDS + CORPUS_FIELDS}
    if not spec.corpus_conversations:  # random weights: the corpus fields do not change what is built
        fields = {k: v for k, v in fields.items() if k not in CORPUS_FIELDS}
    fields = {k: v for k, v in fields.items() if k != "corpus_device" and DEFAULTS_KEPT_OUT.get(k, object()) != v}
    versions = {"template": TEMPLATE_VERSIONS[spec.architecture]} if spec.architecture in TEMPLATE_VERSIONS else {}
    blob = json.dumps({"v": BUILD_VERSION, **versions, **fields}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


# Kimi-K2.5's media tokens, which vLLM's KimiK25 model and its processor look up even for text only
MEDIA_TOKENS = ["<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>",
                "<|kimi_k25_video_placeholder|>"]


def build_tokenizer(spec: DemoTargetSection):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    kimi = spec.architecture == "kimi_k25"
    specials = SPECIAL_TOKENS + (MEDIA_TOKENS if kimi else [])
    added = THINK_TOKENS if kimi else []
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size - len(added), special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    files = [str(p) for p in demo_data.stdlib_sources(spec.tokenizer_source_files)]
    tok.train(files, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", additional_special_tokens=specials[3:])
    fast.add_tokens(added)  # plain added tokens: atomic, and kept when answers are decoded
    fast.chat_template = THINKING_CHAT_TEMPLATE if kimi else CHAT_TEMPLATE
    return fast


def _common(spec: DemoTargetSection, vocab_size: int) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=[2, END_TOKEN_ID], pad_token_id=0, dtype="float32")


def llama_model(spec: DemoTargetSection, vocab_size: int, tokenizer=None):
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**_common(spec, vocab_size), num_key_value_heads=spec.num_kv_heads))


def deepseek_v3_config(spec: DemoTargetSection, vocab_size: int):
    """A Kimi-K2.5-shaped text model: MLA (low-rank q and kv, decoupled rope) and DeepSeek MoE
    (sigmoid-scored routed experts with a correction bias, one shared expert, dense first layers)."""
    from transformers import DeepseekV3Config
    return DeepseekV3Config(
        **_common(spec, vocab_size), num_key_value_heads=spec.num_heads,
        q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank, qk_rope_head_dim=spec.qk_rope_head_dim,
        qk_nope_head_dim=spec.qk_nope_head_dim, v_head_dim=spec.v_head_dim,
        n_routed_experts=spec.n_routed_experts, num_experts_per_tok=spec.num_experts_per_tok,
        n_shared_experts=spec.n_shared_experts, moe_intermediate_size=spec.moe_intermediate_size,
        first_k_dense_replace=spec.first_k_dense_replace, n_group=1, topk_group=1, norm_topk_prob=True,
        # vLLM creates the gate's e_score_correction_bias only for "noaux_tc" (else loading fails with
        # KeyError '…mlp.gate.e_score_correction_bias'); transformers always has it. Both as DeepSeek-V3.
        topk_method="noaux_tc", scoring_func="sigmoid", rope_parameters=_rope(spec),
    )


def deepseek_v3_model(spec: DemoTargetSection, vocab_size: int, tokenizer=None):
    from transformers import DeepseekV3ForCausalLM
    return DeepseekV3ForCausalLM(deepseek_v3_config(spec, vocab_size))


def kimi_k25_model(spec: DemoTargetSection, vocab_size: int, tokenizer=None):
    """Kimi-K2.5's own wrapper (`KimiK25ForConditionalGeneration`: the DeepSeek-V3 text model under
    `text_config`, a MoonViT vision tower and projector) with a one-layer 32-wide vision tower, so
    vLLM and transformers run the exact Kimi code path on text."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration
    media = {t: tokenizer.convert_tokens_to_ids(t) for t in MEDIA_TOKENS}
    text = {**deepseek_v3_config(spec, vocab_size).to_dict(), "model_type": "deepseek_v3"}
    vision = dict(patch_size=14, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, num_attention_heads=2,
                  num_hidden_layers=1, hidden_size=32, intermediate_size=64, merge_kernel_size=[2, 2])
    config = Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32,
                            image_token_id=media["<|media_pad|>"], video_token_id=media["<|media_pad|>"],
                            vision_start_token_id=media["<|media_begin|>"], vision_end_token_id=media["<|media_end|>"],
                            tie_word_embeddings=False, dtype="float32")
    # vLLM's EAGLE-3 proposer reads this top-level key of Kimi's own config
    config.media_placeholder_token_id = media["<|media_pad|>"]
    return Kimi_K25ForConditionalGeneration(config).float()


def _rope(spec: DemoTargetSection) -> dict:
    if not spec.yarn_factor:
        return {"rope_type": "default", "rope_theta": 50000.0}
    return {"rope_type": "yarn", "rope_theta": 50000.0, "factor": spec.yarn_factor, "beta_fast": 1.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": max(1, int(spec.max_position_embeddings / spec.yarn_factor))}


BUILDERS = {"llama": llama_model, "deepseek_v3": deepseek_v3_model, "kimi_k25": kimi_k25_model}


def build_model(spec: DemoTargetSection, vocab_size: int, tokenizer=None):
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(spec.seed)
    model = BUILDERS[spec.architecture](spec, vocab_size, tokenizer).eval()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, END_TOKEN_ID], pad_token_id=0,
                                               do_sample=False)
    return model


ROUTED_EXPERT = re.compile(r"^(language_model\.)?model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def int4_quantization_config(group_size: int) -> dict:
    """Kimi-K2.5's own quantization_config shape: routed experts only (attention, dense MLPs, shared
    experts and lm_head stay float)."""
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                                  "group_size": group_size, "dynamic": False, "actorder": None,
                                                  "observer": "minmax", "observer_kwargs": {}}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                   "re:vision_tower.*", "re:mm_projector.*"],
        "kv_cache_scheme": None,
    }


def quantize_routed_experts(model_dir: Path, group_size: int) -> None:
    """Rewrite the saved routed-expert weights as compressed-tensors pack-quantized INT4 (symmetric,
    min-max scale per group of `group_size` inputs), with compressed-tensors' own packer. transformers
    keeps the experts as fused 3-D parameters in memory, so the quantizer works on the per-expert tensors
    save_pretrained writes."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size,
                            observer="minmax", dynamic=False)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    path = model_dir / "model.safetensors"
    tensors, out = load_file(str(path)), {}
    for name, w in tensors.items():
        if not ROUTED_EXPERT.match(name):
            out[name] = w
            continue
        groups = w.reshape(w.shape[0], -1, group_size)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        packed = PackedQuantizationCompressor.compress(
            {"weight": w, "weight_scale": scale.to(w.dtype), "weight_zero_point": zero}, scheme)
        out.update({name[: -len("weight")] + k: v.contiguous() for k, v in packed.items()})
    save_file(out, str(path), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = int4_quantization_config(group_size)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))


def build_target(spec: DemoTargetSection, cache_dir: Path,
                 on_step: Callable[[int, int, float], None] = lambda step, total, loss: None) -> Path:
    """Return the cached target directory, building it (into a temp dir, then renamed) if absent;
    `on_step` follows the corpus training when there is one."""
    final = Path(cache_dir) / f"demo-target-{cache_key(spec)}"
    if (final / "model.safetensors").is_file() and (final / "tokenizer.json").is_file():
        return final
    # One temp directory per process: two runs of the same spec (say on two ports) build side by side and
    # the first rename wins; a killed build's leftover goes once its process is gone.
    for stale in final.parent.glob(f"{final.name}.building-*"):
        pid = stale.name.rsplit("-", 1)[1]
        if not (pid.isdigit() and psutil.pid_exists(int(pid))):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = final.with_name(f"{final.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if spec.next_release_steps:
        model, tokenizer = next_release(spec, cache_dir, tmp, on_step)
    else:
        tokenizer = build_tokenizer(spec)
        model = build_model(spec, len(tokenizer), tokenizer)
        if spec.corpus_conversations:
            record = demo_pretrain.pretrain(model, tokenizer, spec, on_step)
            atomicio.atomic_write_json(tmp / PRETRAIN_RECORD, record)
    tokenizer.save_pretrained(tmp)
    model.save_pretrained(tmp)
    if spec.architecture == "kimi_k25":
        kimi_layout.write_kimi_layout(tmp)
    if spec.quantization == "w4a16":
        quantize_routed_experts(tmp, spec.quant_group_size)
    if final.exists() and not (final / "model.safetensors").is_file():
        shutil.rmtree(final, ignore_errors=True)  # an incomplete leftover, not another process's result
    try:
        tmp.rename(final)
    except OSError:  # another process finished the same target first (a non-empty directory is there)
        if not (final / "model.safetensors").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    atomicio.fsync_dir(final.parent)
    return final


def next_release(spec: DemoTargetSection, cache_dir: Path, tmp: Path, on_step):
    """The old target (this spec without next_release_steps, built or taken from the cache as itself), trained
    next_release_steps further on next_release_seed's conversations: the same tokenizer and shape, other
    answers. Its record keeps the old one's with the further training's beside it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the old spec without any next-release field: its key is the old target's whatever seed or rate the new asks
    old = build_target(spec.model_copy(update={k: DEFAULTS_KEPT_OUT[k] for k in
                                               ("next_release_steps", "next_release_seed", "next_release_lr")}),
                       cache_dir, on_step)
    tokenizer = AutoTokenizer.from_pretrained(old)
    model = AutoModelForCausalLM.from_pretrained(old, dtype="auto")
    further = spec.model_copy(update={"corpus_seed": spec.next_release_seed, "corpus_steps": spec.next_release_steps,
                                      "corpus_lr": spec.next_release_lr or spec.corpus_lr, "seed": spec.seed + 1})
    record = demo_pretrain.pretrain(model, tokenizer, further, on_step)
    base = json.loads((old / PRETRAIN_RECORD).read_text()) if (old / PRETRAIN_RECORD).is_file() else {}
    atomicio.atomic_write_json(tmp / PRETRAIN_RECORD, {**base, "next_release": {
        "old_target": str(old), "old_key": old.name.removeprefix("demo-target-"), **record}})
    return model, tokenizer


class BuildTarget(Stage):
    name = "build-target"

    def applies(self, profile: Profile) -> bool:
        return profile.target.source == "demo" or profile.data.uses_demo()

    def outputs(self, ctx: StageContext) -> list[Path]:
        return ([ctx.target_dir()] if ctx.profile.target.source == "demo" else []) + (
            [ctx.run.demo_conversations] if ctx.profile.data.uses_demo() else [])

    def fresh_paths(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.demo_conversations]  # the target lives in the shared cache, no run's to leave behind

    def run(self, ctx: StageContext) -> BuildTargetResult:
        figures: dict = {}
        if ctx.profile.target.source == "demo":
            spec = ctx.profile.demo_target
            cache = Path(ctx.profile.run.cache_dir).resolve()
            cached = (cache / f"demo-target-{cache_key(spec)}" / "model.safetensors").is_file()
            ctx.log.info("demo target %s (%s)", cache_key(spec), "cached" if cached else "building")
            try:
                target = build_target(spec, cache, lambda step, total, loss: ctx.progress(
                    step, total, "corpus steps", loss=round(loss, 3)))
            except demo_data.TooFewFunctions as exc:  # the profile asks the impossible: a resume keeps it
                raise StageError(f"demo_target.corpus_conversations = {spec.corpus_conversations}: {exc}",
                                 resumable=False) from None
            ctx.run.update_stage(self.name, figures={"target_dir": str(target)})
            figures.update(target_dir=str(target), cached=cached, params=_param_count(target),
                           vocab_size=spec.vocab_size, layers=spec.num_layers, architecture=spec.architecture)
            if (target / PRETRAIN_RECORD).is_file():
                figures.update(json.loads((target / PRETRAIN_RECORD).read_text()))
        if ctx.profile.data.uses_demo():
            try:
                data = ctx.profile.data
                convs = demo_data.conversations(data.num_conversations, data.seed, data.demo_answers)
            except demo_data.TooFewFunctions as exc:
                raise StageError(f"data.num_conversations = {ctx.profile.data.num_conversations}: {exc}",
                                 resumable=False) from None
            atomicio.atomic_write_text(ctx.run.demo_conversations, "".join(json.dumps(c) + "\n" for c in convs))
            figures["conversations"] = len(convs)
        return BuildTargetResult.of(figures)


def _param_count(target: Path) -> int:
    from safetensors import safe_open
    with safe_open(str(target / "model.safetensors"), framework="pt") as fh:
        return sum(math.prod(fh.get_slice(key).get_shape()) for key in fh.keys())
