"""The engine contract end to end on tiny random models against transformers: chunked prefill,
preemption, cache groups of two attention kinds, an MLA-shaped cache sized by its latent, and
sampling parameters per request."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from executor.core.config import ConfigError
from executor.core.engine import engine as engine_module
from executor.core.model_worker.model_worker import ModelWorker
from executor.offline.dataset import PromptRecord
from executor.platform import create_platform
from executor.types_ import AttentionKind, FinishReason, KVCacheSpec, KVTensorSpec
from module.attention import KVCacheLayer
from module.parallel_group import ModelParallel
from ops.backend import Backend
from tests.backends import cpu_backend
from tests.conftest import WINDOW, SlidingLlama
from tests.engine_harness import hf_greedy, load_hf_model, make_inference, run_engine, token_records


def make_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=generator).tolist() for n in lengths]


def test_a_prompt_three_times_the_prefill_budget_is_chunked_and_equals_transformers(tiny_llama_dir):
    prompts = make_prompts([48, 5, 20], seed=4)
    result = run_engine(tiny_llama_dir, token_records(prompts), batch_size=3, max_prefill_tokens=16)
    hf = load_hf_model(tiny_llama_dir)
    assert [r.output_token_ids for r in result.requests] == [hf_greedy(hf, p, 32) for p in prompts]
    assert result.summary["prefill"]["steps"] >= 5  # 73 prompt tokens in steps of at most 16
    assert all(step.num_tokens <= 16 for step in result.steps if step.phase == "prefill")


def test_a_pool_that_forces_preemptions_gives_the_large_pool_outputs(tiny_llama_dir):
    prompts = make_prompts([30, 12, 25, 7, 18, 40], seed=5)
    large = run_engine(tiny_llama_dir, token_records(prompts), batch_size=6)
    # block_size 16: each request needs 3-5 blocks at its longest; 9 usable blocks hold two or three.
    small = run_engine(tiny_llama_dir, token_records(prompts), batch_size=6, num_blocks=10, max_model_len=128)
    assert small.summary["preemptions"] > 1 and large.summary["preemptions"] == 0
    assert [r.output_token_ids for r in small.requests] == [r.output_token_ids for r in large.requests]
    assert all(r.finish_reason is FinishReason.LENGTH for r in small.requests)


def test_a_budget_that_cannot_hold_one_max_model_len_request_is_an_error_before_the_run(tiny_llama_dir):
    with pytest.raises(ConfigError, match=r"num_blocks 3: 2 usable blocks of 16 tokens\) cannot hold one request "):
        make_inference(tiny_llama_dir, num_blocks=3)  # max_model_len 256 needs 16 blocks
    make_inference(tiny_llama_dir, num_blocks=3, max_model_len=32)  # 2 blocks: fits


def test_sampling_parameters_come_from_each_dataset_line(tiny_llama_dir):
    prompt = make_prompts([6], seed=7)[0]
    records = [
        PromptRecord(id="short", prompt_token_ids=prompt, sampling_overrides={"max_new_tokens": 3}),
        PromptRecord(id="hot", prompt_token_ids=prompt, sampling_overrides={"temperature": 0.7}),
        PromptRecord(id="bad", prompt_token_ids=prompt, sampling_overrides={"top_p": 1.5}),
        PromptRecord(id="default", prompt_token_ids=prompt),
    ]
    short, hot, bad, default = run_engine(tiny_llama_dir, records, batch_size=4).requests
    assert len(short.output_token_ids) == 3 and short.output_token_ids == default.output_token_ids[:3]
    assert len(default.output_token_ids) == 32
    assert hot.finish_reason is FinishReason.LENGTH and hot.output_token_ids != default.output_token_ids
    assert bad.finish_reason is FinishReason.ERROR and "top_p must be in (0, 1]" in bad.error


def test_layers_of_two_kinds_get_two_cache_groups_and_equal_transformers(ministral_dir, monkeypatch):
    monkeypatch.setattr(engine_module, "resolve_model", lambda name: (SlidingLlama, transformers.MinistralConfig))
    prompts = make_prompts([3, 20, 11, 35], seed=8)  # prompts and outputs longer than the window
    inference = make_inference(ministral_dir, batch_size=4, max_new_tokens=24)
    groups = inference.engine.worker.kv_cache_groups
    assert [g.spec.kind for g in groups] == [AttentionKind.SLIDING_WINDOW, AttentionKind.FULL]
    assert [len(g.layer_names) for g in groups] == [2, 2] and groups[0].spec.sliding_window == WINDOW
    assert inference.engine.kv_cache_manager.num_groups == 2
    seen_tables: list[int] = []
    model = inference.engine.worker.model
    forward = model.forward
    monkeypatch.setattr(
        model,
        "forward",
        lambda ids, positions, metadata: seen_tables.append(len(metadata.groups)) or forward(ids, positions, metadata),
    )
    result = inference.generate(token_records(prompts))
    hf = transformers.MinistralForCausalLM.from_pretrained(ministral_dir, dtype=torch.float32).eval()
    assert [r.output_token_ids for r in result.requests] == [hf_greedy(hf, p, 24) for p in prompts]
    assert set(seen_tables) == {2}


class MLAShapedCache(KVCacheLayer):
    """Stores what an MLA layer stores per token: one compressed latent, no separate V."""

    def __init__(self, kv_lora_rank: int, qk_rope_head_dim: int) -> None:
        super().__init__()
        self.latent_dim = kv_lora_rank + qk_rope_head_dim
        self.cache_dtype = torch.get_default_dtype()  # the worker builds the model under its dtype
        self.bound: dict[str, torch.Tensor] = {}

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec((KVTensorSpec("kv_latent", (self.latent_dim,), self.cache_dtype),))

    def bind_kv_cache(self, caches: dict[str, torch.Tensor], group_id: int) -> None:
        self.bound, self.kv_cache_group_id = caches, group_id


class ToyMLAModel(nn.Module):
    def __init__(self, hf_config: object, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MLAShapedCache(512, 64) for _ in range(3)])
        self.proj = nn.Linear(4, 4)


def test_an_mla_shaped_layer_is_sized_and_allocated_by_its_latent():
    worker = ModelWorker(
        create_platform("cpu"), torch.bfloat16, with_ckpt=False, seed=0, backend=cpu_backend(torch.bfloat16)
    )
    worker.init(ToyMLAModel, None, "unused")
    assert len(worker.kv_cache_groups) == 1
    assert worker.kv_cache_bytes_per_block(16) == 3 * 16 * (512 + 64) * 2  # not 2 x heads x head_dim
    worker.init_kv_cache(num_blocks=5, block_size=16)
    for layer in worker.model.layers:
        assert {name: (t.shape, t.dtype) for name, t in layer.bound.items()} == {
            "kv_latent": (torch.Size([5, 16, 576]), torch.bfloat16)
        }


def test_a_tokenizer_id_outside_the_model_vocabulary_fails_its_request_alone(tiny_llama_dir):
    inference = make_inference(tiny_llama_dir)
    inference.engine.vocab_size = 100  # as if the tokenizer had tokens the model lacks
    records = [PromptRecord(id="big", prompt="w5 w200"), PromptRecord(id="ok", prompt="w5 w50")]
    big, ok = inference.generate(records).requests
    assert big.finish_reason is FinishReason.ERROR and "token id 200, outside the model's vocabulary" in big.error
    assert ok.finish_reason is FinishReason.LENGTH


def test_the_warm_up_runs_its_request_through_a_scheduler_of_its_own(tiny_llama_dir, monkeypatch):
    """The warm-up request (a short prompt, two new tokens) is stepped by a throwaway scheduler (in
    an engine core of its own) that logs nothing, so that the scheduler stays the one writer of a
    Request; the run's core, built last, has stepped nothing."""
    cores: list[engine_module.EngineCore] = []

    class RecordingCore(engine_module.EngineCore):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            cores.append(self)

    monkeypatch.setattr(engine_module, "EngineCore", RecordingCore)
    inference = make_inference(tiny_llama_dir)
    warm_up, run = cores
    assert run is inference.core and run._num_steps == 0
    assert warm_up.scheduler is not run.scheduler
    assert not warm_up.has_work() and warm_up._num_steps == 2  # a prefill, then a decode
