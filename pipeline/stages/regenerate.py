"""regenerate (optional): replace the assistant turns with the target's own answers, so the draft learns
the distribution it will be asked to predict. Output: pre-tokenized rows (input_ids + loss_mask), one
per assistant turn, in the conversations' order.

- vllm (data.regenerate_backend, any size): speculators' own `regenerate-responses` against a server of
  the target started on the run's port (the regenerate mode: the baseline, answering to the target's path
  too). Greedy unless the profile samples; a reasoning target's generated thinking is in the rows as the
  server generated it. Resumable: speculators appends each finished conversation and skips those on
  resume; failed requests are retried, then counted and named. Progress from the rows as they arrive.
- transformers: the target loaded here, batch by batch — the small targets' path (the CPU demo: no
  server start); preflight blocks it for a target that does not fit one process.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from itertools import accumulate
from pathlib import Path

from pipeline.compat import vllm_flags
from pipeline.compat.speculators_rows import RowsWatch, askable, read_rows, repair_tail, unique_ids
from pipeline.data import conversations, target
from pipeline.host import procs
from pipeline.layout import atomicio
from pipeline.layout.results import RegenerateResult
from pipeline.profile import GREEDY
from pipeline.serving.client import PromptWindow, generation_tokens
from pipeline.serving.server import death, explain_failure
from pipeline.stages.base import Stage, StageContext, StageError, argv_for


class Regenerate(Stage):
    name = "regenerate"

    def applies(self, profile) -> bool:
        return profile.data.regenerate

    def inputs(self, ctx: StageContext) -> list[Path]:
        from pipeline.data import sources
        return [] if sources.gathered(ctx.profile.data) else [ctx.source_conversations()]

    def outputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.training_conversations()]

    def fresh_paths(self, ctx: StageContext) -> list[Path]:
        return [ctx.training_conversations(), ctx.run.regenerate_dir]

    def server_argv(self, ctx: StageContext) -> list[str] | None:
        return argv_for(ctx, "regenerate") if ctx.profile.data.regenerate_backend == "vllm" else None

    def run(self, ctx: StageContext) -> RegenerateResult:
        data = ctx.profile.data
        gathered = ctx.gather_sources()
        loaded = conversations.load(ctx.source_conversations())
        for lineno, reason in loaded.bad:
            ctx.log.warning("%s:%d: skipped: %s", ctx.source_conversations(), lineno, reason)
        try:
            train, _ = conversations.split_heldout(loaded.conversations, data.heldout)
        except ValueError as exc:
            raise StageError(f"{ctx.source_conversations()}: {exc}") from None
        if loaded.token_rows:
            ctx.log.info("%d pre-tokenized rows pass through unregenerated", len(loaded.token_rows))
        train = enough_for(train, data.max_samples)
        rows, figures = (with_vllm if data.regenerate_backend == "vllm" else with_transformers)(ctx, train)
        rows += loaded.token_rows
        atomicio.atomic_write_text(ctx.training_conversations(), "".join(json.dumps(r) + "\n" for r in rows))
        return RegenerateResult.of({"backend": data.regenerate_backend, "rows": len(rows),
                                    "skipped_rows": len(loaded.bad), **figures, **gathered, **answer_variety(rows)})


def enough_for(train: list[dict], rows: int) -> list[dict]:
    """The leading conversations whose assistant turns give `rows` training rows (data.max_samples; 0 = all):
    regenerating more would be answers prepare drops."""
    if not rows:
        return train
    turns_before = accumulate((sum(m["role"] == "assistant" for m in c["messages"]) for c in train), initial=0)
    return [conv for conv, turns in zip(train, turns_before, strict=False) if turns < rows]


# ---------------------------------------------------------------------------------------------- vllm

def regenerate_command(ctx: StageContext, endpoint: str, dataset: Path, outfile: Path) -> list[str]:
    """speculators regenerate-responses with the profile's settings; --model is the target's path, which
    the regenerate server answers to and speculators loads its tokenizer from (compat/vllm_flags.py)."""
    d = ctx.profile.data
    # greedy unless the profile says otherwise: {top_p = 0.9} alone keeps temperature 0
    context, sampling = vllm_flags.regenerate_limits(d.seq_length, d.regenerate_max_tokens,
                                                     {**GREEDY, **d.regenerate_sampling})
    cmd = [sys.executable, "-m", "speculators", "regenerate-responses", "--endpoint", f"{endpoint}/v1/chat/completions",
           "--model", str(ctx.target_dir()), "--dataset", str(dataset), "--outfile", str(outfile), "--resume",
           "--concurrency", str(d.regenerate_concurrency), "--max-tokens", str(context),
           "--max-retries", str(d.regenerate_max_retries), "--sampling-params", json.dumps(sampling),
           "--seed", str(d.seed)]
    if d.regenerate_temperature:
        cmd += ["--temperature", json.dumps(d.regenerate_temperature)]
    if d.regenerate_reasoning_effort:
        cmd += ["--reasoning-effort", json.dumps(d.regenerate_reasoning_effort)]
    return cmd


class Follower(threading.Thread):
    """Follows one regenerate-responses client and its server every half second: progress from the rows
    as they arrive (tokens/s from the client's first request, seen on the server's prompt counter), the
    server's death and a stall (alive, generating nothing for data.regenerate_stall_s) — either stops the
    client at once, since its requests have no timeout and retrying a dead server is no use."""

    def __init__(self, ctx: StageContext, rec, watch: RowsWatch, total: int):
        super().__init__(name="regenerate-progress", daemon=True)
        self.ctx, self.rec, self.watch, self.total = ctx, rec, watch, total
        self.tokens_before = watch.tokens
        self.first = PromptWindow(rec.base_url)
        self.t0 = self.moved_at = time.perf_counter()
        self.generated: float | None = None
        self.died: str | None = None
        self.stalled: str | None = None
        self.client = None
        self.ended = threading.Event()
        self.end: float | None = None

    def watch_client(self, proc) -> None:
        self.client = proc

    def stop(self) -> None:
        self.end = time.perf_counter()
        self.ended.set()
        self.join()

    def run(self) -> None:
        while not self.ended.wait(0.5):
            try:
                if self._tick() is not None:
                    if self.client is not None:
                        procs.stop_group(self.client.pid, grace=5)
                    return
            except Exception as exc:  # noqa: BLE001 - the watcher must not die silently
                self.ctx.log.warning("regeneration watcher: %s: %s", type(exc).__name__, exc)

    def _tick(self) -> str | None:
        now, w = time.perf_counter(), self.watch
        w.poll()
        made = w.tokens - self.tokens_before
        since = now - (self.first.at or self.first.check() or now)  # once it has moved, one /metrics a tick
        self.ctx.progress(len(w.done), self.total, "conversations", tokens=made,
                          tok_s=round(made / since, 1) if since > 0 else None)
        self.died = death(self.rec, wait=0)
        if self.died is not None:
            return self.died
        generated = generation_tokens(self.rec.base_url)
        if generated is not None and generated != self.generated:
            self.generated, self.moved_at = generated, now
        elif now - self.moved_at > (stall := self.ctx.profile.data.regenerate_stall_s):
            self.stalled = (f"generated nothing for {stall:g} s (data.regenerate_stall_s) while "
                            f"{self.total - len(w.done)} conversation(s) wait")
        return self.stalled

    def timing(self, made: int) -> dict:
        """The client's wall time, its start (imports, tokenizer: not decoding) and the decode rate from its
        first request to its last row (seen within half a second) — the planner's measured rate."""
        end = self.end or time.perf_counter()
        last_row = self.watch.last_row_at
        self.watch.poll()  # the last rows, and when the last one came
        last_row = last_row or self.watch.last_row_at or end
        wall = end - self.t0
        first = self.first.at
        generating = last_row - first if first else None
        return {"generate_seconds": round(wall, 1), "client_start_s": round(first - self.t0, 1) if first else None,
                "generated_tok_s": round(made / generating, 1) if made > 0 and generating else None,
                "generated_tok_s_with_client_start": round(made / wall, 1) if wall and made > 0 else None}


def with_vllm(ctx: StageContext, train: list[dict]) -> tuple[list[dict], dict]:
    d = ctx.profile.data
    work = ctx.run.regenerate_dir
    work.mkdir(parents=True, exist_ok=True)
    dataset, outfile, errfile = work / "input.jsonl", work / "responses.jsonl", work / "responses.errors.jsonl"
    convs = unique_ids([c for c in train if askable(c)])
    if (mute := len(train) - len(convs)):
        ctx.log.warning("%d conversation(s) have no user turn to regenerate from: left out", mute)
    atomicio.atomic_write_text(dataset, "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in convs))
    if (cut := repair_tail(outfile)):
        ctx.log.warning("cut %d bytes of a half-written row a killed attempt left in %s", cut, outfile)
    watch = RowsWatch(outfile)
    watch.poll()
    before, tokens_before = len(watch.done), watch.tokens
    total = len(convs)
    if before:
        ctx.log.info("%d of %d conversations already regenerated: only the rest is asked", before, total)
    with ctx.server("regenerate", on_wait=lambda s: ctx.progress(before, total, "conversations",
                                                                 server_wait_s=round(s))) as srv:
        cmd = regenerate_command(ctx, srv.base_url, dataset, outfile)
        ctx.log.info("command: %s", " ".join(cmd))
        follower = Follower(ctx, srv.rec, watch, total)
        follower.start()
        try:
            rc = ctx.run_child(cmd, on_start=follower.watch_client)
        finally:
            follower.stop()
        if follower.stalled:  # the server lives but generates nothing
            raise StageError(f"{srv.rec.describe()} {follower.stalled}; the client was stopped (a resume goes on)")
        if follower.died or rc != 0:
            client_says = (f"speculators regenerate-responses exited with {rc}: "
                           f"{procs.last_error_line(ctx.run.log_path(ctx.stage))}")
            raise StageError(explain_failure(srv.rec, client_says))
    by_conv = read_rows(outfile)
    errors = {str(row["id"]): str((row.get("metadata") or {}).get("error", ""))[:200]
              for row in atomicio.read_jsonl(errfile) if isinstance(row, dict) and "id" in row}
    failed = {c["id"]: errors.get(c["id"], "no row and no error recorded") for c in convs if c["id"] not in by_conv}
    made = sum(int((r.get("metadata") or {}).get("usage", {}).get("completion_tokens") or 0)
               for rows in by_conv.values() for r in rows) - tokens_before
    figures = {"conversations": total, "regenerated_conversations": total - len(failed),
               "resumed_conversations": before, "failed_conversations": len(failed),
               "truncated_rows": sum(1 for rows in by_conv.values() for r in rows
                                     if (r.get("metadata") or {}).get("finish_reason") == "length"),
               "generated_tokens": sum(sum(r["loss_mask"]) for rows in by_conv.values() for r in rows),
               "server_start_s": srv.start_s, **follower.timing(made)}
    if failed:
        first = next(iter(failed))
        figures["failed"] = sorted(failed)[:10]
        figures["first_failure"] = f"{first}: {failed[first]}"
        ctx.log.warning("%d conversation(s) failed after %d retries, e.g. %s", len(failed), d.regenerate_max_retries,
                        figures["first_failure"])
        if len(failed) > d.regenerate_failure_budget * total:
            raise StageError(f"{len(failed)}/{total} conversations failed to regenerate (more than "
                             f"data.regenerate_failure_budget = {d.regenerate_failure_budget:g}), e.g. "
                             f"{figures['first_failure']}; errors in {errfile}; a resume asks only those again")
    rows = [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}
            for c in convs for r in by_conv.get(c["id"], [])]
    return rows, figures


# --------------------------------------------------------------------------------------- transformers

def with_transformers(ctx: StageContext, train: list[dict]) -> tuple[list[dict], dict]:
    from pipeline.evaluation.offline_decoding import eos_ids, greedy_reference_batch

    data = ctx.profile.data
    tok = target.load_tokenizer(ctx.target_dir())
    model = target.load_model(ctx.target_dir(), ctx.profile.target.dtype)
    tok.padding_side = "left"
    pad = tok.pad_token_id
    if pad is None:  # the model's (first) eos token instead
        eos = model.generation_config.eos_token_id
        pad = (eos[0] if eos else None) if isinstance(eos, list) else eos
    if pad is None:
        raise StageError(f"{ctx.target_dir()}: the tokenizer has no pad token and the model no eos token to pad "
                         f"batches with; use data.regenerate_backend = \"vllm\"", resumable=False)
    histories = [list(c["messages"]) for c in train]
    answers = [[i for i, m in enumerate(h) if m["role"] == "assistant"] for h in histories]  # their positions
    rows: list[tuple[int, int, dict]] = []  # (conversation, turn, row): written in conversation order
    total = sum(map(len, answers))
    t0 = time.perf_counter()
    for turn in range(max(map(len, answers))):
        # Conversations that still have an assistant turn number `turn` to regenerate.
        work = [(h, positions[turn]) for h, positions in enumerate(answers) if turn < len(positions)]
        for start in range(0, len(work), data.regenerate_batch_size):
            batch = work[start:start + data.regenerate_batch_size]
            prompts = [conversations.render_ids(tok, histories[h][:pos], True) for h, pos in batch]
            completions = greedy_reference_batch(model, prompts, data.regenerate_max_tokens, eos_ids(model), pad)
            for (h, pos), prompt, completion in zip(batch, prompts, completions, strict=True):
                rows.append((h, turn, {"input_ids": prompt + completion,
                                       "loss_mask": [0] * len(prompt) + [1] * len(completion)}))
                text = tok.decode([t for t in completion if t not in tok.all_special_ids])
                histories[h][pos] = {"role": "assistant", "content": text}
            ctx.progress(len(rows), total, "turns")
    seconds = time.perf_counter() - t0
    generated_tokens = sum(sum(row["loss_mask"]) for _, _, row in rows)
    return [row for _, _, row in sorted(rows, key=lambda r: r[:2])], {
        "generated_tokens": generated_tokens, "generate_seconds": round(seconds, 1),
                  "generated_tok_s": round(generated_tokens / seconds, 1) if seconds else None}


def answer_variety(rows: list[dict]) -> dict:
    """How much the target's answers say: distinct tokens over all of them, and the share of answer tokens
    that complete a trigram already in their context (what prompt lookup can copy; a looping model
    scores near 1)."""
    distinct: set[int] = set()
    repeated = total = 0
    for row in rows:
        ids, mask = row["input_ids"], row["loss_mask"]
        seen: set[tuple[int, ...]] = set()
        for i in range(2, len(ids)):
            if mask[i]:
                total += 1
                repeated += (ids[i - 2], ids[i - 1], ids[i]) in seen
                distinct.add(ids[i])
            seen.add((ids[i - 2], ids[i - 1], ids[i]))
    return {"answer_distinct_tokens": len(distinct),
            "answer_repeated_trigram_share": round(repeated / total, 3) if total else 0.0}
