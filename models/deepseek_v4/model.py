"""DeepSeek-V4 (every checkpoint that loads as transformers' DeepseekV4ForCausalLM) on the packed TND
path, as transformers defines it.

- Attention: shared-KV multi-query attention (one head of head_dim that is the key and the value),
  q through a normed latent (wq_a, q_norm, wq_b) and an unweighted per-head RMSNorm, interleaved
  partial rope on the trailing dims (undone on the output), a learned sink per head, a grouped
  low-rank output projection (wo_a per group, then wo_b). Each layer is one of three kinds
  (config.layer_types): a sliding window only; plus all the compressed entries closed so far (heavily
  compressed attention, one entry per 128 tokens in V4); plus the entries a lightning indexer picks
  (compressed sparse attention, overlapping windows of 4). Cache layouts and ops: module/compressor.py,
  ops/compressed_kv.py, docs/kv_cache.md.
- Residual: hc_mult streams mixed around every block by hyper-connections (module/hyper_connection.py).
- MoE: sqrt-softplus scored experts with clamped SwiGLU, the first layers routed by a token-id hash
  table (module/hash_router.py), one shared expert.
- MTP: the checkpoints ship num_nextn_predict_layers modules, which transformers does not build
  (it drops their tensors), so neither do we: their tensors are skipped.

Checkpoint names are DeepSeek's (what transformers saves: attn.wq_a, ffn.experts.N.w1, hc_attn_fn, ...);
load_weights maps the few that differ from our modules'. Parity: tests/test_deepseek_v4_parity.py.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from transformers import DeepseekV4Config
from transformers.activations import ACT2FN

from executor.types_.kv_cache_spec import AttentionKind, KVCacheSpec, KVTensorSpec, TPSplit
from executor.types_.quant_scheme import KVCacheScheme
from models.deepseek_v3.model import DeepseekV3ForCausalLM, ShardKey
from module.attention import KVCacheLayer
from module.compressor import Compressor, Indexer
from module.embedding import VocabParallelEmbedding
from module.hash_router import HashRouter, ScoredTopkRouter
from module.hyper_connection import HyperConnection, HyperHead, unweighted_rms_norm
from module.interleaved_rope import InterleavedRope, apply_interleaved_rope
from module.linear import ColumnParallelLinear
from module.mlp import GatedMLP
from module.moe import FusedExperts, SparseMoeBlock
from module.norm import RMSNorm
from module.parallel_group import ModelParallel
from ops.attention.metadata import ForwardMetaData
from ops.backend import Backend
from ops.compressed_kv import token_rows, write_cache_rows

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# DeepSeek's checkpoint names -> ours, where they differ (the rest are our modules' own names).
CHECKPOINT_RENAMES = (
    (re.compile(r"^head\.weight$"), "lm_head.weight"),
    (re.compile(r"^embed\.weight$"), "model.embed_tokens.weight"),
    (re.compile(r"^(layers|norm)\."), r"model.\1."),
    (re.compile(r"^hc_head_(fn|base|scale)$"), r"model.hc_head.hc_\1"),
    (re.compile(r"\.ffn\."), ".mlp."),
    (re.compile(r"\.(experts\.\d+|shared_experts)\.w1\."), r".\1.gate_proj."),
    (re.compile(r"\.(experts\.\d+|shared_experts)\.w3\."), r".\1.up_proj."),
    (re.compile(r"\.(experts\.\d+|shared_experts)\.w2\."), r".\1.down_proj."),
    (re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$"), r".hc_\1.\2"),
)
MTP_TENSOR = re.compile(r"^(model\.)?mtp\.")


def compress_ratio(config: DeepseekV4Config, layer_index: int) -> int:
    """Tokens per compressed entry of the layer; 0 for a sliding-window-only layer."""
    layer_type = config.layer_types[layer_index]
    return 0 if layer_type == SLIDING else config.compress_rates[layer_type]


class DeepseekV4Attention(KVCacheLayer):
    NEEDED_OPS = ("rms_norm", "compressed_kv_attention", "compressed_indexer_topk")

    def __init__(self, config: DeepseekV4Config, layer_index: int, *, backend: Backend) -> None:
        super().__init__()
        backend.require(self.NEEDED_OPS, "DeepSeek-V4 attention")
        self.ops = backend
        method = backend.linear_method()
        layer_type = config.layer_types[layer_index]
        self.ratio = compress_ratio(config, layer_index)
        self.rope_kind = "main" if layer_type == SLIDING else "compress"
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.sliding_window = config.sliding_window
        self.o_groups, self.o_lora_rank = config.o_groups, config.o_lora_rank
        self.norm_eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        self.wq_a = ColumnParallelLinear(hidden, config.q_lora_rank, linear_method=method)
        self.q_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps, backend=backend)
        self.wq_b = ColumnParallelLinear(config.q_lora_rank, self.num_heads * self.head_dim, linear_method=method)
        self.wkv = ColumnParallelLinear(hidden, self.head_dim, linear_method=method)
        self.norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend=backend)
        group_width = self.num_heads * self.head_dim // self.o_groups
        self.wo_a = ColumnParallelLinear(group_width, self.o_groups * self.o_lora_rank, linear_method=method)
        self.wo_a.reads_dense_weight = True  # applied per group to its own rows (grouped_output)
        self.wo_b = ColumnParallelLinear(self.o_groups * self.o_lora_rank, hidden, linear_method=method)
        self.attn_sink = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.compressor = (
            Compressor(
                "compressor", hidden, self.head_dim, self.ratio, layer_type == CSA, config.rms_norm_eps, backend=backend
            )
            if self.ratio
            else None
        )
        self.indexer = Indexer(config, self.ratio, backend=backend) if layer_type == CSA else None
        self.cache_dtype = backend.dtype
        self.caches: dict[str, torch.Tensor] = {}

    def kv_cache_spec(self) -> KVCacheSpec:
        """`kv` per token; a compressed layer adds its compressors' projections and entries and keeps
        everything for the whole sequence (full), a sliding-only layer keeps its window. All of it
        whole on every attention TP rank: the attention's projections are not split (SINGLE)."""
        tensors = [KVTensorSpec("kv", (self.head_dim,), self.cache_dtype, tp_split=TPSplit.WHOLE)]
        for compressor in (self.compressor, self.indexer and self.indexer.compressor):
            if compressor is not None:
                tensors += compressor.spec_tensors(self.cache_dtype)
        if self.ratio:
            return KVCacheSpec(tuple(tensors))
        return KVCacheSpec(tuple(tensors), AttentionKind.SLIDING_WINDOW, self.sliding_window)

    def set_kv_cache_scheme(self, scheme: KVCacheScheme) -> list[nn.Parameter]:
        raise NotImplementedError("an int8 (C8) KV cache is not built for DeepSeek-V4's compressed KV")

    def bind_kv_cache(self, caches: dict[str, torch.Tensor], group_id: int) -> None:
        expected = {tensor.name for tensor in self.kv_cache_spec().tensors}
        assert set(caches) == expected, f"DeepSeek-V4 attention caches must be {sorted(expected)}, got {sorted(caches)}"
        self.caches = caches
        self.kv_cache_group_id = group_id

    def kv_caches(self) -> dict[str, torch.Tensor]:
        return dict(self.caches)

    def forward(
        self,
        hidden_states: torch.Tensor,
        positions: torch.Tensor,
        rope: InterleavedRope,
        forward_metadata: ForwardMetaData,
    ) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]."""
        if self.kv_cache_group_id < 0:
            raise RuntimeError("DeepSeek-V4 attention has no KV cache: the worker must call bind_kv_cache first")
        tables = forward_metadata.groups[self.kv_cache_group_id]
        cos, sin = rope(positions, self.rope_kind, hidden_states.dtype)
        q_latent = self.q_norm(self.wq_a(hidden_states))
        query = self.wq_b(q_latent).view(-1, self.num_heads, self.head_dim)
        query = apply_interleaved_rope(unweighted_rms_norm(query, self.norm_eps), cos, sin)
        kv = apply_interleaved_rope(self.norm(self.wkv(hidden_states)), cos, sin)
        write_cache_rows(kv, self.caches["kv"], tables.slot_mapping)
        entries = selected = None
        if self.compressor is not None:
            rows = token_rows(forward_metadata, hidden_states.shape[0], hidden_states.device)
            where = (tables.block_table, rows, positions, tables.slot_mapping, rope)
            entries = self.compressor(hidden_states, self.caches, *where)
            if self.indexer is not None:
                selected = self.indexer(hidden_states, q_latent, self.caches, *where, forward_metadata)
        output = self.ops.compressed_kv_attention(
            query,
            self.caches["kv"],
            entries,
            tables.block_table,
            forward_metadata,
            positions,
            self.attn_sink,
            self.scale,
            self.sliding_window,
            self.ratio,
            selected,
        )
        output = apply_interleaved_rope(output, cos, -sin)  # K = V carried rope: rotate it back
        return self.wo_b(self.grouped_output(output))

    def grouped_output(self, output: torch.Tensor) -> torch.Tensor:
        """[T, H, D] in o_groups groups of heads, each through its own o_lora_rank rows of wo_a
        -> [T, o_groups * o_lora_rank]."""
        groups = output.reshape(output.shape[0], self.o_groups, -1)
        weight = self.wo_a.weight.view(self.o_groups, self.o_lora_rank, -1)
        return torch.einsum("tgi,goi->tgo", groups, weight.to(groups.dtype)).flatten(1)


class ClampedSiluExperts(FusedExperts):
    """V4's routed experts: silu(min(gate, limit)) * clamp(up, -limit, limit)."""

    NEEDED_OPS = ("moe_experts_clamped_gate_silu",)

    def __init__(self, config: DeepseekV4Config, parallel: ModelParallel, *, backend: Backend) -> None:
        hidden, size = config.hidden_size, config.moe_intermediate_size
        super().__init__(config.n_routed_experts, hidden, size, parallel.moe_tp, parallel.moe_ep, backend=backend)
        self.limit = config.swiglu_limit

    def run_dense_experts(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return self.ops.moe_experts_clamped_gate_silu(
            hidden_states, topk_weights, topk_ids, self.gate_up_proj, self.down_proj, self.limit
        )


class ClampedGatedMLP(GatedMLP):
    """V4's shared expert: GatedMLP with the experts' clamps."""

    def __init__(self, config: DeepseekV4Config, parallel: ModelParallel, *, backend: Backend) -> None:
        size = config.moe_intermediate_size
        super().__init__(config.hidden_size, size, config.hidden_act, tp=parallel.moe_tp, backend=backend)
        self.limit = config.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        gate_up = torch.cat((gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)), dim=-1)
        return self.down_proj(self.ops.silu_and_mul(gate_up))


class DeepseekV4MoE(SparseMoeBlock):
    """Routed experts by a hash or a scored top-k gate (config.mlp_layer_types), plus one shared expert."""

    def __init__(self, config: DeepseekV4Config, layer_index: int, parallel: ModelParallel, backend: Backend) -> None:
        self.is_hash = config.mlp_layer_types[layer_index] == "hash_moe"
        scoring = (config.hidden_size, config.n_routed_experts, config.num_experts_per_tok, config.scoring_func)
        if self.is_hash:
            gate = HashRouter(*scoring, config.routed_scaling_factor, config.vocab_size)
        else:
            gate = ScoredTopkRouter(*scoring, config.routed_scaling_factor)
        super().__init__(
            gate,
            ClampedSiluExperts(config, parallel, backend=backend),
            ClampedGatedMLP(config, parallel, backend=backend),
        )
        if self.is_hash and (parallel.moe_tp.spans_replicas or parallel.moe_ep.spans_replicas):
            raise NotImplementedError("DeepSeek-V4's hash-routed layers with MoE groups across data-parallel replicas")

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.is_hash:
            return super().forward(hidden_states)
        output = self.experts(hidden_states, *self.gate(hidden_states, input_ids))
        return output + self.shared_experts(hidden_states)


class DeepseekV4DecoderLayer(nn.Module):
    """Attention and MoE, each between a hyper-connection's collapse and merge of the streams."""

    def __init__(self, config: DeepseekV4Config, layer_index: int, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__()
        self.attn = DeepseekV4Attention(config, layer_index, backend=backend)
        self.mlp = DeepseekV4MoE(config, layer_index, parallel, backend)
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend=backend)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend=backend)
        hc = (config.hc_mult, config.hidden_size, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
        self.hc_attn = HyperConnection(*hc)
        self.hc_ffn = HyperConnection(*hc)

    def forward(
        self,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rope: InterleavedRope,
        forward_metadata: ForwardMetaData,
    ) -> torch.Tensor:
        """streams [T, hc_mult, hidden] -> the same after attention and MoE."""
        post, comb, block_input = self.hc_attn(streams)
        attention = self.attn(self.attn_norm(block_input), positions, rope, forward_metadata)
        streams = HyperConnection.merge(post, comb, attention, streams)
        post, comb, block_input = self.hc_ffn(streams)
        return HyperConnection.merge(post, comb, self.mlp(self.ffn_norm(block_input), input_ids), streams)


class DeepseekV4Model(nn.Module):
    def __init__(self, config: DeepseekV4Config, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__()
        self.hc_mult = config.hc_mult
        self.num_hidden_layers = config.num_hidden_layers  # decoder layers, no MTP layer after them
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel.embed_tp)
        self.layers = nn.ModuleList(
            [DeepseekV4DecoderLayer(config, index, parallel, backend) for index in range(self.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend=backend)
        self.hc_head = HyperHead(config.hc_mult, config.hidden_size, config.hc_eps, config.rms_norm_eps)
        self.rope = InterleavedRope(config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_metadata: ForwardMetaData
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        streams = hidden_states.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, positions, self.rope, forward_metadata)
        return self.norm(self.hc_head(streams))


class DeepseekV4ForCausalLM(DeepseekV3ForCausalLM):
    """V3's surface (LM head, loading of per-expert tensors) over V4's model; no MTP layers."""

    base_model_cls = DeepseekV4Model  # type: ignore[assignment]
    family = "DeepSeek-V4"
    NEEDED_OPS = (*DeepseekV4Attention.NEEDED_OPS, *ClampedSiluExperts.NEEDED_OPS, "silu_and_mul")
    mtp_absent_reason = "DeepSeek-V4's MTP modules are not built: transformers does not define them"

    @classmethod
    def mtp_layers_to_build(cls, config: DeepseekV4Config) -> int:
        return 0

    @staticmethod
    def check_config(config: DeepseekV4Config) -> None:
        """Refuse, before anything is built, what transformers' V4 would build otherwise than we do."""
        rope_dim = config.qk_rope_head_dim
        problems = {
            "hidden_act": (config.hidden_act != "silu", "'silu' only"),
            "scoring_func": (config.scoring_func not in ACT2FN, "an activation transformers knows"),
            "o_groups": (config.num_attention_heads % config.o_groups != 0, "dividing num_attention_heads"),
            "index_head_dim": (config.index_head_dim < rope_dim, f">= the rope dims ({rope_dim})"),
            "num_key_value_heads": (config.num_key_value_heads != 1, "1 (one shared key-value head)"),
        }
        for key, (wrong, wanted) in problems.items():
            if wrong:
                raise ValueError(f"config {key} {getattr(config, key)!r}: DeepSeek-V4 is built with {wanted}")

    def mtp_layer(self, layer: int) -> nn.Module:
        raise IndexError("DeepSeek-V4's MTP modules are not built (transformers does not define them)")

    def _is_skipped(self, checkpoint_name: str) -> bool:
        return MTP_TENSOR.match(checkpoint_name) is not None or super()._is_skipped(checkpoint_name)

    def _load_tensor(
        self, checkpoint_name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]
    ) -> tuple[str, ShardKey]:
        for pattern, replacement in CHECKPOINT_RENAMES:
            checkpoint_name = pattern.sub(replacement, checkpoint_name)
        return super()._load_tensor(checkpoint_name, tensor, params)
