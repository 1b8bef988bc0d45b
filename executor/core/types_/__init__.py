"""Plain data shared by the scheduler, the engine and the models."""

from executor.core.types_.batch import Batch
from executor.core.types_.forward_metadata import ForwardMetaData
from executor.core.types_.request import FinishReason, Request, RequestStatus, SamplingParams

__all__ = ["Batch", "FinishReason", "ForwardMetaData", "Request", "RequestStatus", "SamplingParams"]
