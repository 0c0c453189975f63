"""pipeline/compat/speculators_heads.py against speculators 0.9.0 itself: a speculators head saved by its own
classes, a research-format head written by hand in the EAGLE layout and converted by its own converter (a
child process, offline), the mapping handed to its trainer's own reader. Tiny models built here."""
import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.compat import speculators_heads as sh
from pipeline.compat.speculators_heads import HeadError
from pipeline.layout.rundir import PROFILE_FILE, RunDir
from pipeline.serving.deploy import publish_draft

os.environ["HF_HUB_OFFLINE"] = "1"
VOCAB, HIDDEN, LAYERS, DRAFT_VOCAB, HEAD_DIM = 64, 16, 3, 32, 8


def _layer_config(layers: int):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=layers,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


def _mapping(seed: int):
    """A draft vocabulary of DRAFT_VOCAB target ids, as EAGLE stores it: d2t offsets, t2d mask."""
    import torch
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(DRAFT_VOCAB), t2d


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of a speculators head whose weights went through edit(dict of tensors)."""
    from safetensors.torch import load_file, save_file
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(edit(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"))
    return dst


def _research_head(root: Path, *, config: dict | None = None, edit=None, safetensors: bool = False) -> Path:
    """An EAGLE-3 head in the research layout (SafeAILab/EAGLE's LlamaForCausalLMEagle3: midlayer.*, fc, norm,
    lm_head, d2t, t2d), sized for the tiny target."""
    import torch
    g = torch.Generator().manual_seed(1)
    root.mkdir()
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HIDDEN,
           "intermediate_size": 2 * HIDDEN, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": HEAD_DIM, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
           "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "hidden_act": "silu", "torch_dtype": "float32",
           "norm_before_residual": True, **(config or {})}
    (root / "config.json").write_text(json.dumps(cfg))
    shapes = {"fc.weight": (HIDDEN, 3 * HIDDEN), "norm.weight": (HIDDEN,), "lm_head.weight": (DRAFT_VOCAB, HIDDEN),
              "midlayer.hidden_norm.weight": (HIDDEN,), "midlayer.input_layernorm.weight": (HIDDEN,),
              "midlayer.post_attention_layernorm.weight": (HIDDEN,),
              "midlayer.self_attn.q_proj.weight": (2 * HEAD_DIM, 2 * HIDDEN),
              "midlayer.self_attn.k_proj.weight": (HEAD_DIM, 2 * HIDDEN),
              "midlayer.self_attn.v_proj.weight": (HEAD_DIM, 2 * HIDDEN),
              "midlayer.self_attn.o_proj.weight": (HIDDEN, 2 * HEAD_DIM),
              "midlayer.mlp.gate_proj.weight": (2 * HIDDEN, HIDDEN),
              "midlayer.mlp.up_proj.weight": (2 * HIDDEN, HIDDEN),
              "midlayer.mlp.down_proj.weight": (HIDDEN, 2 * HIDDEN)}
    weights = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    weights["d2t"], weights["t2d"] = _mapping(seed=7)
    weights = edit(weights) if edit else weights
    if safetensors:
        from safetensors.torch import save_file
        save_file(weights, str(root / "model.safetensors"))
    else:
        torch.save(weights, root / "pytorch_model.bin")
    return root


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny target, a speculators head saved by speculators' own classes on it, and a research head."""
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("heads")
    torch.manual_seed(0)
    LlamaForCausalLM(_layer_config(LAYERS)).save_pretrained(root / "target")
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=_layer_config(layers=2), draft_vocab_size=DRAFT_VOCAB, norm_before_residual=True,
        norm_before_fc=False, fc_norm=True, eagle_aux_hidden_state_layer_ids=[0, 2],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=5)],
            default_proposal_method="greedy", verifier=VerifierConfig.from_pretrained(str(root / "target"))))
    head = Eagle3DraftModel(config)
    d2t, t2d = _mapping(seed=3)
    head.load_vocab_mappings(t2d, d2t)
    head.save_pretrained(root / "speculators")
    return SimpleNamespace(root=root, target=root / "target", head=root / "speculators", config=config,
                           d2t=d2t, t2d=t2d, research=_research_head(root / "research"))


@pytest.fixture(scope="module")
def converted(built):
    """The research head through speculators' real converter, its argv recorded."""
    seen = {}

    def child(argv, env):
        seen.update(argv=argv, env=env)
        return sh._run(argv, env)

    dest = sh.convert(built.research, built.root / "converted", verifier=built.target, run_child=child)
    return SimpleNamespace(dest=dest, **seen)


# --- classify -------------------------------------------------------------------------------------------------

def test_each_kind_is_told_apart(built, tmp_path):
    spec = sh.classify(built.head)
    assert (spec.kind, spec.head, spec.run) == ("speculators", built.head, None)
    assert spec.weights and all(w.suffix == ".safetensors" and w.parent == built.head for w in spec.weights)
    research = sh.classify(built.research)
    assert (research.kind, research.weights) == ("research", (built.research / "pytorch_model.bin",))
    as_safetensors = _research_head(tmp_path / "st", safetensors=True)
    assert sh.classify(as_safetensors).weights == (as_safetensors / "model.safetensors",)
    run = tmp_path / "run"
    run.mkdir()
    (run / PROFILE_FILE).write_text("")
    with pytest.raises(HeadError, match=f"{run}: a run directory without a published head"):
        sh.classify(run)
    publish_draft(built.head, RunDir(run).draft_dir, built.target)  # as the run's deploy publishes it
    found = sh.classify(run)
    assert (found.kind, found.head, found.run) == ("run", RunDir(run).draft_dir, run)
    assert sh.shape(run).draft_vocab_size == sh.shape(built.head).draft_vocab_size


def _empty(d: Path) -> None:
    d.mkdir()


def _config_only(d: Path) -> None:
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3", "draft_vocab_size": 32}))


def _research_config_only(d: Path) -> None:
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "draft_vocab_size": 32}))


def _neither(d: Path) -> None:
    d.mkdir()
    (d / "notes.txt").write_text("a head was here")
    (d / "weights.bin").write_bytes(b"\0" * 8)


def _dflash(d: Path) -> None:
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "dflash_config": {}}))


def _other_speculator(d: Path) -> None:
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"speculators_model_type": "mtp"}))


def _not_eagle(d: Path) -> None:
    import torch
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2)}, d / "pytorch_model.bin")


def _torn_json(d: Path) -> None:
    d.mkdir()
    (d / "config.json").write_text('{"speculators_model_type": ')


@pytest.mark.parametrize("make,says", [
    (_empty, "no config.json and no profile.toml"), (_config_only, "no \\*.safetensors weights"),
    (_research_config_only, "no model.safetensors or pytorch_model.bin"), (_neither, "no config.json"),
    (_dflash, "a DFlash head"), (_other_speculator, "speculators_model_type 'mtp'"),
    (_not_eagle, "no fc.weight and midlayer"), (_torn_json, "unreadable"),
])
def test_what_is_not_a_head_is_one_line_naming_the_path(tmp_path, make, says):
    make(tmp_path / "h")
    with pytest.raises(HeadError, match=says) as err:
        sh.classify(tmp_path / "h")
    assert str(tmp_path / "h") in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(HeadError, match="not a directory"):
        sh.classify(tmp_path / "h" / "missing")


# --- shape, mapping -------------------------------------------------------------------------------------------

def test_shape_of_a_head_speculators_saved(built):
    s, c = sh.shape(built.head), built.config
    layer = c.transformer_layer_config
    assert (s.hidden_size, s.target_hidden_size, s.layers) == (layer.hidden_size, layer.hidden_size,
                                                               layer.num_hidden_layers)
    assert (s.draft_vocab_size, s.target_vocab) == (c.draft_vocab_size, layer.vocab_size)
    assert s.aux_layer_ids == tuple(c.eagle_aux_hidden_state_layer_ids)
    assert s.num_aux == len(c.eagle_aux_hidden_state_layer_ids)  # read off fc.weight's width
    assert s.has_d2t and s.has_t2d and s.speculators_model_type == "eagle3"
    assert s.norms == {f: getattr(c, f) for f in sh.FIELDS}
    assert s.speculative_tokens == c.speculators_config.proposal_methods[0].speculative_tokens
    assert s.verifier == str(built.target)
    d2t, t2d = sh.vocab_mapping(built.head)
    assert d2t.equal(built.d2t) and t2d.equal(built.t2d)


def test_a_head_without_a_mapping_or_with_a_broken_one(built, tmp_path):
    bare = _rewrite(built.head, tmp_path / "bare", lambda w: {k: v for k, v in w.items() if k not in ("d2t", "t2d")})
    assert sh.vocab_mapping(bare) is None and not sh.shape(bare).has_d2t
    with pytest.raises(HeadError, match=f"{bare}: its weights hold no d2t/t2d"):
        sh.write_vocab_files(bare, tmp_path / "out")
    half = _rewrite(built.head, tmp_path / "half", lambda w: {k: v for k, v in w.items() if k != "t2d"})
    with pytest.raises(HeadError, match=f"{half}: its weights hold d2t without"):
        sh.vocab_mapping(half)
    shifted = _rewrite(built.head, tmp_path / "shifted", lambda w: {**w, "d2t": w["d2t"] + 1})
    with pytest.raises(HeadError, match=f"{shifted}: d2t .* disagree"):
        sh.write_vocab_files(shifted, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# --- convert: speculators' own converter, for real ------------------------------------------------------------

def test_a_research_head_converts_through_speculators(built, converted):
    import torch
    argv = converted.argv
    assert argv[:4] == [sys.executable, "-m", "speculators", "convert"] and converted.env["HF_HUB_OFFLINE"] == "1"
    assert argv[argv.index("--verifier") + 1] == str(built.target)
    # the converter takes norm_before_residual from its kwargs only: the research config's is handed on
    assert json.loads(argv[argv.index("--algorithm-kwargs") + 1]) == {"norm_before_residual": True}
    assert sh.classify(converted.dest).kind == "speculators"
    assert not list(converted.dest.parent.glob("converted.tmp-*"))
    research = json.loads((built.research / "config.json").read_text())
    weights = torch.load(built.research / "pytorch_model.bin", weights_only=True)
    s = sh.shape(converted.dest)
    assert (s.hidden_size, s.layers, s.draft_vocab_size) == (research["hidden_size"], research["num_hidden_layers"],
                                                             research["draft_vocab_size"])
    assert s.target_vocab == weights["t2d"].shape[0] and s.num_aux == weights["fc.weight"].shape[1] // HIDDEN
    assert s.norms["norm_before_residual"] is True and s.verifier == str(built.target)
    d2t, t2d = sh.vocab_mapping(converted.dest)
    assert d2t.equal(weights["d2t"]) and t2d.equal(weights["t2d"])


def test_a_research_heads_shape_is_read_as_the_converter_writes_it(built, converted):
    """Preflight checks a research head before any conversion: its shape read from EAGLE's config and weights
    is the converted head's."""
    from dataclasses import fields

    from pipeline.compat.eagle3_fields import trained_value
    before, after = sh.shape(built.research), sh.shape(converted.dest)
    for f in fields(before):
        if f.name not in ("path", "norms", "speculative_tokens", "verifier", "aux_layer_ids"):
            assert getattr(before, f.name) == getattr(after, f.name), f.name
    assert {k: trained_value(v) for k, v in before.norms.items()} == \
        {k: trained_value(v) for k, v in after.norms.items()}


def test_the_mapping_round_trips_into_the_trainers_files(built, converted, tmp_path):
    import numpy as np
    from speculators.train.cli import _load_mappings
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    run = RunDir(tmp_path)
    d2t_path, t2d_path = sh.write_vocab_files(converted.dest, run.prepared_dir)
    n = sh.shape(converted.dest).draft_vocab_size
    assert (d2t_path, t2d_path) == run.vocab_mappings(n)  # the files the vocab stage writes and train passes
    d2t, t2d = sh.vocab_mapping(converted.dest)
    # the vocab stage's arrays come from speculators' own builder: the same dtypes
    built_d2t, built_t2d = build_vocab_mappings_from_distribution({1: 3, 5: 2}, n, VOCAB)
    assert np.load(d2t_path).dtype == built_d2t.numpy().dtype and np.load(t2d_path).dtype == built_t2d.numpy().dtype
    loaded_d2t, loaded_t2d, size = _load_mappings(d2t_path, t2d_path, n)  # the trainer's reader
    assert size == n and loaded_d2t.equal(d2t) and loaded_t2d.equal(t2d)


def test_a_warm_start_takes_the_mapping_it_is_given_not_the_heads(built, converted, tmp_path):
    """Why write_vocab_files exists: speculators' from_pretrained (the trainer's --from-pretrained) replaces
    the head's d2t/t2d by the ones it is handed."""
    from speculators.models.eagle3 import Eagle3DraftModel
    own_d2t, own_t2d = sh.vocab_mapping(converted.dest)
    other_d2t, other_t2d = _mapping(seed=11)
    assert not other_t2d.equal(own_t2d)
    model = Eagle3DraftModel.from_pretrained(str(converted.dest), t2d=other_t2d, d2t=other_d2t)
    assert model.t2d.equal(other_t2d) and model.d2t.equal(other_d2t)
    assert Eagle3DraftModel.from_pretrained(str(converted.dest)).t2d.equal(own_t2d)


def test_a_conversion_speculators_refuses_leaves_nothing(built, tmp_path):
    bad = _research_head(tmp_path / "bad", edit=lambda w: {**w, "lm_head.weight": w["lm_head.weight"][:20]})
    with pytest.raises(HeadError, match=f"{bad}: speculators convert exited with 1: RuntimeError: .*size mismatch"):
        sh.convert(bad, tmp_path / "out", verifier=built.target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_a_conversion_that_drops_a_weight_is_refused(built, tmp_path):
    # speculators' converter only warns and saves the head with that weight at its random initialization
    gap = _research_head(tmp_path / "gap", edit=lambda w: {k: v for k, v in w.items() if "hidden_norm" not in k})
    with pytest.raises(HeadError, match=f"{gap}: .*incomplete \\(not in the checkpoint: layers.0.hidden_norm"):
        sh.convert(gap, tmp_path / "out", verifier=built.target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gap"]


def test_convert_refuses_before_starting_anything(built, tmp_path):
    never = lambda argv, env: pytest.fail("the converter was started")  # noqa: E731
    with pytest.raises(HeadError, match=f"{built.head}: already a speculators head"):
        sh.convert(built.head, tmp_path / "out", verifier=built.target, run_child=never)
    with pytest.raises(HeadError, match=f"{tmp_path}: no config.json \\(the verifier"):
        sh.convert(built.research, tmp_path / "out", verifier=tmp_path, run_child=never)
    (tmp_path / "taken").mkdir()
    with pytest.raises(HeadError, match=f"{tmp_path / 'taken'}: already exists"):
        sh.convert(built.research, tmp_path / "taken", verifier=built.target, run_child=never)


def test_a_converter_that_dies_mid_write_leaves_nothing(built, tmp_path):
    def child(argv, env):
        out = Path(argv[argv.index("--output-path") + 1])
        out.mkdir()
        (out / "config.json").write_text("{")
        return 1, "Traceback (most recent call last):\n  File \"x\", line 1\nOSError: disk full\n"

    with pytest.raises(HeadError, match="exited with 1: OSError: disk full$"):
        sh.convert(built.research, tmp_path / "out", verifier=built.target, run_child=child)
    assert list(tmp_path.iterdir()) == []


# --- mismatches -----------------------------------------------------------------------------------------------

def test_mismatches_name_the_key_each_contradiction_is_about(built):
    s = sh.shape(built.head)
    fits = dict(hidden_size=s.hidden_size, target_vocab=s.target_vocab, draft_vocab=s.draft_vocab_size,
                layers=s.layers, aux_layer_ids=list(s.aux_layer_ids),
                norms={f: bool(v) for f, v in s.norms.items()}, window=0)
    assert sh.mismatches(s, **fits) == []
    assert sh.mismatches(s, hidden_size=s.hidden_size, target_vocab=s.target_vocab, draft_vocab=None,
                         layers=None) == []
    for change, key in [({"hidden_size": s.hidden_size * 2}, "hidden_size"),
                        ({"target_vocab": s.target_vocab + 1}, "vocab_size"),
                        ({"draft_vocab": s.draft_vocab_size // 2}, "vocab.draft_vocab_size"),
                        ({"layers": s.layers + 1}, "train.num_layers"),
                        ({"aux_layer_ids": [*s.aux_layer_ids, 9]}, "extract.layer_ids"),
                        ({"norms": {"fc_norm": not s.norms["fc_norm"]}}, "train.fc_norm"),
                        ({"window": 2048}, "train.sliding_window")]:
        found = sh.mismatches(s, **{**fits, **change})
        assert [k for k, _ in found] == [key], change
        assert all("\n" not in reason for _, reason in found)


def test_the_heads_window_is_read_as_speculators_writes_it(built, tmp_path):
    assert sh.shape(built.head).window == 0  # a layer config without a window: full attention
    windowed = tmp_path / "windowed"
    shutil.copytree(built.head, windowed)
    config = json.loads((windowed / "config.json").read_text())
    config["transformer_layer_config"] |= {"layer_types": ["sliding_attention"] * 2, "sliding_window": 1024,
                                           "use_sliding_window": True}  # speculators 0.9.0's default layers
    (windowed / "config.json").write_text(json.dumps(config))
    assert sh.shape(windowed).window == 1024 and not sh.shape(windowed).full_layers
    assert sh.shape(built.head).full_layers
    config["transformer_layer_config"]["layer_types"] = ["sliding_attention", "full_attention"]  # mixed
    (windowed / "config.json").write_text(json.dumps(config))
    assert sh.shape(windowed).window == 1024 and sh.shape(windowed).full_layers
    config["transformer_layer_config"]["layer_types"] = 1  # not a list: one line naming the file and the key
    (windowed / "config.json").write_text(json.dumps(config))
    with pytest.raises(sh.HeadError, match=r"config.json: transformer_layer_config.layer_types is 1"):
        sh.shape(windowed)


def test_a_head_on_a_wider_target_reads_its_states_but_cannot_be_trained(built):
    from dataclasses import replace
    s = replace(sh.shape(built.head), target_hidden_size=HIDDEN * 2)
    [(key, reason)] = sh.mismatches(s, hidden_size=HIDDEN * 2, target_vocab=s.target_vocab, draft_vocab=None,
                                    layers=None)
    assert key == "hidden_size" and "refuses to train" in reason
    # served, not trained: vLLM reads target_hidden_size, so the draft's own width is no reason to refuse it
    assert sh.mismatches(s, hidden_size=HIDDEN * 2, target_vocab=s.target_vocab, draft_vocab=None, layers=None,
                         training=False) == []


@pytest.mark.parametrize("edit,says", [
    (lambda c: c["transformer_layer_config"].update(hidden_size=None),
     "transformer_layer_config.hidden_size is None, not a positive integer"),
    (lambda c: c["transformer_layer_config"].update(vocab_size="64"),
     "transformer_layer_config.vocab_size is '64', not a positive integer"),
    (lambda c: c.update(transformer_layer_config="llama"), "transformer_layer_config is 'llama', not the draft"),
    # absent, it was read as AutoConfig's qwen3 defaults (hidden 4096, 32 layers): another head's sizes
    (lambda c: c.pop("transformer_layer_config"), "transformer_layer_config is None, not the draft"),
    (lambda c: c.update(draft_vocab_size=-1), "draft_vocab_size is -1"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids="0,2"), "eagle_aux_hidden_state_layer_ids is '0,2'"),
], ids=["null", "string", "not-a-dict", "absent", "negative", "aux"])
def test_a_config_with_a_field_that_is_not_a_size_is_one_line_naming_it(built, tmp_path, edit, says):
    bad = tmp_path / "bad"
    shutil.copytree(built.head, bad)
    config = json.loads((bad / "config.json").read_text())
    edit(config)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(sh.HeadError) as err:
        sh.shape(bad)
    assert str(err.value).startswith(f"{bad / 'config.json'}: ") and says in str(err.value), err.value


def test_a_killed_conversions_leftovers_are_removed_by_the_next(built, tmp_path):
    left = tmp_path / "out.tmp-999999"  # another (dead) process's half-written copy, the head's size
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"half")

    def child(argv, env):
        return 1, "OSError: disk full\n"
    with pytest.raises(HeadError, match="disk full"):
        sh.convert(built.research, tmp_path / "out", verifier=built.target, run_child=child)
    assert list(tmp_path.iterdir()) == []
