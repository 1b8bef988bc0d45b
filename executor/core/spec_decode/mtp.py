"""MTP proposer (cann-recipes' MTPWorker): the target model's own multi-token-prediction modules.

MTP module i takes, at each position p, the previous hidden state at p (the target's for i = 0)
and the embedding of the token at p + 1, and predicts the token at p + 2. After every step it runs
over each request's rows whose K/V stands, with the inputs shifted by one token, which keeps its own
KV cache complete (prefill chunks included), and its last row's prediction is draft 1. Draft j > 1
feeds draft j - 1 back through the module (the last one, when the model has fewer modules than
drafts, as vLLM does for a model with a single MTP module), writing its K/V one position further on.
In graph modes the decode-shaped passes run through the engine's MTP graph runners (mtp_graphs.py),
in lock-step the idle passes too. With a PromptLookup (speculative_config.prompt_lookup) a request
whose last n-gram recurs takes the lookup's drafts and its chain stops after the first pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from executor.core.config import ConfigError, InferenceConfig
from executor.core.kv_cache import KVCacheManager
from executor.core.model_worker.graph_runner import GraphRunner
from executor.core.spec_decode.mtp_graphs import RunnerFactory, mtp_graph_runners
from executor.core.spec_decode.ngram import PromptLookup
from executor.core.spec_decode.proposer import LockStep, ProposalContext
from module.causal_lm import CausalLM
from ops.attention.metadata import (
    AttentionMetadataBuilder,
    ModelInputs,
    ScheduledSequence,
    StepLayout,
    build_model_inputs,
    build_step_layout,
    take_rows,
)


def check_mtp_layers(model_cls: type[CausalLM], hf_config: Any, config: InferenceConfig, config_json: str) -> None:
    """Refuse MTP drafting for a model that `model_cls` builds from `hf_config` without MTP layers
    (the class says how many it builds, and why none): the preflight asks before anything loads, the
    proposer again for engines built without it. `config_json` names where hf_config was read."""
    next_n = config.model_config.next_n
    key = f"model_config.next_n {next_n}" if next_n > 0 else "speculative_config.method 'mtp'"
    try:
        num_layers = model_cls.mtp_layers_to_build(hf_config)
    except ValueError as exc:
        raise ConfigError(f"{key} in {config.source}: {config_json}: {' '.join(str(exc).split())}") from None
    if num_layers < 1:
        raise ConfigError(
            f"{key} in {config.source} asks for MTP drafts, but {model_cls.__name__} builds no MTP module "
            f"from {config_json} ({model_cls.mtp_absent_reason})"
        )


@dataclass(slots=True)
class _Drafting:
    """One request being drafted for: its index in the step and the position of its last MTP row."""

    index: int
    position: int


class MTPProposer:
    def __init__(
        self,
        model: CausalLM,
        kv_cache_manager: KVCacheManager,
        builder: AttentionMetadataBuilder,
        *,
        num_speculative_tokens: int,
        max_blocks_per_request: int,
        config: InferenceConfig,
        argmax_rows: Callable[[torch.Tensor], torch.Tensor],
        lock_step: LockStep | None = None,
        prompt_lookup: PromptLookup | None = None,
    ) -> None:
        self.check_drafter(model, config)
        self.model = model
        self.kv_cache_manager = kv_cache_manager
        self.builder = builder
        self.num_speculative_tokens = num_speculative_tokens
        self.num_lookahead_tokens = num_speculative_tokens - 1  # drafts 2..k write one position on each
        self.max_blocks_per_request = max_blocks_per_request
        self.lock_step = lock_step
        self.argmax_rows = argmax_rows  # each draft's greedy choice: the backend's
        self.prompt_lookup = prompt_lookup  # drafts looked up first, where the request's last n-gram recurs
        self.graph_runners: list[GraphRunner] = []  # by MTP layer, in graph modes (the engine sets them)

    @property
    def num_draft_layers(self) -> int:
        """The drafting layers: draft j runs layer min(j, this - 1)."""
        return self.model.num_mtp_layers

    def check_drafter(self, model: CausalLM, config: InferenceConfig) -> None:
        """Refuse a model that has nothing to draft with (here: no MTP layer)."""
        check_mtp_layers(type(model), model.config, config, "its config.json")

    def first_pass_hidden(self, context: ProposalContext, rows: list[int]) -> torch.Tensor:
        """The hidden states the first pass reads at the given rows of the step: the target's final ones."""
        return context.hidden_states[torch.tensor(rows, device=context.hidden_states.device)]

    @torch.inference_mode()
    def propose(self, context: ProposalContext) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in context.requests]
        sequences, hidden_rows, drafting = [], [], []
        for index, (request, sequence) in enumerate(zip(context.requests, context.sequences, strict=True)):
            num_valid = context.num_valid_tokens[index]
            start = sequence.num_computed_tokens
            new_tokens = context.new_token_ids[index]
            # the token after the last valid one: this step's last emitted token, or the next prompt token
            end = start + num_valid
            following = new_tokens[-1] if new_tokens else request.token_ids_between(end, end + 1)[0]
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            sampled = 1 if new_tokens else 0
            sequences.append(
                ScheduledSequence([*sequence.token_ids[1:num_valid], following], start, block_ids, sampled)
            )
            row = context.row_starts[index]
            hidden_rows.extend(range(row, row + num_valid))
            if new_tokens:
                drafting.append(_Drafting(index, end - 1))
        looked_up = self.prompt_lookup.lookups(context, [item.index for item in drafting]) if self.prompt_lookup else {}
        for index, found in looked_up.items():  # the lookup drafts num_speculative_tokens at most
            drafts[index] = found
        # each request drafts at every depth whose row has a slot, up to num_speculative_tokens; a step
        # that drafts for none (prompt chunks short of their end, drafts looked up) still runs the first
        # pass, which writes the MTP layer's K/V for its rows
        chained = [item for item in drafting if item.index not in looked_up]
        num_passes = max((self._depths(context, item) for item in chained), default=1 if sequences else 0)
        num_passes = self.lock_step.max_over_world(num_passes) if self.lock_step else num_passes
        hidden = self.first_pass_hidden(context, hidden_rows)
        for depth in range(num_passes):
            layer = min(depth, self.num_draft_layers - 1)
            if not sequences:  # lock-step: another replica's requests draft further
                self._idle_pass(layer, context.hidden_states)
                continue
            hidden, tokens = self._run(layer, sequences, hidden)
            if looked_up and depth == 0:  # the chain goes on for the requests without a lookup only
                kept = [position for position, item in enumerate(drafting) if item.index not in looked_up]
                hidden = hidden[torch.tensor(kept, device=hidden.device, dtype=torch.int64)]
                tokens, drafting = [tokens[i] for i in kept], chained
            for item, token in zip(drafting, tokens, strict=True):
                drafts[item.index].append(token)
            if depth + 1 < self.num_speculative_tokens:
                kept, sequences = self._next_rows(context, drafting, tokens)
                hidden = hidden[torch.tensor(kept, device=hidden.device, dtype=torch.int64)]
                drafting = [drafting[i] for i in kept]
        return drafts

    @torch.inference_mode()
    def propose_nothing(self, hidden_states: torch.Tensor) -> None:
        if self.lock_step:
            self._idle_passes(self.lock_step.max_over_world(0), hidden_states)

    def _idle_passes(self, num_passes: int, hidden_states: torch.Tensor) -> None:
        for depth in range(num_passes):
            self._idle_pass(min(depth, self.num_draft_layers - 1), hidden_states)

    def _idle_pass(self, layer: int, hidden_states: torch.Tensor) -> None:
        """Lock-step: a pass of MTP module `layer` over one padding token whose K/V goes to the null
        block, as the runner's idle forward does, so that the collectives of another replica's pass
        meet this one's (in graph modes in the bucket the replicas agree on); its output is dropped."""
        layout = self.idle_layout()
        if self.graph_runners and self.graph_runners[layer].forward(layout, hidden_states[:1]) is not None:
            return
        inputs = build_model_inputs(layout, self.builder)
        # no row: the LM head's gathers only, where its group spans the replicas
        self.eager_pass(layer, inputs, hidden_states[:1], self.lock_step is not None and self.lock_step.joins_lm_head)

    def eager_pass(
        self, layer: int, inputs: ModelInputs, previous_hidden: torch.Tensor, with_logits: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """MTP module `layer` run eagerly: the hidden states of every row, and (with_logits) the logits
        of the sampled rows."""
        hidden = self.model.mtp_forward(
            layer, inputs.input_ids, inputs.positions, previous_hidden, inputs.forward_metadata
        )
        logits = self.model.mtp_compute_logits(layer, hidden, inputs.logits_indices) if with_logits else None
        return hidden, logits

    def draft_token_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """The target's ids of the drafter's greedy choices (MTP's LM head is the target's vocabulary)."""
        return draft_ids

    def make_graph_runners(self, hidden_size: int, dtype: torch.dtype, make_runner: RunnerFactory) -> list[GraphRunner]:
        """The graph runners of the drafting layers' passes, by layer (mtp_graphs.py), for graph modes."""
        return mtp_graph_runners(self.model, self.num_speculative_tokens, hidden_size, dtype, make_runner)

    def layout(self, sequences: list[ScheduledSequence]) -> StepLayout:
        """A drafting pass's packed inputs over the target's block tables."""
        return build_step_layout(
            sequences,
            block_size=self.kv_cache_manager.block_size,
            max_blocks_per_request=self.max_blocks_per_request,
            state_groups=self.kv_cache_manager.state_groups,
        )

    def idle_layout(self) -> StepLayout:
        """One padding token (id 0, position 0) writing only the null block: an idle pass's input."""
        null_blocks = [[0]] * self.kv_cache_manager.num_groups
        return self.layout([ScheduledSequence([0], 0, null_blocks, num_sampled_rows=0)])

    def _depths(self, context: ProposalContext, item: _Drafting) -> int:
        """MTP passes the request drafts in: one per position from its last row on that holds a slot."""
        block_ids = self.kv_cache_manager.get_block_ids(context.requests[item.index].request_id)
        return min(self.num_speculative_tokens, self._slots_end(block_ids) - item.position)

    def _slots_end(self, block_ids: list[list[int]]) -> int:
        """The first position for which some attention group of the request holds no K/V slot (a
        recurrent group's row holds state slots, not blocks; the MTP layers keep no state)."""
        block_size, state_groups = self.kv_cache_manager.block_size, self.kv_cache_manager.state_groups
        return min(len(blocks) * block_size for group, blocks in enumerate(block_ids) if group not in state_groups)

    def _run(
        self, layer: int, sequences: list[ScheduledSequence], previous_hidden: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        """One pass of MTP module `layer`; its hidden states and each sampled row's greedy token."""
        layout = self.layout(sequences)
        graph_output = self.graph_runners[layer].forward(layout, previous_hidden) if self.graph_runners else None
        # rows of the next pass are the sampled rows, one per drafting request, in order
        if graph_output is None:
            inputs = build_model_inputs(layout, self.builder)
            hidden, logits = self.eager_pass(layer, inputs, previous_hidden)
            assert logits is not None
            hidden = hidden[inputs.logits_indices]
        else:
            all_hidden, all_logits = graph_output  # the LM head ran on every row inside the graph
            hidden, logits = take_rows(all_hidden, layout.logits_indices), take_rows(all_logits, layout.logits_indices)
        return hidden, self.draft_token_ids(self.argmax_rows(logits)).tolist()

    def _next_rows(
        self, context: ProposalContext, drafting: list[_Drafting], tokens: list[int]
    ) -> tuple[list[int], list[ScheduledSequence]]:
        """Which drafting requests go on (their index in `drafting`) and their next MTP row: the
        last draft, one position on, for those that hold a K/V slot there (the scheduler allocated
        num_lookahead_tokens of them with the step, short of max_model_len, and gives them back
        after the next verify)."""
        kept, sequences = [], []
        for position, (item, token) in enumerate(zip(drafting, tokens, strict=True)):
            row_position = item.position + 1
            block_ids = self.kv_cache_manager.get_block_ids(context.requests[item.index].request_id)
            if self._slots_end(block_ids) <= row_position:
                continue
            item.position = row_position
            kept.append(position)
            sequences.append(ScheduledSequence([token], row_position, block_ids, num_sampled_rows=1))
        return kept, sequences
