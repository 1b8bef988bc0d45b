"""The MTP proposer's decode-shaped passes as graphs, as cann-recipes compiles its MTP worker's `mtp_decode`.

After a verify step the proposer's first pass runs MTP layer 0 over each request's rows whose K/V
stands (1 to 1 + k of them), then k - 1 passes of one token per request; both shapes run through
graph buckets of their own (the verify-shaped ones for layer 0's first pass), holding the MTP layer's
forward and its LM head over every row. A pass after a prefill chunk runs eagerly. In lock-step data
parallelism each runner agrees on its bucket across the replicas as the target's does (graph_runner.py),
and a replica with nothing to draft runs its idle passes through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from executor.core.model_worker.graph_runner import GraphRunner
from executor.platform.graph_compilers import GraphOutput
from ops.attention.metadata import ForwardMetaData


class MTPStep(torch.nn.Module):
    """What an MTP bucket's graph holds: MTP layer `layer` on a step's tokens and the previous depth's
    hidden states, and its LM head over every row (a padding row's logits are never read)."""

    def __init__(self, model: torch.nn.Module, layer: int) -> None:
        super().__init__()
        self.model = model
        self.layer = layer

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden_states: torch.Tensor,
        forward_metadata: ForwardMetaData,
    ) -> GraphOutput:
        hidden_states = self.draft_forward(input_ids, positions, previous_hidden_states, forward_metadata)
        rows = torch.arange(hidden_states.shape[0], device=hidden_states.device)
        return hidden_states, self.draft_logits(hidden_states, rows)

    def draft_forward(self, *inputs: Any) -> torch.Tensor:
        """The drafting layer's hidden states of every row from forward's inputs (MTP layer `layer`'s)."""
        return self.model.mtp_forward(self.layer, *inputs)

    def draft_logits(self, hidden_states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.model.mtp_compute_logits(self.layer, hidden_states, rows)


# (step module, tokens per verify row, per-token input widths and dtypes, name) -> a runner over the
# engine's buckets with the engine's compiler
RunnerFactory = Callable[[torch.nn.Module, int, tuple[tuple[int, torch.dtype], ...], str], GraphRunner]


def mtp_graph_runners(
    model: torch.nn.Module,
    num_speculative_tokens: int,
    hidden_size: int,
    dtype: torch.dtype,
    make_runner: RunnerFactory,
) -> list[GraphRunner]:
    """One runner per MTP layer the proposer uses (layer i drafts token i + 1; the last layer the rest):
    layer 0 with verify buckets of 1 + k tokens per request for its first pass, every layer with
    decode buckets."""
    num_layers = min(model.num_mtp_layers, num_speculative_tokens)
    return [
        make_runner(
            MTPStep(model, layer),
            1 + num_speculative_tokens if layer == 0 else 1,
            ((hidden_size, dtype),),
            f"mtp{layer}-",
        )
        for layer in range(num_layers)
    ]
