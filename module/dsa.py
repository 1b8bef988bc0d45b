"""DeepSeek sparse attention (DSA; DeepSeek-V3.2, GLM-5): MLA that attends only to the tokens a
lightning indexer selects for each query.

The indexer projects the q LoRA's normed latent to index_n_heads queries and the hidden state to one
key of index_head_dim (LayerNorm'd), ropes the first qk_rope_head_dim dims of both (as half-split
pairs in DeepSeek-V3.2, interleaved in GLM-5), keeps the key in a cache tensor of its own
(`index_key`, beside MLA's `latent`), and scores every cached token of the request
(ops/sparse_attention.py); the index_topk best are the only latents the attention gathers. GLM-5's
"shared" layers run no indexer and keep no indexer key: they reuse the selection of the full layer
before them, which the model carries from layer to layer (forward_with_selection).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from executor.types_.kv_cache_spec import KVCacheSpec, dsa_spec
from module.linear import ColumnParallelLinear
from module.mla import MLAAttention, deinterleave
from module.parallel_group import SINGLE, ParallelGroup
from ops.attention.metadata import ForwardMetaData, cache_writes, group_block_table
from ops.backend import Backend

INDEXER_NORM_EPS = 1e-6  # transformers' DeepseekV32Indexer.k_norm


class LightningIndexer(nn.Module):
    """The indexer's projections, named as in the checkpoints (wq_b, wk, k_norm, weights_proj), all
    replicated on every rank (they are small beside MLA's). weights_proj is kept in fp32, as
    transformers keeps it (_keep_in_fp32_modules)."""

    def __init__(self, config: PretrainedConfig, interleaved_rope: bool, *, backend: Backend) -> None:
        super().__init__()
        self.ops = backend
        method = backend.linear_method()
        self.num_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = config.index_topk
        self.interleaved_rope = interleaved_rope
        self.softmax_scale = self.head_dim**-0.5
        self.wq_b = ColumnParallelLinear(
            config.q_lora_rank, self.num_heads * self.head_dim, bias=False, linear_method=method
        )
        self.wk = ColumnParallelLinear(config.hidden_size, self.head_dim, bias=False, linear_method=method)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False, dtype=torch.float32)

    def forward(
        self,
        hidden_states: torch.Tensor,
        q_resid: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        forward_metadata: ForwardMetaData,
        group_id: int,
        index_cache: torch.Tensor,
        index_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """Write the step's indexer keys into cache group `group_id`, then select -> [T, index_topk]
        positions (-1: none)."""
        query = self.wq_b(q_resid).view(-1, self.num_heads, self.head_dim)
        key = self.k_norm(self.wk(hidden_states)).unsqueeze(1)  # [T, 1, D]
        split = [self.rope_dim, self.head_dim - self.rope_dim]
        q_rot, q_pass = query.split(split, dim=-1)
        k_rot, k_pass = key.split(split, dim=-1)
        if self.interleaved_rope:  # the same permutation of both: their dot products are unchanged
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q_rot, k_rot = self.ops.apply_rotary(q_rot, k_rot, *rotary)
        query = torch.cat((q_rot, q_pass), dim=-1)
        key = torch.cat((k_rot, k_pass), dim=-1).squeeze(1)
        (rows,), slots = cache_writes(forward_metadata, group_id, key)
        self.ops.attention.write_latent_cache(rows, index_cache, slots, index_scale)
        weights = F.linear(hidden_states.float(), self.weights_proj.weight) * self.num_heads**-0.5
        return self.ops.indexer_topk(
            query,
            weights,
            index_cache,
            group_block_table(forward_metadata, group_id),
            forward_metadata,
            self.softmax_scale,
            self.topk,
            index_scale,
        )


class SparseMLAAttention(MLAAttention):
    """MLA over the indexer's selection: its own indexer (`has_indexer`), or the selection handed
    in by the layer before (GLM-5's shared layers)."""

    NEEDED_OPS = (*MLAAttention.NEEDED_OPS, "indexer_topk", "sparse_mla_attention")

    def __init__(
        self,
        config: PretrainedConfig,
        tp: ParallelGroup = SINGLE,
        *,
        has_indexer: bool,
        interleaved_indexer_rope: bool,
        backend: Backend,
    ) -> None:
        super().__init__(config, tp, backend=backend)
        backend.require(self.NEEDED_OPS, "DeepSeek sparse attention")
        self.indexer = LightningIndexer(config, interleaved_indexer_rope, backend=backend) if has_indexer else None
        self.index_cache = torch.empty(0)
        self.index_scale_cache: torch.Tensor | None = None  # a dynamic C8 indexer cache's scales [N, block, 1]

    @staticmethod
    def interleaved_rope(config: PretrainedConfig) -> bool:
        """transformers' DSA attention always ropes MLA's dims as interleaved pairs (no rope_interleave key)."""
        return True

    def kv_cache_spec(self) -> KVCacheSpec:
        index_head_dim = None if self.indexer is None else self.indexer.head_dim
        return dsa_spec(self.kv_lora_rank, self.qk_rope_head_dim, index_head_dim, self.cache_dtype, self.kv_scheme)

    def bind_kv_cache(self, caches: dict[str, torch.Tensor], group_id: int) -> None:
        super().bind_kv_cache(caches, group_id)
        if self.indexer is not None:
            self.index_cache = caches["index_key"]
            scales = caches.get("index_key_scale")
            self.index_scale_cache = None if scales is None else scales.unsqueeze(-1)

    def kv_caches(self) -> dict[str, torch.Tensor]:
        caches = super().kv_caches()
        if self.indexer is not None:
            caches["index_key"] = self.index_cache
            if self.index_scale_cache is not None:
                caches["index_key_scale"] = self.index_scale_cache.squeeze(-1)
        return caches

    def forward(
        self, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], forward_metadata: ForwardMetaData
    ) -> torch.Tensor:
        return self.forward_with_selection(hidden_states, rotary, forward_metadata, None)[0]

    def forward_with_selection(
        self,
        hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        forward_metadata: ForwardMetaData,
        shared_selection: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] -> ([T, hidden], the selection [T, index_topk] it attended over)."""
        q_nope, q_pe, q_resid = self.project_and_cache(hidden_states, rotary, forward_metadata)
        if self.indexer is None:
            if shared_selection is None:
                raise RuntimeError("a shared DSA layer needs the selection of a full indexer layer before it")
            selection = shared_selection
        else:
            selection = self.indexer(
                hidden_states,
                q_resid,
                rotary,
                forward_metadata,
                self.kv_cache_group_id,
                self.index_cache,
                self.index_scale_cache,
            )
        output = self.ops.sparse_mla_attention(
            q_nope,
            q_pe,
            self.latent_cache,
            self.kv_b_proj.weight,
            group_block_table(forward_metadata, self.kv_cache_group_id),
            selection,
            forward_metadata,
            self.scale,
            self.latent_scale(),
        )
        return self.o_proj(output.flatten(1)), selection
