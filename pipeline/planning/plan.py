"""The plan of a run before it starts, and how it reads: disk, GPU memory and time, from the profile, the
target's config.json and the rates earlier runs of the same profile measured (else a calibration or the
profile's estimates, marked as such); the disk verdict `extract.mode = auto` decides by; the table and
notes of `eagle3-console plan PROFILE [PROFILE …] [--json]`, profiles side by side, and preflight's line."""
from __future__ import annotations

import contextlib
import shutil
import textwrap
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pipeline.data.targetinfo import DraftPlan, TargetInfo, draft_plan, target_info
from pipeline.evaluation.offline_policy import offline_evaluation
from pipeline.planning import calibration, history, rates, steps
from pipeline.planning.online import OnlinePlan, online_plan
from pipeline.planning.rates import Rate, ServerStart
from pipeline.planning.steps import StepPlan
from pipeline.profile import Profile, source_kind
from pipeline.units import GIB, count, human

TRAIN_RATIO = 0.9  # speculators' train_data_ratio: the rest validates


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
    server_start: ServerStart
    server_starts: dict  # offline / online: how many starts of the target each way
    totals: dict  # offline / online: wall seconds and GPU-hours of every stage together
    guesses: dict = field(default_factory=dict)  # extraction / regeneration: the profile's estimate, where calibrated
    break_even_tau: calibration.Figure | None = None  # the served target with a head at k, from hardware.calibration
    existing: str = ""  # measure-existing: what it serves first, and whether training may be skipped ("" = n/a)
    may_skip_training: bool = False  # evaluate.existing_policy = deploy: the existing head may spare the training
    warm_start: str = ""  # train.from_pretrained: where training starts from ("" = from nothing)
    trainer_overhead: str = ""  # the trainer's start-up and validation in the training time, or why not

    def disk_for(self, mode: str) -> int:
        states = self.disk_hidden_states if mode == "offline" else self.online.disk_states
        return self.disk_prepared + states + self.disk_checkpoints

    @property
    def disk_total(self) -> int:
        return self.disk_for(self.mode)

    def to_dict(self) -> dict:
        return {**asdict(self), "disk_total": self.disk_total, "disk_offline": self.disk_for("offline"),
                "disk_online": self.disk_for("online"), "online_fits": self.online.fits}


def _source_rows(src, data) -> int:
    """Conversations one source gives (its limit, the demo's count, a file's lines; 0 = unknown)."""
    kind = source_kind(src.source)
    have = data.num_conversations if kind == "demo" else 0
    if kind == "file":
        with contextlib.suppress(OSError), open(src.source) as fh:
            have = sum(1 for line in fh if line.strip())
    return min(have, src.limit) if src.limit and have else (src.limit or have)


def _sample_tokens(profile: Profile) -> tuple[int, int, str]:
    d = profile.data
    measured = history.per_row(profile, "prepare", "tokens")
    samples = d.max_samples or max(0, sum(_source_rows(src, d) for src in d.sources()) - d.heldout)
    mean = measured or d.mean_sample_tokens or d.seq_length // 2
    source = "measured mean tokens per row" if measured else (
        "profile data.mean_sample_tokens" if d.mean_sample_tokens else "estimate: data.seq_length / 2 per row")
    return samples, int(samples * mean), source


def make_plan(profile: Profile, run_dir: Path | None = None, free: int | None = None) -> Plan:
    """`run_dir`/`free`: the disk `auto` decides against (default: where the profile's runs go)."""
    info = target_info(profile)
    draft = draft_plan(info, profile, steps.draft_layers(profile))
    samples, tokens, tokens_source = _sample_tokens(profile)
    t, hw, ev = profile.train, profile.hardware, profile.evaluate
    train_gpus = t.nproc_per_node * t.nnodes
    extract_gpus = profile.server.tensor_parallel_size
    prepared = tokens * 16  # int64 input_ids and loss_mask in arrow
    # hidden states as written: the target's dtype (bf16 on GPUs)
    hidden = tokens * len(draft.layer_ids) * info.hidden * (4 if profile.target.dtype == "float32" else 2)
    per_ckpt = (draft.trainable_params + draft.frozen_params) * 2 + draft.trainable_params * 8
    checkpoints = per_ckpt * t.epochs
    if ev.checkpoints == "each" and t.checkpoint_freq < 1:  # kept sub-epoch copies: weights only
        checkpoints += (steps.checkpoint_count(profile) - t.epochs) * (draft.trainable_params + draft.frozen_params) * 2

    served = rates.extraction_rate(profile, extract_gpus)  # online, the trainer asks the server: no client between
    extract = rates.client_bound(profile, served, tokens / samples if samples else 0.0)
    train = rates.training_rate(profile, train_gpus)
    trained = tokens * TRAIN_RATIO * t.epochs
    extract_s = tokens / extract.tokens_per_s if extract.tokens_per_s else None
    overhead = rates.trainer_overhead(profile)
    extra_train_s = overhead.seconds(t.epochs) if overhead else 0.0
    steps_s = trained / train.tokens_per_s if train.tokens_per_s else None
    train_s = steps_s + extra_train_s if steps_s is not None else None
    gpu_hours = ((extract_s * extract_gpus + train_s * train_gpus) / 3600
                 if extract_s is not None and train_s is not None and hw.gpus else None)
    memory = steps.train_memory(draft, profile, info)
    online = online_plan(profile, tokens, samples, hidden / max(tokens, 1), served, trained, steps_s, memory,
                         extra_train_s)
    regen = steps.regenerate_plan(profile, info, samples, tokens, extract_gpus)
    runs_offline_eval, why = offline_evaluation(profile, info)
    evaluate_offline = StepPlan(runs_offline_eval, 0, Rate(None, ""), None, 0, why)
    matrix = steps.matrix_plan(profile, extract_gpus)
    picks = steps.checkpoints_plan(profile, runs_offline_eval, extract_gpus)
    start = rates.server_start_estimate(profile)
    guesses = {name: rates.estimate(profile, key, extract_gpus) for name, rate, key in (
        ("extraction", served, "extract_tokens_per_s"), ("regeneration", regen.rate, "decode_tokens_per_s"))
        if rate.kind == "calibrated"}
    cb = rates.calibrated_box(profile, extract_gpus)
    vllm_picks = picks.count if picks.runs and not runs_offline_eval else 0
    starts = dict.fromkeys(("offline", "online"), steps.count_server_starts(profile) + vllm_picks)
    totals = {}
    for m, core_s, core_gpu_h in (("offline", extract_s and train_s and extract_s + train_s, gpu_hours),
                                  ("online", online.wall_s, online.gpu_hours)):
        parts = [core_s, regen.seconds, matrix.seconds, picks.seconds if vllm_picks else 0.0,
                 0.0 if not starts[m] else start.seconds * starts[m] if start.seconds else None]
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
                break_even_tau=calibration.break_even_tau(*cb) if cb else None, existing=steps.existing_text(profile),
                may_skip_training=bool(steps.existing_servers(profile)) and ev.existing_policy == "deploy",
                warm_start=steps.warm_start_text(profile),
                trainer_overhead=overhead.source if overhead else (
                    "not counted: no earlier run of this profile measured the trainer's start-up and validation "
                    "(the training time is its steps alone)"))
    if profile.extract.mode == "auto" and profile.extract.backend != "vllm":
        plan = replace(plan, mode="offline", mode_why="auto: online needs extract.backend = \"vllm\"")
    elif profile.extract.mode == "auto":
        fits, text = disk_verdict(plan, profile, run_dir, free=free, mode="offline")
        plan = replace(plan, mode="offline" if fits else "online",
                       mode_why=f"auto: offline {'fits' if fits else 'does not fit'} ({text})")
    return plan


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
    ("server starts × each", lambda p: f"{p.server_starts[p.mode]} × {duration(p.server_start.seconds)}"),
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
        ("trainer start-up and validation", p.trainer_overhead),
        ("mode", p.mode_why), ("regeneration", f"{p.regenerate.why} ({p.regenerate.rate.source or '-'})"),
        ("offline evaluator", p.evaluate_offline.why), ("matrix", p.matrix.why),
        ("checkpoints", p.checkpoints.why), ("server start", p.server_start.source)]
    if p.break_even_tau:
        items.append((None, p.break_even_tau.why))  # it names itself: "break-even τ (k = 3): …"
    if p.existing:
        items.append(("existing head", p.existing))
    if p.warm_start:
        items.append(("warm start", p.warm_start))
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
             f"{plan.server_starts[plan.mode]} server starts × {duration(plan.server_start.seconds)}"]
    skip = ("; training may be skipped: evaluate.existing_policy = deploy and the existing head clears the decision"
            if plan.may_skip_training else "")
    return (f"{plan.mode}: {duration(t['wall_s'])}, {_hours(t['gpu_hours'])} GPU-hours in all ("
            + ", ".join(p for p in parts if p) + ")" + skip)


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
