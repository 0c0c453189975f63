"""build-target (demo only): a tiny Llama target and a byte-level BPE tokenizer with a chat template,
trained and built locally from offline text, cached by their configuration."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from pipeline import atomicio, demo_data
from pipeline.profile import DemoTargetSection, Profile
from pipeline.stages.base import Stage, StageContext

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
END_TOKEN_ID = 6
# Prefix-stable: rendering a conversation's first n turns yields a token prefix of rendering all of
# them, because every role marker and <|end|> is a special token that BPE never merges across.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
BUILD_VERSION = 1  # bump when the builder changes what it produces


def cache_key(spec: DemoTargetSection) -> str:
    blob = json.dumps({"v": BUILD_VERSION, **spec.__dict__}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def build_tokenizer(spec: DemoTargetSection):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    files = [str(p) for p in demo_data.stdlib_sources(spec.tokenizer_source_files)]
    tok.train(files, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", additional_special_tokens=SPECIAL_TOKENS[3:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(spec: DemoTargetSection, vocab_size: int):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=[2, END_TOKEN_ID], pad_token_id=0,
        dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, END_TOKEN_ID], pad_token_id=0,
                                               do_sample=False)
    return model


def build_target(spec: DemoTargetSection, cache_dir: Path) -> Path:
    """Return the cached target directory, building it (into a temp dir, then renamed) if absent."""
    final = Path(cache_dir) / f"demo-target-{cache_key(spec)}"
    if (final / "model.safetensors").is_file() and (final / "tokenizer.json").is_file():
        return final
    tmp = final.with_name(final.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = build_tokenizer(spec)
    tokenizer.save_pretrained(tmp)
    build_model(spec, len(tokenizer)).save_pretrained(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    atomicio.fsync_dir(final.parent)
    return final


class BuildTarget(Stage):
    name = "build-target"

    def applies(self, profile: Profile) -> bool:
        return profile.target.source == "demo" or profile.data.conversations == "demo"

    def outputs(self, ctx: StageContext) -> list[Path]:
        out = []
        if ctx.profile.target.source == "demo":
            out.append(ctx.target_dir())
        if ctx.profile.data.conversations == "demo":
            out.append(ctx.source_conversations())
        return out

    def run(self, ctx: StageContext) -> dict:
        figures: dict = {}
        if ctx.profile.target.source == "demo":
            spec = ctx.profile.demo_target
            cache = Path(ctx.profile.run.cache_dir).resolve()
            cached = (cache / f"demo-target-{cache_key(spec)}" / "model.safetensors").is_file()
            ctx.log.info("demo target %s (%s)", cache_key(spec), "cached" if cached else "building")
            target = build_target(spec, cache)
            ctx.run.update_stage(self.name, figures={"target_dir": str(target)})
            figures.update(target_dir=str(target), cached=cached,
                           params=_param_count(target), vocab_size=spec.vocab_size, layers=spec.num_layers)
        if ctx.profile.data.conversations == "demo":
            convs = demo_data.conversations(ctx.profile.data.num_conversations, ctx.profile.data.seed)
            text = "".join(json.dumps(c) + "\n" for c in convs)
            atomicio.atomic_write_text(ctx.source_conversations(), text)
            figures["conversations"] = len(convs)
        return figures


def _param_count(target: Path) -> int:
    from safetensors import safe_open
    with safe_open(str(target / "model.safetensors"), framework="pt") as fh:
        total = 0
        for key in fh.keys():
            n = 1
            for d in fh.get_slice(key).get_shape():
                n *= d
            total += n
    return total
