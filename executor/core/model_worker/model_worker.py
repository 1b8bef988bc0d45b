"""ModelWorker: owns the model on its device, its KV tensors, and runs one forward pass."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from executor.core.engine.model_inputs import ModelInputs
from executor.model_loader import get_model_loader
from executor.platform import Platform
from module.attention import Attention

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class ModelWorker:
    def __init__(self, platform: Platform, dtype: torch.dtype, with_ckpt: bool, seed: int) -> None:
        self.platform = platform
        self.dtype = dtype
        self.with_ckpt = with_ckpt
        self.seed = seed
        self.model: torch.nn.Module | None = None
        self.hf_config: Any = None
        self.attention_layers: list[Attention] = []

    def init(self, model_cls: type[torch.nn.Module], hf_config: Any, model_path: str) -> None:
        """Build the model from its HF config on the device and load the folder's weights."""
        self.hf_config = hf_config
        with _default_dtype(self.dtype), self.platform.device:
            model = model_cls(self.hf_config)
        get_model_loader(self.with_ckpt, self.seed).load_weights(model, model_path)
        self.model = model.eval()
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        if not self.attention_layers:
            raise ValueError(f"{model_cls.__name__} has no module.attention.Attention layer to hold a KV cache")

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block takes across all layers, keys and values."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return sum(2 * block_size * layer.num_kv_heads * layer.head_dim * itemsize for layer in self.attention_layers)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate [num_blocks, block_size, kv_heads, head_dim] key and value tensors per layer.

        Left uninitialised: attention reads only slots this run has written (ops/torch_ref.py and
        its tests fill unused slots with NaN to hold it to that), so start-up touches no cache page.
        """
        for layer in self.attention_layers:
            shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
            key_cache = torch.empty(shape, dtype=self.dtype, device=self.platform.device)
            value_cache = torch.empty(shape, dtype=self.dtype, device=self.platform.device)
            layer.bind_kv_cache(key_cache, value_cache)

    @torch.inference_mode()
    def inference(self, inputs: ModelInputs) -> torch.Tensor:
        """One forward pass; logits [num_selected_rows, vocab]."""
        assert self.model is not None, "ModelWorker.init() must run first"
        metadata = inputs.forward_metadata
        return self.model(
            inputs.input_ids,
            inputs.position_ids,
            metadata,
            slot_mapping=metadata.slot_mapping,
            block_table=metadata.block_table,
        )
