"""extract (transformers backend): hidden states of the target at the profile's layer ids, written in
speculators' `hs_{i}.safetensors` format (token_ids int64 [T]; hidden_states [T, n_aux+1, H], the last
slot the pre-norm final layer). File writes run in a thread pool, overlapped with the next forward.
Each file is written to a temp name and renamed, so a killed run leaves only complete files, and a
resumed run skips them."""
from __future__ import annotations

import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from pipeline.compat import offline_clients
from pipeline.compat.offline_clients import extraction_clients, shard
from pipeline.data import target
from pipeline.data.targetinfo import from_config
from pipeline.host import procs
from pipeline.layout import atomicio
from pipeline.layout.results import ExtractResult
from pipeline.serving import client, online_training, ports, vllm_modes
from pipeline.serving.server import explain_failure
from pipeline.stages.base import Stage, StageContext, StageError, argv_for
from pipeline.units import GIB


def hs_path(hs_dir: Path, index: int) -> Path:
    return hs_dir / f"hs_{index}.safetensors"


def write_hs_file(path: Path, token_ids, hidden_states) -> int:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp")
    save_file({"token_ids": token_ids.contiguous(), "hidden_states": hidden_states.contiguous()}, str(tmp))
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path.stat().st_size


def _write_when_ready(ready, path: Path, token_ids, hidden_states) -> int:
    if ready is not None:
        ready.synchronize()  # the device-to-host copy of this batch has landed
    return write_hs_file(path, token_ids, hidden_states)


class _PinnedRing:
    """GPU states go to disk through a few reused pinned host buffers, copied asynchronously, so the
    next batch's forward overlaps the copy and the writes. Measured on an H200 (docs/reference.md §7): a
    copy into a fresh pageable tensor ran at 1.33 GiB/s, into a reused pinned buffer 51 GiB/s. A
    buffer is reused only after every write reading it has finished. CPU states pass through."""

    def __init__(self, slots: int):
        self.buffers: list = [None] * slots
        self.readers: list[list[Future]] = [[] for _ in range(slots)]
        self.next = 0

    def to_host(self, states):
        import torch
        if not states.is_cuda:
            return states, None, []
        i, self.next = self.next, (self.next + 1) % len(self.buffers)
        for fut in self.readers[i]:
            fut.result()
        self.readers[i] = []
        n = states.numel()
        if self.buffers[i] is None or self.buffers[i].numel() < n or self.buffers[i].dtype != states.dtype:
            self.buffers[i] = torch.empty(n, dtype=states.dtype, pin_memory=True)
        host = self.buffers[i][:n].view(states.shape)
        host.copy_(states, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready, self.readers[i]


def plan_batches(lengths: dict[int, int], batch_size: int, batch_tokens: int) -> list[list[int]]:
    """Length-sorted batches (little padding), capped by count and by padded tokens."""
    order = sorted(lengths, key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for idx in order:
        width = lengths[idx]  # sorted ascending: the newest is the longest
        if current and (len(current) == batch_size or width * (len(current) + 1) > batch_tokens):
            batches.append(current)
            current = []
        current.append(idx)
    if current:
        batches.append(current)
    return batches


def extract(model, dataset, hs_dir: Path, layer_ids: list[int], batch_size: int, batch_tokens: int,
            writer_threads: int, on_progress=lambda done, total, tokens: None, indices: range | None = None) -> dict:
    import torch

    hs_dir.mkdir(parents=True, exist_ok=True)
    for stale in hs_dir.glob(".hs_*.tmp"):
        stale.unlink()
    dataset = dataset.with_format(None)  # plain lists; the saved format is torch
    indices = indices if indices is not None else range(len(dataset))
    seq_len = dataset["seq_len"]
    lengths = {i: seq_len[i] for i in indices if not hs_path(hs_dir, i).exists()}
    total, already = len(indices), len(indices) - len(lengths)
    reader = target.HiddenStateReader(model, layer_ids)
    done, tokens, written = already, 0, 0
    start = time.perf_counter()
    pending: list[Future] = []
    staging = _PinnedRing(slots=3)
    with ThreadPoolExecutor(max_workers=writer_threads, thread_name_prefix="hs-writer") as pool:
        for batch in plan_batches(lengths, batch_size, batch_tokens):
            rows = [dataset[i]["input_ids"] for i in batch]
            width = max(len(r) for r in rows)
            ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long)
            _, states = reader(ids, mask)  # right padding: causal attention keeps real positions exact
            states, ready, slot = staging.to_host(states)
            for b, idx in enumerate(batch):
                n = len(rows[b])
                fut = pool.submit(_write_when_ready, ready, hs_path(hs_dir, idx), ids[b, :n],
                                  states[b, :n])  # views: a row prefix is contiguous
                slot.append(fut)
                pending.append(fut)
                tokens += n
            # Bound the queue: at most two batches of tensors wait for the disk.
            while len(pending) > 2 * max(batch_size, writer_threads):
                written += pending.pop(0).result()
            done += len(batch)
            on_progress(done, total, tokens)
        for fut in pending:
            written += fut.result()
    seconds = time.perf_counter() - start
    return {"samples": total, "extracted": total - already, "resumed_from": already, "tokens": tokens,
            "bytes_written": written, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 and tokens else 0.0,
            "layer_ids": layer_ids}


class Extract(Stage):
    name = "extract"

    def inputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.prepared_dir / "dataset_info.json"]

    def outputs(self, ctx: StageContext) -> list[Path]:
        if ctx.extract_mode() == "online":
            return [ctx.run.online_cache_record]
        return [ctx.run.hidden_states_dir]

    def fresh_paths(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.hidden_states_dir, ctx.run.hs_raw_dir]

    def server_argv(self, ctx: StageContext) -> list[str] | None:
        return argv_for(ctx, "extraction") if ctx.profile.extract.backend == "vllm" else None

    def run(self, ctx: StageContext) -> ExtractResult:
        if ctx.extract_mode() == "online":
            return ExtractResult.of(extract_cache(ctx))
        ex = ctx.profile.extract
        if ex.backend == "vllm":
            return ExtractResult.of(extract_with_vllm(ctx, ex.world_size, ex.rank,
                                                      clients=extraction_clients(ctx.profile)))
        from datasets import load_from_disk

        ds = load_from_disk(str(ctx.run.prepared_dir))
        model = target.load_model(ctx.target_dir(), ctx.profile.target.dtype)
        layer_ids = target.resolve_layer_ids(ex.layer_ids, target.num_layers(model))
        ctx.log.info("extracting %d samples, layer ids %s", len(ds), layer_ids)
        figures = extract(model, ds, ctx.run.hidden_states_dir, layer_ids, ex.batch_size, ex.batch_tokens,
                          ex.writer_threads, on_progress=lambda d, t, n: ctx.progress(d, t, "samples", tokens=n),
                          indices=shard(len(ds), ex.world_size, ex.rank))
        figures["shard"] = f"{ex.rank}/{ex.world_size}"
        ctx.log.info("extracted %s", figures)
        return ExtractResult.of(figures)


def extract_cache(ctx: StageContext) -> dict:
    """Online mode: extract only the leading rows whose states fit extract.cache_gib (kept for every
    epoch); the trainer generates the rest while it trains. Nothing to extract without a cache."""
    from datasets import load_from_disk

    seq_len = load_from_disk(str(ctx.run.prepared_dir)).with_format(None)["seq_len"]
    rows = online_training.cached_prefix(seq_len, state_bytes_per_token(ctx), int(ctx.profile.extract.cache_gib * GIB))
    figures: dict = {"mode": "online", "cached_rows": 0, "rows": len(seq_len)}
    if rows:
        world, rank = online_training.leading_slice(len(seq_len), rows)
        figures.update(extract_with_vllm(ctx, world, rank, keep_server=True), mode="online")
        figures["cached_rows"] = figures["samples"]
    ctx.run.hidden_states_dir.mkdir(parents=True, exist_ok=True)
    atomicio.atomic_write_json(ctx.run.online_cache_record, figures)
    return figures


def state_bytes_per_token(ctx: StageContext) -> int:
    """Bytes of one token's states as the extraction server writes them: the aux layers plus the
    last, in the server's dtype (float32 on a CPU, bf16 on GPUs unless the profile says otherwise)."""
    info = from_config(ctx.target_dir() / "config.json")
    n = len(target.resolve_layer_ids(ctx.profile.extract.layer_ids, info.layers))
    return n * info.hidden * (4 if vllm_modes.served_dtype(ctx.profile) == "float32" else 2)


def extract_with_vllm(ctx: StageContext, world_size: int, rank: int, keep_server: bool = False,
                      clients: int = 1) -> dict:
    """Through a vLLM extraction server and speculators' own `generate-offline-data` (resumable: it
    skips the hs files that exist; each is renamed into place once complete). Rows: slice `rank` of
    `world_size` (its own split), over `clients` client processes (pipeline/compat/offline_clients.py).
    keep_server: hand the server on to online training, which asks it next."""
    from datasets import load_from_disk

    prepared = ctx.run.prepared_dir
    ds = load_from_disk(str(prepared))
    rows = offline_clients.rows(len(ds), world_size, rank, clients)
    seq_len = ds.with_format(None)["seq_len"]
    total, tokens = len(rows), int(sum(seq_len[i] for i in rows))

    def have_files() -> int:
        return sum(hs_path(ctx.run.hidden_states_dir, i).exists() for i in rows)

    before = have_files()  # a resume skips them
    _, mode_args = ports.mode_inputs(ctx.profile, ctx.run, "extraction")
    with ctx.server("extraction", on_wait=lambda s: ctx.progress(0, total, "samples", server_wait_s=round(s)),
                    **mode_args) as srv:
        cmd = [sys.executable, "-m", "speculators", "generate-offline-data", "--endpoint", f"{srv.base_url}/v1",
               "--preprocessed-data", str(prepared), "--concurrency", str(ctx.profile.extract.concurrency),
               "--validate-outputs", "--fail-on-error"]
        if clients > 1:
            cmd = [sys.executable, "-m", "pipeline.compat.offline_clients", str(clients), str(world_size),
                   str(rank), "--", *cmd]
        else:
            cmd = offline_clients.client_argv(cmd, world_size, rank)
        ctx.log.info("command: %s", " ".join(cmd))
        t1 = time.perf_counter()
        window = client.PromptWindow(srv.base_url)
        window.start()
        rc = ctx.run_child(cmd)
        seconds = time.perf_counter() - t1
        window.stop()
        if rc != 0:
            raise StageError(explain_failure(srv.rec, f"speculators generate-offline-data exited with {rc}: "
                                                      f"{procs.last_error_line(ctx.run.log_path(ctx.stage))}"))
        have = have_files()
        if have != total:
            raise StageError(f"generate-offline-data finished with {have}/{total} hidden-state files of shard "
                             f"{rank}/{world_size}")
        if keep_server:
            srv.handed_on_to = "train"  # online training asks this server next
    # the server's rate, from its first prompt to its last: the CLI's start before (imports, the dataset: 15 s
    # or more) and the clients' tail after (their last files, their exit: 2–3 s) come once a run, not per token,
    # and a slice's calibration would carry them as per-token costs
    rate = window.tokens_per_s()
    timed = {"client_start_s": round(window.at - t1, 1), "tail_s": round(t1 + seconds - window.last, 1),
             "tokens_per_s": round(rate, 1)} if rate and window.at and window.last else {}
    return {"backend": "vllm", "samples": total, "extracted": total - before, "resumed_from": before,
            "tokens": tokens, "server_start_s": srv.start_s, "seconds": round(seconds, 3), **timed,
            "samples_per_s": round((total - before) / seconds, 2) if seconds else 0.0,
            "layer_ids": mode_args["layer_ids"], "shard": f"{rank}/{world_size}", "clients": clients}
