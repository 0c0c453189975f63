"""Online training (extract.mode = "online"): the trainer asks the extraction server for each sample's
hidden states while it trains — speculators' own path, `--on-missing generate --vllm-endpoint` — loads
them and deletes them (hs_connectors: files on this node, Mooncake across nodes). Only the states in
flight are on disk, plus an optional cache: the first rows up to extract.cache_gib, extracted once
by the extract stage and read every epoch (the trainer looks for hs_{i} files before generating).

Applies to speculators 0.9.0 / hs-connectors 0.9.0 (ArrowDataset._get_raw_data, FileTransfer,
MooncakeBackend); docs/reference.md §1 and NOTES.md "Online training"."""
from __future__ import annotations

import argparse
import itertools
import threading
import time
from pathlib import Path

from pipeline.profile import Profile
from pipeline.serving import client


def mooncake_args(profile: Profile) -> argparse.Namespace:
    """The profile's Mooncake keys under the names hs_connectors' own argparse gives them."""
    ex = profile.extract
    return argparse.Namespace(mooncake_master=ex.mooncake_master, mooncake_metadata_server=ex.mooncake_metadata_server,
                              mooncake_protocol=ex.mooncake_protocol, mooncake_device=ex.mooncake_device,
                              mooncake_global_segment_gib=ex.mooncake_global_segment_gib,
                              mooncake_local_buffer_gib=ex.mooncake_local_buffer_gib, mooncake_writer_threads=4)


def mooncake_kv_config(profile: Profile) -> dict:
    """The extraction server's --kv-transfer-config for Mooncake, built by hs_connectors itself
    (MOONCAKE_LOCAL_HOSTNAME, else this host's address, names the node)."""
    from hs_connectors.transfer import MooncakeBackend
    return MooncakeBackend.build_kv_transfer_config(mooncake_args(profile))


def trainer_flags(profile: Profile, endpoint: str, states_dir: Path) -> list[str]:
    """speculators train flags that make it generate missing states through `endpoint`."""
    ex = profile.extract
    flags = ["--on-missing", "generate", "--vllm-endpoint", endpoint, "--hidden-states-backend", ex.transfer]
    if ex.transfer == "file":
        return flags + ["--hidden-states-path", str(states_dir)]
    ns = vars(mooncake_args(profile))
    for key in ("mooncake_master", "mooncake_metadata_server", "mooncake_protocol", "mooncake_device",
                "mooncake_global_segment_gib", "mooncake_local_buffer_gib"):  # the trainer's, named
        flags += ["--" + key.replace("_", "-"), str(ns[key])]
    return flags


def cached_prefix(seq_lens: list[int], bytes_per_token: int, budget_bytes: int) -> int:
    """How many leading rows' states fit the cache budget."""
    used = itertools.accumulate(length * bytes_per_token for length in seq_lens)
    return next((n for n, total in enumerate(used) if total > budget_bytes), len(seq_lens))


def leading_slice(total: int, rows: int) -> tuple[int, int]:
    """(world_size, rank) whose speculators split (generate-offline-data --world-size/--rank) is a
    leading slice of at most `rows` rows: its own tool extracts the cache, hs_{i} named as training reads them."""
    return (1, 0) if rows >= total else (-(-total // rows), 0)


class StatesWatch:
    """While online training runs: the disk the in-flight states take (peak, sampled) and the
    server's generation rate (prompt tokens per second from /metrics), reported to `report`."""

    def __init__(self, raw_dir: Path, base_url: str, report, period: float = 0.1):
        self.raw_dir, self.base_url, self.report, self.period = Path(raw_dir), base_url, report, period
        self.peak_bytes = self.peak_files = 0
        self.generated_tokens = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="states-watch", daemon=True)

    def __enter__(self) -> StatesWatch:
        self._start_tokens = client.prompt_tokens(self.base_url) or 0.0
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sample_disk()

    def _sample_disk(self) -> None:
        sizes = []
        for path in self.raw_dir.rglob("*") if self.raw_dir.is_dir() else []:
            try:
                if path.is_file():
                    sizes.append(path.stat().st_size)
            except FileNotFoundError:  # loaded and deleted between listing and stat
                continue
        self.peak_bytes = max(self.peak_bytes, sum(sizes))
        self.peak_files = max(self.peak_files, len(sizes))

    def _loop(self) -> None:
        last_t, last_tokens, next_rate = time.monotonic(), self._start_tokens, time.monotonic() + 2
        while not self._stop.wait(self.period):
            self._sample_disk()
            if time.monotonic() < next_rate:
                continue
            tokens, now = client.prompt_tokens(self.base_url), time.monotonic()
            if tokens is not None:
                self.generated_tokens = tokens - self._start_tokens
                self.report(generate_tok_s=round((tokens - last_tokens) / (now - last_t), 1),
                            states_disk_peak_mb=round(self.peak_bytes / 1e6, 2))
                last_t, last_tokens = now, tokens
            next_rate = now + 2
