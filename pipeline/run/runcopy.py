"""`run [PROFILE] --copy-of RUN --from STAGE [--set …]`: a new run that starts from RUN's work before STAGE
and does the rest with its own settings. The earlier stages' files are hard-linked where the file
system allows (copied where it does not: another device, a file system without links), their records
carried over with RUN's paths rewritten to the new run's; what a stage from STAGE on would start from
(its outputs and its work in progress: checkpoints, states, rows) is left behind, so those stages run
afresh; the run's own history (events, notes, logs, caches, the report) starts empty. RUN is only read.

Hard links share the file: nothing in a run rewrites a finished stage's file in place (its writers
replace files by rename), so RUN keeps its own."""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from pipeline.layout.atomicio import atomic_write_json
from pipeline.layout.rundir import RunDir, RunDirError, utc_stamp
from pipeline.profile import Profile
from pipeline.report import notes
from pipeline.run.runner import manifest, outputs_intact
from pipeline.stages import STAGES, stage_names
from pipeline.stages.base import StageContext

# The run's own history and records: a copy starts each of them afresh (RunDir.create writes the two files)
HISTORY = ("profile.toml", "state.json", "events.jsonl", "notes.jsonl", "gpu_timeline.jsonl", "job.json",
           "logs", ".cache", "report", "notes.md", "server-handover.json")
# What a stage's record carries over; process ids and groups (a child, a Mooncake master) stay RUN's
ENTRY_KEYS = ("status", "started", "finished", "seconds", "attempts", "figures", "outputs", "gpu", "error")


class RunCopyError(RunDirError):
    pass


@dataclass(frozen=True)
class Copied:
    stages: list[str]
    linked: int
    copied: int
    bytes: int
    changed: list[str]  # "key: old -> new" between RUN's resolved profile and the new one

    def line(self, src: Path) -> str:
        how = f"{self.linked} file(s) linked" + (f", {self.copied} copied" if self.copied else "")
        changed = "; settings changed: " + ", ".join(self.changed) if self.changed else "; no setting changed"
        return (f"copied from {src}: {', '.join(self.stages) or 'no stage'} ({how}, "
                f"{self.bytes / 2**30:.2f} GiB){changed}")


def _flat(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def changed_settings(old: Profile, new: Profile) -> list[str]:
    a, b = _flat(old.model_dump()), _flat(new.model_dump())
    return [f"{k}: {json.dumps(a.get(k))} -> {json.dumps(b.get(k))}" for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k) and k != "name"]


def _rewrite(value, src: str, dst: str):
    if isinstance(value, str):
        return dst + value[len(src):] if value == src or value.startswith(src + os.sep) else value
    if isinstance(value, dict):
        return {k: _rewrite(v, src, dst) for k, v in value.items()}
    if isinstance(value, list):
        return [_rewrite(v, src, dst) for v in value]
    return value


REWRITTEN_MAX = 4 << 20  # a result file this small that names RUN's own paths is copied with them rewritten


def _bring(src: Path, dst: Path, skip: set[Path], new_root: Path) -> tuple[int, int, int]:
    """Every file under src into dst (links, else copies), but for HISTORY at the top and the paths in skip
    (relative); a small JSON file naming src's paths (a result such as pick-checkpoint's choice) is copied
    with them pointing into new_root instead. Returns (linked, copied, bytes)."""
    old = str(src).encode()
    linked = copied = size = 0
    for folder, dirs, files in os.walk(src):
        here = Path(folder).relative_to(src)
        dirs[:] = [d for d in dirs if (here / d) not in skip and not (here == Path(".") and d in HISTORY)]
        (dst / here).mkdir(parents=True, exist_ok=True)
        # a linked directory (listed, not walked into) stays a link to what it pointed at, not a copy of its files
        for name in files + [d for d in dirs if (Path(folder) / d).is_symlink()]:
            rel = here / name
            if rel in skip or (here == Path(".") and name in HISTORY):
                continue
            s, target = Path(folder) / name, dst / rel
            if s.is_symlink():
                os.symlink(os.readlink(s), target)
                continue
            if name.endswith(".json") and s.stat().st_size <= REWRITTEN_MAX and old in (text := s.read_bytes()):
                target.write_bytes(text.replace(old + b"/", str(new_root).encode() + b"/"))
                copied += 1
            else:
                try:
                    os.link(s, target)
                    linked += 1
                except OSError:  # another device, or links not allowed there
                    shutil.copy2(s, target)
                    copied += 1
            size += target.stat().st_size
    return linked, copied, size


def copy_of(src_root: Path, profile: Profile, start: str, run_dir: Path | None = None) -> tuple[RunDir, Copied]:
    """The new run (created atomically: built beside its place, then renamed), RUN's stages before `start`
    done in it. Refused, with nothing written, where RUN has not finished one of them."""
    try:
        src = RunDir.open(src_root)
    except RunDirError as exc:
        raise RunCopyError(f"--copy-of {src_root}: {exc}") from None
    names = stage_names()
    if start not in names:
        raise RunCopyError(f"--from {start!r}: unknown stage (stages: {', '.join(names)})")
    before = [s for s in STAGES[:names.index(start)] if not s.always_run and s.applies(profile)]
    state = src.read_state()
    for stage in before:
        entry = state["stages"].get(stage.name, {})
        status = entry.get("status", "pending")
        if status != "done" or not outputs_intact(src, entry.get("outputs", {})):
            why = status if status != "done" else "done, but its outputs changed or are gone"
            raise RunCopyError(f"--copy-of {src.root}: {stage.name} is {why} there, and --from {start} starts "
                               f"from its outputs (copy from an earlier stage, or finish that run first)")
    old_profile = src.profile()
    old, new = old_profile.model_dump(), profile.model_dump()

    def at(d: dict, dotted: str):  # a whole value (a table too: evaluate.traffic)
        value: object = d
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        return value

    for stage in before:
        keys = dict.fromkeys(stage.decided(old_profile) + stage.decided(profile))
        if changed := [k for k in keys if at(old, k) != at(new, k)]:
            raise RunCopyError(f"{changed[0]} changed: {stage.name} decided with {json.dumps(at(old, changed[0]))} "
                               f"in {src.root}, and a copy carries its decision over as it is; copy --from "
                               f"{stage.name} to decide again with {json.dumps(at(new, changed[0]))}")
    final = (Path(run_dir) if run_dir else Path(profile.run.runs_dir) / f"{profile.name}-{utc_stamp()}").resolve()
    if (final / "profile.toml").exists():
        raise RunCopyError(f"{final}: already holds a run; use `run --resume {final}`")
    if final == src.root or src.root in final.parents or final in src.root.parents:
        raise RunCopyError(f"--run-dir {final}: inside {src.root} or around it; give a directory of its own")
    if final.exists() and any(final.iterdir()):
        raise RunCopyError(f"--run-dir {final}: not empty; give a new or empty directory")
    building = final.with_name(final.name + ".copying")
    shutil.rmtree(building, ignore_errors=True)  # what an interrupted copy to this place left
    try:
        result = _build(src, state, profile, start, before, building, final)
        if final.exists():
            final.rmdir()  # empty (checked above)
        building.rename(final)
    except BaseException:  # a failed or interrupted copy leaves nothing that reads as a run
        shutil.rmtree(building, ignore_errors=True)
        raise
    return RunDir(final), result


def _build(src: RunDir, state: dict, profile: Profile, start: str, before: list, building: Path,
           final: Path) -> Copied:
    names = stage_names()
    new = RunDir.create(profile, building)
    ctx = StageContext(run=RunDir(final), profile=profile, log=logging.getLogger("eagle3.runcopy"))
    inside = {Path(k) for stage in before for k in state["stages"][stage.name].get("outputs", {})
              if not Path(k).is_absolute()}  # what a carried stage recorded stays, whoever else names it
    skip: set[Path] = set()
    for stage in STAGES[names.index(start):] + [s for s in STAGES if s.always_run]:
        if not stage.applies(profile):
            continue
        for path in stage.fresh_paths(ctx):
            if final in Path(path).parents and Path(path).relative_to(final) not in inside:
                skip.add(Path(path).relative_to(final))
    linked, copied, size = _bring(src.root, building, skip, final)
    old_root, new_root = str(src.root), str(final)
    fresh = new.read_state()
    for stage in before:
        entry = _rewrite({k: v for k, v in state["stages"][stage.name].items() if k in ENTRY_KEYS},
                         old_root, new_root)
        here = [building / k for k in entry.get("outputs", {}) if not Path(k).is_absolute()]
        # recorded anew on the new tree: RUN's directory times would never match, and each status would
        # fall back to the full digest
        entry["outputs"] = {**{k: v for k, v in entry.get("outputs", {}).items() if Path(k).is_absolute()},
                            **manifest(RunDir(building), here)}
        fresh["stages"][stage.name] = entry
    result = Copied([s.name for s in before], linked, copied, size, changed_settings(src.profile(), profile))
    fresh["copied_from"] = {"run": old_root, "from": start, "stages": result.stages, "linked": linked,
                            "copied": copied, "bytes": size, "changed": result.changed}
    atomic_write_json(new.state_path, fresh)
    notes.add(new, result.line(src.root), source="auto")
    return result
