"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of compressed latents.

Each token's K and V for every head come from one latent: kv_lora_rank values (normed) that
kv_b_proj decompresses into per-head k_nope and v, plus one rope key of qk_rope_head_dim shared by
all heads. The cache keeps only that latent (kv_lora_rank + qk_rope_head_dim per token, not per
head); the attention backend's `mla` attends over it, decompressing per request in prefill and folding
kv_b_proj into the query and output in decode (see ops/attention/reference.py). A C8 cache holds the latent
in int8 as one head: one scale per token (dynamic), or the checkpoint's k_scale (static, as vLLM's
MLA reads it; v_scale is loaded and unused, the latent being the keys and the values both).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

from executor.types_.kv_cache_spec import KVCacheSpec, mla_spec
from module.attention import KVCacheLayer
from module.linear import ColumnParallelLinear, RowParallelLinear, divide
from module.norm import RMSNorm
from module.parallel_group import SINGLE, ParallelGroup
from ops.attention.metadata import ForwardMetaData, cache_writes
from ops.backend import Backend

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rope dims stored as pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...), so that the
    rotate-half rotary of apply_rotary rotates each pair by its frequency. Applied to query and
    key alike, it gives exactly transformers' interleaved rotary output (rope_interleave)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAAttention(KVCacheLayer):
    """Projections named as in DeepSeek checkpoints; heads split over tensor-parallel ranks (q_b_proj
    or q_proj, kv_b_proj, o_proj), the down-projections to the latents replicated."""

    NEEDED_OPS: tuple[str, ...] = ("write_latent_cache", "mla_attention")

    context_parallel = True

    def __init__(self, config: PretrainedConfig, tp: ParallelGroup = SINGLE, *, backend: Backend) -> None:
        super().__init__()
        backend.require(self.NEEDED_OPS, "multi-head latent attention")
        self.ops = backend
        method = backend.linear_method()
        hidden_size, total_heads = config.hidden_size, config.num_attention_heads
        self.num_heads = divide(total_heads, tp.size)
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        self.rope_interleave = self.interleaved_rope(config)
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(
                hidden_size, total_heads * qk_head_dim, bias=False, tp=tp, linear_method=method
            )
        else:
            self.q_a_proj = ColumnParallelLinear(
                hidden_size, self.q_lora_rank, bias=config.attention_bias, linear_method=method
            )
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, backend=backend)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, total_heads * qk_head_dim, bias=False, tp=tp, linear_method=method
            )
        self.kv_a_proj_with_mqa = ColumnParallelLinear(
            hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=config.attention_bias, linear_method=method
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, backend=backend)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank,
            total_heads * (self.qk_nope_head_dim + self.v_head_dim),
            bias=False,
            tp=tp,
            linear_method=method,
        )
        self.kv_b_proj.reads_dense_weight = True  # mla_attention multiplies its weight itself
        self.o_proj = RowParallelLinear(
            total_heads * self.v_head_dim, hidden_size, bias=config.attention_bias, tp=tp, linear_method=method
        )
        self.scale = self.softmax_scale(config, qk_head_dim)
        self.cache_dtype = backend.dtype
        self.latent_cache = torch.empty(0)
        self.latent_scale_cache: torch.Tensor | None = None  # a dynamic C8 cache's scales [N, block, 1]

    @staticmethod
    def interleaved_rope(config: PretrainedConfig) -> bool:
        """Whether the rope dims come as interleaved pairs: the config's rope_interleave (DeepSeek-V3's)."""
        return config.rope_interleave

    def project_query(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [T, hidden] -> (every head's query [T, heads * qk_head_dim], through the q LoRA or
        q_proj; the q LoRA's normed latent [T, q_lora_rank], which DSA's indexer reads, or None)."""
        if self.q_lora_rank is None:
            return self.q_proj(hidden_states), None
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
        return self.q_b_proj(q_resid), q_resid

    def normed_latent(self, latent: torch.Tensor) -> torch.Tensor:
        """The compressed KV [T, kv_lora_rank] as cached and decompressed: kv_a_layernorm's output."""
        return self.kv_a_layernorm(latent)

    @staticmethod
    def softmax_scale(config: PretrainedConfig, qk_head_dim: int) -> float:
        """qk_head_dim^-1/2, times yarn's mscale as in transformers (a no-op for other rope types)."""
        return yarn_apply_mscale(config.rope_parameters, qk_head_dim**-0.5)

    def rotate(
        self, q_pe: torch.Tensor, k_pe: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rope parts of the queries [T, heads, R] and of the shared key [T, 1, R], rotated."""
        if self.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        return self.ops.apply_rotary(q_pe, k_pe, *rotary)

    def gate_output(self, output: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """The attention output [T, heads, v_head_dim] before o_proj; a gated variant scales it here."""
        return output

    def kv_cache_spec(self) -> KVCacheSpec:
        return mla_spec(self.kv_lora_rank, self.qk_rope_head_dim, self.cache_dtype, self.kv_scheme)

    def static_scale_shape(self) -> tuple[int, int]:
        return (1, self.kv_lora_rank + self.qk_rope_head_dim)

    def latent_scale(self) -> torch.Tensor | None:
        """The ops' latent_scale: the scale cache (dynamic C8), the static k_scale, or None."""
        if self.kv_scheme is None or self.kv_scheme.dynamic:
            return self.latent_scale_cache
        return self.k_scale

    def bind_kv_cache(self, caches: dict[str, torch.Tensor], group_id: int) -> None:
        latent_cache = caches["latent"]
        scales = caches.get("latent_scale")
        self.latent_scale_cache = None if scales is None else scales.unsqueeze(-1)
        width = self.kv_lora_rank + self.qk_rope_head_dim
        assert latent_cache.dim() == 3 and latent_cache.shape[2] == width, (
            f"MLA cache must be [num_blocks, block_size, {width}], got {tuple(latent_cache.shape)}"
        )
        self.latent_cache = latent_cache
        self.kv_cache_group_id = group_id

    def kv_caches(self) -> dict[str, torch.Tensor]:
        if self.latent_scale_cache is None:
            return {"latent": self.latent_cache}
        return {"latent": self.latent_cache, "latent_scale": self.latent_scale_cache.squeeze(-1)}

    @property
    def kv_b_weight(self) -> torch.Tensor:
        """kv_b_proj's dense weight, which the attention absorbs (ops/attention's LatentLayer)."""
        return self.kv_b_proj.weight

    def forward(
        self, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], forward_metadata: ForwardMetaData
    ) -> torch.Tensor:
        """hidden [T, hidden], rotary (cos, sin) [T, qk_rope_head_dim] -> [T, hidden]."""
        q_nope, q_pe, _ = self.project_and_cache(hidden_states, rotary, forward_metadata)
        output = self.ops.attention.mla(self, q_nope, q_pe, forward_metadata)
        return self.o_proj(self.gate_output(output, hidden_states).flatten(1))

    def project_and_cache(
        self, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], forward_metadata: ForwardMetaData
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The step's queries, rotated, and its latents written to the cache -> (q_nope [T, H, nope],
        q_pe [T, H, R], the q LoRA's normed latent [T, q_lora_rank] or None without q LoRA), which
        DSA's indexer reads too."""
        if self.kv_cache_group_id < 0:
            raise RuntimeError("MLAAttention has no KV cache: the worker must call bind_kv_cache before forward")
        query, q_resid = self.project_query(hidden_states)
        q_nope, q_pe = query.view(-1, self.num_heads, query.shape[-1] // self.num_heads).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1
        )
        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = self.rotate(q_pe, k_pe.unsqueeze(1), rotary)  # k_pe [T, 1, R]: one rope key for every head
        # The cached latent is kv_b_proj's input: quantized as its scheme quantizes inputs (a no-op
        # unquantized), which the absorbed decode and the decompressing prefill then both read.
        latent = self.kv_b_proj.linear_method.quantize_input(self.kv_b_proj, self.normed_latent(latent))
        (rows,), slots = cache_writes(
            forward_metadata, self.kv_cache_group_id, torch.cat((latent, k_pe.squeeze(1)), -1)
        )
        self.ops.attention.write_latent_cache(rows, self.latent_cache, slots, self.latent_scale())
        return q_nope, q_pe, q_resid
