"""benchmarks/bench_cpu_peers.py: its parts that decide the figures: llama-bench's output read, the
teacher-forced logits (the engine fed given tokens one step at a time) and their agreement."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest
import torch

from executor.model_loader.gguf_import import convert_gguf_blocks
from tests.engine_harness import make_inference, token_records
from tests.test_model_loader import write_tiny_gguf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_cpu_peers  # noqa: E402


def fake_llama_bench(tmp_path: Path, body: str) -> str:
    script = tmp_path / "llama-bench"
    script.write_text(f"#!{sys.executable}\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_llama_bench_figures_are_its_generation_rate(tmp_path):
    record = {"avg_ts": 125.0, "n_gen": 64, "build_commit": "abc", "cpu_info": "AMD EPYC", "model_type": "llama"}
    binary = fake_llama_bench(
        tmp_path, f"import sys, json; assert '-n' in sys.argv and '-t' in sys.argv; print(json.dumps([{record!r}]))"
    )
    figures = bench_cpu_peers.run_llama_bench(binary, tmp_path / "m.gguf", threads=2, new_tokens=64)
    assert figures["decode_output_tokens_per_s"] == 125.0 and figures["decode_ms_per_token"] == 8.0


def test_a_failing_llama_bench_is_named_with_its_last_words(tmp_path):
    binary = fake_llama_bench(tmp_path, "import sys; print('error: no model', file=sys.stderr); sys.exit(3)")
    with pytest.raises(SystemExit, match="llama-bench failed \\(exit 3\\): error: no model"):
        bench_cpu_peers.run_llama_bench(binary, tmp_path / "m.gguf", threads=2, new_tokens=64)


def test_agreement_of_equal_and_of_shifted_logits():
    logits = torch.randn(5, 11)
    same = bench_cpu_peers.logits_agreement(logits, logits)
    assert same["top1_agreement"] == 1.0 and same["mean_kl"] == pytest.approx(0.0, abs=1e-12)
    other = logits.clone()
    other[0] = -logits[0]  # the first position's top token changes
    differs = bench_cpu_peers.logits_agreement(logits, other)
    assert differs["top1_agreement"] == pytest.approx(0.8) and differs["max_kl"] > 0


def test_teacher_forced_logits_follow_the_forced_tokens(tmp_path):
    """Forced with the engine's own greedy output, every decode step's logits pick the next forced token."""
    blocks = convert_gguf_blocks(write_tiny_gguf(tmp_path / "tiny.gguf", blocks=True), tmp_path / "blocks")
    inference = make_inference(blocks, batch_size=1, max_new_tokens=6, ignore_eos=True)
    prompt = [1, *range(40, 52)]
    forced = inference.generate(token_records([prompt])).requests[0].output_token_ids
    logits = bench_cpu_peers.teacher_forced_logits(inference, [prompt], [forced])
    assert logits.shape[0] == len(forced) - 1
    assert logits.argmax(-1).tolist() == forced[1:]
    assert json.dumps(bench_cpu_peers.logits_agreement(logits, logits))  # plain figures
