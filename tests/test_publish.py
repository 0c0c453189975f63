"""`eagle3-console publish RUN_DIR OUT_DIR`: the chosen head as speculators and vLLM load it, its model card
and the run's evaluation; refused for a head whose run did not decide deploy, unless --force."""
import json

from pipeline.layout.rundir import RunDir
from tests.conftest import cli


def test_a_head_without_a_deploy_decision_is_published_only_when_forced(finished_run, tmp_path):
    out = tmp_path / "head"
    refused = cli("publish", finished_run, out)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip() == (f"eagle3-console: error: {finished_run}: the run's decision is not measured "
                                      "(no deploy-measure ran: evaluate.online = false); --force publishes the "
                                      "head anyway")
    assert not out.exists()  # nothing written where it was refused

    done = cli("publish", finished_run, out, "--force")
    assert done.returncode == 0, done.stderr
    from pipeline.evaluation.offline_decoding import load_draft
    load_draft(out)  # speculators loads it as it is
    config = json.loads((out / "config.json").read_text())
    run = RunDir.open(finished_run)
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(run.target_dir(run.profile()))
    card = (out / "README.md").read_text()
    offline = run.stage_state("evaluate-offline")["figures"]
    assert "published with --force" in card and f"τ {offline['tau']:.3f}" in card
    assert '"method": "eagle3"' in card and str(out.resolve()) in card and "--speculative-config" in card
    # speculators' windowed head beside the demo's plain Llama: served in one KV-cache group, as the run did
    assert config["transformer_layer_config"]["layer_types"] == ["sliding_attention"]
    assert "--disable-hybrid-kv-cache-manager" in card
    assert json.loads((out / "evaluation" / "offline.json").read_text())["tau"] == offline["tau"]

    again = cli("publish", finished_run, out, "--force")  # never over what is there
    assert again.returncode == 2 and "exists and is not an empty directory" in again.stderr
