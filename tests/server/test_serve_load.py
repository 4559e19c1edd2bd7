"""benchmarks/serve_load.py against the tiny server of test_server.py on 127.0.0.1 for about a
second: its report agrees with what it sent and with the server's own /metrics (no timings)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from test_limits_metrics import scrape
from test_server import Server, folder  # noqa: F401  (folder: a fixture)

from core import load_model
from core.serve.app import create_app

ROOT = Path(__file__).resolve().parents[2]


def serve_load():
    spec = importlib.util.spec_from_file_location("serve_load", ROOT / "benchmarks/serve_load.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_load"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("load", [["--concurrency", "3"], ["--rate", "20", "--concurrency", "3"]])
def test_report_matches_what_was_sent(folder, tmp_path, load):  # noqa: F811
    server = Server(create_app(load_model(folder, max_seq_len=64, max_batch_size=2), "tiny"))
    try:
        out = tmp_path / "r.json"
        argv = ["--url", server.url, "--duration", "1", "--seed", "3", "--json", str(out)]
        argv += ["--input-len", "2", "12", "--output-len", "1", "8", *load]
        result = serve_load().main(argv)
        metrics = scrape(server)
    finally:
        server.close()
    assert json.loads(out.read_text())["completed"] == result["completed"]
    n = result["completed"]
    assert n >= 3 and result["failed"] == 0 and not result["errors"]
    # eos ignored: every answer has the length asked, and the server counted the same tokens
    assert result["output_lens"] == result["asked_output_lens"]
    assert result["total_output_tokens"] == sum(result["output_lens"])
    assert metrics["vllm:generation_tokens_total"] == result["total_output_tokens"]
    assert result["total_input_tokens"] == sum(result["input_lens"])
    assert metrics["vllm:prompt_tokens_total"] == result["total_input_tokens"]
    assert metrics["vllm:request_success_total{finished_reason=length}"] == n
    assert all(2 <= x <= 12 for x in result["input_lens"])
    assert result["request_throughput"] == pytest.approx(n / result["duration"])
    assert result["output_throughput"] == pytest.approx(
        n and sum(result["output_lens"]) / result["duration"]
    )
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"median_{key}_ms"] <= result[f"p99_{key}_ms"], key
    assert result["mean_ttft_ms"] <= result["mean_e2el_ms"]
