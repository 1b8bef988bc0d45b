"""ModelRunner (vLLM's name): one step, from a scheduled Batch to its StepResult.

A step reads as its parts: pack the requests' tokens and blocks into a StepLayout, run the
worker's forward, take the logits of the rows the step samples (and of the prompt rows whose
tokens a request asks to score: prompt logprobs), sample them, verify drafts, and propose the
next drafts. The runner only reads requests: the scheduler applies the StepResult.
"""

from __future__ import annotations

import itertools

import torch

from executor.core.engine.context_parallel import ContextParallelForward, splits_step
from executor.core.engine.engine_core import StepTimer
from executor.core.kv_cache import CacheLayout
from executor.core.model_worker import ModelWorker
from executor.core.sampler import Sampler, SamplingMetadata, prompt_logprobs
from executor.core.sampler.constraints import LogitsConstraints
from executor.core.sampler.noise import token_seed
from executor.core.spec_decode.proposer import ProposalContext, Proposer
from executor.core.spec_decode.verify import accept_greedy, rejection_sample
from executor.types_ import Batch, Request, StepResult, TokenLogprobs
from ops.attention.metadata import (
    AttentionMetadataBuilder,
    ScheduledSequence,
    StepLayout,
    build_model_inputs,
    build_step_layout,
    take_rows,
    to_device,
)


class ModelRunner:
    def __init__(
        self,
        worker: ModelWorker,
        sampler: Sampler,
        cache_layout: CacheLayout,
        metadata_builder: AttentionMetadataBuilder,
        step_timer: StepTimer,
        *,
        device: torch.device,
        max_blocks_per_request: int,
        lock_step_kinds: list[str],
        proposer: Proposer | None = None,
        context_parallel: ContextParallelForward | None = None,
        constraints: LogitsConstraints | None = None,
    ) -> None:
        """`lock_step_kinds`: the model groups spanning data-parallel replicas; `context_parallel`: the
        forward of a prefill step split over the ranks (docs/distributed.md); `constraints`: bad words
        and grammars, applied to the sampled rows' logits before the sampler (docs/sampling.md)."""
        self.worker = worker
        self.sampler = sampler
        self.cache_layout = cache_layout
        self.metadata_builder = metadata_builder
        self.step_timer = step_timer
        self.max_blocks_per_request = max_blocks_per_request
        self.lock_step_kinds = lock_step_kinds
        self.proposer = proposer
        self.context_parallel = context_parallel
        self.constraints = constraints
        self.device = device  # where the sampled rows' indices go

    def execute(self, batch: Batch) -> StepResult:
        """Run one step for `batch`: what each request emits, how many of its drafts were accepted,
        its logprobs and prompt logprobs, and (with a proposer) its drafts for the next step."""
        drafts = batch.draft_token_ids or [[]] * len(batch.requests)
        sequences, layout = self.prepare_inputs(batch, drafts)
        self.step_timer.mark("prepare")
        split = self.context_parallel is not None and splits_step(sequences)
        hidden_states, all_logits = self._forward(layout, split)  # marks h2d
        if not layout.logits_indices and not layout.prompt_logprob_indices:
            self._join_lm_head_without_rows(hidden_states, all_logits)
            self.step_timer.mark("forward")
            result = StepResult.empty(len(sequences))
        else:
            result = self._sample_and_verify(batch, drafts, sequences, hidden_states, all_logits, layout)
        if self.proposer is not None:  # a step that samples no row too: MTP writes its K/V for the rows
            result.next_drafts = self._propose(batch.requests, drafts, sequences, result, hidden_states, layout)
            self.step_timer.mark("propose")
        return result

    def _sample_and_verify(
        self,
        batch: Batch,
        drafts: list[list[int]],
        sequences: list[ScheduledSequence],
        hidden_states: torch.Tensor,
        all_logits: torch.Tensor | None,
        layout: StepLayout,
    ) -> StepResult:
        """The step's sampled rows as what each request emits (verifying its drafts), and its prompt logprobs."""
        logits = self._logits(hidden_states, all_logits, layout)
        self.step_timer.mark("forward")
        num_sampled = len(layout.logits_indices)
        if num_sampled:
            sampled_logits = logits[:num_sampled]
            constrained = any(request.sampling_params.has_logits_constraints for request in batch.requests)
            if self.constraints is not None and constrained:  # eagerly, after the graph's LM head in graphs
                rows_per_request = [seq.num_sampled_rows for seq in sequences]
                sampled_logits = self.constraints.apply(sampled_logits, batch.requests, rows_per_request, drafts)
            row_token_ids, row_logprobs = self._sample(sampled_logits, batch.requests, sequences)
            result = self._verify(batch.requests, drafts, sequences, row_token_ids, row_logprobs, sampled_logits)
        else:
            result = StepResult.empty(len(sequences))
        if layout.prompt_logprob_indices:
            result.prompt_logprobs = self._prompt_logprobs(logits[num_sampled:], batch.requests, sequences)
        self.step_timer.mark("sample")
        return result

    def prepare_inputs(self, batch: Batch, drafts: list[list[int]]) -> tuple[list[ScheduledSequence], StepLayout]:
        """Each request's share of the step (its tokens not yet computed, then its `drafts`), and
        the step's packed inputs."""
        sequences = []
        for request, num_tokens, request_drafts, block_ids in zip(
            batch.requests, batch.num_scheduled_tokens, drafts, batch.block_ids, strict=True
        ):
            start = request.num_computed_tokens
            end = start + num_tokens - len(request_drafts)  # the request's own tokens; the drafts follow them
            sequences.append(
                ScheduledSequence(
                    token_ids=request.token_ids_between(start, end) + request_drafts,
                    num_computed_tokens=start,
                    block_ids=block_ids,
                    num_sampled_rows=1 + len(request_drafts) if end >= request.num_tokens else 0,
                    prompt_logprob_rows=_prompt_logprob_rows(request, start, end),
                )
            )
        return sequences, self._pack(sequences)

    def _pack(self, sequences: list[ScheduledSequence]) -> StepLayout:
        return build_step_layout(
            sequences,
            block_size=self.cache_layout.block_size,
            max_blocks_per_request=self.max_blocks_per_request,
            state_groups=self.cache_layout.state_groups,
        )

    @torch.inference_mode()
    def _forward(self, layout: StepLayout, split: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model on the step: `split` over the context-parallel group, else through the bucket's
        graph where one serves it, else eagerly. Hidden states [rows, hidden] (a graph's padding rows
        follow the layout's) and, from a graph, the logits of every row; None where the LM head runs
        on the sampled rows after (_logits)."""
        if split:
            assert self.context_parallel is not None
            return self.context_parallel(self.worker.model, layout), None
        graph_runner = self.worker.graph_runner
        if graph_runner is not None and (output := graph_runner.forward(layout)) is not None:
            return output
        inputs = build_model_inputs(layout, self.metadata_builder)
        self.step_timer.mark("h2d")
        return self.worker.model(inputs.input_ids, inputs.positions, inputs.forward_metadata), None

    def _logits(self, hidden_states: torch.Tensor, all_logits: torch.Tensor | None, layout: StepLayout) -> torch.Tensor:
        """The sampled rows' logits, then the prompt logprob rows': picked from a graph's LM head
        output, or one LM head call on those rows (one set of collectives per step, as every
        replica of a lock-step group makes)."""
        rows = layout.logits_indices + layout.prompt_logprob_indices
        if all_logits is not None:
            return take_rows(all_logits, rows)
        with torch.inference_mode():
            return self.worker.model.compute_logits(hidden_states, to_device(rows, torch.int64, self.device))

    def _sample(
        self, logits: torch.Tensor, requests: list[Request], sequences: list[ScheduledSequence]
    ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """One token per row of logits, each with its request's sampling parameters; the step's one
        host read of the sampled ids (a second brings logprobs back when a request asks for them)."""
        if all(request.sampling_params.is_plain_greedy for request in requests):  # no row needs processing
            return self.sampler.greedy(logits).tolist(), None
        requests_per_row = [
            request for request, seq in zip(requests, sequences, strict=True) for _ in range(seq.num_sampled_rows)
        ]
        metadata = SamplingMetadata.build(requests_per_row, logits.device)
        output = self.sampler.sample(logits, metadata)
        token_ids = output.token_ids.tolist()
        if output.logprobs is None:
            return token_ids, None
        return token_ids, output.logprobs.per_row(token_ids, metadata.num_logprobs)

    def _prompt_logprobs(
        self, logits: torch.Tensor, requests: list[Request], sequences: list[ScheduledSequence]
    ) -> list[list[TokenLogprobs]]:
        """Each request's scored prompt tokens: the logits of the row at position p score prompt
        token p + 1 (the next chunk's first token for a chunk's last row)."""
        token_ids: list[int] = []
        num_logprobs: list[int] = []
        counts: list[int] = []
        for request, seq in zip(requests, sequences, strict=True):
            rows = seq.prompt_logprob_rows
            first_scored = seq.num_computed_tokens + rows.start + 1
            token_ids.extend(request.prompt_token_ids[first_scored : first_scored + len(rows)])
            num_logprobs.extend([request.sampling_params.prompt_logprobs or 0] * len(rows))
            counts.append(len(rows))
        entries = iter(prompt_logprobs(logits, token_ids, num_logprobs))
        return [list(itertools.islice(entries, count)) for count in counts]

    def _verify(
        self,
        requests: list[Request],
        drafts: list[list[int]],
        sequences: list[ScheduledSequence],
        row_token_ids: list[int],
        row_logprobs: list[TokenLogprobs | None] | None,
        logits: torch.Tensor,
    ) -> StepResult:
        """Split the sampled rows by request; a request with drafts emits what its verify rows accept
        (the logprobs of the rows past what it emits are dropped)."""
        result = StepResult([], [], [])
        row = 0
        for request, request_drafts, seq in zip(requests, drafts, sequences, strict=True):
            end = row + seq.num_sampled_rows
            emitted = row_token_ids[row:end]
            if request_drafts:
                emitted = self._accepted(request, request_drafts, emitted, logits[row:end])
            result.new_token_ids.append(emitted)
            result.num_accepted_drafts.append(len(emitted) - 1 if request_drafts else 0)
            kept = row_logprobs[row : row + len(emitted)] if row_logprobs is not None else []
            result.logprobs.append([entry for entry in kept if entry is not None])
            row = end
        return result

    def _accepted(
        self, request: Request, drafts: list[int], row_token_ids: list[int], logits: torch.Tensor
    ) -> list[int]:
        """What a request emits from its verify rows: the greedy prefix match, or rejection sampling
        for a random request (its generator seeded by its seed and output index, as its sampled
        tokens are)."""
        if request.sampling_params.is_greedy:
            return accept_greedy(drafts, row_token_ids)
        probs = self.sampler.probabilities(logits, SamplingMetadata.build([request] * len(logits), logits.device))
        seed = request.sampling_params.seed
        generator = None
        if seed is not None:
            generator = torch.Generator(logits.device).manual_seed(token_seed(seed, len(request.output_token_ids)))
        return rejection_sample(probs, drafts, None, generator)

    def _propose(
        self,
        requests: list[Request],
        drafts: list[list[int]],
        sequences: list[ScheduledSequence],
        result: StepResult,
        hidden_states: torch.Tensor,
        layout: StepLayout,
    ) -> list[list[int]]:
        """Each request's drafts for its next step, from what this one computed."""
        assert self.proposer is not None
        context = ProposalContext(
            requests=requests,
            sequences=sequences,
            new_token_ids=result.new_token_ids,
            num_valid_tokens=[
                len(seq.token_ids) - (len(request_drafts) - accepted)
                for seq, request_drafts, accepted in zip(sequences, drafts, result.num_accepted_drafts, strict=True)
            ],
            hidden_states=hidden_states,
            row_starts=[0, *layout.query_ends[:-1]],
            verified_drafts=drafts,
            num_accepted_drafts=result.num_accepted_drafts,
        )
        next_drafts = self.proposer.propose(context)
        result.looked_up = context.looked_up
        if self.constraints is not None:  # drafts the grammar refuses are cut, as vLLM does
            next_drafts = self.constraints.cut_drafts(requests, result.new_token_ids, next_drafts)
        return next_drafts

    def idle_forward(self) -> None:
        """Lock-step data parallelism: the step of a replica with nothing to run, so that the groups it
        shares with busy replicas meet in every collective. One padding token (id 0, position 0) whose
        K/V goes to slot 0 of the null block 0 (its state to the null state slot), where padded rows
        write and which no request reads;
        its hidden state and logits are dropped. Not a step of the run: nothing is scheduled. With
        graphs it runs in the bucket the replicas agree on (a decode step of one row), padded."""
        null_blocks = [[0]] * self.cache_layout.num_groups
        layout = self._pack(
            [ScheduledSequence(token_ids=[0], num_computed_tokens=0, block_ids=null_blocks, num_sampled_rows=0)]
        )
        hidden_states, all_logits = self._forward(layout)
        self._join_lm_head_without_rows(hidden_states, all_logits)
        self._propose_nothing(hidden_states)

    def _propose_nothing(self, hidden_states: torch.Tensor) -> None:
        """A step that drafts nothing here still joins the proposer forwards of the other replicas
        (lock-step: they hold collectives across the replicas)."""
        if self.proposer is not None:
            self.proposer.propose_nothing(hidden_states)

    def _join_lm_head_without_rows(self, hidden_states: torch.Tensor, all_logits: torch.Tensor | None) -> None:
        """A step that samples no row still joins the LM head's collectives when its group spans
        replicas (another replica may sample in this step); a graph's LM head (all_logits) has."""
        if all_logits is None and "lmhead_tp" in self.lock_step_kinds:
            self.worker.compute_logits(hidden_states, torch.empty(0, dtype=torch.int64, device=hidden_states.device))


def _prompt_logprob_rows(request: Request, start: int, end: int) -> range:
    """The rows of the request's positions [start, end) that score a prompt token: from the first
    position not yet scored (so a recompute after a preemption scores none twice) up to the
    prompt's second last (the last one's logits pick the first output token)."""
    if request.sampling_params.prompt_logprobs is None:
        return range(0)
    assert len(request.prompt_logprobs) >= min(start, request.num_prompt_tokens - 1), "unscored positions skipped"
    first = max(start, len(request.prompt_logprobs))
    last = min(end, request.num_prompt_tokens - 1)
    return range(first - start, max(last, first) - start)
