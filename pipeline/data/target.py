"""Loading the target with transformers and reading its hidden states the way vLLM numbers layers.

Layer id k is the residual stream after k decoder layers (0 = embeddings); id L (the last layer) is
taken *before* the final norm. transformers 5.x hands back hidden_states[L] after the norm
(docs/reference.md §7), so the pre-norm state is captured with a hook on the final norm's input
(pipeline/compat/prenorm.py).
"""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.compat import prenorm

# torch is imported where it is used: the console imports the stage modules and must stay light.


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


def load_model(path: Path, dtype: str, device: str = "auto"):
    """The target for transformers-side work; "auto" = spread over the visible GPUs when there are
    any (accelerate's device map), else the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    if device == "auto":
        device = "auto" if torch.cuda.is_available() else "cpu"
    # A multimodal wrapper (Kimi-K2.5: the text model under text_config) loads through its own class.
    cfg = json.loads((Path(path) / "config.json").read_text())
    auto = AutoModelForImageTextToText if text_config(cfg) is not cfg else AutoModelForCausalLM
    model = auto.from_pretrained(str(path), dtype=getattr(torch, dtype), device_map=None if device == "cpu" else device)
    return model.eval()


def text_config(cfg: dict) -> dict:
    """The language model's part of a config.json: itself, or a multimodal wrapper's (Kimi-K2.5)."""
    return cfg.get("text_config") or cfg.get("language_config") or cfg


def num_layers(model) -> int:
    return model.config.get_text_config().num_hidden_layers


def text_decoder(model):
    """The decoder stack whose final norm ends the residual stream (LlamaModel, the wrapper's
    language model)."""
    return model.get_decoder()


def default_layer_ids(n: int) -> list[int]:
    """speculators' default aux ids [2, n//2, n-3] plus the final layer; for tiny targets where that
    is not strictly increasing, evenly spread ids instead (docs/reference.md §3.2)."""
    ids = [2, n // 2, n - 3, n]
    if sorted(set(ids)) == ids:
        return ids
    return sorted({max(1, round(n * f)) for f in (0.25, 0.5, 0.75)} | {n})


def resolve_layer_ids(configured: list[int], n: int) -> list[int]:
    """The profile's vLLM-style ids (last = final layer), or the default for an n-layer target."""
    return list(configured) or default_layer_ids(n)


class HiddenStateReader:
    """Run the target and return logits plus the hidden states at `layer_ids` as [B, T, len(ids), H]."""

    def __init__(self, model, layer_ids: list[int]):
        n = num_layers(model)
        if max(layer_ids) > n:
            raise ValueError(f"layer id {max(layer_ids)} > number of layers {n}")
        self.model = model
        self.layer_ids = list(layer_ids)
        self._prenorm = None
        self._final = n
        prenorm.hook_final_norm_input(text_decoder(model), self._capture)

    def _capture(self, module, args):
        self._prenorm = args[0]

    def __call__(self, input_ids, attention_mask=None):
        import torch
        device = self.model.get_input_embeddings().weight.device
        input_ids = input_ids.to(device)
        attention_mask = attention_mask.to(device) if attention_mask is not None else None
        with torch.no_grad():
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                             use_cache=False)
            layers = [self._prenorm if i == self._final else out.hidden_states[i] for i in self.layer_ids]
            # spread over several GPUs (device_map "auto"), the layers' states live on different devices
            return out.logits, torch.stack([x.to(out.logits.device) for x in layers], dim=2)
