"""Publishing a trained head for vLLM: a copy of the checkpoint's config and weights at one stable path,
with `speculators_config.verifier.name_or_path` rewritten to the served target (speculators keeps the
training-time path, vllm-project/speculators#1065: pipeline/compat/verifier_path.py). Built aside and
renamed into place."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipeline.compat import verifier_path
from pipeline.layout import atomicio

FILES = ("config.json", "model.safetensors")


def publish_draft(checkpoint: Path, dest: Path, target_dir: Path) -> Path:
    checkpoint, dest = Path(checkpoint), Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in FILES:
        shutil.copy2(checkpoint / name, tmp / name)
    config = json.loads((checkpoint / "config.json").read_text())
    verifier_path.point_at_target(config, target_dir)
    atomicio.atomic_write_json(tmp / "config.json", config)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    atomicio.fsync_dir(dest.parent)
    return dest
