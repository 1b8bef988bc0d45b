"""ExecutionEngine: packed inputs, one forward pass, sampling."""

from executor.core.engine.engine import ExecutionEngine

__all__ = ["ExecutionEngine"]
