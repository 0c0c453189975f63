import pytest

from pipeline.profile import PROFILES_DIR, ProfileError, dump_toml, load_profile
from tests.conftest import TINY, cli


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_demo_profile_is_valid_and_tiny_inherits_it():
    demo = load_profile(PROFILES_DIR / "demo.toml")
    tiny = load_profile(TINY)
    assert demo.name == "demo" and tiny.name == "tiny"
    assert tiny.train.epochs == 3 and tiny.train.lr == demo.train.lr  # overridden vs inherited
    assert tiny.extract.layer_ids == [1, 2, 3, 4]


def test_unknown_key_names_file_key_and_value(tmp_path):
    p = write(tmp_path, "bad.toml", 'extends = "%s"\n[train]\nepoch = 3\n' % (PROFILES_DIR / "demo.toml"))
    with pytest.raises(ProfileError) as e:
        load_profile(p)
    msg = str(e.value)
    assert str(p) in msg and "'train.epoch'" in msg and "3" in msg and "\n" not in msg


@pytest.mark.parametrize("text,message", [
    ('[train]\nepochs = "many"\n', r"key 'train.epochs': expected int, got 'many'"),
    ("[vocab]\ndraft_vocab_size = true\n", r"vocab.draft_vocab_size"),  # a bool is not an int
    ('[train]\noptimizer = "sgd"\n', r"train.optimizer.*one of 'adamw', 'muon'.*'sgd'"),
    ('[target]\nsource = "path"\n', r"missing required key 'target.model_path'"),
    ("[extract]\nlayer_ids = [3, 1]\n", r"extract.layer_ids.*\[3, 1\]"),
    ("[train\n", r"not valid TOML"),
    ('[target]\nsource = "path"\nmodel_path = "no/such/model"\n',
     r"key 'target.model_path': no model \(config.json\) at '.*no/such/model'"),
    ('[data]\nconversations = "missing.jsonl"\n', r"key 'data.conversations': file not found '.*missing.jsonl'"),
], ids=["wrong-type", "bool-is-not-int", "literal-choice", "missing-required", "semantic-bounds", "bad-toml",
        "missing-model-path", "missing-conversations"])
def test_bad_profile_is_one_line_naming_file_and_key(tmp_path, text, message):
    p = write(tmp_path, "bad.toml", text)
    with pytest.raises(ProfileError, match=message) as err:
        load_profile(p)
    assert str(p) in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_extends_missing_file_and_cycle(tmp_path):
    p = write(tmp_path, "a.toml", 'extends = "nope.toml"\n')
    with pytest.raises(ProfileError, match=r"a.toml: key 'extends'.*nope.toml"):
        load_profile(p)
    write(tmp_path, "b.toml", 'extends = "c.toml"\n')
    c = write(tmp_path, "c.toml", 'extends = "b.toml"\n')
    with pytest.raises(ProfileError, match="cycle"):
        load_profile(c)


def test_resolved_profile_round_trips(tmp_path):
    tiny = load_profile(TINY)
    p = write(tmp_path, "resolved.toml", dump_toml(tiny.model_dump()))
    assert load_profile(p) == tiny


def test_cli_bad_profile_is_one_line_and_exit_2(tmp_path):
    p = write(tmp_path, "bad.toml", "[train]\nepochs = 0\n")
    proc = cli("run", p, "--no-tui", "--run-dir", tmp_path / "run")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "train.epochs" in proc.stderr and str(p) in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing created for a refused profile


def test_cli_unknown_stage_and_missing_profile(tmp_path):
    proc = cli("run", TINY, "--no-tui", "--from", "extrct", "--run-dir", tmp_path / "r")
    assert proc.returncode == 2 and "--from 'extrct': unknown stage" in proc.stderr
    proc = cli("run", tmp_path / "missing.toml", "--no-tui")
    assert proc.returncode == 2 and "profile file not found" in proc.stderr


def test_relative_input_paths_resolve_against_the_profile(tmp_path):
    (tmp_path / "convs.jsonl").write_text("")
    p = write(tmp_path, "rel.toml", '[data]\nconversations = "convs.jsonl"\n')
    assert load_profile(p).data.conversations == str(tmp_path / "convs.jsonl")


def test_set_with_resume_is_refused_not_ignored(tmp_path):
    """A resumed run keeps the profile it was created with; an override there used to be dropped silently."""
    proc = cli("run", "--resume", tmp_path / "run", "--no-tui", "--set", 'extract.backend="vllm"')
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "extract.backend" in proc.stderr and "profile.toml" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key,value,why", [
    ("demo_target.architecture", "foo", "expected one of"),
    ("demo_target.num_heads", 0, "must be >= 1"),
    ("demo_target.kv_lora_rank", 0, "must be >= 1"),
    ("demo_target.num_experts_per_tok", 20, "must be <= demo_target.n_routed_experts"),
    ("demo_target.yarn_factor", 0.5, "finite factor >= 1"),
    ("demo_target.first_k_dense_replace", 4, "must be in [0, demo_target.num_layers"),
    ("demo_target.quant_group_size", 0, "must be >= 1 and divide"),
])
def test_bad_kimi_class_target_keys_are_one_line_errors(key, value, why):
    overrides = {key: value, "demo_target.quantization": "w4a16"} if "quant" in key else {key: value}
    with pytest.raises(ProfileError) as err:
        load_profile("demo-int4" if "quant" in key else "demo-mla", overrides)
    message = str(err.value)
    assert "\n" not in message and key in message and why in message, message


@pytest.mark.parametrize("text", ["two\nlines", 'a "quoted" word', "back\\slash and \\n literally", "ünïcødé ✔ 日本",
                                  "tab\tand\r\ncarriage", "'single' and ''' triple"],
                         ids=["newline", "quotes", "backslash", "unicode", "control", "triple-quotes"])
def test_any_string_round_trips_through_a_run_directory(tmp_path, text):
    """A resolved profile is written with a TOML library: every string reads back as it was (a newline in
    a description used to make profile.toml invalid, and the run unreadable for good)."""
    from pipeline.layout.rundir import RunDir
    profile = load_profile(TINY, {"description": text, "server.production_args": [text, "--x"]})
    run = RunDir.create(profile, tmp_path / "run")
    again = run.profile()
    assert again == profile and again.description == text and again.server.production_args == [text, "--x"]


def test_the_json_schema_in_docs_is_the_profiles_own():
    """docs/profile.schema.json (for editors) is generated from the models: `eagle3-console schema`."""
    from pipeline.profile import json_schema
    shipped = (PROFILES_DIR.parent / "docs" / "profile.schema.json").read_text()
    assert shipped == json_schema(), "regenerate it: eagle3-console schema > docs/profile.schema.json"
    import json
    props = json.loads(shipped)["$defs"]["TrainSection"]["properties"]
    assert props["epochs"]["minimum"] == 1 and "torchrun" in props["nproc_per_node"]["description"]
