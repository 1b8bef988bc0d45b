"""Running our engine and transformers side by side on the same model folder, for parity tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from executor.core.config import build_config
from executor.offline.dataset import PromptRecord
from executor.offline.offline_inference import OfflineInference, RunResult
from executor.offline.results import ResultWriter
from executor.offline.run_folder import plan_run
from ops.attention.metadata import build_model_inputs
from tests.factories import make_request, tiny_tokenizer
from tests.paged_harness import random_prompts

# A tiny random model run by the whole engine: tiny_tokenizer's special token ids, and room for the
# longest of ENGINE_PROMPT_LENS plus the engine's 32 new tokens.
ENGINE_CONFIG = dict(max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2)
ENGINE_PROMPT_LENS = (1, 5, 17, 33, 8, 40, 3)


def make_inference(
    model_dir: Path,
    dtype: str = "float32",
    model_config: dict | None = None,
    speculative_config: dict | None = None,
    **scheduler,
) -> OfflineInference:
    config = build_config(
        {
            "model_config": {"model_path": str(model_dir), "dtype": dtype, "device": "cpu"} | (model_config or {}),
            "data_config": {"apply_chat_template": False, "input_truncated_len": 0},
            "scheduler_config": {"block_size": 16, "max_new_tokens": 32} | scheduler,
            "speculative_config": speculative_config or {},
        },
        source="test.yaml",
    )
    return OfflineInference(config, str(model_dir))


def run_engine(model_dir: Path, records: list[PromptRecord], output_dir: Path | None = None, **scheduler) -> RunResult:
    inference = make_inference(model_dir, **scheduler)
    writer = ResultWriter(plan_run(output_dir, inference.config, records), inference.config) if output_dir else None
    try:
        return inference.generate(records, writer)
    finally:
        if writer is not None:
            writer.close()


def load_hf_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def engine_prefill_logits(inference: OfflineInference, prompts: list[list[int]]) -> torch.Tensor:
    """Our last-token logits for `prompts` prefilled together in one packed step, as fp32."""
    engine = inference.engine
    requests = [make_request(f"p{i}", ids) for i, ids in enumerate(prompts)]
    for request in requests:
        assert engine.kv_cache_manager.allocate_slots(request, request.num_prompt_tokens) is not None
    batch = engine.kv_cache_manager.batch(requests, [r.num_prompt_tokens for r in requests], is_prefill=True)
    _, layout = engine.runner.prepare_inputs(batch, [[] for _ in requests])
    inputs = build_model_inputs(layout, engine.metadata_builder)
    try:
        return engine.worker.compute_logits(engine.worker.forward(inputs), inputs.logits_indices).float()
    finally:
        for request in requests:
            engine.kv_cache_manager.free(request)


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy output for one prompt alone (stops at the model's EOS, like ours)."""
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=max_new_tokens
    )
    return out[0, len(prompt_ids) :].tolist()


@torch.inference_mode()
def hf_last_logits(model: torch.nn.Module, prompt_ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt_ids])).logits[0, -1]


def token_records(prompts: list[list[int]]) -> list[PromptRecord]:
    return [PromptRecord(id=f"p{i}", prompt_token_ids=ids) for i, ids in enumerate(prompts)]


def generate_random_prompts(
    model_dir: Path,
    model_name: str,
    prompt_lens: tuple[int, ...] = ENGINE_PROMPT_LENS,
    seed: int = 5,
    **scheduler: object,
) -> tuple[OfflineInference, list[list[int]], RunResult]:
    """The whole engine (scheduler, KV cache manager, worker) on the torch backend, on model folder
    `model_dir` given tiny_tokenizer, with random prompts of `prompt_lens` in one batch, under
    scheduler_config `scheduler` (a prefill budget that chunks, a pool that preempts):
    -> (the inference, the prompts, its result)."""
    tiny_tokenizer().save_pretrained(model_dir)
    inference = make_inference(
        model_dir, model_config={"model_name": model_name}, batch_size=len(prompt_lens), **scheduler
    )
    prompts = random_prompts(prompt_lens, seed)
    return inference, prompts, inference.generate(token_records(prompts))


# fp32 logits closer than this can swap places under any other order of the same sums (a fused
# kernel, another GEMM library), which is rounding, not a wrong model.
NEAR_TIE = 1e-5


def check_engine_greedy(hf_model: torch.nn.Module, prompts: list[list[int]], result: RunResult) -> None:
    """Each request's output is transformers' greedy output for its prompt alone (the engine's 32
    tokens), except that a request may part from it at a near-tie: a token where transformers' own
    logits of its choice and ours differ by under NEAR_TIE. At most one request in four may part."""
    parted = []
    for request, prompt in zip(result.requests, prompts, strict=True):
        ours, reference = request.output_token_ids, hf_greedy(hf_model, prompt, 32)
        if ours == reference:
            continue
        assert len(ours) == len(reference), f"{request.request_id}: {len(ours)} tokens, transformers {len(reference)}"
        position = next(i for i, (a, b) in enumerate(zip(ours, reference, strict=True)) if a != b)
        logits = hf_last_logits(hf_model, prompt + reference[:position])
        margin = (logits[reference[position]] - logits[ours[position]]).item()
        assert margin < NEAR_TIE, f"{request.request_id} parts from transformers at token {position} by {margin:.2e}"
        parted.append(request.request_id)
    assert len(parted) <= len(prompts) // 4, f"{parted} part from transformers at near-ties: too many to be rounding"


def check_chunked_preempting_run(
    hf_model: torch.nn.Module,
    inference: OfflineInference,
    prompts: list[list[int]],
    result: RunResult,
    model_cls: type,
    chunk: int = 16,
) -> None:
    """The whole engine built `model_cls`, prefilled prompts longer than `chunk` in chunks of at most
    `chunk` tokens, preempted at least once, and still gave transformers' greedy output per prompt."""
    assert isinstance(inference.engine.worker.model, model_cls)
    assert result.summary["preemptions"] > 0
    assert max(len(p) for p in prompts) > chunk
    assert all(step.num_tokens <= chunk for step in result.steps if step.phase == "prefill")
    check_engine_greedy(hf_model, prompts, result)
