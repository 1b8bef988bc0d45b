"""Plain data shared by the scheduler, the engine, the worker and the models."""

from executor.types_.batch import Batch
from executor.types_.block_hash import BlockHash
from executor.types_.forward_metadata import CacheGroupTables, ForwardMetaData
from executor.types_.kv_cache_spec import AttentionKind, KVCacheSpec, KVTensorSpec, attention_spec
from executor.types_.model_inputs import ModelInputs, StepLayout
from executor.types_.request import FinishReason, Request, RequestStatus, SamplingParams, TokenLogprobs

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
