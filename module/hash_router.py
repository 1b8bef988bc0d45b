"""DeepSeek-V4's MoE gates, op for op as transformers' (so that ties break as its do): scores by the
config's scoring_func (sqrt(softplus) for V4), the chosen experts' scores renormalised to sum to
one and times routed_scaling_factor. Which experts: the top-k of scores + a correction bias
(ScoredTopkRouter), or, in the first hash_moe layers, a frozen token id -> experts table
(HashRouter, the paper's hash routing), so those gates need the step's input ids.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from module.moe import Router


class ScoredRouter(Router):
    """What both gates share: weight [E, H] (in the model's dtype, as transformers keeps it), the
    scoring function and the weights of the chosen experts."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, scoring_func: str, routed_scaling_factor: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.top_k = top_k
        self.score_fn = ACT2FN[scoring_func]
        self.routed_scaling_factor = routed_scaling_factor

    def scores(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.score_fn(F.linear(hidden_states, self.weight))

    def expert_weights(self, scores: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        weights = scores.gather(1, expert_ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.routed_scaling_factor


class ScoredTopkRouter(ScoredRouter):
    """top_k of scores + bias (unsorted torch.topk, as transformers calls it)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, scoring_func: str, routed_scaling_factor: float):
        super().__init__(hidden_size, num_experts, top_k, scoring_func, routed_scaling_factor)
        self.bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.scores(hidden_states)
        expert_ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        return self.expert_weights(scores, expert_ids), expert_ids


class HashRouter(ScoredRouter):
    """Experts by tid2eid[token id] [vocab, top_k] (a checkpoint table, int64), weighted by scores."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        scoring_func: str,
        routed_scaling_factor: float,
        vocab_size: int,
    ):
        super().__init__(hidden_size, num_experts, top_k, scoring_func, routed_scaling_factor)
        self.tid2eid = nn.Parameter(torch.zeros(vocab_size, top_k, dtype=torch.int64), requires_grad=False)

    # routed by the token ids too, which only DeepSeek-V4's MoE block passes (models/deepseek_v4/model.py)
    def forward(  # type: ignore[override]
        self, hidden_states: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        expert_ids = self.tid2eid[input_ids].long()
        return self.expert_weights(self.scores(hidden_states), expert_ids), expert_ids
