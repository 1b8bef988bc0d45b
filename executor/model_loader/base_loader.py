"""The one interface the model worker uses to put weights into a model, whatever their source."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class BaseModelLoader(ABC):
    @abstractmethod
    def load_weights(self, model: torch.nn.Module, model_path: str) -> None:
        """Fill every parameter of `model`; raise WeightLoadError naming what is wrong."""
