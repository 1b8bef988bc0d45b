"""Token embedding and LM head with the vocabulary split over tensor-parallel ranks.

When the group spans data-parallel replicas (embed_tp or lmhead_tp wider than attn_tp), its ranks
hold different tokens: each layer gathers every rank's ids or rows first, runs its vocabulary shard
over all of them, combines, and keeps its own rows.

Either may hold a quantized table (set_scheme, module/quantized.py): the embedding then dequantizes
only the rows it looks up (a GGUF's Q8_0 token table stays in its blocks), and an LM head tied to it
shares its quantized tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from module.linear import divide
from module.parallel_group import SINGLE, ParallelGroup
from module.quantized import QuantizableLinear, load_quant_tensor, quant_param
from module.weights import ShardId, load_shard, set_weight_loader
from ops import quant_math
from ops.linear_method import PLAIN, LinearMethod


class VocabParallelEmbedding(QuantizableLinear, nn.Module):
    """Rank r holds rows [r * V/tp, (r+1) * V/tp) of the table; other ids embed to zero there and
    the all-reduce fills them in from their owner."""

    tp_dim = 0
    scheme = None  # a quantized table's LinearScheme (set_scheme)

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: ParallelGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.tp_rank = tp.rank
        self.tp_size = tp.size
        self.num_embeddings_per_rank = divide(num_embeddings, tp.size)
        self.vocab_start = tp.rank * self.num_embeddings_per_rank
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_rank, embedding_dim), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        quant = quant_param(param)
        if quant is None:
            load_shard(param.data, loaded_weight, 0, self.tp_rank, self.tp_size)
        else:
            load_quant_tensor(param.data, loaded_weight, quant, self.tp_rank, self.tp_size)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of this rank's table, dequantized (only those rows) where it is quantized."""
        if self.scheme is None:
            return F.embedding(ids, self.weight)
        flat = ids.reshape(-1)
        offset = getattr(self, "weight_offset", None)
        zero_point = getattr(self, "weight_zero_point", None)
        rows = quant_math.dequantize_weight(
            self.weight[flat],
            self.weight_scale[flat],
            None if zero_point is None else zero_point[flat],
            self.scheme.weights,
            self.compute_dtype,
            None if offset is None else offset[flat],
        )
        return rows.reshape(*ids.shape, -1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.lookup(input_ids)
        if self.tp.spans_replicas:
            all_ids, own = self.tp.gather_rows(input_ids)
            return self._embed_and_reduce(all_ids)[own]
        return self._embed_and_reduce(input_ids)

    def _embed_and_reduce(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of this rank's vocabulary shard (zeros for other ids), summed over the group."""
        local_ids = input_ids - self.vocab_start
        owned = (local_ids >= 0) & (local_ids < self.num_embeddings_per_rank)
        embeddings = self.lookup(local_ids.clamp(0, self.num_embeddings_per_rank - 1))
        embeddings.masked_fill_(~owned.unsqueeze(-1), 0)
        return self.tp.all_reduce(embeddings)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits for the selected rows only; each rank computes its vocab slice, then the
    slices are gathered so every rank holds full logits. The multiply is the layer's LinearMethod,
    as in module/linear.py, quantized as a column layer is."""

    linear_method: LinearMethod

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tp: ParallelGroup = SINGLE, linear_method: LinearMethod = PLAIN
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, tp)
        self.linear_method = linear_method
        self.packed_weight = None

    # it shares the table's weights and loading, not its call: hidden rows in, logits out
    def forward(self, hidden_states: torch.Tensor, row_indices: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        rows = hidden_states[row_indices]
        if self.tp_size == 1:
            return self.linear_method.apply(self, rows, None)
        if not self.tp.spans_replicas:
            return self.tp.all_gather(self.linear_method.apply(self, rows, None), dim=-1)
        all_rows, own = self.tp.gather_rows(rows)  # every rank calls it each step, with 0 rows or more
        if all_rows.shape[0] == 0:  # no rank samples this step
            return rows.new_empty((0, self.num_embeddings_per_rank * self.tp_size))
        return self.tp.all_gather(self.linear_method.apply(self, all_rows, None), dim=-1)[own]
