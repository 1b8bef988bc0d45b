"""LongCat-Flash (every checkpoint that loads as transformers' LongcatFlashForCausalLM) as
models/deepseek_v3/'s classes with what LongCat does otherwise.

- Each of the num_layers decoder layers holds two attention blocks, each followed by its own dense
  MLP, and one MoE block fed from the first attention block's normed output whose result joins the
  residual stream only at the layer's end (the shortcut-connected MoE).
- MLA as DeepSeek's with a q LoRA always, rope always on interleaved pairs, and LoRA scaling: the
  query times sqrt(hidden / q_lora_rank), the normed latent (as cached) times sqrt(hidden / kv_lora_rank).
- The router picks from the routed experts and zero_expert_num zero-computation experts, which return
  their input: softmax scores over all of them, a score-correction bias that steers the choice but not
  the weights, weights times routed_scaling_factor, never renormalised. No shared experts.
- MTP: LongCat's checkpoints carry one module under model.mtp (its own embedding, enorm / hnorm /
  eh_proj, one block of MLA and a dense MLP, a final norm), which module/mtp.py drives as DeepSeek's;
  transformers defines none. Parity with transformers: tests/test_longcat_flash_parity.py; the MTP
  against a plain reference: tests/test_longcat_flash_mtp.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LongcatFlashConfig

from models.deepseek_v3.model import DeepseekV3ForCausalLM, DeepseekV3Model, ShardKey
from module.causal_lm import PreNormDecoderLayer
from module.embedding import VocabParallelEmbedding
from module.mla import MLAAttention
from module.mlp import GatedMLP
from module.moe import EXPERT_TENSOR, FusedExperts, Router, SparseMoeBlock
from module.mtp import MTPLayerMixin, num_mtp_layers_of
from module.norm import RMSNorm
from module.parallel_group import ModelParallel, ParallelGroup
from ops.attention.metadata import ForwardMetaData
from ops.backend import Backend


class LongcatFlashAttention(MLAAttention):
    """MLA with LoRA scaling: both factors apply before rope and before the latent is cached."""

    def __init__(self, config: LongcatFlashConfig, tp: ParallelGroup, *, backend: Backend) -> None:
        super().__init__(config, tp, backend=backend)
        self.q_lora_scale = (config.hidden_size / config.q_lora_rank) ** 0.5
        self.kv_lora_scale = (config.hidden_size / config.kv_lora_rank) ** 0.5

    @staticmethod
    def interleaved_rope(config: LongcatFlashConfig) -> bool:
        return True

    def project_query(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        query, q_resid = super().project_query(hidden_states)
        return query * self.q_lora_scale, q_resid

    def normed_latent(self, latent: torch.Tensor) -> torch.Tensor:
        return super().normed_latent(latent) * self.kv_lora_scale


class LongcatFlashRouter(Router):
    """transformers' LongcatFlashTopkRouter op for op, so that ties break the same way: fp32 logits
    over routed and zero experts, softmax, top-k (unsorted) of the scores plus e_score_correction_bias,
    weights the unbiased scores times routed_scaling_factor."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, routed_scaling_factor: float) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"router: moe_topk {top_k} must be in [1, {num_experts} experts]")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
        self.top_k = top_k
        self.routed_scaling_factor = routed_scaling_factor

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(hidden_states.float(), self.weight).softmax(dim=-1)
        scores_for_choice = scores + self.e_score_correction_bias.unsqueeze(0)
        topk_ids = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        return scores.gather(1, topk_ids) * self.routed_scaling_factor, topk_ids


class LongcatFlashMoE(SparseMoeBlock):
    """Routed experts (stacked, module/moe.py) and zero-computation experts, ids n_routed_experts and
    up: a slot routed to one weighs its token itself. The routed experts run with those slots' weights
    zeroed; the identity part is added once, after the experts' all-reduce, on this rank's rows."""

    def __init__(self, config: LongcatFlashConfig, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__(
            LongcatFlashRouter(
                config.hidden_size,
                config.n_routed_experts + (config.zero_expert_num or 0),
                config.moe_topk,
                config.routed_scaling_factor,
            ),
            FusedExperts(
                config.n_routed_experts,
                config.hidden_size,
                config.expert_ffn_hidden_size,
                parallel.moe_tp,
                parallel.moe_ep,
                backend=backend,
            ),
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens, own = self.experts.gather_tokens(hidden_states)
        topk_weights, topk_ids = self.gate(tokens)
        is_zero_expert = topk_ids >= self.experts.num_experts
        routed = self.experts(
            tokens, topk_weights.masked_fill(is_zero_expert, 0), topk_ids.masked_fill(is_zero_expert, 0)
        )
        identity_weight = topk_weights.masked_fill(~is_zero_expert, 0).sum(dim=-1, keepdim=True)
        return (routed + (tokens * identity_weight).to(routed.dtype))[own]


class LongcatFlashDecoderLayer(nn.Module):
    """Two pre-norm attention + dense MLP blocks (self_attn.i, mlps.i and the norms .i, as checkpoints
    name them) and the shortcut MoE `mlp`. The residual add is fused into the next norm, as in
    module/causal_lm.py: (output, residual) pairs flow between layers."""

    attention_cls: type[LongcatFlashAttention] = LongcatFlashAttention
    moe_cls: type[LongcatFlashMoE] = LongcatFlashMoE

    def __init__(self, config: LongcatFlashConfig, layer_index: int, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__()
        hidden_size, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = nn.ModuleList(
            [self.attention_cls(config, parallel.attn_tp, backend=backend) for _ in range(2)]
        )
        self.mlps = nn.ModuleList(
            [
                GatedMLP(hidden_size, config.ffn_hidden_size, config.hidden_act, tp=parallel.dense_tp, backend=backend)
                for _ in range(2)
            ]
        )
        self.mlp = self.moe_cls(config, parallel, backend)
        self.input_layernorm = nn.ModuleList([RMSNorm(hidden_size, eps, backend=backend) for _ in range(2)])
        self.post_attention_layernorm = nn.ModuleList([RMSNorm(hidden_size, eps, backend=backend) for _ in range(2)])

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        forward_metadata: ForwardMetaData,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.attention_block(0, hidden_states, residual, rotary, forward_metadata)
        shortcut = self.mlp(hidden_states)
        hidden_states, residual = self.attention_block(
            1, self.mlps[0](hidden_states), residual, rotary, forward_metadata
        )
        return self.mlps[1](hidden_states) + shortcut, residual

    def attention_block(
        self,
        block: int,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        forward_metadata: ForwardMetaData,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention block `block` on (output, residual) of what came before -> (its normed output for
        an MLP, the residual stream with the attention added)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm[block](hidden_states)
        else:
            hidden_states, residual = self.input_layernorm[block](hidden_states, residual)
        hidden_states = self.self_attn[block](hidden_states, rotary, forward_metadata)
        return self.post_attention_layernorm[block](hidden_states, residual)


class LongcatFlashMTPBlock(PreNormDecoderLayer):
    """The MTP module's decoder block: one MLA block and one dense MLP, as a plain pre-norm layer."""

    def __init__(self, config: LongcatFlashConfig, layer_index: int, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__()
        hidden_size, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LongcatFlashAttention(config, parallel.attn_tp, backend=backend)
        self.mlp = GatedMLP(
            hidden_size, config.ffn_hidden_size, config.hidden_act, tp=parallel.dense_tp, backend=backend
        )
        self.input_layernorm = RMSNorm(hidden_size, eps, backend=backend)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, backend=backend)


class LongcatFlashMTPLayer(MTPLayerMixin, LongcatFlashMTPBlock):
    """module/mtp.py's MTP on LongCat's block; its shared_head.norm is the checkpoint's model.mtp.norm."""


class LongcatFlashMTP(nn.Module):
    """model.mtp of LongCat's checkpoints: the MTP's own embedding and its layers."""

    def __init__(self, config: LongcatFlashConfig, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel.embed_tp)
        self.layers = nn.ModuleList(
            [LongcatFlashMTPLayer(config, index, parallel, backend) for index in range(num_mtp_layers_of(config))]
        )


class LongcatFlashModel(DeepseekV3Model):
    decoder_layer_cls = LongcatFlashDecoderLayer

    def __init__(self, config: LongcatFlashConfig, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__(config, parallel, backend)
        self.mtp = LongcatFlashMTP(config, parallel, backend) if num_mtp_layers_of(config) else None

    @staticmethod
    def num_decoder_layers(config: LongcatFlashConfig) -> int:
        """num_layers; the config's num_hidden_layers counts attention blocks, two per layer."""
        return config.num_layers

    @staticmethod
    def num_mtp_layers(config: LongcatFlashConfig) -> int:
        """None among `layers`: LongCat's MTP is `mtp`, named as its checkpoints name it."""
        return 0


# LongCat's MTP tensor names -> ours: its norms wrap their weight in `m`, its MLP sits in a
# `transformer_layer`, and its one final norm is the module's shared_head.norm.
MTP_RENAMES = (
    (".enorm.m.", ".enorm."),
    (".hnorm.m.", ".hnorm."),
    (".transformer_layer.", "."),
    ("model.mtp.norm.", "model.mtp.layers.0.shared_head.norm."),
)


class LongcatFlashForCausalLM(DeepseekV3ForCausalLM):
    base_model_cls = LongcatFlashModel
    family = "LongCat-Flash"

    @classmethod
    def mtp_layers_to_build(cls, config: LongcatFlashConfig) -> int:
        """num_nextn_predict_layers, built as `model.mtp` (none among `layers`)."""
        return num_mtp_layers_of(config)

    @classmethod
    def num_checkpoint_layers(cls, config: LongcatFlashConfig) -> int:
        """num_layers: the checkpoints number layers of two attention blocks each."""
        return cls.base_model_cls.num_decoder_layers(config)

    def mtp_layer(self, layer: int) -> LongcatFlashMTPLayer:
        if not 0 <= layer < self.num_mtp_layers:
            raise IndexError(f"MTP layer {layer} does not exist: the model has {self.num_mtp_layers}")
        return self.model.mtp.layers[layer]

    def mtp_embedding(self, layer: int) -> nn.Module:
        """model.mtp.embed_tokens: LongCat's checkpoints give the MTP an embedding of its own."""
        return self.model.mtp.embed_tokens

    @staticmethod
    def check_config(config: LongcatFlashConfig) -> None:
        """Refuse what transformers' LongcatFlashForCausalLM would build otherwise than LongCat's own
        code (it ignores these keys of LongCat's config.json), so that no checkpoint runs as a model it
        is not; released LongCat-Flash configs pass."""
        settings = {
            "router_bias": (getattr(config, "router_bias", False), (False,)),
            "norm_topk_prob": (getattr(config, "norm_topk_prob", False), (False,)),
            "mla_scale_q_lora": (getattr(config, "mla_scale_q_lora", True), (True,)),
            "mla_scale_kv_lora": (getattr(config, "mla_scale_kv_lora", True), (True,)),
            "zero_expert_type": (getattr(config, "zero_expert_type", "identity"), ("identity", None)),
            "qk_head_dim": (config.qk_head_dim, (config.qk_nope_head_dim + config.qk_rope_head_dim,)),
            "head_dim (the rope's dims)": (config.head_dim, (config.qk_rope_head_dim,)),
        }
        for key, (value, built) in settings.items():
            if value not in built:
                raise ValueError(
                    f"config {key} {value!r}: LongCat-Flash is built with {' or '.join(map(repr, built))} only"
                )
        if config.q_lora_rank is None:
            raise ValueError("config q_lora_rank None: LongCat-Flash's MLA always has a q LoRA")
        if num_mtp_layers_of(config) > 1:
            raise ValueError(
                f"config num_nextn_predict_layers {config.num_nextn_predict_layers}: LongCat-Flash's checkpoints "
                "hold one MTP module (one final norm, model.mtp.norm), so 0 or 1"
            )

    def _is_skipped(self, checkpoint_name: str) -> bool:
        """Also skipped: the gate/up tensors transformers saves for the zero experts (its stacked
        gate_up_proj has a slot per expert, zero ones included), and the MTP's when the config has none."""
        expert = EXPERT_TENSOR.match(checkpoint_name)
        return (
            super()._is_skipped(checkpoint_name)
            or (expert is not None and int(expert["expert"]) >= self.config.n_routed_experts)
            or (checkpoint_name.startswith("model.mtp.") and not self.num_mtp_layers)
        )

    def _load_tensor(
        self, checkpoint_name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]
    ) -> tuple[str, ShardKey]:
        """The router's tensors (mlp.router.classifier.weight, mlp.router.e_score_correction_bias)
        go to the MoE block's `gate`; the MTP's are renamed by MTP_RENAMES."""
        name = checkpoint_name.replace(".mlp.router.classifier.", ".mlp.gate.").replace(".mlp.router.", ".mlp.gate.")
        if name.startswith("model.mtp."):
            for old, new in MTP_RENAMES:
                name = name.replace(old, new)
        return super()._load_tensor(name, tensor, params)
