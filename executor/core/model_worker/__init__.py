"""ModelWorker: the model on its device, its KV tensors, one forward pass."""

from executor.core.model_worker.model_worker import ModelWorker

__all__ = ["ModelWorker"]
