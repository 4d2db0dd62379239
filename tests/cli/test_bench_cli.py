import json

import pytest
from typer.testing import CliRunner

from hybridkv.cli import app

runner = CliRunner()


def test_bench_throughput_reports_what_it_generated():
    r = runner.invoke(
        app, ["bench", "throughput", "--num-prompts", "3", "--input-len", "8", "--output-len", "5", "--json"]
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["requests"] == 3 and out["preemptions"] == 0
    assert out["output_tokens"] == 15
    assert out["output_tok_per_s"] * out["elapsed_s"] == pytest.approx(15, rel=0.1)  # elapsed_s is rounded
    assert out["total_tok_per_s"] > out["output_tok_per_s"] > 0


def test_bench_throughput_bad_model_is_a_clear_error(tmp_path):
    r = runner.invoke(app, ["bench", "throughput", "--model", str(tmp_path / "missing")])
    assert r.exit_code == 2
    assert "config.json" in r.output
