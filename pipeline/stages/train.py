"""train: `speculators train` as a subprocess (torchrun when the profile asks for more than one
process per node), in its own process group, its output in logs/train.log, its metric records (the
trainer's launcher's JSON lines) into events. speculators resumes from the highest epoch directory by
itself; before a relaunch, epoch directories that a kill left half-written are moved aside so that
resume never reads them."""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

from pipeline.compat import speculators_compat, torch_distributed_errors
from pipeline.data.target import resolve_layer_ids
from pipeline.data.targetinfo import from_config
from pipeline.host import procs
from pipeline.layout import atomicio
from pipeline.layout.checkpoints import final_checkpoint, kept_sub_epoch, quarantine_incomplete
from pipeline.layout.results import TrainResult
from pipeline.planning import plan
from pipeline.serving import mooncake, online_training, ports, vllm_modes
from pipeline.serving.server import explain_failure
from pipeline.stages import heads
from pipeline.stages.base import Stage, StageContext, StageError, argv_for
from pipeline.training import launch, node_sync


def trainer_env(ctx: StageContext, endpoint: str | None) -> dict:
    """The trainer's environment: the run's children's (procs.child_env), its compile caches shared by the
    runs of the cache_dir unless the operator's environment names them, and this profile's switches only."""
    env = procs.child_env(ctx.run.cache_root)
    env |= {k: v for k, v in vllm_modes.trainer_cache_env(ctx.profile).items() if k not in os.environ}
    if ctx.profile.train.cuda_visible_devices:  # training on some GPUs, serving on the others
        env["CUDA_VISIBLE_DEVICES"] = ctx.profile.train.cuda_visible_devices
    if mooncake.runs_here(ctx.profile):  # the trainer's store client on loopback, beside the run's master
        env["MOONCAKE_LOCAL_HOSTNAME"] = "127.0.0.1"
    env.pop(speculators_compat.KEEP_ENV, None)  # only this profile's setting turns it on, not the shell's
    if ctx.profile.evaluate.checkpoints == "each" and ctx.profile.train.checkpoint_freq < 1:
        env[speculators_compat.KEEP_ENV] = "1"  # each sub-epoch checkpoint copied to kept/ as it is saved
    env.pop(launch.REQUESTS_ENV, None)
    if endpoint:  # online: each loader worker's batch fetched through several requests at once
        env[launch.REQUESTS_ENV] = str(ctx.profile.train.requests_per_worker)
    return env


def build_command(ctx: StageContext, *, python: str = sys.executable, endpoint: str | None = None,
                  start: Path | None = None) -> list[str]:
    """The argv (never a shell string) that trains the draft with this profile; with `endpoint` (online),
    missing states are generated through that extraction server instead of being an error; with `start`, on
    from that head (--from-pretrained: it defines the draft, so the decoder-shaping --num-layers is not
    given — speculators refuses both; preflight saw the profile agree with the head)."""
    p, t = ctx.profile, ctx.profile.train
    gpu = vllm_modes.accelerator_available()
    n_layers = from_config(ctx.target_dir() / "config.json").layers  # multimodal wrappers: text_config
    layer_ids = resolve_layer_ids(p.extract.layer_ids, n_layers)
    d2t, t2d = ctx.run.vocab_mappings(ctx.profile.vocab.draft_vocab_size)
    flags = [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", str(ctx.target_dir()),
        "--data-path", str(ctx.run.prepared_dir),
        "--save-path", str(ctx.run.checkpoints_dir),
        # vLLM-style ids end with the final layer, which the trainer takes as its target, not an aux id.
        "--target-layer-ids", *[str(i) for i in layer_ids[:-1]],
        "--draft-vocab-size", str(p.vocab.draft_vocab_size),
        "--d2t-path", str(d2t), "--t2d-path", str(t2d),
        "--epochs", str(t.epochs), "--total-seq-len", str(t.total_seq_len),
        "--lr", str(t.lr), "--optimizer", t.optimizer, "--ttt-steps", str(t.ttt_steps),
        *(["--from-pretrained", str(start)] if start else ["--num-layers", str(t.num_layers), *window_flags(t)]),
        "--num-workers", str(t.num_workers), "--seed", str(t.seed),
        "--draft-attn-impl", t.draft_attn_impl if t.draft_attn_impl != "auto"
        else ("simple_flex_attention" if gpu else "sdpa"),  # flex has no CPU backward
        "--loss-implementation", t.loss_implementation if t.loss_implementation != "auto"
        else ("fused" if gpu else "eager"),  # the fused loss is Triton
        "--log-freq", "1",
        "--checkpoint-freq", f"{t.checkpoint_freq:g}",
    ]
    if endpoint:
        flags += online_training.trainer_flags(p, endpoint, ctx.run.hidden_states_dir)
    else:
        flags += ["--on-missing", "raise"]  # offline: every hidden-state file must already exist
    if t.loggers:  # speculators' own trackers, written inside the run
        flags += ["--logger", ",".join(t.loggers), "--log-dir", str(ctx.run.trackers_dir),
                  "--run-name", ctx.run.root.name]
    if t.hidden_states_dtype != "auto":
        flags += ["--hidden-states-dtype", t.hidden_states_dtype]
    flags += eagle31_flags(t)
    flags += list(t.extra_args)
    if t.fsdp:
        flags.append("--fsdp-shard")
    # Always through the trainer's launcher: it adapts nothing that works as released (a CPU's three
    # accelerator assumptions and gloo; on a GPU the fused loss's shared autotuner lists).
    trainer = ["-m", "pipeline.training.launch", "train", *flags]
    if t.nproc_per_node * t.nnodes > 1:
        return [python, "-m", "torch.distributed.run", *torchrun_args(t, p.name), *trainer]
    return [python, *trainer]


def window_flags(t) -> list[str]:
    """The draft layers' attention (train.sliding_window), only where it moves off speculators' default
    (a window of 2048 on every layer): 0 = every layer full attention."""
    if t.sliding_window == 0:
        return ["--full-attention-indices", *(str(i) for i in range(t.num_layers))]
    default = type(t).model_fields["sliding_window"].default
    return [] if t.sliding_window == default else ["--sliding-window", str(t.sliding_window)]


def eagle31_flags(t) -> list[str]:
    """EAGLE-3.1's norms and the loss, each only where the profile moves it off speculators 0.9.0's eagle3
    default (TrainSection's defaults are those): a profile that sets none keeps the argv it had, and a
    run's recorded command shows what it changed. per_position_loss_weight has no flag here: its only
    value the profile accepts is the default (eagle3 reads no other)."""
    defaults = type(t).model_fields
    flags: list[str] = []
    for key in ("norm_before_residual", "norm_before_fc", "norm_output"):  # speculators' --x / --no-x pairs
        if getattr(t, key) != defaults[key].default:
            flags.append(f"--{'' if getattr(t, key) else 'no-'}{key.replace('_', '-')}")
    if t.fc_norm:  # a store_true flag: no --no-fc-norm
        flags.append("--fc-norm")
    if t.loss_fn != defaults["loss_fn"].default:  # a mix goes as the JSON object speculators parses
        flags += ["--loss-fn", t.loss_fn if isinstance(t.loss_fn, str) else json.dumps(t.loss_fn)]
    if t.ttt_step_loss_decay != defaults["ttt_step_loss_decay"].default:
        flags += ["--ttt-step-loss-decay", str(t.ttt_step_loss_decay)]
    return flags


def torchrun_args(t, job: str) -> list[str]:
    """A static rendezvous at node 0's endpoint: the only one that keeps --node-rank (c10d ranks nodes in the
    order they join, so node 1 could become rank 0 and write the job's checkpoints into its own run; seen
    on two nodes of one machine, 2026-12-02). job: the id every node gives (train.rdzv_id, else the
    profile's name: each node's run directory has a name of its own)."""
    if t.nnodes == 1:
        return ["--standalone", f"--nproc-per-node={t.nproc_per_node}"]
    return [f"--nnodes={t.nnodes}", f"--node-rank={t.node_rank}", f"--nproc-per-node={t.nproc_per_node}",
            "--rdzv-backend=static", f"--rdzv-endpoint={t.rdzv_endpoint}", f"--rdzv-id={t.rdzv_id or job}"]


class Train(Stage):
    name = "train"

    def inputs(self, ctx: StageContext) -> list[Path]:
        states = [] if ctx.extract_mode() == "online" else [ctx.run.hidden_states_dir]
        return [ctx.run.prepared_dir / "dataset_info.json", *ctx.run.vocab_mappings(ctx.profile.vocab.draft_vocab_size),
                *states]

    def outputs(self, ctx: StageContext) -> list[Path]:
        if not ctx.profile.train.first_node:  # node 0's trainer (rank 0) writes the job's checkpoints
            return [ctx.run.node_record]
        ckpt = final_checkpoint(ctx.run.checkpoints_dir)
        return [ckpt] if ckpt else [ctx.run.checkpoints_dir / "missing-final-epoch"]

    def fresh_paths(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.checkpoints_dir]  # every epoch's: a resumed trainer continues from the last

    def server_argv(self, ctx: StageContext) -> list[str] | None:
        return argv_for(ctx, "extraction") if ctx.extract_mode() == "online" else None

    def run(self, ctx: StageContext) -> TrainResult:
        if ctx.extract_mode() != "online":
            return TrainResult.of(self.train(ctx))
        _, mode_args = ports.mode_inputs(ctx.profile, ctx.run, "extraction")
        try:
            master = mooncake.master(ctx.profile, ctx.run, self.name)  # Mooncake transfer: before both, after both
            with master, ctx.server("extraction", on_wait=lambda w: ctx.progress(
                    0, ctx.profile.train.epochs, "epochs", server_wait_s=round(w)), **mode_args) as srv:
                with online_training.StatesWatch(mode_args["storage"], srv.base_url,
                                                 lambda **f: ctx.emit("metric", **f)) as watch:
                    figures = self.train(ctx, endpoint=f"{srv.base_url}/v1", server=srv.rec)
        except mooncake.MasterError as exc:
            raise StageError(str(exc)) from None
        seconds = ctx.run.stage_state(self.name).get("train_seconds") or 0
        figures.update(mode="online", states_disk_peak_bytes=watch.peak_bytes, states_peak_files=watch.peak_files,
                       generated_tokens=int(watch.generated_tokens),
                       generate_tok_s=round(watch.generated_tokens / seconds, 1) if seconds else None)
        return TrainResult.of(figures)

    def train(self, ctx: StageContext, endpoint: str | None = None, server=None) -> dict:
        save = ctx.run.checkpoints_dir
        moved = quarantine_incomplete(save, ctx.log)
        resumed = final_checkpoint(save)
        start = heads.start_head(ctx)
        cmd = build_command(ctx, endpoint=endpoint, start=start)
        ctx.log.info("command: %s", " ".join(cmd))
        ctx.emit("command", argv=cmd, resumed_from=resumed.name if resumed else None)
        t = ctx.profile.train
        last: dict[str, float] = {}
        step_ms: list[float] = []
        fetch_ms: list[float] = []  # of each logged step, the time it waited for its batch (states online)
        steps = 0
        epoch = int(resumed.name) + 1 if resumed else 0
        first_step_at: list[float] = []  # the first logged step: the trainer's start-up ends there

        def on_line(line: str) -> None:
            nonlocal epoch, steps
            metrics = speculators_compat.metrics_record(line)
            if metrics is None:
                return
            epoch = int(metrics.pop("epoch", epoch))
            step = metrics.pop("global_step", None)
            if any(k.startswith("train/") for k in metrics):
                steps += 1
                first_step_at[:] = first_step_at or [time.monotonic()]
                if "profile/step_ms" in metrics:
                    step_ms.append(metrics["profile/step_ms"])
                    fetch_ms.append(metrics.get("profile/fetch_ms", 0.0))
                last.update(metrics)
                ctx.emit("metric", step=int(step) if step is not None else steps, epoch=epoch, **metrics)
                ctx.progress(epoch, t.epochs, "epochs", step=steps, loss=metrics.get("train/loss"))
            elif any(k.startswith("val/") for k in metrics):
                last.update(metrics)
                ctx.emit("metric", epoch=epoch, **metrics)

        # Recorded so that a resume after this process was SIGKILLed can stop the orphaned trainer
        # (it runs in its own session and would keep writing checkpoints).
        env = trainer_env(ctx, endpoint)
        t0 = time.monotonic()
        log = ctx.run.log_path(self.name)
        this_attempt = log.stat().st_size if log.exists() else 0  # the log keeps every attempt's lines
        rc = ctx.run_child(cmd, env=env, on_line=on_line)
        wall = time.monotonic() - t0
        ctx.run.update_stage(self.name, train_seconds=round(wall, 2))
        if rc != 0:
            failure = f"speculators train exited with {rc}; see {log}: {procs.last_error_line(log)}"
            said = procs.read_log(log, this_attempt) or ""
            if node_sync.NODES_DISAGREE in said:  # the launcher's own reason comes before its echoes
                raise StageError(said.split(node_sync.NODES_DISAGREE, 1)[1].splitlines()[0])
            if t.nnodes > 1 and (why := torch_distributed_errors.node_lost(said)):
                raise StageError(f"the training job across {t.nnodes} nodes lost a node ({why}); resume every "
                                 f"node's run (node 0 hands its last checkpoint to the others)")
            raise StageError(explain_failure(server, failure) if server else failure)
        if not t.first_node:
            figures = {"node_rank": t.node_rank, "nnodes": t.nnodes, "rdzv_endpoint": t.rdzv_endpoint,
                       "epochs": t.epochs, "checkpoints": "on node 0"}
            atomicio.atomic_write_json(ctx.run.node_record, figures)
            return figures
        ckpt = final_checkpoint(save)
        if ckpt is None or int(ckpt.name) != t.epochs - 1:
            raise StageError(f"speculators train exited 0 but the last complete epoch is "
                             f"{ckpt.name if ckpt else 'none'}, expected {t.epochs - 1}")
        rate = steady_tokens_per_s(step_ms, ctx.profile)
        figures = {"checkpoint": str(ckpt), "epochs": t.epochs, "logged_steps": steps,
                   # the planner's measured rate: median step after the first (compile), all ranks
                   "tokens_per_s": rate,
                   "data_wait_share": data_wait_share(step_ms, fetch_ms),
                   "resumed_from_epoch": int(resumed.name) if resumed else None, "quarantined": moved,
                   "from_pretrained": str(start) if start else None,
                   **({"kept_sub_epoch": len(kept_sub_epoch(save))} if speculators_compat.KEEP_ENV in env else {})}
        figures.update({k.replace("/", "_"): round(v, 4) for k, v in last.items()
                        if k == "train/loss" or (k.startswith("val/") and re.search(r"(loss|acc)", k))})
        tokens = (ctx.run.stage_state("prepare").get("figures") or {}).get("tokens")
        # from a whole offline job on one node only: online, an epoch also waits on the server's states (the
        # plan's online wall counts them already); across nodes the start-up holds the rendezvous, however late
        # the other node came; a resume may start inside an epoch (a sub-epoch checkpoint) that it would count
        if endpoint is None and t.nnodes == 1 and not resumed and first_step_at and tokens and rate:
            figures.update(overhead_figures(wall, first_step_at[0] - t0, t.epochs, tokens, rate))
        return figures


def overhead_figures(wall_s: float, startup_s: float, epochs: int, tokens: int, tokens_per_s: float) -> dict:
    """The planner's overhead figures (rates.trainer_overhead): the start-up, and each epoch's wall beyond its
    steps at the steady rate (validation, the checkpoint's save, logging), as the plan reads them back."""
    steps_s = tokens * plan.TRAIN_RATIO * epochs / tokens_per_s
    per_epoch = max(0.0, (wall_s - startup_s - steps_s) / epochs) if epochs > 0 else 0.0
    return {"startup_s": round(startup_s, 1), "epoch_overhead_s": round(per_epoch, 1)}


def data_wait_share(step_ms: list[float], fetch_ms: list[float]) -> float | None:
    """The share of the logged steps' time (after the first: compile) spent waiting for data — online, for the
    server's states; what keeps online training below offline where it is not the server's rate."""
    steady = slice(1, None) if len(step_ms) > 1 else slice(None)
    total = sum(step_ms[steady])
    return round(sum(fetch_ms[steady]) / total, 3) if total > 0 else None


def steady_tokens_per_s(step_ms: list[float], profile) -> float | None:
    import statistics
    steady = step_ms[1:] or step_ms
    if not steady:
        return None
    t = profile.train
    return round(t.total_seq_len * t.nproc_per_node * t.nnodes / (statistics.median(steady) / 1000), 1)
