"""Online training's fetcher: several requests in flight per data-loader worker, and a generated state read as
soon as it is written (speculators 0.9.0, hs-connectors 0.9.0).

speculators' online path (`--on-missing generate`) fetches a packed batch's samples one after another in each
data-loader worker (torch's fetcher: `[dataset[i] for i in batch]`), each a synchronous request to the
extraction server: a rank keeps `--num-workers` requests in flight (one with none), far below what a vLLM
server prefills at (NOTES.md "Online training"). torch's fetcher asks a dataset's `__getitems__` for the whole
batch when it has one; ConcurrentArrowDataset answers it with `requests` threads, each running speculators'
own `__getitem__` (the request, the load, the validation, the delete), results in the batch's order. The
threads wait on the network, not the GIL. The same threads serve every batch of a worker (hs_connectors'
Mooncake store registers a staging buffer per thread id and never frees it), and a worker fetches serially
until its client is set up (speculators' `_setup_client` and the transfer's `setup()` hold no lock: two
threads would each mount a Mooncake segment).

Each answer then waits for the connector's `.lock` on the state file: hs_connectors' `wait_for_lock` tries
once and sleeps 0.1 s between tries, so a state written in a millisecond costs its sample up to 100 ms.
`wait_for_lock_promptly` keeps its contract (the same lock, the same 10 s timeout, the lock file removed)
and tries again after 1 ms, doubling up to the same 0.1 s.

Installed by the trainer's launcher when the train stage asks for more than one request per worker (online
only; 1 = speculators as released); the class lives in this module so that spawned workers unpickle it by
name, and a worker that unpickles it installs the prompt wait in its own process.
"""
from __future__ import annotations

import fcntl
import importlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from speculators.train.data import ArrowDataset

REPLACED = ("speculators.train.dataloader", "ArrowDataset")  # the name create_train_val_loaders builds with
LOCK_WAIT = ("hs_connectors.transfer", "wait_for_lock")  # what _load_hs_file calls for a generated file
FIRST_RETRY_S = 0.001


def wait_for_lock_promptly(lock_path: str, timeout: float = 10.0, poll_interval: float = 0.1) -> None:
    """hs_connectors 0.9.0's wait_for_lock, retrying after 1 ms and doubling up to `poll_interval`."""
    fd = os.open(lock_path, os.O_RDWR)
    try:
        deadline, delay = time.monotonic() + timeout, min(FIRST_RETRY_S, poll_interval)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"Timed out waiting for lock: {lock_path}") from None
                time.sleep(delay)
                delay = min(delay * 2, poll_interval)
    finally:
        os.close(fd)
    os.remove(lock_path)


def _wait_promptly() -> None:
    module = importlib.import_module(LOCK_WAIT[0])
    if getattr(module, LOCK_WAIT[1]) is wait_for_lock_promptly:
        return
    if not callable(getattr(module, LOCK_WAIT[1], None)) or not hasattr(module, "_load_hs_file"):
        raise RuntimeError(f"hs_connectors changed: {'.'.join(LOCK_WAIT)} or _load_hs_file is gone; "
                           f"pipeline/compat/speculators_online.py must be updated")
    setattr(module, LOCK_WAIT[1], wait_for_lock_promptly)


class ConcurrentArrowDataset(ArrowDataset):
    requests = 1  # set by install(); each instance keeps its own (a spawned worker unpickles its __dict__)
    _pool: ThreadPoolExecutor | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests = type(self).requests

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_pool"}  # threads stay in their process

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        _wait_promptly()  # in a spawned worker's process too

    def __getitems__(self, indices: list[int]) -> list[Any]:
        if self.on_missing != "generate" or self.requests < 2 or len(indices) < 2:
            return [self[i] for i in indices]
        rest, fetched = list(indices), []
        while rest and self.client is None:  # one at a time until the client (and a Mooncake store) is set up
            fetched.append(self[rest.pop(0)])
        if rest:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.requests, thread_name_prefix="eagle3-generate")
            fetched += self._pool.map(self.__getitem__, rest)
        return fetched


def install(requests: int) -> str | None:
    """With 2 or more requests per worker: speculators' loaders build ConcurrentArrowDataset and generated
    states are read promptly; what was replaced (None for 1: speculators as released)."""
    if requests < 2:
        return None
    module_name, name = REPLACED
    module = importlib.import_module(module_name)
    if getattr(module, name, None) not in (ArrowDataset, ConcurrentArrowDataset):
        raise RuntimeError(f"speculators changed: {module_name}.{name} is no longer speculators.train.data's "
                           f"ArrowDataset; pipeline/compat/speculators_online.py must be updated")
    ConcurrentArrowDataset.requests = requests
    setattr(module, name, ConcurrentArrowDataset)
    _wait_promptly()
    return f"{module_name}.{name} ({requests} requests per worker), {'.'.join(LOCK_WAIT)} (1 ms first retry)"
