"""Logits constraints: what a request forbids at each sampled row before the sampler sees the
logits (its bad words, its grammar's bitmask), and the drafts its grammar refuses.

The runner calls `apply` on a step's sampled rows (a verify step's k + 1 rows of a request each
see the drafts before them) and `cut_drafts` on the proposer's drafts. Both run on the logits the
LM head gave, eagerly: in the graph modes after the graph, never inside it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from executor.core.sampler.bad_words import bad_words_token_ids, banned_token_ids
from executor.core.sampler.structured_output import GrammarStates, StructuredOutputCompiler, apply_token_bitmask
from executor.types_ import Request, SamplingParams


@dataclass(slots=True)
class ConstraintStats:
    """Host time spent on constraints over the run, for the grammar's cost per step."""

    mask_ms: float = 0.0  # filling and applying bitmasks and bans
    masked_steps: int = 0  # steps with at least one constrained row
    masked_rows: int = 0
    draft_cut_ms: float = 0.0
    drafts_cut: int = 0  # drafts the grammar refused

    def as_dict(self) -> dict[str, float]:
        mean = self.mask_ms / self.masked_steps if self.masked_steps else 0.0
        return dataclasses.asdict(self) | {"mask_ms_per_step": mean}

    @classmethod
    def summed(cls, entries: list[dict[str, Any]]) -> ConstraintStats:
        """The whole run's from its data-parallel replicas' summary entries (as_dict), added up."""
        return cls(
            **{field.name: sum(entry.get(field.name, 0) for entry in entries) for field in dataclasses.fields(cls)}
        )


@dataclass(slots=True)
class PreparedConstraints:
    """A request's parameters with its bad words as token ids, and its grammar's compile time."""

    params: SamplingParams
    compile_ms: float | None  # None: no structured output


def prepare_constraints(params: SamplingParams, compiler: StructuredOutputCompiler) -> PreparedConstraints:
    """What a request needs before it is scheduled: its bad words tokenized, its grammar compiled
    (so that one that does not compile fails this request alone, with the compiler's message).
    Raises ValueError naming the key at fault."""
    if params.bad_words:
        sequences = bad_words_token_ids(params.bad_words, compiler.tokenizer, compiler.vocab_size)
        params = dataclasses.replace(params, bad_words_token_ids=sequences)
    compile_ms = None
    if params.structured_output is not None:
        compile_ms = compiler.compile(params.structured_output).compile_ms
    return PreparedConstraints(params, compile_ms)


class LogitsConstraints:
    def __init__(self, compiler: StructuredOutputCompiler) -> None:
        self.grammars = GrammarStates(compiler)
        self.stats = ConstraintStats()

    def apply(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        rows_per_request: Sequence[int],
        drafts: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """`logits` [rows, vocab] (a request's `rows_per_request` consecutive rows: its own token,
        then one per draft) with -inf at each row's banned words' tokens and outside its grammar. The
        runner calls it only for a step where some request has constraints, so that a step without
        any passes through no file of theirs."""
        start_s = time.perf_counter()
        grammar_rows = self.grammars.fill_rows(requests, rows_per_request, drafts)
        if grammar_rows is not None:
            bitmask, rows = grammar_rows
            logits = apply_token_bitmask(logits, bitmask, rows)
        banned_rows, banned_tokens = _bad_word_bans(requests, rows_per_request, drafts)
        if banned_rows:
            logits = logits.index_put(
                (torch.tensor(banned_rows, device=logits.device), torch.tensor(banned_tokens, device=logits.device)),
                torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device),
            )
        self.stats.mask_ms += (time.perf_counter() - start_s) * 1e3
        self.stats.masked_steps += 1
        self.stats.masked_rows += sum(rows_per_request)
        return logits

    def cut_drafts(
        self, requests: Sequence[Request], new_token_ids: Sequence[Sequence[int]], drafts: list[list[int]]
    ) -> list[list[int]]:
        """Each structured request's drafts up to the first its grammar refuses after what it emits
        this step; others' as they are."""
        if not any(request.sampling_params.structured_output is not None for request in requests):
            return drafts
        start_s = time.perf_counter()
        cut = []
        for request, emitted, request_drafts in zip(requests, new_token_ids, drafts, strict=True):
            if request.sampling_params.structured_output is not None and request_drafts and not request.is_finished:
                kept = self.grammars.valid_drafts(request, emitted, request_drafts)
                self.stats.drafts_cut += len(request_drafts) - len(kept)
                request_drafts = kept
            cut.append(request_drafts)
        self.stats.draft_cut_ms += (time.perf_counter() - start_s) * 1e3
        return cut


def _bad_word_bans(
    requests: Sequence[Request], rows_per_request: Sequence[int], drafts: Sequence[Sequence[int]]
) -> tuple[list[int], list[int]]:
    """(row, token) pairs to ban: per row, its request's bad words after its output and the drafts before it."""
    banned_rows: list[int] = []
    banned_tokens: list[int] = []
    row = 0
    for request, num_rows, request_drafts in zip(requests, rows_per_request, drafts, strict=True):
        sequences = request.sampling_params.bad_words_token_ids
        for j in range(num_rows if sequences else 0):
            past = [*request.output_token_ids[-_longest(sequences) :], *request_drafts[:j]]
            for token in banned_token_ids(sequences, past):
                banned_rows.append(row + j)
                banned_tokens.append(token)
        row += num_rows
    return banned_rows, banned_tokens


def _longest(sequences: Sequence[Sequence[int]]) -> int:
    return max(len(sequence) for sequence in sequences)
