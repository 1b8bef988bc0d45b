"""Speculative decoding on the real SmolLM2-135M-Instruct, fp32: n-gram, a layer-skip draft model and an
MTP head trained by scripts/train_mtp_head.py all give the greedy output of the run without speculation,
in a batch whose requests accept different numbers of drafts and finish at different steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from executor.core.config import build_config
from executor.offline.dataset import DATASET_DIR, PromptRecord, load_prompts
from executor.offline.offline_inference import OfflineInference, RunResult
from scripts import train_mtp_head
from scripts.make_layer_skip_draft import make_draft

pytestmark = pytest.mark.slow

BATCH_SIZE = 8


def records() -> list[PromptRecord]:
    """Six prompts whose answers repeat their input and two that do not, each with its own length limit."""
    chosen = load_prompts(DATASET_DIR / "repeat_input.jsonl")[:6] + load_prompts(DATASET_DIR / "default.jsonl")[1:3]
    for index, record in enumerate(chosen):
        record.sampling_overrides["max_new_tokens"] = 24 + 4 * index
    return chosen


def run(model_dir: Path, **speculative) -> RunResult:
    config = build_config(
        {
            "model_config": {"model_path": str(model_dir), "dtype": "float32", "device": "cpu"},
            "scheduler_config": {"block_size": 16, "batch_size": BATCH_SIZE, "max_model_len": 1024},
            "speculative_config": speculative,
        },
        source="test.yaml",
    )
    return OfflineInference(config, str(model_dir)).generate(records())


def outputs(result: RunResult) -> list[list[int]]:
    return [request.output_token_ids for request in result.requests]


@pytest.fixture(scope="module")
def greedy(smollm2_dir) -> list[list[int]]:
    return outputs(run(smollm2_dir))


def check_exact_with_acceptance(result: RunResult, greedy: list[list[int]]) -> dict:
    assert outputs(result) == greedy
    stats = result.summary["speculative"]
    assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] > 0
    return stats


def test_ngram_on_smollm2_gives_greedy_output(smollm2_dir, greedy):
    result = run(smollm2_dir, method="ngram", num_speculative_tokens=3)
    check_exact_with_acceptance(result, greedy)


@pytest.mark.long  # the draft-model path is exact on the tiny models (test_spec_graphs.py)
def test_layer_skip_draft_model_on_smollm2_gives_greedy_output(smollm2_dir, greedy, tmp_path):
    draft = make_draft(smollm2_dir, tmp_path / "draft8", num_layers=8)
    result = run(smollm2_dir, method="draft_model", num_speculative_tokens=2, draft_model_path=str(draft))
    check_exact_with_acceptance(result, greedy)


def test_trained_mtp_head_on_smollm2_gives_greedy_output(smollm2_dir, greedy, tmp_path):
    """A head trained for a minute accepts a few drafts; exactness must not depend on how good it is."""
    prompts = tmp_path / "prompts.jsonl"
    training_prompts = load_prompts(train_mtp_head.DEFAULT_PROMPT_FILES[0])[:16]
    prompts.write_text("".join(json.dumps({"prompt": record.prompt}) + "\n" for record in training_prompts))
    head = tmp_path / "SmolLM2-MTP"
    train_mtp_head.main(
        ["--model", str(smollm2_dir), "--prompts", str(prompts), "--output", str(head), "--steps", "60",
         "--max-new-tokens", "32", "--threads", "2"]
    )  # fmt: skip
    for next_n in (1, 2):
        result = run(head, method="mtp", num_speculative_tokens=next_n)
        check_exact_with_acceptance(result, greedy)
