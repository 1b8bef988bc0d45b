"""Plain data shared by the scheduler, the engine, the worker and the models."""

from executor.core.types_.batch import Batch
from executor.core.types_.block_hash import BlockHash
from executor.core.types_.forward_metadata import CacheGroupTables, ForwardMetaData
from executor.core.types_.kv_cache_spec import AttentionKind, KVCacheSpec, KVTensorSpec, attention_spec
from executor.core.types_.model_inputs import ModelInputs, StepLayout
from executor.core.types_.request import FinishReason, Request, RequestStatus, SamplingParams, TokenLogprobs

__all__ = [
    "AttentionKind",
    "Batch",
    "BlockHash",
    "CacheGroupTables",
    "FinishReason",
    "ForwardMetaData",
    "KVCacheSpec",
    "KVTensorSpec",
    "ModelInputs",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "StepLayout",
    "TokenLogprobs",
    "attention_spec",
]
