"""speculators' dataset presets, read from speculators itself without importing it.

`speculators.data_generation.configs.DATASET_CONFIGS` is the registry `prepare-data` and
`regenerate-responses` take preset names from; `regenerate-responses` leaves out the multimodal ones
(`MULTIMODAL_DATASETS` in speculators/cli/regenerate_responses.py). Importing the package pulls in torch
(≈ 7 s on 2 cores), too slow for loading a profile, so the registry module — which imports only the
standard library — is loaded from its file, and the multimodal set is read from the CLI's source with
`ast`. speculators 0.9.0; tests/test_compat_adaptations.py holds these to the imported package.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path


def _package_dir() -> Path | None:
    spec = importlib.util.find_spec("speculators")
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


@functools.lru_cache(maxsize=1)
def configs() -> dict:
    """name -> speculators' DatasetConfig (hf_path, subset, split, normalize_fn, …); {} without speculators."""
    root = _package_dir()
    path = root / "data_generation" / "configs.py" if root else None
    if path is None or not path.is_file():
        return {}
    spec = importlib.util.spec_from_file_location("_speculators_dataset_configs", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.DATASET_CONFIGS)


@functools.lru_cache(maxsize=1)
def multimodal() -> frozenset[str]:
    root = _package_dir()
    path = root / "cli" / "regenerate_responses.py" if root else None
    if path is None or not path.is_file():
        return frozenset()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "MULTIMODAL_DATASETS" for t in node.targets):
            return frozenset(ast.literal_eval(node.value))
    return frozenset()


def names() -> list[str]:
    """The presets a text conversation source can name (speculators' registry less its multimodal ones)."""
    return [n for n in configs() if n not in multimodal()]
