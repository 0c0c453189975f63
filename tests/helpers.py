"""What the tests share (issue 45 item 3), in one module: the repository's paths, a free port, waiting for a
condition, the real CLI in a subprocess, run to its end (`cli`) or started in the background (`spawn_cli`),
and the stand-in for an interpreter with vLLM (`standin_python`, tests/vllm_standin.py). Fixtures live in
tests/conftest.py, which re-exports these for the tests that import them from there."""
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "profiles" / "tiny.toml"
TINY_MLA = ROOT / "tests" / "profiles" / "tiny-mla.toml"
STANDIN = ROOT / "tests" / "vllm_standin.py"


# Ports for the tests' servers come from below the kernel's ephemeral range (Linux: 32768-60999), a slice of
# their own for each test worker, each handed out once per process. A port the kernel picked (bind to 0) is
# free only until the kernel hands it out again: vLLM's own internal ports, a client's outgoing connections
# and the other worker's picks all draw from that range, and the fresh-clone CI of c995df3 lost a two-node
# test to "Address already in use" between the pick and the server's bind.
PORT_SLICE = 1500
_handed: set[int] = set()


def _port_slice() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    lo = 20000 + (int(worker) if worker.isdigit() else 0) % 8 * PORT_SLICE
    return range(lo, lo + PORT_SLICE)


def free_port(width: int = 1) -> int:
    """A TCP port p free on 127.0.0.1 now, p .. p + width - 1 all free and never handed out before in this
    process: a run's serving port no other run holds (width 2: a benchmark matrix's two servers side by side)."""
    from pipeline.serving.server import port_in_use

    ports = _port_slice()
    start = random.randrange(len(ports))
    for i in range(len(ports) - width):
        p = ports[(start + i) % (len(ports) - width)]
        block = range(p, p + width)
        if not _handed.intersection(block) and not any(port_in_use("127.0.0.1", q) for q in block):
            _handed.update(block)
            return p
    raise RuntimeError(f"no {width} free consecutive ports in {ports.start}-{ports.stop - 1}")


def free_port_pair() -> int:
    """A port p with p + 1 free too: a benchmark matrix's two servers side by side."""
    return free_port(2)


def copy_run_dir(src: Path, dst: Path, **sections) -> Path:
    """A copy of a finished run (shutil.copytree) on a serving port of its own, its profile's sections updated
    (`train={"epochs": 1}`): a run holds its port's lock while its stages run, so two copies of a shared run
    on one port, run at once (two test workers), would refuse each other."""
    import shutil
    import tomllib

    from pipeline.profile import dump_toml
    shutil.copytree(src, dst, symlinks=True)
    resolved = tomllib.loads((dst / "profile.toml").read_text())
    resolved["server"]["port"] = free_port()
    for name, values in sections.items():
        resolved.setdefault(name, {}).update(values)
    (dst / "profile.toml").write_text(dump_toml(resolved))
    return dst


def wait_for(predicate, timeout: float = 30.0, what: str = "condition", *, poll: float = 0.02,
             alive: subprocess.Popen | None = None):
    """Call `predicate` every `poll` seconds until it returns something true, and return that. Fails (an
    AssertionError naming `what`) once `timeout` seconds have passed, or as soon as the process `alive`
    has ended, when one is given (a run that ended before the point waited for can never reach it)."""
    deadline = time.monotonic() + timeout
    while not (got := predicate()):
        if alive is not None:
            assert alive.poll() is None, f"the process ended (exit {alive.returncode}) before {what}"
        assert time.monotonic() < deadline, f"{what} not reached in {timeout:g} s"
        time.sleep(poll)
    return got


def cli(*args, cwd=None, timeout=600, env=None) -> subprocess.CompletedProcess:
    """Run the real CLI (`python -m pipeline ARGS`) in a subprocess to its end, its output captured."""
    return subprocess.run([sys.executable, "-m", "pipeline", *map(str, args)], cwd=cwd or ROOT, text=True,
                          capture_output=True, timeout=timeout, env={**os.environ, **(env or {})})


def spawn_cli(*args, log: Path | None = None, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
              new_session: bool = False, env=None) -> subprocess.Popen:
    """Start the real CLI (`python -m pipeline ARGS`) in the background from the repository's root. With
    `log`, stdout and stderr both go to that file; otherwise where `stdout` and `stderr` say (text when
    piped). `new_session`: in a session of its own, so that os.killpg(proc.pid, ...) reaches all it started
    in its group (its servers start sessions of their own)."""
    argv = [sys.executable, "-m", "pipeline", *map(str, args)]
    full_env = {**os.environ, **(env or {})}
    if log is not None:
        with open(log, "wb") as out:
            return subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=new_session, env=full_env)
    return subprocess.Popen(argv, cwd=ROOT, stdout=stdout, stderr=stderr, text=True, start_new_session=new_session,
                            env=full_env)


def standin_python(where: Path) -> Path:
    """An executable to name as a profile's server.python (`where`/python): tests/vllm_standin.py under this
    interpreter. Its servers answer what the tool reads of vLLM in a few hundredths of a second; anything
    else it is asked (preflight's version question, the vLLM probe) goes to this interpreter. The conftest
    fixture `standin_python` writes one for the whole suite (one path: the probe's answers are kept by it)."""
    path = where / "python"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(STANDIN))} "$@"\n')
    path.chmod(0o755)
    return path


def vllm_serve_parser():
    """The installed vLLM's own `vllm serve` / api_server argument parser, built in-process (skips without vLLM)."""
    import pytest

    pytest.importorskip("vllm")
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    return make_arg_parser(FlexibleArgumentParser())
