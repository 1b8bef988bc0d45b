"""gpt-oss (every checkpoint that loads as transformers' GptOssForCausalLM, bf16 or fp32) on Llama's
skeleton: the same embedding, pre-norm blocks, biased q/k/v/o projections and YaRN rope table
(module/rotary.py computes it with transformers' own function, `truncate` included), with

- attention sinks (a learned logit per head in every softmax denominator, module.attention.Attention with sinks),
- a sliding window on the layers `config.layer_types` marks "sliding_attention" (a cache group of their own),
- an MoE block in every layer: a biased linear router (top-k logits, softmax over the chosen) and
  experts with biases and a clamped SwiGLU, stacked as module/moe.py stacks them.

The released checkpoints hold the experts in gpt-oss's own MXFP4 format (`*_blocks` / `*_scales`,
quant_method "mxfp4"): they are dequantized once at load into the stacked float experts, as
transformers' Mxfp4Config(dequantize=True) does. A compressed-tensors checkpoint may quantize the
attention projections (Linear modules); the experts are 3-D tensors there and stay unquantized.

Parity with transformers: tests/test_gpt_oss_parity.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GptOssConfig

from executor.types_.checkpoint_tensor import LoadedWeight, materialize
from executor.types_.errors import WeightLoadError
from executor.types_.quant_scheme import LinearScheme
from models.llama.model import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from module.attention import Attention
from module.moe import FusedExperts, Router
from module.mtp import num_mtp_layers_of
from module.parallel_group import ONE_PROCESS, ModelParallel, ParallelGroup
from module.quantized import QuantizationError
from module.weights import ShardId, load_shard
from ops import quant_math
from ops.backend import Backend

LAYER_TYPES = ("sliding_attention", "full_attention")
NEEDED_OPS = ("paged_attention_with_sinks", "moe_experts_clamped_swiglu")


class GptOssAttention(LlamaAttention):
    """Llama's attention (q/k/v/o biased as config.attention_bias says) with sinks, and with the
    config's sliding window on the layers config.layer_types marks sliding."""

    @staticmethod
    def layer_sliding_window(config: GptOssConfig, layer_index: int) -> int | None:
        return config.sliding_window if config.layer_types[layer_index] == "sliding_attention" else None

    def build_attention(self, config: GptOssConfig, sliding_window: int | None, parallel: ModelParallel) -> Attention:
        return Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale=self.head_dim**-0.5,
            sliding_window=sliding_window,
            sinks=True,
            tp=parallel.attn_tp,
            backend=self.ops,
        )


class GptOssRouter(Router):
    """logits = x W^T + b; the top_k logits of each token, softmaxed among themselves, are its
    weights. Op for op as transformers' GptOssTopKRouter (in the model's dtype, torch.topk), so
    that ties between equal logits break the same way. Every rank holds it whole."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"router: num_experts_per_tok {top_k} must be in [1, num_local_experts {num_experts}]")
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states [T, H] -> (weights [T, top_k], expert ids [T, top_k])."""
        top_logits, topk_ids = torch.topk(F.linear(hidden_states, self.weight, self.bias), self.top_k, dim=-1)
        return F.softmax(top_logits, dim=1, dtype=top_logits.dtype), topk_ids


class GptOssExperts(FusedExperts):
    """FusedExperts' stacked layout ([E, 2I, H] gate rows then up rows, [E, H, I]) plus biases, run
    with clamped_swiglu(alpha, limit). Checkpoints store each projection stacked and transposed,
    gate_up_proj [E, H, 2I] with gate and up interleaved (even and odd columns) and down_proj
    [E, I, H]; the loaders de-interleave and transpose them into place, one expert at a time
    through FusedExperts.load_expert_weight."""

    NEEDED_OPS = ("moe_experts_clamped_swiglu",)

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        alpha: float,
        limit: float,
        tp: ParallelGroup,
        ep: ParallelGroup,
        backend: Backend,
    ) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, tp, ep, backend=backend)
        self.alpha = alpha
        self.limit = limit
        size = self.intermediate_per_rank
        local = self.num_local_experts
        self.gate_up_proj_bias = nn.Parameter(torch.empty(local, 2 * size), requires_grad=False)
        # Replicated, but added on rank 0 only (zeros elsewhere), so the all-reduce adds it once.
        self.down_proj_bias = nn.Parameter(torch.empty(local, hidden_size), requires_grad=False)
        self.gate_up_proj.weight_loader = self.load_gate_up_proj
        self.down_proj.weight_loader = self.load_down_proj
        self.gate_up_proj_bias.weight_loader = self.load_gate_up_proj_bias
        self.down_proj_bias.weight_loader = self.load_down_proj_bias

    def _check_experts(self, loaded_weight: LoadedWeight, ndim: int) -> None:
        if loaded_weight.ndim != ndim or loaded_weight.shape[0] != self.num_experts:
            raise WeightLoadError(
                f"expected {self.num_experts} stacked experts ({ndim} dims), got shape {tuple(loaded_weight.shape)}"
            )

    def _local_rows(self, stacked: LoadedWeight) -> torch.Tensor:
        """This EP rank's experts of a tensor stacked over all experts (the others are not read)."""
        return materialize(stacked.narrow(0, self.first_expert, self.num_local_experts))

    def _local_experts(self, stacked: LoadedWeight) -> Iterator[tuple[int, torch.Tensor]]:
        """(expert id, its tensor) for this EP rank's experts, read one at a time; the others are not read."""
        for expert in range(self.first_expert, self.first_expert + self.num_local_experts):
            yield expert, materialize(stacked.narrow(0, expert, 1))[0]

    def load_gate_up_proj(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        self._check_experts(loaded_weight, 3)
        for expert, weight in self._local_experts(loaded_weight):  # weight [H, 2I]
            self.load_expert_weight(weight[:, ::2].T, expert, "gate_proj")
            self.load_expert_weight(weight[:, 1::2].T, expert, "up_proj")

    def load_down_proj(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        self._check_experts(loaded_weight, 3)
        for expert, weight in self._local_experts(loaded_weight):  # weight [I, H]
            self.load_expert_weight(weight.T, expert, "down_proj")

    def load_gate_up_proj_bias(
        self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None
    ) -> None:
        self._check_experts(loaded_weight, 2)
        gate, up = param.data.chunk(2, dim=1)
        local = self._local_rows(loaded_weight)
        load_shard(gate, local[:, ::2], 1, self.tp_rank, self.tp_size)
        load_shard(up, local[:, 1::2], 1, self.tp_rank, self.tp_size)

    def load_down_proj_bias(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        self._check_experts(loaded_weight, 2)
        load_shard(param.data, self._local_rows(loaded_weight), None, 0, 1)
        if self.tp_rank != 0:
            param.data.zero_()

    def checkpoint_modules(self, name: str) -> list[tuple[str, str]]:
        """gpt-oss checkpoints stack the experts in one module (no per-expert Linear to target)."""
        return [(name, "GptOssExperts")]

    def set_scheme(self, scheme: LinearScheme, method: object, compute_dtype: torch.dtype, at_load: bool) -> None:
        raise QuantizationError(
            f"gpt-oss's experts are quantized only in gpt-oss's own MXFP4 format (quant_method mxfp4), "
            f"not by a plan ({scheme.describe()}); add the experts to the ignore list"
        )

    def run_dense_experts(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return self.ops.moe_experts_clamped_swiglu(
            hidden_states,
            topk_weights,
            topk_ids,
            self.gate_up_proj,
            self.gate_up_proj_bias,
            self.down_proj,
            self.down_proj_bias,
            self.alpha,
            self.limit,
        )


class GptOssMoE(nn.Module):
    def __init__(self, config: GptOssConfig, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__()
        self.router = GptOssRouter(config.hidden_size, config.num_local_experts, config.num_experts_per_tok)
        self.experts = GptOssExperts(
            config.num_local_experts,
            config.hidden_size,
            config.intermediate_size,
            config.swiglu_alpha,
            config.swiglu_limit,
            parallel.moe_tp,
            parallel.moe_ep,
            backend,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens, own = self.experts.gather_tokens(hidden_states)
        return self.experts(tokens, *self.router(tokens))[own]


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = GptOssAttention

    def build_mlp(self, config: GptOssConfig, layer_index: int, parallel: ModelParallel, backend: Backend) -> nn.Module:
        """An MoE block in every layer."""
        return GptOssMoE(config, parallel, backend)


def check_config(config: GptOssConfig) -> None:
    """Layer types we build, and no MTP modules: no gpt-oss checkpoint has them, and the MTP layer the
    base class would build from a gpt-oss layer is untested."""
    if num_mtp_layers_of(config):
        raise ValueError("config num_nextn_predict_layers: gpt-oss has no MTP modules; remove the key")
    layer_types = list(config.layer_types)
    if len(layer_types) != config.num_hidden_layers or not set(layer_types) <= set(LAYER_TYPES):
        raise ValueError(
            f"config layer_types must name one of {list(LAYER_TYPES)} for each of the {config.num_hidden_layers} "
            f"layers, got {layer_types}"
        )
    if "sliding_attention" in layer_types and not config.sliding_window:
        raise ValueError(f"config has sliding_attention layers but sliding_window {config.sliding_window!r}")


class GptOssForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = GptOssDecoderLayer

    def __init__(self, hf_config: GptOssConfig, *, parallel: ModelParallel = ONE_PROCESS, backend: Backend) -> None:
        backend.require(NEEDED_OPS, "gpt-oss")
        check_config(hf_config)
        super().__init__(hf_config, parallel=parallel, backend=backend)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (gpt-oss's stacked experts; sinks under self_attn, ours under
        self_attn.attn); returns the parameters that received every shard they need."""
        return super().load_weights(self._renamed(weights))

    @staticmethod
    def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in dequantized_mxfp4(weights):
            yield name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), tensor


MXFP4_PARTS = ("_blocks", "_scales")


def dequantized_mxfp4(weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
    """gpt-oss's MXFP4 experts as the float tensors a bf16 checkpoint holds: each `P_blocks` [E, N, G,
    16] and `P_scales` [E, N, G] pair (in either order) -> `P` [E, K, N] (transposed, as transformers'
    convert_moe_packed_tensors returns it) in the model's dtype; other tensors pass through."""
    pending: dict[str, dict[str, LoadedWeight]] = {}
    for name, tensor in weights:
        part = next((part for part in MXFP4_PARTS if name.endswith(part)), None)
        if part is None:
            yield name, tensor
            continue
        base = name.removesuffix(part)
        parts = pending.setdefault(base, {})
        parts[part] = tensor
        if len(parts) == len(MXFP4_PARTS):
            blocks, scales = (materialize(parts[p]) for p in MXFP4_PARTS)
            del pending[base]
            if blocks.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
                raise WeightLoadError(
                    f"checkpoint tensor {base}_blocks {tuple(blocks.shape)} / _scales {tuple(scales.shape)}: "
                    "expected uint8 [E, N, G, 16] blocks with [E, N, G] scales (gpt-oss's MXFP4)"
                )
            dense = quant_math.dequantize_mxfp4_blocks(blocks, scales, torch.get_default_dtype())
            yield base, dense.transpose(1, 2).contiguous()
    if pending:
        base, parts = next(iter(pending.items()))
        missing = next(part for part in MXFP4_PARTS if part not in parts)
        raise WeightLoadError(f"checkpoint tensor {base}{missing} is missing (its MXFP4 pair is in the checkpoint)")
