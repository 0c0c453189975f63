"""Reading out of a trainer's log that another node of its job was lost (torch 2.11–2.13).

gloo's TCP transport, when the other end of a pair goes away mid-collective, raises `Connection closed by
peer [HOST]:PORT. This is typically caused by a remote worker crashing.` (third_party/gloo
gloo/transport/tcp/pair.cc; measured on torch 2.13.0 CPU, two nodes on one machine, 2026-12-02). NCCL's
watchdog words it as `remote process exited or there was a network error` (ProcessGroupNCCL.cpp).
torchrun's c10d rendezvous gives up on a node that never joins with `RendezvousTimeoutError`
(torch/distributed/elastic/rendezvous). torchrun itself then ends with its own `ChildFailedError`, which
names the local rank, not the cause: the cause is these lines above it.
"""
from __future__ import annotations

import re

PEER_CLOSED = re.compile(r"Connection closed by peer \[([^\]]+)\]:(\d+)")
NCCL_REMOTE = "remote process exited or there was a network error"
RENDEZVOUS_TIMEOUT = "RendezvousTimeoutError"


def node_lost(log_text: str) -> str | None:
    """Why the job lost a node, in words, when the log says so; None otherwise."""
    if m := PEER_CLOSED.search(log_text):
        return f"gloo: connection closed by peer {m.group(1)}:{m.group(2)} (a remote worker stopped)"
    if NCCL_REMOTE in log_text:
        return f"NCCL: {NCCL_REMOTE}"
    if RENDEZVOUS_TIMEOUT in log_text:
        return "not every node joined the rendezvous in time (torchrun's RendezvousTimeoutError)"
    return None
