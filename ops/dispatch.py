"""Which op table the layers call: chosen once per process by (device backend, exe_mode).

The choice is a module-level switch rather than a per-call argument so that layers stay free of
device checks; the engine sets it from the platform and model_config.exe_mode before building the
model. Each table comes with the metadata builder that makes what its attention reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from executor.platform import npu_runtime
from ops import torch_ref
from ops.attention_metadata import AttentionMetadataBuilder, NpuMetadataBuilder, TorchMetadataBuilder
from ops.npu import NpuGraphOps, NpuOps

BACKENDS = ("torch", "npu")
EXE_MODES = ("eager", "ge_graph", "npugraph_ex")


@dataclass(frozen=True, slots=True)
class OpTable:
    backend: str
    exe_mode: str
    ops: Any  # the torch_ref module, or an NpuOps object: one attribute per op in ops.OPS

    def metadata_builder(self, device: torch.device) -> AttentionMetadataBuilder:
        if self.backend == "npu":
            return NpuMetadataBuilder(device, lengths_as_tensors=self.exe_mode != "eager")
        return TorchMetadataBuilder(device)


_current = OpTable("torch", "eager", torch_ref)


def make_op_table(backend: str, exe_mode: str = "eager") -> OpTable:
    """The table for (backend, exe_mode); "npu" imports torch_npu (and torchair for graph modes) now,
    so a bad install fails here with the reason, not mid-run."""
    if backend not in BACKENDS:
        raise ValueError(f"ops backend must be one of {list(BACKENDS)}, got {backend!r}")
    if exe_mode not in EXE_MODES:
        raise ValueError(f"exe_mode must be one of {list(EXE_MODES)}, got {exe_mode!r}")
    if backend == "torch":
        return OpTable(backend, exe_mode, torch_ref)
    if exe_mode == "eager":
        return OpTable(backend, exe_mode, NpuOps(npu_runtime.torch_npu()))
    return OpTable(backend, exe_mode, NpuGraphOps(npu_runtime.torch_npu(), npu_runtime.torchair()))


def set_backend(backend: str, exe_mode: str = "eager") -> OpTable:
    global _current
    _current = make_op_table(backend, exe_mode)
    return _current


def current_table() -> OpTable:
    return _current


def implementation() -> Any:
    return _current.ops
