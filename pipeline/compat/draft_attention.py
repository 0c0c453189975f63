"""The attention a loaded EAGLE-3 head runs with in this project's own decoding
(pipeline/evaluation/offline_decoding.py).

speculators 0.9.0's `Eagle3DraftModel` takes its attention from transformers' private
`transformer_layer_config._attn_implementation`, which a saved checkpoint does not carry: a loaded head
gets speculators' default "simple_flex_attention" (BlockMask masks; flex attention has no CPU backward),
whatever the trainer ran with. The `DraftProposer` calls the head's decoder layers itself with dense
boolean masks, so the config is set to transformers' "sdpa" before the model is built; the layers
dispatch on that same attribute.

Applies to speculators 0.9.0 with transformers 5.19.0 (5.17.0 on the GPU box). tests/test_compat_adaptations.py
fails when the attribute stops being honoured (the head and its layers do not run sdpa) or a loaded head
stops defaulting to flex attention.
"""
from __future__ import annotations

DRAFT_ATTENTION = "sdpa"
SPECULATORS_DEFAULT = "simple_flex_attention"  # what a loaded head runs without this adaptation


def use_sdpa(config) -> None:
    """Set a loaded `Eagle3SpeculatorConfig` to build its decoder layers with sdpa."""
    config.transformer_layer_config._attn_implementation = DRAFT_ATTENTION
