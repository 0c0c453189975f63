import subprocess
import sys

from tests.conftest import ROOT


def test_pipeline_never_imports_textual():
    code = ("import sys, pipeline, pipeline.cli, pipeline.run.runner, pipeline.stages, "
            "pipeline.evaluation.offline_decoding, pipeline.training.launch; pipeline.cli.build_parser(); "
            "bad = sorted(m for m in sys.modules if m == 'textual' or m.startswith('textual.')); "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_textual_import_statement_in_pipeline_sources():
    offenders = [p for p in (ROOT / "pipeline").rglob("*.py")
                 if "import textual" in p.read_text() or "from textual" in p.read_text()]
    assert offenders == []
