"""Reading out of a trainer's log that another node of its job was lost (torch 2.11–2.13).

gloo's TCP transport, when the other end of a pair goes away mid-collective, raises `Connection closed by
peer [HOST]:PORT. This is typically caused by a remote worker crashing.` (third_party/gloo
gloo/transport/tcp/pair.cc; measured on torch 2.13.0 CPU, two nodes on one machine, 2026-12-02). NCCL's
watchdog words it as `remote process exited or there was a network error` (ProcessGroupNCCL.cpp).
A rendezvous that never forms: torchrun's `RendezvousTimeoutError` (torch/distributed/elastic/rendezvous),
or, for the static rendezvous the train stage uses, the TCPStore's "waiting for clients" timeout (its C++
wording, not yet seen here). torchrun itself then ends with its own `ChildFailedError`, which
names the local rank, not the cause: the cause is these lines above it.
"""
from __future__ import annotations

import re

# gloo's two wordings: the peer closed the pair, or reset it mid-read (`Read error [127.0.0.1]:48528:
# Connection reset by peer. This is typically caused by a remote worker hanging…`, the same kill, 2026-12-02)
PEER_LOST = re.compile(r"Connection (closed) by peer \[([^\]]+)\]:(\d+)|\[([^\]]+)\]:(\d+): Connection (reset) by peer")
NCCL_REMOTE = "remote process exited or there was a network error"
RENDEZVOUS_TIMEOUT = ("RendezvousTimeoutError", "waiting for clients")
# torchrun prefixes each line of a worker with its rank, and rich wraps the message across such lines
RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s?", re.MULTILINE)


def node_lost(log_text: str) -> str | None:
    """Why the job lost a node, in words, when the log says so; None otherwise."""
    text = " ".join(RANK_PREFIX.sub("", log_text).split())
    if m := PEER_LOST.search(text):
        how, addr, port = (m.group(1), m.group(2), m.group(3)) if m.group(1) else (m.group(6), m.group(4), m.group(5))
        return f"gloo: connection {how} by peer {addr}:{port} (a remote worker stopped)"
    if NCCL_REMOTE in log_text:
        return f"NCCL: {NCCL_REMOTE}"
    if any(words in text for words in RENDEZVOUS_TIMEOUT):
        return "not every node joined the rendezvous in time"
    return None
