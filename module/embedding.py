"""Token embedding and LM head with the vocabulary split over tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from module.blocked_weights import BlockedWeightMixin, linear
from module.linear import divide
from module.parallel_group import SINGLE, ParallelGroup
from module.weights import ShardId, load_shard


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r * V/tp, (r+1) * V/tp) of the table; other ids embed to zero there and
    the all-reduce fills them in from their owner."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: ParallelGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.tp_rank = tp.rank
        self.tp_size = tp.size
        self.num_embeddings_per_rank = divide(num_embeddings, tp.size)
        self.vocab_start = tp.rank * self.num_embeddings_per_rank
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        load_shard(param.data, loaded_weight, 0, self.tp_rank, self.tp_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        owned = (local_ids >= 0) & (local_ids < self.num_embeddings_per_rank)
        embeddings = F.embedding(local_ids.clamp(0, self.num_embeddings_per_rank - 1), self.weight)
        embeddings.masked_fill_(~owned.unsqueeze(-1), 0)
        return self.tp.all_reduce(embeddings)


class ParallelLMHead(BlockedWeightMixin, VocabParallelEmbedding):
    """hidden -> logits for the selected rows only; each rank computes its vocab slice, then the
    slices are gathered so every rank holds full logits."""

    def forward(self, hidden_states: torch.Tensor, row_indices: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden_states[row_indices], self.weight, None, self.blocked_weight)
        return self.tp.all_gather(logits, dim=-1)
