"""SamplingMetadata: one step's sampling parameters as per-row tensors, built once from the
requests of the step's rows, so that every stage of the sampler runs over all rows at once."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from executor.types_ import Request


@dataclass(slots=True)
class PenaltyInputs:
    """What the penalties read. The tokens each row has seen are flattened with their row index,
    so a step builds two flat tensors instead of padding every row to the longest sequence."""

    repetition: torch.Tensor  # [rows] float32; 1.0 = off
    frequency: torch.Tensor  # [rows] float32; 0.0 = off
    presence: torch.Tensor  # [rows] float32; 0.0 = off
    seen_rows: torch.Tensor  # [n] int64: the row of each prompt or output token below
    seen_token_ids: torch.Tensor  # [n] int64
    output_rows: torch.Tensor  # [m] int64: the row of each output token below
    output_token_ids: torch.Tensor  # [m] int64


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row parameters of one step. A filter's tensor is None when no row uses it, so a step
    pays only for what its requests ask; a greedy row has every filter off (argmax is what it
    picks either way) and temperature 1.0, so its logprobs are those of its penalised logits."""

    num_rows: int
    all_greedy: bool
    any_greedy: bool
    greedy: torch.Tensor | None  # [rows] bool; None when every row is greedy
    temperature: torch.Tensor | None  # [rows] float32, 1.0 on greedy rows; None when every row is greedy
    random_rows: torch.Tensor | None  # [r] int64: the rows that sample at random; None when none does
    random_seeds: list[int | None]  # per random row: its request's seed, None = the run generator
    random_positions: list[int]  # per random row: the output index of the token it samples
    top_k: torch.Tensor | None  # [rows] int64, 0 = no cut
    max_top_k: int  # the largest top_k of any row (0: none), known on the host so no step syncs for it
    top_p: torch.Tensor | None  # [rows] float32, 1.0 = no cut
    min_p: torch.Tensor | None  # [rows] float32, 0.0 = no cut
    penalties: PenaltyInputs | None
    num_logprobs: list[int | None]  # per row: SamplingParams.logprobs

    @property
    def max_num_logprobs(self) -> int | None:
        """The most top logprobs any row asks for; None when no row asks for logprobs."""
        asked = [n for n in self.num_logprobs if n is not None]
        return max(asked) if asked else None

    @property
    def needs_processing(self) -> bool:
        """False when the step is one argmax over the raw logits (every row greedy, no penalty, no logprobs)."""
        return not self.all_greedy or self.penalties is not None or self.max_num_logprobs is not None

    @classmethod
    def build(cls, requests_per_row: list[Request], device: torch.device | str) -> SamplingMetadata:
        """Row i samples for requests_per_row[i]. A request may own several consecutive rows (a
        verify step's k+1); the j-th of them samples output index len(output_token_ids) + j, and
        its penalties count the tokens the request had before the step (the draft tokens of
        earlier rows are not counted: an approximation that only penalised verify rows see)."""
        params = [request.sampling_params for request in requests_per_row]
        greedy = [p.is_greedy for p in params]
        all_greedy = all(greedy)
        penalised = [p.has_penalties for p in params]
        metadata = cls(
            num_rows=len(params),
            all_greedy=all_greedy,
            any_greedy=any(greedy),
            greedy=None,
            temperature=None,
            random_rows=None,
            random_seeds=[],
            random_positions=[],
            top_k=None,
            max_top_k=0,
            top_p=None,
            min_p=None,
            penalties=_penalty_inputs(requests_per_row, penalised, device) if any(penalised) else None,
            num_logprobs=[p.logprobs for p in params],
        )
        if all_greedy:
            return metadata
        random = [not g for g in greedy]
        top_k = [p.top_k if r else 0 for p, r in zip(params, random, strict=True)]
        top_p = [p.top_p if r else 1.0 for p, r in zip(params, random, strict=True)]
        min_p = [p.min_p if r else 0.0 for p, r in zip(params, random, strict=True)]
        positions = _output_positions(requests_per_row)
        rows = [row for row, r in enumerate(random) if r]
        metadata.greedy = _tensor(greedy, torch.bool, device)
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        metadata.temperature = _tensor(temperature, torch.float32, device)
        metadata.random_rows = _tensor(rows, torch.int64, device)
        metadata.random_seeds = [params[row].seed for row in rows]
        metadata.random_positions = [positions[row] for row in rows]
        metadata.max_top_k = max(top_k)
        metadata.top_k = _tensor(top_k, torch.int64, device) if metadata.max_top_k > 0 else None
        metadata.top_p = _tensor(top_p, torch.float32, device) if min(top_p) < 1.0 else None
        metadata.min_p = _tensor(min_p, torch.float32, device) if max(min_p) > 0.0 else None
        return metadata


def _output_positions(requests_per_row: list[Request]) -> list[int]:
    """The output index each row samples: len(output_token_ids), plus j for a request's j-th row."""
    positions: list[int] = []
    previous: Request | None = None
    for request in requests_per_row:
        positions.append(positions[-1] + 1 if request is previous else len(request.output_token_ids))
        previous = request
    return positions


def _penalty_inputs(
    requests_per_row: list[Request], penalised: list[bool], device: torch.device | str
) -> PenaltyInputs:
    """Penalty values per row and the tokens of the penalised rows (others contribute none)."""
    params = [request.sampling_params for request in requests_per_row]
    seen = [
        (request.prompt_token_ids, request.output_token_ids) if wanted else ((), ())
        for request, wanted in zip(requests_per_row, penalised, strict=True)
    ]
    seen_counts = [len(prompt) + len(output) for prompt, output in seen]
    output_counts = [len(output) for _, output in seen]
    return PenaltyInputs(
        repetition=_tensor([p.repetition_penalty for p in params], torch.float32, device),
        frequency=_tensor([p.frequency_penalty for p in params], torch.float32, device),
        presence=_tensor([p.presence_penalty for p in params], torch.float32, device),
        seen_rows=_row_index(seen_counts, device),
        seen_token_ids=_tensor(list(chain.from_iterable(chain(p, o) for p, o in seen)), torch.int64, device),
        output_rows=_row_index(output_counts, device),
        output_token_ids=_tensor(list(chain.from_iterable(o for _, o in seen)), torch.int64, device),
    )


def _row_index(counts: list[int], device: torch.device | str) -> torch.Tensor:
    """[sum(counts)] int64: row i repeated counts[i] times."""
    return torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.int64)).to(device)


def _tensor(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list on the device, built on the host first so the copy is one transfer."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
