"""A profile from its file: TOML read with `extends` inheritance, `--set` overrides applied, validated against the
schema, input paths resolved against the profile's own directory (`load_profile`); and a resolved profile
written back (`dump_toml`, a TOML library, so any string round-trips through a run directory). Layering follows
speculators: command-line override > profile file (> the files it extends) > default.
"""
import os
import tomllib
from pathlib import Path

import tomli_w
from pydantic import ValidationError

from pipeline.profile.errors import ProfileError, one_line
from pipeline.profile.schema import Profile, source_kind

PROFILES_DIR = Path(__file__).resolve().parent.parent.parent / "profiles"


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if nested else value
    return out


def _read_toml(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    if path in chain:
        raise ProfileError(f"{chain[0]}: key 'extends': cycle through {path}")
    if not path.is_file():
        where = f"{chain[-1]}: key 'extends': " if chain else ""
        raise ProfileError(f"{where}profile file not found: {path}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: not valid TOML: {exc}") from None
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise ProfileError(f"{path}: key 'extends': expected a file name, got {parent!r}")
    return _merge(_read_toml((path.parent / parent).resolve(), chain + (path,)), data)


def _resolve_inputs(p: Profile, source: Path, check: bool = True, held: tuple[str, ...] = ()) -> Profile:
    """Input paths are relative to the profile file's directory (so a profile works from any cwd) and
    must exist: a missing model or data file is refused before anything runs. With check=False
    (plan, preflight) paths are resolved but not required: preflight reports what is missing. `held`: keys
    whose input a run already holds a copy of (RunDir.profile), not required either."""
    base = source.parent
    target, data = p.target, p.data
    if target.source == "path":
        model = (base / target.model_path).resolve()
        config = (base / target.config).resolve() if target.config else None
        if config is not None and not config.is_file():
            raise ProfileError(f"{source}: key 'target.config': file not found {str(config)!r}")
        if check and not (model / "config.json").is_file():
            raise ProfileError(f"{source}: key 'target.model_path': no model (config.json) at {str(model)!r}")
        target = target.model_copy(update={"model_path": str(model), "config": str(config) if config else ""})
    evaluate = p.evaluate
    if evaluate.existing_head:  # relative to the profile, as any input; one that is not there: measure-existing
        # (or deploy-measure's row) says so in one line naming the key, preflight before any GPU work
        evaluate = evaluate.model_copy(update={"existing_head": str((base / evaluate.existing_head).resolve())})
    train = p.train
    if train.from_pretrained and train.from_pretrained != "existing":
        head = (base / train.from_pretrained).resolve()
        if check and "train.from_pretrained" not in held and not head.exists():
            raise ProfileError(f"{source}: key 'train.from_pretrained': no head at {str(head)!r}")
        train = train.model_copy(update={"from_pretrained": str(head)})
    hardware = p.hardware
    if hardware.calibration:
        calibration = (base / hardware.calibration).resolve()
        if not calibration.is_file():
            raise ProfileError(f"{source}: key 'hardware.calibration': file not found {str(calibration)!r}")
        hardware = hardware.model_copy(update={"calibration": str(calibration)})
    resolved = []
    for i, src in enumerate(data.sources()):
        if source_kind(src.source) == "file":
            conv = (base / src.source).resolve()
            where = "data.conversations" + (f"[{i}].source" if isinstance(data.conversations, list) else "")
            if check and not conv.is_file():
                from pipeline.compat import speculators_presets
                hint = ("" if Path(src.source).suffix else
                        f" (nor a speculators preset: {', '.join(speculators_presets.names())})")
                raise ProfileError(f"{source}: key '{where}': file not found {str(conv)!r}{hint}")
            src = src.model_copy(update={"source": str(conv)})
        resolved.append(src)
    data = data.model_copy(update={"conversations": (resolved[0].source if isinstance(data.conversations, str)
                                                     else resolved)})
    # cache_dir "" = the per-user cache (XDG base directories): $XDG_CACHE_HOME/eagle3-console, else ~/.cache/…
    cache = (Path(p.run.cache_dir).resolve() if p.run.cache_dir
             else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").resolve() / "eagle3-console")
    # Where runs go is where the operator stands (the working directory), made absolute once, here: the
    # run's profile.toml then names the same runs/, server registry and locks for the detached job, the
    # console and `server stop`, wherever they are started from.
    run = p.run.model_copy(update={"runs_dir": str(Path(p.run.runs_dir).resolve()), "cache_dir": str(cache)})
    return p.model_copy(update={"target": target, "data": data, "run": run, "hardware": hardware, "train": train,
                         "evaluate": evaluate})


# input paths an override may name: typed on a command line, a relative one is the operator's working
# directory's — not the profile's folder, which for `run --copy-of` is another run's
CWD_PATHS = ("target.model_path", "target.config", "evaluate.existing_head", "train.from_pretrained",
             "hardware.calibration", "data.conversations")


def _from_cwd(dotted: str, value):
    """An override's relative input path made absolute against the working directory; any other value as is
    ("existing", a speculators preset's name, a list of sources: their own rules)."""
    if dotted not in CWD_PATHS or not isinstance(value, str) or not value or value == "existing" \
            or Path(value).is_absolute() or (dotted == "data.conversations" and source_kind(value) != "file"):
        return value
    return str(Path.cwd() / value)


def load_profile(path: str | Path, overrides: dict | None = None, check_inputs: bool = True,
                 held: tuple[str, ...] = ()) -> Profile:
    """Load a profile file (a bare name is looked up in profiles/), apply dotted overrides."""
    path = Path(path)
    if not path.exists() and path.suffix != ".toml":  # a bare name, e.g. "kimi-k2.5-b300x8-full"
        path = PROFILES_DIR / f"{path}.toml"
    path = path.resolve()
    data = _read_toml(path)
    for dotted, value in (overrides or {}).items():
        value = _from_cwd(dotted, value)
        node = data
        *parents, leaf = dotted.split(".")
        for depth, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ProfileError(f"--set {dotted}: {'.'.join(parents[:depth + 1])} is a value, not a table")
        if not all(p.strip() for p in (*parents, leaf)):
            raise ProfileError(f"--set {dotted}: empty part in the key path")
        node[leaf] = value
    data.setdefault("name", path.stem)
    try:
        profile = Profile.model_validate(data)
    except ValidationError as exc:
        raise ProfileError(one_line(exc, data, path)) from None
    return _resolve_inputs(profile, path, check_inputs, held)


def dump_toml(data: dict) -> str:
    """A resolved profile as TOML (any string survives: newlines, quotes, backslashes, unicode)."""
    return tomli_w.dumps(data)
