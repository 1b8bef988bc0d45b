"""Linear layers shaped for tensor parallelism, after vLLM/nano-vllm.

Each rank holds one shard of the weight; every parameter carries a `weight_loader(param,
loaded_weight, shard_id=None)` that cuts this rank's shard out of the full checkpoint tensor (and
reads only that shard from the file when handed a CheckpointTensor), so model loaders never know how
a layer is split. Column layers split the output dim and need no
communication; RowParallelLinear splits the input dim and all-reduces its partial sums over the
layer's own group (module/parallel_group.py), never the default one.
"""

from __future__ import annotations

import torch
from torch import nn

from executor.types_.errors import WeightLoadError
from module.parallel_group import SINGLE, ParallelGroup
from module.quantized import QuantizableLinear, load_quant_part, load_quant_tensor, quant_param
from module.weights import LoadedWeight, ShardId, load_shard, set_weight_loader
from ops.linear_method import PLAIN, LinearMethod


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} does not split evenly over tp_size={denominator}")
    return numerator // denominator


class LinearBase(QuantizableLinear, nn.Module):
    """y = x W^T + b with W [output_size, input_size] already cut to this rank's shard, multiplied by
    the layer's LinearMethod (its backend's for its weight scheme: ops/linear_method.py), which may
    keep a copy of W laid out for its kernel in `packed_weight` (a plain attribute, in no state_dict).
    A quantized scheme (set_scheme, module/quantized.py) adds its scales beside W."""

    linear_method: LinearMethod
    bias: nn.Parameter | None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp_dim: int,
        tp: ParallelGroup,
        linear_method: LinearMethod = PLAIN,
    ) -> None:
        super().__init__()
        self.linear_method = linear_method
        self.packed_weight = None
        self.tp_dim = tp_dim
        self.tp = tp
        self.tp_rank = tp.rank
        self.tp_size = tp.size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        quant = quant_param(param)
        if quant is not None:
            load_quant_tensor(param.data, loaded_weight, quant, self.tp_rank, self.tp_size)
            return
        # The bias follows the weight's split on the output dim and is replicated on the input dim.
        dim = None if param is self.bias and self.tp_dim == 1 else self.tp_dim
        load_shard(param.data, loaded_weight, dim, self.tp_rank, self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks; each rank's output is its own slice."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: ParallelGroup = SINGLE,
        linear_method: LinearMethod = PLAIN,
    ) -> None:
        super().__init__(input_size, divide(output_size, tp.size), bias, 0, tp, linear_method)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column layers fused along the output dim (gate_proj + up_proj), loaded one shard at a time."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp: ParallelGroup = SINGLE,
        linear_method: LinearMethod = PLAIN,
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp, linear_method)

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        assert isinstance(shard_id, int), "a merged layer is loaded one shard (by index) at a time"
        offset = divide(sum(self.output_sizes[:shard_id]), self.tp_size)
        size = divide(self.output_sizes[shard_id], self.tp_size)
        quant = quant_param(param)
        if quant is None:
            load_shard(param.data.narrow(0, offset, size), loaded_weight, 0, self.tp_rank, self.tp_size)
        else:  # the part's rows of the weight, its scales and zero points; the shared input scale
            load_quant_part(param.data, loaded_weight, quant, offset, size, self.tp_rank, self.tp_size)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections in one matmul; heads (not features) are split over ranks. `parts` names
    the projections it holds, in order: "qkv", or fewer where a layer has no v ("qk": values are
    the keys' projection) or no k and v ("q": the layer reads another layer's K/V)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        tp: ParallelGroup = SINGLE,
        linear_method: LinearMethod = PLAIN,
        parts: str = "qkv",
    ) -> None:
        assert parts in ("qkv", "qk", "q"), f"QKV parts must be 'qkv', 'qk' or 'q', got {parts!r}"
        self.parts = parts
        self.num_heads = divide(total_num_heads, tp.size)
        self.num_kv_heads = divide(total_num_kv_heads, tp.size)
        kv_size = total_num_kv_heads * head_dim
        sizes = {"q": total_num_heads * head_dim, "k": kv_size, "v": kv_size}
        super().__init__(hidden_size, [sizes[part] for part in parts], bias, tp, linear_method)

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        if shard_id not in tuple(self.parts):
            raise WeightLoadError(f"QKV shard {shard_id!r} is not one of this projection's parts {self.parts!r}")
        super().weight_loader(param, loaded_weight, self.parts.index(shard_id))


class RowParallelLinear(LinearBase):
    """Input features split over ranks; partial products are summed with an all-reduce.

    The bias is replicated and added on rank 0 only, so the all-reduce adds it once. In one process
    (tp_size 1) it makes no group call.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: ParallelGroup = SINGLE,
        linear_method: LinearMethod = PLAIN,
    ) -> None:
        super().__init__(divide(input_size, tp.size), output_size, bias, 1, tp, linear_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.linear_method.apply(self, x, self.bias)
        bias = self.bias if self.tp_rank == 0 else None
        return self.tp.all_reduce(self.linear_method.apply(self, x, bias))
