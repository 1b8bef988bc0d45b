"""benchmarks/bench_pd.py: its pure parts (percentiles, the transfer figures per request, the
table), and a tiny run end to end (slow: four servers start)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_pd  # noqa: E402


def test_defaults_are_the_issue_workload():
    args = bench_pd.parse_args([])
    assert args.concurrency == [8, 32] and args.prompt_tokens == 1000 and args.cores == "0,1"


def test_percentiles_and_the_transfer_share_per_request():
    assert bench_pd.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert bench_pd.percentile([], 99) is None
    before = {
        "kv_transfers": 2,
        "kv_transfer_s": 1.0,
        "kv_transfer_bytes": 100,
        "prefill_step_s": 5.0,
        "prefill_steps": 1,
        "prefilled_requests": 3,
    }
    after = {
        "kv_transfers": 6,
        "kv_transfer_s": 1.4,
        "kv_transfer_bytes": 500,
        "prefill_step_s": 9.0,
        "prefill_steps": 3,
        "prefilled_requests": 8,  # 5 prefilled, 4 of them sent: the step time is shared by the 5
    }
    decode = {"kv_transfers": 4, "kv_transfer_s": 0.8}
    figures = bench_pd.transfer_figures(before, after, {"kv_transfers": 0, "kv_transfer_s": 0.0}, decode)
    assert figures["kv_bytes_per_request"] == 100
    assert figures["send_ms_per_request"] == pytest.approx(100.0)
    assert figures["receive_ms_per_request"] == pytest.approx(200.0)
    assert figures["prefill_step_ms_per_request"] == pytest.approx(800.0)
    assert figures["transfer_share_of_prefill"] == pytest.approx(0.25)
    assert bench_pd.transfer_figures(before, before, decode, decode) == {"kv_transfers": 0}
    row = {
        "system": "PD",
        "concurrency": 8,
        "output_tok_s": 10.0,
        "ttft_ms_p50": 1.0,
        "ttft_ms_p99": 2.0,
        "tpot_ms_p50": 3.0,
        "tpot_ms_p99": 4.0,
        "transfer": figures,
    }
    assert "| PD | 8 | 10.0 | 1.0 / 2.0 | 3.0 / 4.0 |" in bench_pd.format_table([row])
    assert "25.0%" in bench_pd.format_table([row])


@pytest.mark.slow
@pytest.mark.long  # a real PD and combined run: past CI's budget; its figures are docs/benchmarks.md's
def test_a_tiny_run_end_to_end(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "pd.json"
    argv = [
        "--yaml",
        "models/qwen3/config/tiny_random.yaml",
        "--prompt-tokens",
        "64",
        "--max-new-tokens",
        "6",
        "--concurrency",
        "2",
        "--num-prompts",
        "4",
        "--set",
        "scheduler_config.num_blocks=64",
        "--out",
        str(out),
    ]
    assert bench_pd.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["system"] for row in rows] == ["PD (1 + 1 core)", "combined (2 cores)"]
    assert all(row["requests"] == 4 and row["num_failed"] == 0 and row["output_tok_s"] > 0 for row in rows)
    transfer = rows[0]["transfer"]
    assert transfer["kv_transfers"] == 4 and transfer["kv_bytes_per_request"] > 0
    assert transfer["transfer_share_of_prefill"] is not None
