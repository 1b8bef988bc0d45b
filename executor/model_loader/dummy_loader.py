"""Seeded random weights for `with_ckpt: false`: runs the whole flow without a checkpoint.

Values are drawn on the CPU with a private generator, so a seed gives the same weights on every
device and does not disturb the global RNG. Norm weights are 1 and biases 0, so activations stay
in a sane range through many layers.
"""

from __future__ import annotations

import torch

from executor.model_loader.base_loader import BaseModelLoader

INIT_STD = 0.02


class DummyModelLoader(BaseModelLoader):
    def __init__(self, seed: int) -> None:
        self.seed = seed

    @torch.no_grad()
    def load_weights(self, model: torch.nn.Module, model_path: str) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        norm_params = {
            id(param)
            for module in model.modules()
            if "norm" in type(module).__name__.lower()
            for param in module.parameters(recurse=False)
        }
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif id(param) in norm_params:
                param.fill_(1.0)
            else:
                values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * INIT_STD
                param.copy_(values)
