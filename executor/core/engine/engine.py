"""ExecutionEngine: turns a scheduled Batch into packed inputs, runs the worker, samples.

Built in two phases, as in cann-recipes: the constructor readies the platform and an empty
ModelWorker; init() loads weights, the tokenizer and the KV cache.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig

import ops
from executor.core.config import ConfigError, InferenceConfig
from executor.core.config.inference_config import check_device_rules
from executor.core.engine.kv_cache_sizing import host_available_bytes, plan_num_blocks
from executor.core.engine.model_inputs import ModelInputs, ScheduledSequence, build_model_inputs
from executor.core.kv_cache import KVCacheManager
from executor.core.model_worker import ModelWorker
from executor.core.types_ import Batch, Request, SamplingParams
from executor.platform import create_platform, resolve_dtype

logger = logging.getLogger(__name__)


class ExecutionEngine:
    def __init__(self, config: InferenceConfig) -> None:
        self.config = config
        self.platform = create_platform(config.model_config.device)
        check_device_rules(config, self.platform.device_type)
        ops.set_backend(self.platform.ops_backend)
        self.dtype = resolve_dtype(config.model_config.dtype)
        self.worker = ModelWorker(
            self.platform, self.dtype, config.model_config.with_ckpt, seed=config.data_config.seed
        )
        self.tokenizer: Any = None
        self.kv_cache_manager: KVCacheManager | None = None
        self.max_model_len = 0
        self.eos_token_ids: set[int] = set()
        logger.info("platform %s, dtype %s", self.platform.device, config.model_config.dtype)

    def init(self, model_cls: type[torch.nn.Module], config_cls: Any, model_path: str) -> None:
        hf_config = config_cls.from_pretrained(model_path)
        self.max_model_len = self._resolve_max_model_len(hf_config.max_position_embeddings)  # before the weights
        self.worker.init(model_cls, hf_config, model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.eos_token_ids = self._collect_eos_token_ids(model_path)
        self._init_cache_manager()

    def _resolve_max_model_len(self, model_limit: int) -> int:
        requested = self.config.scheduler_config.max_model_len
        if requested > model_limit:
            raise ConfigError(
                f"scheduler_config.max_model_len {requested} exceeds the model's max_position_embeddings "
                f"{model_limit} ({self.config.source})"
            )
        return requested or model_limit

    def _collect_eos_token_ids(self, model_path: str) -> set[int]:
        """EOS ids from the tokenizer and, when present, generation_config.json."""
        eos = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        try:
            generation_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        except OSError:
            generation_eos = None
        if generation_eos is not None:
            eos.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
        return eos

    def _init_cache_manager(self) -> None:
        sched = self.config.scheduler_config
        memory = self.platform.memory_info_bytes()
        free_bytes = memory[0] if memory is not None else host_available_bytes()
        bytes_per_block = self.worker.kv_cache_bytes_per_block(sched.block_size)
        num_blocks = plan_num_blocks(
            num_blocks=sched.num_blocks,
            block_size=sched.block_size,
            bytes_per_block=bytes_per_block,
            batch_size=sched.batch_size,
            max_model_len=self.max_model_len,
            free_memory_bytes=free_bytes,
            mem_fraction_static=sched.mem_fraction_static,
        )
        self.worker.init_kv_cache(num_blocks, sched.block_size)
        self.kv_cache_manager = KVCacheManager(num_blocks, sched.block_size)
        total_mib = num_blocks * bytes_per_block / 2**20
        logger.info("KV cache: %d blocks of %d tokens (%.0f MiB)", num_blocks, sched.block_size, total_mib)

    def warm_up(self) -> None:
        """One dummy prefill and one decode step, so first-call costs stay out of the step log."""
        assert self.kv_cache_manager is not None
        capacity = self.kv_cache_manager.num_blocks * self.kv_cache_manager.block_size
        num_tokens = max(1, min(16, self.max_model_len - 2, capacity - 1))
        request = Request("warm-up", None, [0] * num_tokens, SamplingParams(max_new_tokens=2))
        for batch in (Batch([request], True, [num_tokens]), Batch([request], False, [1])):
            if self.kv_cache_manager.allocate_slots(request, batch.total_tokens) is None:
                raise RuntimeError("the KV cache is too small for a warm-up request")
            batch.update_requests_from_batch(self.forward_batch(batch))
        self.kv_cache_manager.free(request)

    def forward_batch(self, batch: Batch) -> list[int]:
        """Run one step for `batch` and return one sampled token id per request."""
        logits = self.worker.inference(self._build_model_inputs(batch))
        return self._sample_tokens(logits)

    def _build_model_inputs(self, batch: Batch) -> ModelInputs:
        assert self.kv_cache_manager is not None
        sequences = [
            ScheduledSequence(
                token_ids=request.token_ids_between(
                    request.num_computed_tokens, request.num_computed_tokens + num_tokens
                ),
                num_computed_tokens=request.num_computed_tokens,
                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            )
            for request, num_tokens in zip(batch.requests, batch.num_scheduled_tokens, strict=True)
        ]
        return build_model_inputs(
            sequences,
            is_prefill=batch.is_prefill,
            block_size=self.kv_cache_manager.block_size,
            device=self.platform.device,
        )

    def _sample_tokens(self, logits: torch.Tensor) -> list[int]:
        """Greedy argmax; the one host sync of the step."""
        return logits.argmax(dim=-1).tolist()
