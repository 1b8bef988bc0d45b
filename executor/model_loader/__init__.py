"""Weight loading: safetensors checkpoints, seeded dummy weights, and GGUF import."""

from executor.model_loader.base_loader import BaseModelLoader
from executor.model_loader.default_loader import DefaultModelLoader
from executor.model_loader.dummy_loader import DummyModelLoader


def get_model_loader(with_ckpt: bool, seed: int) -> BaseModelLoader:
    """The checkpoint loader for `with_ckpt: true`, else seeded random weights."""
    return DefaultModelLoader() if with_ckpt else DummyModelLoader(seed)


__all__ = ["BaseModelLoader", "DefaultModelLoader", "DummyModelLoader", "get_model_loader"]
