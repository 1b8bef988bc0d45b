"""Plain data shared by the scheduler, the engine, the worker and the models."""

from executor.types_.accept_counts import AcceptCounts
from executor.types_.batch import Batch, StepResult, StepRunner
from executor.types_.block_hash import BlockHash
from executor.types_.kv_cache_spec import AttentionKind, KVCacheSpec, KVTensorSpec, attention_spec, recurrent_spec
from executor.types_.request import FinishReason, Request, RequestStatus, SamplingParams, TokenLogprobs

__all__ = [
    "AcceptCounts",
    "AttentionKind",
    "Batch",
    "BlockHash",
    "FinishReason",
    "KVCacheSpec",
    "KVTensorSpec",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "StepResult",
    "StepRunner",
    "TokenLogprobs",
    "attention_spec",
    "recurrent_spec",
]
