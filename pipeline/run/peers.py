"""The other nodes of a multi-node job, read from their exporters (`eagle3-console exporter RUN_DIR` on each,
listed in train.node_exporters): node 0's `status` and console show each node's run, its running stage,
progress and ETA, or why it cannot be read. Prometheus text, parsed by prometheus_client."""
from __future__ import annotations

import http.client

from prometheus_client.parser import text_string_to_metric_families

from pipeline.host import httpio
from pipeline.layout.results import Peer

TIMEOUT_S = 1.5  # a node that does not answer in this long is shown as such, the watcher does not wait on it
SHOWN = ("running", "failed", "interrupted", "stale", "done")  # the stage a node is shown at, in this order
PER_STAGE = {"eagle3_stage_progress_ratio": "progress", "eagle3_stage_eta_seconds": "eta"}  # a figure per stage


def read(url: str, timeout: float = TIMEOUT_S) -> list[Peer]:
    """Every run the exporter at `url` serves (one per node, usually); one Peer with its error otherwise."""
    try:
        text = httpio.read(url, timeout)
    except (http.client.HTTPException, OSError, ValueError) as exc:  # OSError: URLError too; not HTTP there too
        return [Peer(url, error=f"unreachable ({getattr(exc, 'reason', None) or exc})")]
    runs: dict[str, dict] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                run = s.labels.get("run")
                if run is None:
                    continue
                r = runs.setdefault(run, {"host": s.labels.get("host"), "stages": {}, "progress": {}, "eta": {}})
                if s.name == "eagle3_run_state" and s.value == 1:
                    r["state"] = s.labels.get("state")
                elif s.name == "eagle3_stage_state" and s.value == 1:
                    r["stages"][s.labels["stage"]] = s.labels.get("state")
                elif s.name in PER_STAGE:
                    r[PER_STAGE[s.name]][s.labels["stage"]] = s.value
    except ValueError as exc:  # not Prometheus text
        return [Peer(url, error=f"not an eagle3-console exporter ({exc})")]
    if not runs:
        return [Peer(url, error="its exporter serves no run")]
    return [_peer(url, run, r) for run, r in sorted(runs.items())]


def _peer(url: str, run: str, r: dict) -> Peer:
    stages = r["stages"]
    stage = next((name for status in SHOWN for name in reversed(list(stages)) if stages[name] == status), None)
    return Peer(url, run, r["host"], r.get("state"), stage, stages.get(stage) if stage else None,
                r["progress"].get(stage), r["eta"].get(stage))


def read_all(urls: list[str]) -> tuple[Peer, ...]:
    return tuple(p for url in urls for p in read(url))
