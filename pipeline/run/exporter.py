"""`eagle3-console exporter [RUN_DIR …] [--runs-dir DIR] [--port N] [--host H]`: the runs and the box's GPUs as
Prometheus metrics (prometheus_client), for Grafana beside nvitop-exporter and vLLM's own /metrics
(docs/grafana-eagle3.json). Each scrape reads the runs' files as they stand — the same state, events
and liveness `status` and the console read — and every GPU through the NVML chokepoint (pipeline/host/gpu.py).
Labelled by host, run, stage and GPU; a figure not measured yet is no sample (N/A), not a zero.
Binds 127.0.0.1 unless --host says otherwise."""
from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from pipeline.host import gpu
from pipeline.layout.results import DeployMeasureResult, EvaluateOfflineResult, RunSnapshot, TrainResult
from pipeline.layout.rundir import RunDir, RunDirError
from pipeline.run import jobs
from pipeline.run.runview import RunWatcher, StageView
from pipeline.stages import stage_names

RUN_STATES = ("running", "interrupted", "failed", "finished", "stopped", "not started")
STAGE_STATES = ("n/a", "pending", "running", "interrupted", "done", "stale", "failed")
# Where a stage says how fast it makes tokens: live (the stage's progress and metric events) or, once done,
# its figures. Generation: the target writing answers or states; training: the trainer's median step.
GENERATION_KEYS = ("generated_tok_s", "generate_tok_s", "tok_s", "tokens_per_s")
GENERATION_STAGES = ("regenerate", "extract")
TRAIN_KEYS = ("profile/tokens_per_s", "tokens_per_s")


def _first(figures: dict, keys: Iterable[str]) -> float | None:
    return next((float(figures[k]) for k in keys if isinstance(figures.get(k), (int, float))), None)


class RunsCollector(Collector):
    """Every scrape: each run named (and each under runs_dir, as they appear) and the GPUs."""

    def __init__(self, run_dirs: list[Path], runs_dir: Path | None = None, host: str | None = None):
        self.run_dirs = [Path(p).resolve() for p in run_dirs]
        self.runs_dir = Path(runs_dir).resolve() if runs_dir else None
        self.host = host or socket.gethostname()
        self._watchers: dict[Path, RunWatcher] = {}

    def _runs(self) -> list[Path]:
        found = list(self.run_dirs)
        if self.runs_dir and self.runs_dir.is_dir():
            found += sorted(p.parent for p in self.runs_dir.glob("*/profile.toml")
                            if p.parent not in found and not p.parent.name.endswith(".copying"))
        return found

    def collect(self) -> Iterator[Metric]:
        g = _Families(self.host)
        for root in self._runs():
            try:
                run = RunDir.open(root)
                watcher = self._watchers.setdefault(root, RunWatcher(run, stage_names()))
                snap = jobs.snapshot(run, peers=False)  # never a scrape of a scrape
                view = watcher.poll({s.name: s.status for s in snap.stages})
            except (RunDirError, OSError, ValueError):  # gone, or not (yet) a run: no sample but its up = 0
                g.add("run_up", "1 while the run directory reads as a run", 0, run=root.name)
                continue
            name = run.root.name
            g.add("run_up", "1 while the run directory reads as a run", 1, run=name)
            for state in RUN_STATES:
                g.add("run_state", "the run's state (1 for the one it is in)", int(snap.state == state),
                      run=name, profile=snap.profile, state=state)
            g.add("server_up", "1 while a healthy vLLM server answers on the run's serving port",
                  int(bool(snap.server.get("healthy"))), run=name, mode=str(snap.server.get("mode") or ""))
            # the same stages in the same order; the view's statuses are the snapshot's
            for stage, recorded in zip(view.stages, snap.stages, strict=True):
                self._stage(g, name, stage, recorded.figures)
            self._results(g, name, snap, (view.metrics or {}).get("train", {}))
        self._gpus(g)
        yield from g.families.values()

    @staticmethod
    def _stage(g: _Families, run: str, s: StageView, recorded: dict) -> None:
        at = {"run": run, "stage": s.name}
        for state in STAGE_STATES:
            g.add("stage_state", "a stage's status (1 for the one it is in)", int(s.status == state), **at, state=state)
        g.add("stage_progress_ratio", "a stage's share done", s.fraction, **at)
        # the view has an ETA only for a running stage
        g.add("stage_eta_seconds", "a running stage's time left at its current rate", s.eta_s, **at)
        g.add("stage_elapsed_seconds", "a stage's time so far (all its attempts)", s.elapsed_s, **at)
        figures = recorded if s.status == "done" else dict(s.figures)  # live: the view's; done: all it recorded
        if s.name == "train":
            g.add("train_tokens_per_second", "the trainer's tokens/s", _first(figures, TRAIN_KEYS), **at)
        rate = _first(figures, ("generate_tok_s",) if s.name == "train" else GENERATION_KEYS)  # train: online's server
        if rate is None and s.name == "extract" and s.status == "done" and figures.get("seconds"):
            rate = float(figures.get("tokens") or 0) / float(figures["seconds"])  # over its requests
        if s.name in (*GENERATION_STAGES, "train"):
            g.add("generation_tokens_per_second", "tokens/s the target generates for a stage", rate, **at)

    @staticmethod
    def _results(g: _Families, name: str, snap: RunSnapshot, live: dict) -> None:
        """Figures of a run as its stages recorded them, and the trainer's live loss and data wait (`live`:
        its latest metric values, as the run's watcher read them from the events)."""
        train = snap.result(TrainResult)
        last_logged = live.get("train/loss") if train.train_loss is None else train.train_loss  # live till recorded
        for split, loss in (("train", last_logged), ("val", train.val_loss_epoch)):
            g.add("train_loss", "the draft's loss (train: the last logged; val: the last epoch's)", loss, run=name,
                  split=split)
        g.add("train_data_wait_ratio", "the share of the last logged training step spent waiting for data",
              live.get("profile/fetch_frac"), run=name)
        offline, served = snap.result(EvaluateOfflineResult), snap.result(DeployMeasureResult)
        for source, value in (("offline", offline.tau), ("vllm", served.mean_acceptance_length),
                              ("ngram", served.ngram_tau)):
            g.add("tau", "mean acceptance length (tokens per draft step)", value, run=name, source=source)
        g.add("speedup_ratio", "the head's tok/s over the baseline's at the deciding concurrency", served.speedup,
              run=name)
        g.add("deploy", "1 when the run decided to deploy its head", served.deploy, run=name)  # None: not decided

    def _gpus(self, g: _Families) -> None:
        snap = gpu.sample()
        g.add("nvml_up", "1 when NVML answers on this host", int(snap.unavailable is None))
        for s in snap.gpus:
            labels = {"gpu": str(s.index), "name": s.name}
            for metric, doc, value in (
                    ("gpu_utilization_ratio", "GPU utilisation", None if s.util_pct is None else s.util_pct / 100),
                    ("gpu_memory_used_bytes", "GPU memory in use", s.mem_used),
                    ("gpu_memory_total_bytes", "GPU memory in all", s.mem_total),
                    ("gpu_temperature_celsius", "GPU temperature", s.temp_c),
                    ("gpu_power_watts", "GPU power draw", s.power_w),
                    ("gpu_power_limit_watts", "GPU power limit", s.power_limit_w),
                    ("gpu_sm_clock_hertz", "GPU SM clock", None if s.sm_clock_mhz is None else s.sm_clock_mhz * 1e6),
                    ("gpu_processes", "processes holding GPU memory", len(s.processes))):
                if not s.lost:
                    g.add(metric, doc, value, **labels)
            g.add("gpu_lost", "1 when NVML lost the GPU (fallen off the bus, reset)", int(s.lost), **labels)


class _Families:
    """Gauge families by name, each sample with the host label first; a value of None is no sample (N/A)."""

    def __init__(self, host: str):
        self.host = host
        self.families: dict[str, GaugeMetricFamily] = {}
        self._labels: dict[str, list[str]] = {}

    def add(self, name: str, doc: str, value: float | None, **labels: str) -> None:
        if value is None:
            return
        full = f"eagle3_{name}"
        if full not in self.families:
            self._labels[full] = ["host", *labels]
            self.families[full] = GaugeMetricFamily(full, doc, labels=self._labels[full])
        self.families[full].add_metric([self.host, *(labels[k] for k in self._labels[full][1:])], float(value))


def registry(run_dirs: list[Path], runs_dir: Path | None = None, host: str | None = None) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(RunsCollector(run_dirs, runs_dir, host))
    return reg

