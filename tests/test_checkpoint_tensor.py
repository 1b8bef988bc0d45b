"""Specification of reading only a rank's shard from the checkpoint: CheckpointTensor narrows without
reading, a tensor-parallel rank reads only its slice of each split tensor (never a whole one), an
expert-parallel rank never reads another rank's experts, and every rank ends with the same weights as
when the loader handed over whole tensors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig

from executor.model_loader import DefaultModelLoader, default_loader
from executor.types_.checkpoint_tensor import CheckpointTensor, materialize
from models.gpt_oss.model import GptOssForCausalLM
from models.llama import LlamaForCausalLM
from models.qwen3_moe.model import Qwen3MoeForCausalLM
from module.parallel_group import ModelParallel, ParallelGroup
from tests.backends import cpu_backend
from tests.factories import gpt_oss_config, qwen_config
from tests.test_gpt_oss_parity import save_checkpoint as save_gpt_oss_checkpoint
from tests.test_qwen_parity import save_checkpoint as save_qwen_checkpoint


@dataclass(slots=True)
class Read:
    name: str
    index: tuple[slice, ...]
    nbytes: int


class RecordingSlice:
    """A safetensors slice that records each read (which tensor, which index, how many bytes)."""

    def __init__(self, name: str, tensor_slice, reads: list[Read]) -> None:
        self.name, self.tensor_slice, self.reads = name, tensor_slice, reads

    def get_shape(self) -> list[int]:
        return self.tensor_slice.get_shape()

    def get_dtype(self) -> str:
        return self.tensor_slice.get_dtype()

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        tensor = self.tensor_slice[index]
        self.reads.append(Read(self.name, index, tensor.nbytes))
        return tensor


class RecordingFile:
    def __init__(self, file, reads: list[Read]) -> None:
        self.file, self.reads = file, reads

    def keys(self) -> list[str]:
        return self.file.keys()

    def get_slice(self, name: str) -> RecordingSlice:
        return RecordingSlice(name, self.file.get_slice(name), self.reads)

    def get_tensor(self, name: str) -> torch.Tensor:
        raise AssertionError(f"the loader read the whole tensor {name!r}")


@pytest.fixture
def reads(monkeypatch) -> list[Read]:
    """Every read the default loader makes from a safetensors file, in order."""
    recorded: list[Read] = []

    @contextlib.contextmanager
    def recording_safe_open(path: str, framework: str) -> Iterator[RecordingFile]:
        with safe_open(path, framework=framework) as file:
            yield RecordingFile(file, recorded)

    monkeypatch.setattr(default_loader, "safe_open", recording_safe_open)
    return recorded


def load_lazily(model: nn.Module, folder: Path) -> nn.Module:
    DefaultModelLoader().load_weights(model, str(folder))
    return model


def load_whole_tensors(model: nn.Module, folder: Path) -> nn.Module:
    """The load as it was before: every tensor read whole, then cut by the weight_loaders."""
    tensors = load_file(str(folder / "model.safetensors"))
    assert model.load_weights(tensors.items()) == {name for name, _ in model.named_parameters()}
    return model


def assert_same_parameters(first: nn.Module, second: nn.Module) -> None:
    second_params = dict(second.named_parameters())
    for name, param in first.named_parameters():
        assert torch.equal(param, second_params[name]), name


def tensor_bytes(folder: Path) -> dict[str, int]:
    return {name: tensor.nbytes for name, tensor in load_file(str(folder / "model.safetensors")).items()}


def test_narrow_reads_nothing_and_materialize_reads_only_the_narrowed_range():
    full = torch.arange(24.0).reshape(4, 6)
    indices: list[tuple[slice, ...]] = []

    def read(index: tuple[slice, ...]) -> torch.Tensor:
        indices.append(index)
        return full[index]

    lazy = CheckpointTensor(read, full.shape, full.dtype)
    part = lazy.narrow(0, 1, 2).narrow(1, 3, 3).narrow(-1, 1, 2)
    assert part.shape == torch.Size([2, 2]) and part.ndim == 2 and part.dtype == torch.float32
    assert indices == []
    assert torch.equal(materialize(part), full.narrow(0, 1, 2).narrow(1, 4, 2))
    assert indices == [(slice(1, 3), slice(4, 6))]
    assert materialize(full) is full  # a plain tensor is already there
    with pytest.raises(IndexError, match="outside dim 1 of size 6"):
        lazy.narrow(1, 4, 3)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_a_tp_rank_reads_only_its_shard_of_each_split_tensor_and_gets_the_same_weights(tiny_llama_dir, reads, tp_rank):
    """Tiny Llama at TP 2 everywhere (attention, dense FFN, embedding, LM head): each tensor is read
    once, half of it except the replicated norms, and never whole (RecordingFile.get_tensor)."""
    config = LlamaConfig.from_pretrained(tiny_llama_dir)
    group = ParallelGroup("tp", tp_rank, 2)
    parallel = ModelParallel(attn_tp=group, dense_tp=group, embed_tp=group, lmhead_tp=group)
    lazy = load_lazily(LlamaForCausalLM(config, parallel=parallel, backend=cpu_backend()), tiny_llama_dir)

    full_bytes = tensor_bytes(tiny_llama_dir)
    assert sorted(read.name for read in reads) == sorted(full_bytes)
    for read in reads:
        share = 1 if read.name.endswith("norm.weight") else 2
        assert read.nbytes * share == full_bytes[read.name], read
    rows = config.vocab_size // 2
    assert next(read.index for read in reads if read.name == "model.embed_tokens.weight") == (
        slice(tp_rank * rows, (tp_rank + 1) * rows),
        slice(0, config.hidden_size),
    )
    assert_same_parameters(
        lazy, load_whole_tensors(LlamaForCausalLM(config, parallel=parallel, backend=cpu_backend()), tiny_llama_dir)
    )


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_an_ep_rank_never_reads_another_ranks_experts(tmp_path, reads, ep_rank):
    """Qwen3-MoE's 8 experts over EP 2: rank r reads experts 4r..4r+3 and no tensor of the others."""
    config = qwen_config("qwen3_moe")
    save_qwen_checkpoint(tmp_path, config)
    parallel = ModelParallel(moe_ep=ParallelGroup("moe_ep", ep_rank, 2))
    lazy = load_lazily(Qwen3MoeForCausalLM(config, parallel=parallel, backend=cpu_backend()), tmp_path)

    local = range(4 * ep_rank, 4 * ep_rank + 4)
    experts_read = {int(read.name.split(".experts.")[1].split(".")[0]) for read in reads if ".experts." in read.name}
    assert experts_read == set(local)
    assert_same_parameters(
        lazy, load_whole_tensors(Qwen3MoeForCausalLM(config, parallel=parallel, backend=cpu_backend()), tmp_path)
    )


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_gpt_oss_stacked_experts_are_read_for_this_ep_ranks_experts_only(tmp_path, reads, ep_rank):
    """gpt-oss stores each layer's experts stacked in one tensor: an EP rank reads its rows only."""
    config = gpt_oss_config()
    save_gpt_oss_checkpoint(tmp_path, config)
    local_experts = config.num_local_experts // 2
    parallel = ModelParallel(moe_ep=ParallelGroup("moe_ep", ep_rank, 2))
    lazy = load_lazily(GptOssForCausalLM(config, parallel=parallel, backend=cpu_backend()), tmp_path)

    first = ep_rank * local_experts
    stacked_reads = [read for read in reads if ".mlp.experts." in read.name]
    assert stacked_reads
    for read in stacked_reads:
        assert first <= read.index[0].start and read.index[0].stop <= first + local_experts, read
    assert_same_parameters(
        lazy, load_whole_tensors(GptOssForCausalLM(config, parallel=parallel, backend=cpu_backend()), tmp_path)
    )
