"""prepare: conversations JSONL -> speculators' prepared dataset (arrow: input_ids, loss_mask, seq_len),
chat template applied, loss on assistant turns only, plus token_freq.pt for the draft vocabulary and
the held-out evaluation prompts."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from pipeline.data import conversations, target
from pipeline.host import procs
from pipeline.layout import atomicio
from pipeline.layout.results import PrepareResult
from pipeline.serving import ports
from pipeline.serving.server import explain_failure
from pipeline.stages.base import Stage, StageContext, StageError, argv_for


def dataset_features():
    # Explicit int64: a plain from_dict stores int32, and the trainer compares input_ids with the
    # int64 token_ids of the hidden-state files using torch.equal (docs/reference.md §7).
    from datasets import Features, Sequence, Value
    return Features({"input_ids": Sequence(Value("int64")), "loss_mask": Sequence(Value("int64")),
                     "seq_len": Value("int64")})


class Prepare(Stage):
    name = "prepare"

    def inputs(self, ctx: StageContext) -> list[Path]:
        from pipeline.data import sources
        needed = [ctx.training_conversations()] if ctx.profile.data.regenerate else []
        if not sources.gathered(ctx.profile.data):  # a preset or a mix is gathered here when absent
            needed.insert(0, ctx.source_conversations())
        return list(dict.fromkeys(needed))

    def outputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.prepared_dir / "dataset_info.json", ctx.run.prepared_dir / "state.json",
                ctx.run.token_freq, ctx.run.heldout_prompts]

    def fresh_paths(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.prepared_dir, ctx.run.heldout_prompts]

    def server_argv(self, ctx: StageContext) -> list[str] | None:
        if ctx.profile.data.tokenize != "render" or ctx.profile.data.regenerate:
            return None
        return argv_for(ctx, "extraction" if ctx.profile.extract.backend == "vllm" else "baseline")

    def run(self, ctx: StageContext) -> PrepareResult:
        from datasets import Dataset

        data = ctx.profile.data
        gathered = ctx.gather_sources()
        source = ctx.source_conversations()
        try:
            loaded = conversations.load(source)
        except FileNotFoundError as exc:
            raise StageError(str(exc)) from None
        for lineno, reason in loaded.bad:
            ctx.log.warning("%s:%d: skipped malformed row: %s", source, lineno, reason)
        try:
            train, heldout = conversations.split_heldout(loaded.conversations, data.heldout, len(loaded.token_rows)) \
                if loaded.conversations else ([], [])
        except ValueError as exc:
            raise StageError(f"{source}: {exc}") from None
        if data.tokenize == "render":
            return PrepareResult.of({**self._with_speculators(ctx, loaded, train, heldout), **gathered})
        tok = target.load_tokenizer(ctx.target_dir())
        if data.regenerate:
            rows = conversations.load(ctx.training_conversations()).token_rows
        else:
            rows = list(loaded.token_rows)
            for conv in train:
                try:
                    rows += conversations.assistant_rows(tok, conv["messages"])
                except ValueError as exc:
                    raise StageError(f"{source}: conversation {conv['id']}: {exc}") from None
        columns: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
        truncated = unsupervised = 0
        for row in rows[: data.max_samples or None]:  # the rows the plan counted
            ids, mask = row["input_ids"][: data.seq_length], row["loss_mask"][: data.seq_length]
            truncated += len(ids) < len(row["input_ids"])
            if sum(mask) == 0:
                unsupervised += 1
                continue
            columns["input_ids"].append(ids)
            columns["loss_mask"].append(mask)
            columns["seq_len"].append(len(ids))
        if not columns["input_ids"]:
            raise StageError(f"{source}: no usable training row ({len(loaded.bad)} malformed, "
                             f"{unsupervised} without assistant tokens after truncation to {data.seq_length})")
        ds = Dataset.from_dict(columns, features=dataset_features())
        ds.set_format(type="torch")  # as speculators' prepare-data saves it; its loader relies on it
        out = ctx.run.prepared_dir
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        ds.save_to_disk(str(tmp))
        # Hidden states of an earlier, different dataset must not survive a re-prepare.
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        atomicio.fsync_dir(out.parent)
        _write_token_freq(ds, ctx.run.token_freq)
        prompts = _write_heldout(ctx, heldout)
        return PrepareResult.of({**gathered, "rows": len(columns["seq_len"]), "tokens": sum(columns["seq_len"]),
                                 "loss_tokens": sum(sum(m) for m in columns["loss_mask"]),
                                 "skipped_malformed": len(loaded.bad), "skipped_unsupervised": unsupervised,
                                 "truncated": truncated, "heldout_prompts": len(prompts)})


    def _with_speculators(self, ctx: StageContext, loaded, train: list[dict], heldout: list[dict]) -> dict:
        """speculators' own prepare-data: conversations rendered by the served chat template (through
        the extraction server, which extract then reuses), pre-tokenized rows passed through (a second
        prepare-data without a server: speculators takes one kind of row per file), the two concatenated."""
        from datasets import concatenate_datasets, load_from_disk

        data = ctx.profile.data
        out = ctx.run.prepared_dir
        tmp = out.with_name(out.name + ".tmp")

        def prepare_data(into: Path, extra: list[str]) -> int:
            shutil.rmtree(into, ignore_errors=True)
            cmd = [sys.executable, "-m", "speculators", "prepare-data", "--model", str(ctx.target_dir()),
                   "--output", str(into), "--seq-length", str(data.seq_length), "--seed", str(data.seed),
                   "--no-skip-token-freq", "--token-freq-path", str(into / "token_freq.pt"), *extra]
            if data.max_samples:
                cmd += ["--max-samples", str(data.max_samples)]
            ctx.log.info("command: %s", " ".join(cmd))
            return ctx.run_child(cmd)

        def failed(rc: int) -> str:
            return f"speculators prepare-data exited with {rc}: {procs.last_error_line(ctx.run.log_path(self.name))}"

        parts: list[Path] = []
        rows_file: Path | None
        if data.regenerate:  # the regenerated token rows: no server needed
            rows_file, rendered = ctx.training_conversations(), False
        else:
            rows_file = ctx.run.train_token_rows if loaded.token_rows else None
            rendered = bool(train)
            if rows_file:
                atomicio.atomic_write_text(rows_file, "".join(json.dumps(r) + "\n" for r in loaded.token_rows))
        if rows_file:
            parts.append(tmp.with_name(tmp.name + "-rows") if rendered else tmp)
            if (rc := prepare_data(parts[-1], ["--data", str(rows_file)])) != 0:
                raise StageError(failed(rc))
        if rendered:
            source = ctx.run.train_conversations
            atomicio.atomic_write_text(source, "".join(json.dumps({"conversations": c["messages"]}) + "\n"
                                                       for c in train))
            mode = "extraction" if ctx.profile.extract.backend == "vllm" else "baseline"
            _, mode_args = ports.mode_inputs(ctx.profile, ctx.run, mode)
            with ctx.server(mode, **mode_args) as srv:
                parts.append(tmp.with_name(tmp.name + "-rendered") if parts else tmp)
                if (rc := prepare_data(parts[-1], ["--data", str(source), "--render-endpoint", srv.base_url])) != 0:
                    raise StageError(explain_failure(srv.rec, failed(rc)))
                if mode == "extraction":  # the next stage that serves asks for exactly this server
                    srv.handed_on_to = "extract" if ctx.extract_mode() == "offline" else "train"
        if not parts:
            raise StageError(f"{ctx.source_conversations()}: no training row or conversation left "
                             f"after {len(heldout)} held out")
        if len(parts) > 1:  # the rows first, as the local path orders them; max_samples counts both
            merged = concatenate_datasets([load_from_disk(str(p)).with_format(None).cast(dataset_features())
                                           for p in parts])
            merged = merged.select(range(min(len(merged), data.max_samples or len(merged))))
            merged.set_format(type="torch")
            shutil.rmtree(tmp, ignore_errors=True)
            merged.save_to_disk(str(tmp))
            _write_token_freq(merged, tmp / "token_freq.pt")
            for p in parts:
                shutil.rmtree(p, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        atomicio.fsync_dir(out.parent)
        ds = load_from_disk(str(out)).with_format(None)
        prompts = _write_heldout(ctx, heldout)
        passed = {} if data.regenerate else {"token_rows": len(loaded.token_rows)}  # the source's own
        return {"tokenize": "render" if rendered else "pass-through", "rows": len(ds), **passed,
                "tokens": int(sum(ds["seq_len"])), "loss_tokens": int(sum(sum(m) for m in ds["loss_mask"])),
                "skipped_malformed": len(loaded.bad), "heldout_prompts": len(prompts)}


def _write_heldout(ctx: StageContext, heldout: list[dict]) -> list[dict]:
    prompts = [{"id": c["id"], "messages": conversations.first_prompt(c["messages"]),
                **({"source": c["source"]} if "source" in c else {})} for c in heldout]
    atomicio.atomic_write_text(ctx.run.heldout_prompts, "".join(json.dumps(p) + "\n" for p in prompts))
    return prompts


def _write_token_freq(ds, path: Path) -> None:
    """speculators' own counter (same keys and semantics the trainer expects), written atomically;
    it refuses to overwrite, so it writes into a fresh temp path that is then renamed."""
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    tmp = path.with_name(f".{path.name}.tmp.pt")
    tmp.unlink(missing_ok=True)
    atomicio.atomic_write_with(path, lambda p: (save_token_frequency_distribution(ds.with_format("torch"), tmp),
                                                 tmp.replace(p)))
