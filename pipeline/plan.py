"""The planner: disk, GPU memory and time of a run before it starts, from the profile, the target's
config.json and the rates earlier runs of the same profile measured (else the profile's estimates,
marked as such). `eagle3-console plan PROFILE [PROFILE …] [--json]` shows profiles side by side."""
from __future__ import annotations

import json
import shutil
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.profile import Profile
from pipeline.targetinfo import DraftPlan, TargetInfo, draft_plan, target_info

GIB = 2**30
TRAIN_RATIO = 0.9  # speculators' train_data_ratio: the rest validates


@dataclass(frozen=True)
class Rate:
    tokens_per_s: float | None
    source: str  # "measured: RUN" or "estimate: …" or "unknown: …"


@dataclass(frozen=True)
class Plan:
    profile: str
    target: TargetInfo
    draft: DraftPlan
    samples: int
    tokens: int
    tokens_source: str
    disk_prepared: int
    disk_hidden_states: int
    disk_checkpoints: int
    train_gpu_memory: int
    train_gpus: int
    extract_gpus: int
    extract: Rate
    train: Rate
    extract_s: float | None
    train_s: float | None
    gpu_hours: float | None

    @property
    def disk_total(self) -> int:
        return self.disk_prepared + self.disk_hidden_states + self.disk_checkpoints

    def to_dict(self) -> dict:
        out = asdict(self)
        out["disk_total"] = self.disk_total
        return out


def state_bytes(profile: Profile) -> int:
    """Bytes per element of the hidden states as written: the target's dtype (bf16 on GPUs)."""
    return 4 if profile.target.dtype == "float32" else 2


def _earlier_runs(profile: Profile) -> list[tuple[Path, dict]]:
    """(run dir, state) of earlier runs of the same profile name, newest first."""
    runs = Path(profile.run.runs_dir)
    found = []
    for state_file in sorted(runs.glob("*/state.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            name = tomllib.loads((state_file.parent / "profile.toml").read_text()).get("name")
            if name == profile.name:
                found.append((state_file.parent, json.loads(state_file.read_text())))
        except (OSError, ValueError):
            continue
    return found


def _measured(profile: Profile, stage: str, rate_of) -> tuple[float, Path] | None:
    for run_dir, state in _earlier_runs(profile):
        entry = state.get("stages", {}).get(stage, {})
        if entry.get("status") == "done":
            rate = rate_of(entry.get("figures") or {})
            if rate:
                return rate, run_dir
    return None


def _extract_rate(figures: dict) -> float | None:
    if figures.get("tokens_per_s"):
        return float(figures["tokens_per_s"])
    if figures.get("tokens") and figures.get("seconds"):
        return figures["tokens"] / figures["seconds"]
    return None


def _sample_tokens(profile: Profile) -> tuple[int, int, str]:
    d = profile.data
    measured = None
    for _, state in _earlier_runs(profile):
        fig = state.get("stages", {}).get("prepare", {}).get("figures") or {}
        if fig.get("rows") and fig.get("tokens"):
            measured = fig["tokens"] / fig["rows"]
            break
    if d.max_samples:
        samples = d.max_samples
    elif d.conversations == "demo":
        samples = d.num_conversations - d.heldout
    else:
        try:
            with open(d.conversations) as fh:
                samples = sum(1 for line in fh if line.strip()) - d.heldout
        except OSError:
            samples = 0
    mean = measured or d.mean_sample_tokens or d.seq_length // 2
    source = "measured mean tokens per row" if measured else (
        "profile data.mean_sample_tokens" if d.mean_sample_tokens else "estimate: data.seq_length / 2 per row")
    return samples, int(samples * mean), source


def train_memory(draft: DraftPlan, profile: Profile, info: TargetInfo) -> int:
    """Per-GPU bytes of draft training: fp32 weights, gradients and two optimizer states of the
    trainable parameters (divided over ranks with FSDP); the frozen bf16 embeddings and the verifier's
    lm_head; per step the draft logits of every TTT step (fp32, with their softmax and gradient), the
    verifier's full-vocabulary target logits, and the hidden states; plus 1 GiB of CUDA context and
    allocator slack. Checked against the H200: 19.3 GiB predicted for the 8B-class bench vs 19.1 (fused
    loss) and 20.5 GiB (eager loss) measured by NVML (NOTES.md)."""
    t = profile.train
    ranks = t.nproc_per_node * t.nnodes if t.fsdp else 1
    seq = t.total_seq_len
    weights = draft.trainable_params * 16 // ranks + 2 * draft.frozen_params * 2
    logits = seq * draft.draft_vocab * 4 * t.ttt_steps * 2 + seq * info.vocab * 4
    states = seq * (len(draft.layer_ids)) * draft.hidden * 2
    return weights + logits + states + GIB


def _rate(profile: Profile, stage: str, rate_of, hardware_key: str, gpus: int) -> Rate:
    """What an earlier run of this profile measured for `stage`, else the profile's per-GPU estimate."""
    if (m := _measured(profile, stage, rate_of)):
        return Rate(round(m[0], 1), f"measured: {m[1]}")
    per_gpu = getattr(profile.hardware, hardware_key)
    if per_gpu:
        return Rate(per_gpu * gpus, f"estimate: hardware.{hardware_key} {per_gpu:g} × {gpus} GPU(s)")
    return Rate(None, f"unknown: no earlier run, no hardware.{hardware_key}")


def make_plan(profile: Profile) -> Plan:
    info = target_info(profile)
    draft = draft_plan(info, profile)
    samples, tokens, tokens_source = _sample_tokens(profile)
    t, hw = profile.train, profile.hardware
    train_gpus = t.nproc_per_node * t.nnodes
    extract_gpus = profile.server.tensor_parallel_size
    prepared = tokens * 16  # int64 input_ids and loss_mask in arrow
    hidden = tokens * len(draft.layer_ids) * info.hidden * state_bytes(profile)
    per_ckpt = (draft.trainable_params + draft.frozen_params) * 2 + draft.trainable_params * 8
    checkpoints = per_ckpt * t.epochs

    extract = _rate(profile, "extract", _extract_rate, "extract_tokens_per_s", extract_gpus)
    train = _rate(profile, "train", lambda f: f.get("tokens_per_s"), "train_tokens_per_s", train_gpus)
    extract_s = tokens / extract.tokens_per_s if extract.tokens_per_s else None
    train_s = tokens * TRAIN_RATIO * t.epochs / train.tokens_per_s if train.tokens_per_s else None
    gpu_hours = None
    if extract_s is not None and train_s is not None and hw.gpus:
        gpu_hours = (extract_s * extract_gpus + train_s * train_gpus) / 3600
    return Plan(profile=profile.name, target=info, draft=draft, samples=samples, tokens=tokens,
                tokens_source=tokens_source, disk_prepared=prepared, disk_hidden_states=hidden,
                disk_checkpoints=checkpoints, train_gpu_memory=train_memory(draft, profile, info),
                train_gpus=train_gpus, extract_gpus=extract_gpus, extract=extract, train=train,
                extract_s=extract_s, train_s=train_s, gpu_hours=gpu_hours)


def free_disk(profile: Profile, run_dir: Path | None = None) -> tuple[Path, int]:
    """Free bytes where the run directory is or will be (its nearest existing parent): the one in
    use when given, else under the profile's runs_dir."""
    path = Path(run_dir or profile.run.runs_dir).resolve()
    while not path.exists():
        path = path.parent
    return path, shutil.disk_usage(path).free


def disk_verdict(plan: Plan, profile: Profile, run_dir: Path | None = None) -> tuple[bool, str]:
    where, free = free_disk(profile, run_dir)
    need = plan.disk_total + int(profile.hardware.min_free_disk_gib * GIB)
    text = (f"plan needs {human(plan.disk_total)} (+{profile.hardware.min_free_disk_gib:g} GiB headroom) "
            f"under {where}; {human(free)} free")
    return free >= need, text


def human(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def duration(s: float | None) -> str:
    if s is None:
        return "?"
    h = s / 3600
    return f"{h:.1f} h" if h >= 1 else f"{s / 60:.0f} min"


def table(plans: list[Plan]) -> str:
    """Profiles side by side, one row per figure."""
    def row(label, fn):
        return [label] + [fn(p) for p in plans]

    rows = [
        row("profile", lambda p: p.profile),
        row("target", lambda p: f"{p.target.architecture} ({p.target.attention})"),
        row("hidden / layers / vocab", lambda p: f"{p.target.hidden} / {p.target.layers} / {p.target.vocab}"),
        row("aux layer ids (vLLM)", lambda p: str(p.draft.layer_ids)),
        row("draft: vocab / layers / k", lambda p: f"{p.draft.draft_vocab} / {p.draft.num_layers} / {p.draft.ttt_steps}"),
        row("draft params (trainable)", lambda p: f"{p.draft.trainable_params / 1e6:.0f} M"),
        row("samples", lambda p: f"{p.samples:,}"),
        row("tokens", lambda p: f"{p.tokens / 1e6:,.1f} M"),
        row("disk: prepared data", lambda p: human(p.disk_prepared)),
        row("disk: hidden states", lambda p: human(p.disk_hidden_states)),
        row("disk: checkpoints", lambda p: human(p.disk_checkpoints)),
        row("disk: total", lambda p: human(p.disk_total)),
        row("train GPU memory / GPU (est.)", lambda p: f"{p.train_gpu_memory / GIB:.1f} GiB"),
        row("extraction rate", lambda p: f"{p.extract.tokens_per_s:,.0f} tok/s" if p.extract.tokens_per_s else "?"),
        row("training rate", lambda p: f"{p.train.tokens_per_s:,.0f} tok/s" if p.train.tokens_per_s else "?"),
        row("extraction time", lambda p: duration(p.extract_s)),
        row("training time", lambda p: duration(p.train_s)),
        row("GPU-hours", lambda p: f"{p.gpu_hours:,.0f}" if p.gpu_hours is not None else "?"),
    ]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    sources = [f"{p.profile}: tokens {p.tokens_source}; extraction {p.extract.source}; training {p.train.source}"
               for p in plans]
    return "\n".join(lines + [""] + sources)
