"""Structured output with xgrammar (the library vLLM and SGLang use): a request's JSON schema,
regex, choice or EBNF grammar compiled once, a grammar matcher per request that follows its
output tokens, and the token bitmask of each sampled row applied to its logits.

The bitmask is xgrammar's: int32 words, bit j of word i allowing token 32 i + j. It is applied in
plain torch (`apply_token_bitmask`: unpacked to a bool mask, -inf where a token is not allowed),
on the logits the LM head gave, before the sampler: outside any compiled graph in the graph modes.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from executor.types_ import Request
from executor.types_.structured_output import StructuredOutputSpec

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the message
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
_BITS = 32


class StructuredOutputError(ValueError):
    """A constraint that does not compile; the message is the compiler's."""


@dataclass(slots=True)
class CompiledConstraint:
    grammar: Any  # xgrammar.CompiledGrammar
    compile_ms: float  # what this compile took (a cached one: the lookup's time)


class StructuredOutputCompiler:
    """Compiles constraints for one tokenizer and vocabulary; xgrammar's compiler caches each
    grammar, so the request's check when it is made and the runner's use share one compile. Built
    lazily: the tokenizer's tables cost ~0.2 s, which a run with no structured request never pays."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None

    def compile(self, spec: StructuredOutputSpec) -> CompiledConstraint:
        """The compiled grammar of `spec`; StructuredOutputError with the compiler's message."""
        compiler = self._xgrammar_compiler()
        start_s = time.perf_counter()
        try:
            if spec.kind == "json":
                grammar = compiler.compile_json_schema(str(spec.value), any_whitespace=False)
            elif spec.kind == "json_object":
                grammar = compiler.compile_builtin_json_grammar()
            elif spec.kind == "regex":
                grammar = compiler.compile_regex(str(spec.value))
            elif spec.kind == "grammar":
                grammar = compiler.compile_grammar(str(spec.value))
            else:
                grammar = compiler.compile_grammar(choice_grammar(tuple(spec.value)))
        except (RuntimeError, ValueError, TypeError) as exc:
            message = _CPP_PREFIX.sub("", " ".join(str(exc).split()))
            raise StructuredOutputError(f"{spec.kind} does not compile: {message}") from None
        return CompiledConstraint(grammar, (time.perf_counter() - start_s) * 1e3)

    def matcher(self, spec: StructuredOutputSpec) -> Any:
        """A fresh matcher of `spec`'s grammar, at the start of an output; rollback unlimited, so a
        verify step can take back any number of drafts."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.compile(spec).grammar, max_rollback_tokens=-1)

    def _xgrammar_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar

            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
            )
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar matching exactly one of `choices` (vLLM turns a choice list into one so)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32, every token allowed (-1: all bits set)."""
    return torch.full((rows, (vocab_size + _BITS - 1) // _BITS), -1, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`logits` [R, vocab] with -inf at the tokens the bitmask [len(rows), words] does not allow at
    the given rows; a new tensor. On the CPU with float32 logits xgrammar's own kernel does it (in
    place on a copy); elsewhere plain torch (`unpack_bitmask`), which gives the same on any device."""
    vocab = logits.shape[-1]
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        import xgrammar

        masked = logits.clone()
        full = allocate_bitmask(logits.shape[0], vocab)
        full[rows] = bitmask
        xgrammar.apply_token_bitmask_inplace(masked, full, vocab_size=vocab, backend="cpu")
        return masked
    return apply_token_bitmask_torch(logits, bitmask, rows)


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """apply_token_bitmask in plain torch, on any device and dtype."""
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    masked = logits.clone()
    masked[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return masked


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool: each byte of the (little-endian) words looked
    up in a table of its 8 bits, which avoids 32 shifts of every word."""
    bits = torch.arange(8, device=bitmask.device)
    table = ((torch.arange(256, device=bitmask.device)[:, None] >> bits) & 1).bool()
    return table[bitmask.contiguous().view(torch.uint8).long()].flatten(1)[:, :vocab_size]


@dataclass(slots=True)
class _RequestGrammar:
    request: Request  # read only: its output tokens, and whether it has finished
    matcher: Any  # xgrammar.GrammarMatcher after `num_accepted` of the output tokens
    num_accepted: int = 0
    rejected: bool = False  # an output token the grammar refused (a stop token under ignore_eos)


class GrammarStates:
    """The runner's grammar matcher per structured request. A matcher follows its request's output
    tokens (read at each step, so only the scheduler changes a Request), takes a verify step's
    drafts in turn while the rows are masked, and gives them back after; a finished request's
    matcher is dropped at the next step."""

    def __init__(self, compiler: StructuredOutputCompiler) -> None:
        self.compiler = compiler
        self._states: dict[str, _RequestGrammar] = {}

    def fill_rows(
        self, requests: Sequence[Request], rows_per_request: Sequence[int], drafts: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, list[int]] | None:
        """The bitmask of every sampled row of a structured request (row j of a request: after its
        output and its first j drafts) and those rows' indices; None when no row is structured."""
        self._drop_finished()
        rows: list[int] = []
        masks: list[torch.Tensor] = []
        row = 0
        for request, num_rows, request_drafts in zip(requests, rows_per_request, drafts, strict=True):
            if num_rows and request.sampling_params.structured_output is not None:
                masks.append(self._request_rows(self._synced(request), num_rows, request_drafts))
                rows.extend(range(row, row + num_rows))
            row += num_rows
        return (torch.cat(masks), rows) if rows else None

    def valid_drafts(self, request: Request, new_token_ids: Sequence[int], drafts: Sequence[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar accepts after the request's output and the
        tokens it emits this step (vLLM cuts drafts so)."""
        if any(token < 0 for token in new_token_ids):  # a NaN mark: the request fails in this step
            return []
        state = self._synced(request)
        matcher = state.matcher
        taken = 0
        for token in (*new_token_ids, *drafts):
            if state.rejected or matcher.is_terminated() or not matcher.accept_token(token):
                break
            taken += 1
        if taken:
            matcher.rollback(taken)
        return list(drafts[: max(taken - len(new_token_ids), 0)])

    def _request_rows(self, state: _RequestGrammar, num_rows: int, drafts: Sequence[int]) -> torch.Tensor:
        bitmask = allocate_bitmask(num_rows, self.compiler.vocab_size)
        matcher = state.matcher
        taken = 0
        for j in range(num_rows):
            if state.rejected:
                break  # the grammar no longer follows the output: rows stay unmasked
            if matcher.is_terminated():
                bitmask[j:] = self._stop_only()
                break
            matcher.fill_next_token_bitmask(bitmask, j)
            if j < len(drafts) and not matcher.accept_token(drafts[j]):
                break  # this row refuses the draft, so no row after it is kept: leave them unmasked
            taken += j < len(drafts)
        if taken:
            matcher.rollback(taken)
        return bitmask

    def _stop_only(self) -> torch.Tensor:
        """After the grammar has ended (its stop token taken: only under ignore_eos is anything
        sampled after), only stop tokens may follow."""
        bitmask = torch.zeros(1, allocate_bitmask(1, self.compiler.vocab_size).shape[1], dtype=torch.int32)
        for token in self.compiler.stop_token_ids:
            bitmask[0, token // _BITS] |= 1 << (token % _BITS) if token % _BITS != _BITS - 1 else -(1 << 31)
        return bitmask

    def _synced(self, request: Request) -> _RequestGrammar:
        spec = request.sampling_params.structured_output
        assert spec is not None
        state = self._states.get(request.request_id)
        output = request.output_token_ids
        if state is None or state.request is not request or state.num_accepted > len(output):
            state = _RequestGrammar(request, self.compiler.matcher(spec))
            self._states[request.request_id] = state
        for token in output[state.num_accepted :]:
            if not state.rejected and not state.matcher.is_terminated():
                state.rejected = not state.matcher.accept_token(token)
            state.num_accepted += 1
        return state

    def _drop_finished(self) -> None:
        for request_id in [rid for rid, state in self._states.items() if state.request.is_finished]:
            del self._states[request_id]
