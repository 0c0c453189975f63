"""A run's records as declared types. Stage results: what each stage records in state.json and what later
stages, the CLI, the report and the plots read of it — a model declares the figures others read (typed;
absent = None) and keeps every other figure as the stage wrote it (`extra`); the runner stores a stage's
figures through its model, so a figure of the wrong type fails where it is written, not where it is read.
The run's read model: `RunSnapshot`, computed by `jobs.snapshot` and shown by `status`, `status --json`,
the console and the report."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import ClassVar, Literal, Self, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline.layout.decision import Decision


class Result(BaseModel):
    """A stage's figures: the declared ones typed, any other kept as it is."""
    model_config = ConfigDict(extra="allow", frozen=True)
    STAGE: ClassVar[str] = ""

    @classmethod
    def of(cls, figures: dict) -> Self:
        """What a stage returns: its figures as its model (ValueError naming the figure of the wrong type)."""
        try:
            return cls.model_validate(figures)
        except ValidationError as exc:
            wrong = "; ".join(f"{'.'.join(map(str, e['loc']))} = {e['input']!r}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"{cls.STAGE} recorded a figure of the wrong type: {wrong}") from None


class AcceptanceCheck(Result):
    """Where a measured τ falls far below what training promised (pipeline/evaluation/diagnose.py)."""
    acceptance_gap: str | None = None
    likely_causes: list[str] = []


class Decided(Result):
    """A head measured through vLLM and decided on (deploy-measure, measure-existing)."""
    deploy: bool | None = None
    reason: str | None = None
    """The measurement that decides (Decision.reason)."""
    decision: str | None = None
    """The decision's line for people: "deploy: …" or "do not deploy: …"."""
    mean_acceptance_length: float | None = None
    acceptance_per_position: list[float] = []
    identical_outputs: bool | None = None
    numeric_ties: int | None = None
    """Outputs apart from the baseline's only where the target's own two best tokens are a near-tie (numerics)."""
    speedup: float | None = None
    baseline_tok_s: float | None = None

    def verdict(self) -> Decision | None:
        """The decision as a value (None: not measured)."""
        return None if self.deploy is None or self.reason is None else Decision(self.deploy, self.reason)


class PreflightResult(Result):
    STAGE = "preflight"
    extract_mode: Literal["offline", "online"] | None = None
    """What preflight decided for extract.mode = "auto" on this run's disk."""


class BuildTargetResult(Result):
    STAGE = "build-target"
    target_dir: str | None = None


class MeasureProductionResult(Result):
    STAGE = "measure-production"


class MeasureExistingResult(Decided):
    STAGE = "measure-existing"
    existing_head: str | None = None
    """The head as evaluate.existing_head names it."""
    head: str | None = None
    """The head as served: its copy in the run (RunDir.existing_head_dir: published, or converted from a
    research-format head), or where it is when it could not be published."""
    kind: str | None = None
    """What evaluate.existing_head named: run, speculators or research (compat/speculators_heads.classify)."""
    k: int | None = None
    skips_training: bool | None = None
    """evaluate.existing_policy = "deploy" and the head cleared: the stages that make a new head are skipped."""


class RegenerateResult(Result):
    STAGE = "regenerate"
    generated_tokens: int | None = None


class PrepareResult(Result):
    STAGE = "prepare"
    rows: int | None = None
    tokens: int | None = None
    loss_tokens: int | None = None


class ExtractResult(Result):
    STAGE = "extract"


class VocabResult(Result):
    STAGE = "vocab"
    target_vocab_size: int | None = None
    coverage: float | None = None


class TrainResult(Result):
    STAGE = "train"
    checkpoint: str | None = None
    """The last epoch's head (node 0)."""
    tokens_per_s: float | None = None
    """The median logged step's, the first (compile) left out, all ranks."""
    train_loss: float | None = None
    val_loss_epoch: float | None = None
    startup_s: float | None = None
    """To the first logged step: the planner's trainer start-up (rates.trainer_overhead)."""
    epoch_overhead_s: float | None = None
    """Each epoch's wall beyond its steps at tokens_per_s: validation, the checkpoint's save."""


class PickCheckpointResult(Result):
    STAGE = "pick-checkpoint"
    checkpoint: str | None = None
    """The chosen epoch's head."""


class EvaluateOfflineResult(AcceptanceCheck):
    STAGE = "evaluate-offline"
    tau: float | None = None
    acceptance_per_position: list[float] = []
    lossless: bool | None = None
    prompts: int | None = None
    ngram_tau: float | None = None
    ngram_tokens_per_step: float | None = None


class DeployMeasureResult(AcceptanceCheck, Decided):
    STAGE = "deploy-measure"
    offline_tau: float | None = None
    speculative_tok_s: float | None = None
    tokens_per_step: float | None = None
    # what a step costs with and without the head (deploy_measure.step_economics)
    step_ms: float | None = None
    baseline_step_ms: float | None = None
    break_even_tau: float | None = None
    deploy_speedup: float | None = None
    gpu: bool | None = None
    ttft_ms: float | None = None
    baseline_ttft_ms: float | None = None
    decode_tpot_ms: float | None = None
    baseline_decode_tpot_ms: float | None = None
    chunk_ms: float | None = None
    baseline_chunk_ms: float | None = None
    decode_speedup: float | None = None
    ngram_tau: float | None = None
    ngram_tokens_per_step: float | None = None

    def why(self) -> str | None:
        """What the speed figures mean: a decode step's cost with and without the head, and the tokens per
        step from which the head pays on this machine (like with like: what it reached is tokens per step
        too, τ beside it)."""
        o = self
        if not o.break_even_tau:
            return None
        text = (f"a decode step with the head costs {o.step_ms:.1f} ms here against {o.baseline_step_ms:.1f} ms "
                f"without it, so the head pays from {o.break_even_tau:.2f} tokens per step (it reached "
                f"{o.tokens_per_step:.2f}" + (f", τ {o.mean_acceptance_length:.3f}" if o.mean_acceptance_length
                                              else "")
                + f"; deploy threshold x{o.deploy_speedup or 1.1:g})")
        if o.decode_speedup is not None:
            text += (f"; streamed, the first token waits {o.ttft_ms:.1f} ms ({o.baseline_ttft_ms:.1f} "
                     f"without the head), then a token comes every {o.decode_tpot_ms:.2f} ms "
                     f"({o.baseline_decode_tpot_ms:.2f}) and a step every {o.chunk_ms:.2f} ms "
                     f"({o.baseline_chunk_ms:.2f}): the decode alone is x{o.decode_speedup:.2f}")
        if not o.gpu:
            text += ("; on a CPU the head's draft forwards and the wider verification cost about as much as the "
                     "small target's own step, on a GPU the target's forward dominates a step and the head pays "
                     "from a far lower tau (NOTES.md \"The demo\")")
        return text


class HandoverResult(Result):
    STAGE = "handover"
    after_run: str | None = None
    server: str | None = None


MODELS: dict[str, type[Result]] = {m.STAGE: m for m in (
    PreflightResult, BuildTargetResult, MeasureProductionResult, MeasureExistingResult, RegenerateResult,
    PrepareResult, ExtractResult, VocabResult, TrainResult, PickCheckpointResult, EvaluateOfflineResult,
    DeployMeasureResult, HandoverResult)}
R = TypeVar("R", bound=Result)


def decision_in(online: dict | None) -> Decision | None:
    """The decision deploy-measure wrote into eval/online.json (there also when the head failed its own
    checks and the stage with it), or None."""
    return DeployMeasureResult.model_validate(online or {}).verdict()


def stored(stage: str, result: Result | dict) -> dict:
    """What a stage returned, as state.json keeps it: its model's figures (ValueError naming the figure when
    one is not of its declared type, or the model when a stage returned another's)."""
    model = MODELS.get(stage, Result)
    if isinstance(result, dict):
        result = model.of(result)
    if type(result) is not model:
        raise ValueError(f"{stage} returned a {type(result).__name__}, not its {model.__name__}")
    return result.model_dump(mode="json", exclude_unset=True)  # what the stage set, declared or not


def read(model: type[R], figures: dict | None) -> R:
    """The recorded figures of `model`'s stage as `model` (every declared figure None before it ran)."""
    return model.model_validate(figures or {})


@dataclass(frozen=True)
class StageStatus:
    name: str
    status: str  # as it stands (live_status): n/a, pending, running, interrupted, done, stale, failed
    seconds: float | None = None
    attempts: int | None = None
    figures: dict = field(default_factory=dict)
    error: str | None = None
    gpu: dict | None = None


@dataclass(frozen=True)
class Peer:
    """Another node's run as its exporter serves it (train.node_exporters): what node 0 shows of it."""
    url: str
    run: str | None = None
    host: str | None = None
    state: str | None = None
    stage: str | None = None  # the one running, else the last that ran
    status: str | None = None
    progress: float | None = None
    eta_s: float | None = None
    error: str | None = None  # unreachable, or not an exporter

    def line(self) -> str:
        if self.error:
            return f"node {self.url}: {self.error}"
        where = f"{self.run} on {self.host}"
        if not self.stage:
            return f"node {where}: {self.state}"
        pct = f" {self.progress:.0%}" if self.progress is not None and self.status == "running" else ""
        eta = f" ETA {int(self.eta_s // 60)}:{int(self.eta_s % 60):02d}" if self.eta_s is not None else ""
        return f"node {where}: {self.state}; {self.stage} {self.status}{pct}{eta}"


@dataclass(frozen=True)
class RunSnapshot:
    """A run as it stands, read in one place for whoever shows it (`status`, `status --json`, the console,
    the report):
    the job's state and pid, each stage's live status, the serving port's server and which processes of
    the box serve or train this run."""
    root: str
    profile: str
    state: str
    pid: int | None
    stages: tuple[StageStatus, ...]
    server: dict
    roles: dict[int, str]
    peers: tuple[Peer, ...] = ()  # the job's other nodes (train.node_exporters)

    def result(self, model: type[R]) -> R:
        """What `model`'s stage recorded, typed, as this snapshot read it (RunDir.result without another read)."""
        return read(model, next((s.figures for s in self.stages if s.name == model.STAGE), None))

    def as_json(self) -> dict:
        return {"run": self.root, "profile": self.profile, "state": self.state, "pid": self.pid,
                "stages": [{"stage": s.name, **{k: v for k, v in asdict(s).items() if k != "name"}}
                           for s in self.stages], "server": self.server,
                "roles": {str(pid): role for pid, role in self.roles.items()},
                "peers": [asdict(p) for p in self.peers]}
