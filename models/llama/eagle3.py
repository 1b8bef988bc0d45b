"""The EAGLE-3 drafter of a Llama-family target, as vLLM's `eagle3` method defines it
(vllm/model_executor/models/llama_eagle3.py) and loading the checkpoints published for it.

The target's residual stream is read at three of its layers (low, middle, high; by default the
inputs of layers 2, L // 2 and L - 3, as vLLM takes them, or the config's
`eagle_aux_hidden_state_layer_ids`), concatenated and projected by `fc` (3 x target hidden ->
hidden). One decoder layer (`midlayer`) then takes, at each position p, the embedding of the token
at p + 1 (the target's embedding) and the hidden state at p: both normed (`input_layernorm`,
`hidden_norm`) and concatenated, so its attention's q/k/v projections read 2 x hidden; its residual
is the hidden state. Its output plus residual (before `norm`) is the hidden state the next draft
step feeds back (chain drafting); `norm` and `lm_head` give logits over a reduced draft vocabulary,
whose token d is target token d + d2t[d].

Checkpoint layout (vLLM's, as published for EAGLE-3 drafters): config.json with architectures
[LlamaForCausalLMEagle3], draft_vocab_size, optionally target_hidden_size, norm_before_residual and
eagle_config; tensors midlayer.*, fc.weight, norm.weight, lm_head.weight, d2t (int64 offsets),
t2d (bool, unused: vLLM skips it too) and optionally embed_tokens.weight.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from executor.types_.checkpoint_tensor import LoadedWeight, materialize
from executor.types_.errors import WeightLoadError
from models.llama.model import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, head_dim_of
from module.embedding import ParallelLMHead, VocabParallelEmbedding
from module.linear import ColumnParallelLinear
from module.norm import RMSNorm
from module.parallel_group import ONE_PROCESS, ModelParallel
from module.rotary import RotaryEmbedding
from module.weights import fused_shards_needed, load_fused_tensor
from ops.attention.metadata import ForwardMetaData
from ops.backend import Backend

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def aux_hidden_state_layers(draft_config: PretrainedConfig, num_target_layers: int) -> tuple[int, int, int]:
    """The target layers whose input (residual stream) the drafter reads: the config's
    eagle_aux_hidden_state_layer_ids, else vLLM's default (2, L // 2, L - 3)."""
    eagle_config = getattr(draft_config, "eagle_config", None) or {}
    layers = eagle_config.get("eagle_aux_hidden_state_layer_ids") or getattr(
        draft_config, "eagle_aux_hidden_state_layer_ids", None
    )
    if layers is None:
        layers = (2, num_target_layers // 2, num_target_layers - 3)
    if len(layers) != 3 or not all(0 <= layer < num_target_layers for layer in layers):
        raise ValueError(
            f"EAGLE-3 reads three target layers in [0, {num_target_layers}), got eagle_aux_hidden_state_layer_ids "
            f"{list(layers)}"
        )
    return (int(layers[0]), int(layers[1]), int(layers[2]))


class Eagle3Attention(LlamaAttention):
    """Llama attention whose q/k/v read the concatenated [embedding, hidden] (2 x hidden)."""

    def qkv_input_size(self, config: PretrainedConfig) -> int:
        return 2 * config.hidden_size


class Eagle3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Eagle3Attention

    def __init__(self, config: PretrainedConfig, layer_index: int, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__(config, layer_index, parallel, backend)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend=backend)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def predict(
        self,
        inputs_embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        forward_metadata: ForwardMetaData,
    ) -> torch.Tensor:
        """[T, hidden] embeddings of the next tokens and hidden states -> [T, hidden] after the MLP's
        residual add (before `norm`): what the next draft step feeds back."""
        normed_hidden = self.hidden_norm(hidden_states)
        residual = normed_hidden if self.norm_before_residual else hidden_states
        mixed = torch.cat((self.input_layernorm(inputs_embeds), normed_hidden), dim=-1)
        attention = self.mix_tokens(mixed, rotary, forward_metadata)
        output, residual = self.post_attention(attention, residual)
        return output + residual


class Eagle3Drafter(nn.Module):
    """The drafter's modules under the checkpoint's names; the target's embedding and rope are
    passed in (a checkpoint with its own embed_tokens uses that)."""

    @staticmethod
    def config_problem(config: Any) -> str | None:
        """Why a draft config.json is not one this class loads (eagle3_config_problem); None when it is."""
        return eagle3_config_problem(config)

    @staticmethod
    def aux_layers(config: PretrainedConfig, num_target_layers: int) -> tuple[int, int, int]:
        """The target layers this drafter reads (aux_hidden_state_layers)."""
        return aux_hidden_state_layers(config, num_target_layers)

    def __init__(
        self,
        config: PretrainedConfig,
        target_hidden_size: int,
        *,
        parallel: ModelParallel = ONE_PROCESS,
        backend: Backend,
    ) -> None:
        super().__init__()
        self.config = config
        self.draft_vocab_size: int = getattr(config, "draft_vocab_size", None) or config.vocab_size
        method = backend.linear_method()
        # replicated (tp size 1): every rank needs the whole projected hidden state, as for MTP's eh_proj
        self.fc = ColumnParallelLinear(3 * target_hidden_size, config.hidden_size, bias=False, linear_method=method)
        self.midlayer = Eagle3DecoderLayer(config, 0, parallel, backend)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend=backend)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, config.hidden_size, linear_method=method)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64), persistent=False)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config))  # the drafter's own rope settings
        self.embed_tokens: VocabParallelEmbedding | None = None  # set when the checkpoint has one

    def combine_hidden_states(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, 3 x target hidden] (low, middle, high) -> [T, hidden]."""
        return self.fc(aux_hidden_states)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_metadata: ForwardMetaData,
    ) -> torch.Tensor:
        """Embeddings of each row's next token and hidden states [T, hidden] (fc's output for rows of
        the target, the previous draft step's output in a chain) at `positions` [T] -> [T, hidden]
        before `norm`. Its attention reads and writes its own cache through the step's block tables."""
        rotary = self.rotary_emb(positions, inputs_embeds.dtype)
        return self.midlayer.predict(inputs_embeds, hidden_states, rotary, forward_metadata)

    def compute_logits(self, hidden_states: torch.Tensor, row_indices: torch.Tensor) -> torch.Tensor:
        """Logits [rows, draft vocab] of the given rows (after `norm`)."""
        return self.lm_head(self.norm(hidden_states), row_indices)

    def target_token_ids(self, draft_token_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> the target's: d + d2t[d] (vLLM's draft_id_to_target_id)."""
        return draft_token_ids + self.d2t[draft_token_ids]

    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """Load a published EAGLE-3 checkpoint's tensors; returns the filled parameters (and d2t)."""
        params = dict(self.named_parameters())
        received: dict[str, set[Hashable]] = {}
        for name, tensor in weights:
            if name == "t2d":
                continue
            if name == "d2t":
                if tensor.shape != self.d2t.shape:
                    raise WeightLoadError(
                        f"checkpoint tensor 'd2t' has shape {tuple(tensor.shape)}, expected {tuple(self.d2t.shape)}"
                    )
                self.d2t.copy_(materialize(tensor).to(torch.int64))
                received["d2t"] = {None}
                continue
            if name == "embed_tokens.weight" and self.embed_tokens is None:
                self.embed_tokens = VocabParallelEmbedding(tensor.shape[0], tensor.shape[1])
                params["embed_tokens.weight"] = self.embed_tokens.weight
            try:
                param_name, shard = load_fused_tensor(self, name, tensor, params, self.packed_modules_mapping)
            except WeightLoadError as error:
                raise WeightLoadError(f"checkpoint tensor {name!r}: {error}") from None
            received.setdefault(param_name, set()).add(shard)
        return {
            name
            for name, shards in received.items()
            if name == "d2t" or len(shards) == fused_shards_needed(name, self.packed_modules_mapping)
        }


def eagle3_config_problem(config: Any) -> str | None:
    """Why a draft config.json is not an EAGLE-3 drafter's this loads; None when it is."""
    architectures = getattr(config, "architectures", None) or []
    if not any(arch in EAGLE3_ARCHITECTURES for arch in architectures):
        return f"architectures {architectures} names no EAGLE-3 drafter (expected one of {list(EAGLE3_ARCHITECTURES)})"
    if getattr(config, "num_hidden_layers", 1) != 1:
        return f"num_hidden_layers is {config.num_hidden_layers}; an EAGLE-3 drafter here has one layer (midlayer)"
    return None
