"""ExecutionEngine builds a run's parts (platform, groups, op table, worker, KV cache, proposer) and
its EngineCore, the loop both entries drive; its ModelRunner turns each scheduled Batch into a StepResult."""

from executor.core.engine.engine import ExecutionEngine
from executor.core.engine.engine_core import (
    PARTS,
    EngineCore,
    EngineStep,
    PhaseProfiler,
    RequestOutput,
    StepRecord,
    StepTimer,
)
from executor.core.engine.model_runner import ModelRunner

__all__ = [
    "PARTS",
    "EngineCore",
    "EngineStep",
    "ExecutionEngine",
    "ModelRunner",
    "PhaseProfiler",
    "RequestOutput",
    "StepRecord",
    "StepTimer",
]
