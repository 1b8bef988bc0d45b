"""ExecutionEngine builds a run's parts (platform, groups, op table, worker, KV cache, proposer);
its ModelRunner turns each scheduled Batch into a StepResult."""

from executor.core.engine.engine import ExecutionEngine
from executor.core.engine.model_runner import ModelRunner

__all__ = ["ExecutionEngine", "ModelRunner"]
