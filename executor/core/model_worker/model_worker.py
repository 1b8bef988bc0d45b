"""ModelWorker: builds and loads the model on its device with its backend, holds its KV cache tensors and its
graph runner; the ModelRunner (executor/core/engine/model_runner.py) runs it each step."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from executor.core.model_worker.graph_runner import GraphRunner
from executor.model_loader import get_model_loader
from executor.model_loader.default_loader import checkpoint_header
from executor.model_loader.quantized_checkpoint import check_quantized_tensors
from executor.platform import Platform
from executor.types_.kv_cache_spec import KVCacheSpec
from executor.types_.quant_scheme import QuantizationPlan
from executor.utils.slow_phase import announced_if_slow
from module.attention import KVCacheLayer
from module.parallel_group import ONE_PROCESS, ModelParallel
from module.quantization_pass import (
    QuantizedLayer,
    describe_quantized_layers,
    layer_kind_schemes,
    quantize_model,
    weight_bytes,
)
from ops.attention.metadata import ModelInputs
from ops.backend import Backend
from ops.linear_method import process_linear_weights

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers with one KV cache spec: they share a block table and a SingleTypeKVCacheManager."""

    spec: KVCacheSpec
    layer_names: tuple[str, ...]


def group_kv_cache_layers(layers: dict[str, KVCacheLayer]) -> list[KVCacheGroup]:
    """One group per distinct spec, in the order the specs first appear in the model."""
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, layer in layers.items():
        by_spec.setdefault(layer.kv_cache_spec(), []).append(name)
    return [KVCacheGroup(spec, tuple(names)) for spec, names in by_spec.items()]


class ModelWorker:
    def __init__(
        self,
        platform: Platform,
        dtype: torch.dtype,
        with_ckpt: bool,
        seed: int,
        parallel: ModelParallel = ONE_PROCESS,
        *,
        backend: Backend,
    ) -> None:
        self.platform = platform
        self.backend = backend
        self.parallel = parallel
        self.dtype = dtype
        self.with_ckpt = with_ckpt
        self.seed = seed
        self.model: torch.nn.Module | None = None
        self.kv_cache_layers: dict[str, KVCacheLayer] = {}
        self.kv_cache_groups: list[KVCacheGroup] = []
        self.graph_runner: GraphRunner | None = None
        self.quantized_layers: list[QuantizedLayer] = []
        self.layer_schemes: dict[str, str] = {}  # linear layer kind -> its scheme and method (set by init)
        self.weight_bytes = 0

    def init(
        self,
        model_cls: type[torch.nn.Module],
        hf_config: Any,
        model_path: str,
        quantization: QuantizationPlan | None = None,
        before_load: Callable[[torch.nn.Module], None] | None = None,
    ) -> None:
        """Build the model from its HF config on the device with this rank's groups, give the layers
        that `quantization` quantizes their scheme (and check the checkpoint holds their tensors),
        run `before_load` on the built model (a check that must not wait for the weights), load its
        shard of the folder's weights (each layer cuts its part out of each checkpoint tensor as it
        streams by), let each linear layer's method process its weights once (the CPU packs them; a
        scheme quantizes or dequantizes them), and group its KV cache layers by spec."""
        with _default_dtype(self.dtype), self.platform.device:
            model = model_cls(hf_config, parallel=self.parallel, backend=self.backend)
            if quantization is not None:
                self.quantized_layers = quantize_model(model, quantization, self.backend, self.dtype)
        if before_load is not None:
            before_load(model)
        if quantization is not None and not quantization.at_load and self.with_ckpt:
            check_quantized_tensors(self.quantized_layers, quantization, checkpoint_header(model_path))
        source = f"from {model_path}" if self.with_ckpt else "(random, with_ckpt false)"
        with announced_if_slow(logger, f"loading the weights {source}"):
            get_model_loader(self.with_ckpt, self.seed).load_weights(model, model_path)
        with announced_if_slow(logger, "laying the linear weights out for their kernels"):
            methods = process_linear_weights(model)
        logger.info("%s backend; linear weights by %s", self.backend.name, ", ".join(methods) or "none")
        self.layer_schemes = layer_kind_schemes(model)
        self.weight_bytes = weight_bytes(model)
        for line in describe_quantized_layers(model, self.quantized_layers):
            logger.info("quantized linears %s", line)
        logger.info("weights: %.1f MiB (parameters and the copies kernels laid out)", self.weight_bytes / 2**20)
        self.model = model.eval()
        self.kv_cache_layers = {name: m for name, m in model.named_modules() if isinstance(m, KVCacheLayer)}
        if not self.kv_cache_layers:
            raise ValueError(f"{model_cls.__name__} has no module.attention.KVCacheLayer to hold a KV cache")
        self.kv_cache_groups = group_kv_cache_layers(self.kv_cache_layers)

    def add_draft_module(
        self, name: str, build: Callable[[ModelParallel, Backend], torch.nn.Module]
    ) -> torch.nn.Module:
        """Build a drafter that lives beside the model (EAGLE-3's) on the device in the model's dtype
        with this rank's groups, lay its linear weights out, and give its attention layers a KV cache
        in the model's pool (grouped with the model's layers of the same spec). Before the KV cache
        is sized. `build` loads its weights."""
        with _default_dtype(self.dtype), self.platform.device:
            module = build(self.parallel, self.backend)
        process_linear_weights(module)
        self.weight_bytes += weight_bytes(module)
        module.eval()
        layers = {f"{name}.{n}": m for n, m in module.named_modules() if isinstance(m, KVCacheLayer)}
        self.kv_cache_layers |= layers
        self.kv_cache_groups = group_kv_cache_layers(self.kv_cache_layers)
        return module

    def kv_cache_bytes_per_token(self) -> int:
        """KV bytes one token takes across every layer's cache tensors."""
        return sum(layer.kv_cache_spec().bytes_per_token for layer in self.kv_cache_layers.values())

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block id takes across every layer's cache tensors (a sum over the layers' specs;
        recurrent layers keep nothing per token)."""
        return sum(layer.kv_cache_spec().bytes_per_block(block_size) for layer in self.kv_cache_layers.values())

    def state_bytes_per_slot(self) -> int:
        """Bytes one state slot takes across every recurrent layer's state tensors (0 without any)."""
        return sum(layer.kv_cache_spec().bytes_per_slot for layer in self.kv_cache_layers.values())

    def state_groups(self) -> tuple[int, ...]:
        """The recurrent cache groups (linear attention): per-request state slots, no blocks."""
        return tuple(group_id for group_id, group in enumerate(self.kv_cache_groups) if group.spec.is_recurrent)

    def init_kv_cache(self, num_blocks: int, block_size: int, num_state_slots: int = 0) -> None:
        """Allocate [num_blocks, entries per block, *per-entry shape] for every tensor of every layer's
        spec (entries are tokens, but for a compressed tensor's one per tokens_per_entry tokens), and
        [num_state_slots, *shape] for every tensor of a recurrent spec.

        Left uninitialised: attention reads only slots this run has written (ops/torch_ref.py and
        its tests fill unused slots with NaN to hold it to that), so start-up touches no cache page;
        a recurrent layer reads a slot's state only where its row continues one it wrote.
        """
        for group_id, group in enumerate(self.kv_cache_groups):
            for name in group.layer_names:
                caches = {
                    tensor.name: torch.empty(
                        group.spec.allocation_shape(tensor, num_blocks, block_size, num_state_slots),
                        dtype=tensor.dtype,
                        device=self.platform.device,
                    )
                    for tensor in group.spec.tensors
                }
                self.kv_cache_layers[name].bind_kv_cache(caches, group_id)

    @torch.inference_mode()
    def init_graphs(self, runner: GraphRunner) -> float:
        """Compile or capture every bucket of `runner` (after the KV cache is bound: graphs read the
        cache tensors they were built on); returns the warm-up seconds."""
        self.graph_runner = runner
        return runner.warm_up()

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """One forward pass; hidden states [T, hidden]."""
        assert self.model is not None, "ModelWorker.init() must run first"
        return self.model(inputs.input_ids, inputs.positions, inputs.forward_metadata)

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor, row_indices: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] for the rows the step samples."""
        assert self.model is not None, "ModelWorker.init() must run first"
        return self.model.compute_logits(hidden_states, row_indices)
