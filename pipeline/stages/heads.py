"""Heads a run did not train (a stage helper, like benchmark.py): the one an operator names in the profile —
evaluate.existing_head, measured first (measure-existing), or train.from_pretrained, trained on from
(vocab, train, pick-checkpoint) — resolved into a speculators directory once, and checked against the target
and the profile before a server or a trainer is started on it."""
from __future__ import annotations

from pathlib import Path

from pipeline.compat import speculators_heads
from pipeline.compat.speculators_heads import HeadError, HeadSource
from pipeline.layout.results import MeasureExistingResult
from pipeline.layout.rundir import head_copy_source, record_head_copy
from pipeline.planning.preflight import start_mismatches
from pipeline.serving.deploy import FILES, publish_draft
from pipeline.stages.base import StageContext, StageError


def resolve_head(ctx: StageContext, named: str, key: str, dest: Path) -> tuple[HeadSource, Path]:
    """What `named` (the profile's `key`) is, and the speculators head directory to serve or train from: a
    research-format head converted into `dest` by speculators' converter, once (it renames the head into place
    whole, so a config.json there is a finished conversion); a speculators head (or a run's) published into
    `dest` with its verifier pointed at this run's target, as deploy-measure publishes a new one
    (compat/verifier_path), or used where it is when its weights are not the one model.safetensors that
    publishing copies."""
    try:
        source = speculators_heads.classify(Path(named))
    except HeadError as exc:  # the profile names it: a resume would read the same path
        raise StageError(f"{key} = {named!r}: {exc}", resumable=False) from None
    if source.kind != "research":
        if not all((source.head / name).is_file() for name in FILES):
            ctx.note(f"the head {source.head} ({key}) is used where it is (weights "
                     f"{', '.join(p.name for p in source.weights)}, not one model.safetensors): its verifier path "
                     f"is kept as it was written", ctx.log.warning)
            return source, source.head
        published = publish_draft(source.head, dest, ctx.target_dir())
        record_head_copy(dest, named)
        return source, published
    if held_copy(ctx, dest, named, key):
        ctx.log.info("the research-format head was converted by an earlier attempt: %s", dest)
        return source, dest

    def child(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
        # through the stage's child runner: its output in the stage's log, its group stopped on a resume
        lines: list[str] = []
        return ctx.run_child(argv, env=env, on_line=lines.append), "".join(lines)

    ctx.note(f"converting the research-format head {source.head} ({key}) with speculators convert into {dest}",
             ctx.log.info)
    try:
        converted = speculators_heads.convert(source.head, dest, verifier=ctx.target_dir(), run_child=child)
    except HeadError as exc:  # the same head converts the same way on a resume: a new head or a new run
        raise StageError(f"{key} = {named!r}: {exc}", resumable=False) from None
    record_head_copy(dest, named)
    return source, converted


def held_copy(ctx: StageContext, dest: Path, named: str, key: str) -> Path | None:
    """`dest` where it holds a whole copy of the head `key` names (None: no copy yet). A copy of another head —
    the run's profile.toml edited since it was made — is refused, not trained or served as the new one."""
    if not (dest / "config.json").is_file():
        return None
    if (made_from := head_copy_source(dest)) not in (None, named):
        raise StageError(f"{key} = {named!r}: this run's copy {dest} was made from {made_from!r} (its profile.toml "
                         f"changed since): train from the new head in a new run (eagle3-console run --copy-of "
                         f"{ctx.run.root} --from vocab --set {key}=...)", resumable=False)
    return dest


def existing_head(ctx: StageContext) -> tuple[HeadSource, Path]:
    """What evaluate.existing_head names, and the speculators head directory vLLM serves
    (RunDir.existing_head_dir): measure-existing's, and deploy-measure's where that stage did not run."""
    return resolve_head(ctx, ctx.profile.evaluate.existing_head, "evaluate.existing_head", ctx.run.existing_head_dir)


def served_existing(ctx: StageContext) -> Path:
    """The existing head as the matrix's row serves it: measure-existing's copy where that stage ran, else
    resolved into the run (published or converted) and checked now (evaluate.existing_policy = off)."""
    if measured := ctx.run.result(MeasureExistingResult).head:
        return Path(measured)
    head = existing_head(ctx)[1]
    check_served(ctx, head)
    return head


def check_served(ctx: StageContext, head: Path) -> None:
    """A head the target cannot serve (another hidden size or vocabulary) fails here, naming the field and both
    values, not after two server starts."""
    from pipeline.data.targetinfo import TargetInfoError, from_config

    named = ctx.profile.evaluate.existing_head
    try:
        info = from_config(ctx.target_dir() / "config.json")
        shape = speculators_heads.shape(head)
    except (TargetInfoError, HeadError) as exc:
        raise StageError(f"evaluate.existing_head = {named!r}: {exc}", resumable=False) from None
    # only what serving needs: the draft vocabulary, layers and aux ids are the head's own when it is served
    found = speculators_heads.mismatches(shape, hidden_size=info.hidden, target_vocab=info.vocab, draft_vocab=None,
                                         layers=None, training=False)
    if found:
        key, why = found[0]
        raise StageError(f"evaluate.existing_head = {named!r}: {key}: {why}", resumable=False)


def start_head(ctx: StageContext) -> Path | None:
    """The head train.from_pretrained names, as a speculators directory (None without a warm start):
    "existing" is evaluate.existing_head, as measure-existing resolved it (or resolves it now, where that
    stage did not run); checked against the target and the profile (check_start)."""
    if (start := ctx.profile.warm_start()) is None:
        return None
    key, named = start
    dest = ctx.run.existing_head_dir if ctx.profile.train.from_pretrained == "existing" else ctx.run.start_head_dir
    # vocab, train and pick-checkpoint each ask: the head is copied (or converted) into the run once, by the
    # first; publish_draft renames a whole directory into place, so a config.json there is a finished copy
    head = held_copy(ctx, dest, named, key) or resolve_head(ctx, named, key, dest)[1]
    check_start(ctx, head)
    return head


def check_start(ctx: StageContext, head: Path) -> None:
    from pipeline.data.targetinfo import TargetInfoError, from_config

    named = ctx.profile.train.from_pretrained
    try:
        info = from_config(ctx.target_dir() / "config.json")
        found = start_mismatches(ctx.profile, head, info.hidden, info.vocab, info.layers)
    except (TargetInfoError, HeadError) as exc:
        raise StageError(f"train.from_pretrained = {named!r}: {exc}", resumable=False) from None
    if found:  # every contradiction at once: one fix, one rerun
        said = "; ".join(f"{key}: {why}" for key, why in found)
        raise StageError(f"train.from_pretrained = {named!r}: {said}", resumable=False)
