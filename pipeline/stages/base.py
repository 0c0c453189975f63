"""The one small interface every stage implements, and the context a stage runs in."""
from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from pipeline.host import procs
from pipeline.layout import results
from pipeline.layout.rundir import RunDir, RunDirError
from pipeline.profile import Profile
from pipeline.report import notes
from pipeline.serving import ports, vllm_modes
from pipeline.serving.server import ServerError, ServerRecord, is_live


class StageError(RuntimeError):
    """A stage failed for a reason the operator can act on; the message is one line. `resumable`:
    False when the cause is in the run's own profile, which a resume keeps."""

    def __init__(self, message: str, resumable: bool = True):
        super().__init__(message)
        self.resumable = resumable


def clear_raw_states(raw: Path) -> int:
    """Empty the extraction connector's storage: each file there is a state in flight, or one a killed
    attempt left with its lock; generate-offline-data moves every finished one out. Returns the files cleared."""
    if not raw.is_dir():
        return 0
    cleared = sum(1 for p in raw.rglob("*") if p.is_file())
    shutil.rmtree(raw)
    raw.mkdir(parents=True)
    return cleared


@dataclass
class Lease:
    """One server a stage uses: started (or reused) when the lease is taken, stopped when it ends — the
    stage finished, failed or was interrupted — unless the stage hands it on to the next one, visibly
    (the log, the notes and the stage's record say so)."""
    ctx: StageContext
    profile: Profile
    rec: ServerRecord
    start_s: float
    handed_on_to: str | None = None  # the stage that asks for exactly this server next (and reuses it)

    @property
    def base_url(self) -> str:
        return self.rec.base_url

    def release(self, failed: bool = False) -> None:
        if self.handed_on_to and not failed:
            self.ctx.note(f"{self.rec.describe()} kept for {self.handed_on_to}", self.ctx.log.info)
            self.ctx.run.update_stage(self.ctx.stage, server_handed_on={
                "mode": self.rec.mode, "pid": self.rec.pid, "port": self.rec.port, "to": self.handed_on_to})
            return
        try:
            ports.stop_server_on_port(self.profile, self.ctx.log.info, own_run=str(self.ctx.run.root))
        except ServerError as exc:
            if not failed:
                raise StageError(f"stopping {self.rec.describe()}: {exc}") from None
            self.ctx.log.error("stopping %s: %s", self.rec.describe(), exc)  # the stage's own failure goes on


@dataclass
class StageContext:
    run: RunDir
    profile: Profile
    log: logging.Logger
    on_event: Callable[[dict], None] = lambda record: None
    stage: str = ""
    _last_progress: float = field(default=0.0, repr=False)

    def lease(self, mode: str, *, profile: Profile | None = None, name: str | None = None,
              on_wait: Callable[[float], None] = lambda s: None, **mode_args) -> Lease:
        """Start (or reuse) the server of `mode` on the profile's port (or `profile`'s: a side-by-side
        port), owned by this run; `name`: its log's name (server-NAME.log). Use it in a `with` block,
        or call release() yourself."""
        p = profile or self.profile
        if mode == "extraction" and (left := clear_raw_states(mode_args["storage"])):
            self.log.info("cleared %d raw state files a killed attempt left in %s", left, mode_args["storage"])
        t0 = time.perf_counter()
        there = ports.controller(p).record()
        if (mode != "production" and there is not None and there.mode == "production" and not there.run
                and is_live(there)):
            # the operator's production, stopped (or taken as this run's own) for this stage, written before
            # it is touched: a run that fails brings it back (run/runner.py production_back)
            self.run.update_state(production_stopped={"by": self.stage, "pid": there.pid, "port": there.port,
                                                      "argv": there.argv})
        rec = ports.start_mode(p, mode, self.target_dir(), log_path=self.run.log_path(f"server-{name or mode}"),
                               say=self.log.info, on_wait=on_wait,
                               owner=str(self.run.root), **mode_args)
        start_s = round(time.perf_counter() - t0, 1)
        self.emit("server", mode=mode, method=name or mode, pid=rec.pid, port=rec.port, start_s=start_s)
        return Lease(self, p, rec, start_s)

    def run_child(self, cmd: list[str], *, env: dict | None = None, on_line: Callable[[str], None] = lambda line: None,
                  on_start: Callable = lambda proc: None) -> int:
        """Run a child of the stage (a speculators command) in its own session, its output into the stage's
        log. Its process group is recorded in the stage's state, so that a resume after this process was
        SIGKILLed stops the orphan first (stop_orphan_child): two clients would write the same outputs."""
        def started(proc) -> None:
            self.run.update_stage(self.stage, child_pgid=proc.pid, child_cmd=cmd[:4])
            on_start(proc)

        return procs.run_logged(cmd, self.run.log_path(self.stage), env=env or procs.child_env(self.run.cache_root),
                                cwd=self.run.root, on_line=on_line, on_start=started)

    @contextmanager
    def server(self, mode: str, **kwargs) -> Iterator[Lease]:
        """`with ctx.server("baseline") as srv:` — the server for the block, stopped when it ends
        (extraction: the connector's storage emptied before and after)."""
        lease = self.lease(mode, **kwargs)
        try:
            yield lease
        except BaseException:
            lease.release(failed=True)
            raise
        finally:
            if mode == "extraction":
                clear_raw_states(kwargs["storage"])
        lease.release()

    def note(self, text: str, say: Callable[[str], None] | None = None) -> None:
        """`text` into the run's notes, from this stage; said first through `say` (a log level) when given."""
        if say is not None:
            say(text)
        notes.add(self.run, text, source="auto", stage=self.stage)

    def emit(self, kind: str, **data) -> None:
        self.on_event(self.run.emit(self.stage, kind, **data))

    def progress(self, done: int, total: int | None, unit: str = "", force: bool = False, **figures) -> None:
        """Record progress; throttled to 4 events/s so a tight loop cannot flood the event log."""
        now = time.monotonic()
        if not force and total is not None and done < total and now - self._last_progress < 0.25:
            return
        self._last_progress = now
        self.emit("progress", done=done, total=total, unit=unit, **figures)

    # What earlier stages produced, typed (one place decides where a stage's inputs are).
    def target_dir(self) -> Path:
        """The served target (RunDir.target_dir), a stage's failure when the demo target is not built yet."""
        try:
            return self.run.target_dir(self.profile)
        except RunDirError as exc:
            raise StageError(str(exc)) from None

    def source_conversations(self) -> Path:
        """Where the conversations are read: the one local file, the demo's, or the run's gathered mix
        (gather_sources writes it)."""
        data = self.profile.data
        if (single := data.single_file()) is not None:
            return Path(single)
        return self.run.demo_conversations if data.conversations == "demo" else self.run.gathered_conversations

    def gather_sources(self) -> dict:
        """Gather a preset or a mix into the run (once per spec); {} for one file or the demo alone."""
        from pipeline.data import sources

        if not sources.gathered(self.profile.data):
            return {}
        try:
            counts = sources.gather(self.profile.data, self.run.demo_conversations, self.run.gathered_conversations,
                                    self.run.gathered_record)
        except sources.SourceError as exc:
            raise StageError(str(exc)) from None
        self.log.info("conversations gathered: %s", counts)
        return {"sources": counts}

    def heldout_rows(self) -> list[dict]:
        """The held-out prompts the evaluations use (evaluate.num_prompts of prepare's)."""
        rows = [json.loads(line) for line in self.run.heldout_prompts.read_text().splitlines()
                if line.strip()][: self.profile.evaluate.num_prompts]
        if not rows:
            raise StageError(f"{self.run.heldout_prompts}: no held-out prompts (data.heldout = 0?)")
        return rows

    def training_conversations(self) -> Path:
        return self.run.regenerated_conversations if self.profile.data.regenerate else self.source_conversations()

    def extract_mode(self) -> str:
        """offline / online: the profile's, or what preflight decided for `auto` on this run's disk."""
        if self.profile.extract.mode != "auto":
            return self.profile.extract.mode
        decided = self.run.result(results.PreflightResult).extract_mode
        if decided is None:
            raise StageError("extract.mode auto: preflight has not decided offline or online for this run")
        return decided

    def draft_checkpoint(self) -> Path:
        """The head the run deploys: pick-checkpoint's choice (evaluate.checkpoints = "each"), else the last
        epoch's."""
        from pipeline.report.publish import chosen_head

        head, stage = chosen_head(self.run, self.profile)
        if head is None:
            raise StageError(f"{stage} has not finished: no checkpoint "
                             f"{'chosen' if stage == 'pick-checkpoint' else 'recorded'} in state.json")
        return head


# The stages that exist only to make a new head and weigh it (its data, states, vocabulary, training, the
# checkpoint chosen, its evaluations): under evaluate.existing_policy = "deploy" the runner skips them once
# measure-existing found that the existing head already clears the deploy decision.
HEAD_STAGES = frozenset({"regenerate", "prepare", "extract", "vocab", "train", "pick-checkpoint", "evaluate-offline",
                         "deploy-measure"})


def existing_clears(run: RunDir, profile: Profile) -> results.MeasureExistingResult | None:
    """measure-existing's result where it lets the run do without a new head (evaluate.existing_policy =
    "deploy" and the existing head cleared the decision), else None."""
    measured = run.result(results.MeasureExistingResult)
    if profile.evaluate.existing_policy != "deploy" or not measured.skips_training or not measured.deploy:
        return None
    return measured


# a deploy decision's inputs (deploy-measure's, measure-existing's), which the handover acts on: the threshold,
# the traffic mix, the noise bound
DECISION_KEYS = ("evaluate.deploy_speedup", "evaluate.traffic", "evaluate.instance_spread")


class Stage:
    """name: the CLI name. inputs(): the files earlier stages wrote that this one reads (checked before
    it runs). outputs(): what the stage writes (recorded when it finishes; the stage counts as done only
    while they are all still there, unchanged). run(): does the work and returns the key figures that go
    into the state, the events and the notes."""

    name: str = ""
    always_run: bool = False  # a check that must hold on every attempt (preflight): never skipped as done
    # profile keys its recorded result embodies and later stages act on as it stands (a decision): a copy of
    # the run that carries the stage over as done may not change them (run/runcopy.py)
    decided_by: tuple[str, ...] = ()

    def decided(self, profile: Profile) -> tuple[str, ...]:
        """decided_by under `profile` (a stage whose decision rests on other keys in some profiles says so)."""
        return self.decided_by

    @property
    def makes_head(self) -> bool:
        """Only makes and weighs a new head (HEAD_STAGES): skipped when the existing head is deployed instead."""
        return self.name in HEAD_STAGES

    def applies(self, profile: Profile) -> bool:
        return True

    def inputs(self, ctx: StageContext) -> list[Path]:
        return []

    def outputs(self, ctx: StageContext) -> list[Path]:
        raise NotImplementedError

    def fresh_paths(self, ctx: StageContext) -> list[Path]:
        """What a fresh attempt starts without: its outputs, and the work a resumed attempt would continue
        from (rows, states, checkpoints). A run copied from another (`--copy-of`) leaves these behind."""
        return self.outputs(ctx)

    def run(self, ctx: StageContext) -> results.Result:
        """The stage's work; what it returns is its model's (pipeline/layout/results.py), stored in state.json."""
        raise NotImplementedError

    def server_argv(self, ctx: StageContext) -> list[str] | None:
        """The argv of the server this stage asks for first on the run's serving port (None: none): a
        resume keeps such a server an earlier attempt left instead of starting it again."""
        return None


def stop_orphan_child(run: RunDir, stage: str, log: logging.Logger) -> bool:
    """A child a killed attempt of the stage left running (a trainer writing checkpoints, a client asking a
    server and writing rows) is stopped — SIGTERM (speculators' trainer saves `interrupted/`), then SIGKILL
    — before the stage starts again. Checked by its recorded command, so a reused pid is left alone."""
    entry = run.stage_state(stage)
    pgid = entry.get("child_pgid")
    if not pgid or not procs.group_members(pgid):
        return False
    with suppress(psutil.Error):  # a leader gone with its group still there: the group is stopped
        if psutil.Process(pgid).cmdline()[:4] != entry.get("child_cmd"):
            return False  # the pid was reused by something else
    log.warning("stopping %s's child process group %d (%s) left by an earlier attempt", stage, pgid,
                " ".join(entry.get("child_cmd") or []))
    procs.stop_group(pgid)
    return True


def argv_for(ctx: StageContext, mode: str) -> list[str]:
    """The argv of `mode`'s server for this run, as a lease would start it (Stage.server_argv)."""
    target, mode_args = ports.mode_inputs(ctx.profile, ctx.run, mode)
    return vllm_modes.server_argv(ctx.profile, mode, target, **mode_args)


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where two token sequences differ (the shorter's length when one is a prefix)."""
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
