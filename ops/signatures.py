"""Each op kind's signature, as a typed callable alias: what a field of the backend record (ops/backend.py)
holds, so that the type checker (tests/test_type_check.py) holds every backend's form of an op, and every
layer's call of it, to the reference's parameters. The attention's kinds are typed by ops/attention/.

Parameter names and meanings are the reference's (ops/torch_ref.py, ops/recurrent_ref.py, ops/kda.py,
ops/sparse_attention.py, ops/compressed_kv.py); trailing optional parameters are left out where no
layer passes them.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from ops.attention.metadata import ForwardMetaData, RecurrentStateTables

# scores [rows, V] -> each row's first maximum [rows]
ArgmaxOp = Callable[[Tensor], Tensor]
# (x, weight, eps) -> normed x
NormOp = Callable[[Tensor, Tensor, float], Tensor]
# (x, residual, weight, eps) -> (normed x + residual, x + residual)
AddNormOp = Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
# (query [T, H, D], key [T, Hkv, D], cos, sin [T, D]) -> rotated (query, key)
RotaryOp = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
# [T, 2I] -> [T, I], the gate first
GatedActivationOp = Callable[[Tensor], Tensor]
# ([T, 2I], limit) -> [T, I]
ClampedActivationOp = Callable[[Tensor, float], Tensor]
# (hidden_states, topk_weights, topk_ids, gate_up_proj, down_proj) -> [T, H]
ExpertsOp = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
# ExpertsOp's, then limit
ClampedExpertsOp = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, float], Tensor]
# (hidden_states, topk_weights, topk_ids, gate_up_proj, gate_up_bias, down_proj, down_bias, alpha, limit)
BiasedClampedExpertsOp = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float, float], Tensor]
# (hidden_states, topk_weights, topk_ids, gate_up_t, gate_up_scale, down_t, down_scale, gate_up_input_scale,
# down_input_scale)
Int8ExpertsOp = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None], Tensor]
# DSA: (query, weights, index_cache, block_table, metadata, softmax_scale, topk, index_scale) -> [T, topk]
IndexerTopkOp = Callable[[Tensor, Tensor, Tensor, Tensor, ForwardMetaData, float, int, Tensor | None], Tensor]
# DSA: (q_nope, q_pe, latent_cache, kv_b_weight, block_table, topk_indices, metadata, scale, latent_scale)
SparseMlaOp = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, ForwardMetaData, float, Tensor | None], Tensor]
# DeepSeek-V4: (query, kv_cache, entry_cache, block_table, metadata, positions, sinks, scale, sliding_window,
# ratio, selected)
CompressedKVAttentionOp = Callable[
    [Tensor, Tensor, Tensor | None, Tensor, ForwardMetaData, Tensor, Tensor, float, int, int, Tensor | None],
    Tensor,
]
# DeepSeek-V4: (query, head_weights, index_cache, block_table, metadata, positions, ratio, top_k, softmax_scale)
CompressedIndexerTopkOp = Callable[[Tensor, Tensor, Tensor, Tensor, ForwardMetaData, Tensor, int, int, float], Tensor]
# the short conv over state slots: (x, weight, conv_cache, tables, activation)
CausalConvOp = Callable[[Tensor, Tensor, Tensor, RecurrentStateTables, str | None], Tensor]
# the gated delta rule: (query, key, value, g, beta, state_cache, tables, use_qk_l2norm)
GatedDeltaRuleOp = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, RecurrentStateTables, bool], Tensor]
# (x, gate, weight, eps) -> normed x times silu(gate)
GatedNormOp = Callable[[Tensor, Tensor, Tensor, float], Tensor]
# Kimi delta attention: (query, key, value, gate, beta, state_cache, tables)
KdaOp = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, RecurrentStateTables], Tensor]
