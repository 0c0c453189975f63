"""What a run's stages cost beyond the extraction and the training rates: training's GPU memory, the
answers regeneration generates, the benchmark matrix, the checkpoints pick-checkpoint measures,
measure-existing's servers, a warm start, and how often the target's server starts; each with why."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.data.targetinfo import DraftPlan, TargetInfo
from pipeline.evaluation import schedule
from pipeline.evaluation.offline_policy import transformers_fit
from pipeline.planning import history, rates
from pipeline.planning.rates import Rate, decode_rate
from pipeline.profile import Profile
from pipeline.units import GIB


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


def regenerate_plan(profile: Profile, info: TargetInfo, samples: int, tokens: int, serve_gpus: int) -> StepPlan:
    """Answer tokens to generate: rows × measured answer length, else tokens × data.answer_share capped at
    data.regenerate_max_tokens per row; at the decode rate (vllm) or not at all when transformers cannot
    hold the target."""
    d = profile.data
    if not d.regenerate:
        return StepPlan(False, 0, Rate(None, ""), 0.0, 0, "data.regenerate = false")
    measured = history.per_row(profile, "regenerate", "generated_tokens")
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
    concurrency, evaluate.rounds times; at the target alone's tok/s at each level where an earlier run of the
    profile measured them, else decode tokens/s taken linear in concurrency up to data.regenerate_concurrency
    (memory-bound decode: a step at c is no slower than at the full batch, so a bound — on one H100 the target
    alone served 519 tok/s at c = 1 where that line gave 63, 2026-12-07)."""
    ev = profile.evaluate
    if not ev.online:
        return StepPlan(False, 0, Rate(None, ""), 0.0, 0, "evaluate.online = false")
    rows = schedule.matrix_rows(profile) + (noisy := schedule.noise_rows(profile))

    def level_tokens(c: int) -> int:  # a round is at least evaluate.waves waves of c requests, after one wave
        return (max(ev.num_prompts, ev.waves * c) * ev.rounds + c) * ev.max_new_tokens  # not measured
    tokens = sum(level_tokens(c) for c in ev.concurrency) * len(rows)
    measured = rates.matrix_rates(profile)
    if measured and all(c in measured[0] for c in ev.concurrency):
        seconds: float | None = len(rows) * sum(level_tokens(c) / measured[0][c] for c in ev.concurrency)
        rate = Rate(round(tokens / seconds, 1) if seconds else None,
                    f"{measured[1]} (the target alone at each level; the heads' rows timed as it)", "measured")
    else:
        rate = decode_rate(profile, serve_gpus)
        full = profile.data.regenerate_concurrency
        seconds = (len(rows) * sum(level_tokens(c) / (rate.tokens_per_s * min(c, full) / full)
                                   for c in ev.concurrency) if rate.tokens_per_s else None)
    return StepPlan(True, tokens, rate, seconds, serve_gpus,
                    f"{len(rows)} servers ({', '.join(rows)}; the schedule's at most"
                    + (f"; the last {len(noisy)} only where instances disagree" if noisy else "")
                    + f") × concurrency {ev.concurrency} "
                    f"× {ev.num_prompts} prompts × {ev.max_new_tokens} tokens"
                    + (f" × {ev.rounds} rounds" if ev.rounds > 1 else "")
                    + (f", ≥ {ev.waves} waves a round" if ev.waves > 1 else "")
                    + ("; timed by the target alone's tok/s at each level, " + rate.source if rate.kind == "measured"
                       else "; decode taken linear in concurrency below data.regenerate_concurrency: a bound, "
                            "no earlier run of this profile measured the levels"))


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
    start = 1 if profile.train.from_pretrained else 0  # the warm start's head, measured beside them
    if ev.checkpoints != "each" and not start:
        return StepPlan(False, 0, Rate(None, ""), 0.0, 0, "evaluate.checkpoints = last: the last epoch's head")
    n = (checkpoint_count(profile) if ev.checkpoints == "each" else 1) + start
    if offline:
        return StepPlan(True, 0, Rate(None, "offline evaluator: not planned"), None, 0,
                        f"{n} checkpoints through the offline evaluator", count=n, offline=True)
    rate = decode_rate(profile, serve_gpus)
    tokens = n * ev.num_prompts * ev.max_new_tokens
    full = profile.data.regenerate_concurrency
    seconds = tokens / (rate.tokens_per_s * min(max(ev.concurrency), full) / full) if rate.tokens_per_s else None
    return StepPlan(True, tokens, rate, seconds, serve_gpus,
                    f"{n} checkpoints × one speculative server each × {ev.num_prompts} prompts", count=n)


def existing_servers(profile: Profile) -> int:
    """measure-existing's servers (the target alone, its other instances, the existing head at each k it serves
    and with its schedule); 0 where it does not run (no evaluate.existing_head, or evaluate.existing_policy = off)."""
    ev = profile.evaluate
    if not ev.existing_head or ev.existing_policy == "off":
        return 0
    return ev.baseline_instances + 1 + len(schedule.head_rows(profile, "existing"))


def existing_text(profile: Profile) -> str:
    """What measure-existing adds to the run, and where evaluate.existing_policy = deploy may spare the training."""
    ev = profile.evaluate
    if not (n := existing_servers(profile)):
        return ""
    text = (f"measure-existing serves the existing head beside the target alone first ({n} servers × concurrency "
            f"{ev.concurrency} × {ev.num_prompts} prompts × {ev.max_new_tokens} tokens), before any training")
    if ev.existing_policy == "deploy":
        return text + (f"; where it clears the deploy decision (x{ev.deploy_speedup:g}) the stages that make a new "
                       "head are skipped (evaluate.existing_policy = deploy): training may be skipped, and the times "
                       "planned for it not spent")
    return text + "; the run trains a new head whatever it measures (evaluate.existing_policy = measure)"


def draft_layers(profile: Profile) -> int | None:
    """A warm start's decoder layers where train.num_layers is left at its default (the head keeps its own,
    and the plan's parameters, memory and checkpoints are the head's); None: the profile's."""
    from pathlib import Path

    from pipeline.compat import speculators_heads
    t = profile.train
    if (start := profile.warm_start()) is None or t.num_layers != type(t).model_fields["num_layers"].default:
        return None
    try:
        return speculators_heads.shape(Path(start[1])).layers
    except speculators_heads.HeadError:  # what it is not, preflight says
        return None


def warm_start_text(profile: Profile) -> str:
    """What a warm start changes: where training starts, what it keeps of the head, what pick-checkpoint adds."""
    t, v = profile.train, profile.vocab
    if (start := profile.warm_start()) is None:
        return ""
    from pathlib import Path

    from pipeline.compat import speculators_heads
    head = f"{start[0]} ({start[1]})" if t.from_pretrained == "existing" else start[1]
    try:  # the plan's sizes fall back to the profile's where the head cannot be read: say so
        speculators_heads.classify(Path(start[1]))
        unread = ""
    except speculators_heads.HeadError as exc:
        unread = f" — not readable now ({exc}): the plan is the profile's shape and preflight blocks the run"
    return (f"{t.epochs} epoch(s) on from {head}{unread} (speculators --from-pretrained; the planned training time is "
            f"those epochs'); its draft vocabulary {'kept' if v.from_head else 'rebuilt (vocab.from_head = false)'}; "
            f"pick-checkpoint measures it as checkpoint 'start' beside "
            f"{'every checkpoint' if profile.evaluate.checkpoints == 'each' else 'the last epoch'}")


def count_server_starts(profile: Profile) -> int:
    """Starts of the target's server over a run, offline and online alike: regeneration, prepare's render
    server (extract reuses an extraction server), extraction (online: one server, handed from prepare or
    the cache extraction to the trainer, or started by it), one per matrix row (schedule.matrix_rows: the
    methods, the head at other k, its schedule; noise_rows: the servers added where instances disagree; starts
    side by side overlap), the handover's production."""
    d, ex, ev = profile.data, profile.extract, profile.evaluate
    starts = int(d.regenerate and d.regenerate_backend == "vllm")
    # the extraction server (started by prepare's render when rendered, then reused), else prepare's baseline renderer
    starts += int(ex.backend == "vllm" or (d.tokenize == "render" and not d.regenerate))
    if ev.online:
        rows = schedule.matrix_rows(profile) + schedule.noise_rows(profile)  # at most
        together = max(1, min(ev.start_together, len(rows)))
        starts += -(-len(rows) // together)
    starts += int(profile.server.after_run != "stop")
    if n := existing_servers(profile):  # measure-existing's, side by side as the matrix's
        starts += -(-n // max(1, min(ev.start_together, n)))
    return starts
