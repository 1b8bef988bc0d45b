"""Sampler: the processed distribution of every row, the token each row samples from it, and logprobs.

Order of operations, as xLLM's Sampler::forward (seed 000, section 5) and vLLM: penalties
(repetition, then frequency and presence), temperature, top-k, top-p, min-p, then per row greedy
(argmax) or random (the exponential race of noise.py), in one pass over a batch that may mix both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor.core.sampler.metadata import SamplingMetadata
from executor.core.sampler.noise import ExponentialNoise
from executor.core.sampler.processors import (
    NEG_INF,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
)
from executor.types_ import TokenLogprobs

# The token a row samples when its logits hold a NaN (a damaged checkpoint, an overflow): no token,
# but this mark, which reaches the host in the step's one read of the sampled ids; the scheduler
# then fails the row's request alone with NAN_LOGITS_REASON instead of appending it.
NAN_LOGITS_TOKEN = -1
NAN_LOGITS_REASON = (
    "the model's logits for this request hold NaN (damaged weights or an overflow in the model's dtype); "
    "nothing was sampled from them"
)


@dataclass(slots=True)
class LogprobsTensors:
    """Logprobs of a step's rows, still on the device; `per_row` brings them to the host in one read."""

    sampled: torch.Tensor  # [rows] float32: the sampled token's logprob
    top_token_ids: torch.Tensor  # [rows, n] int64, most likely first (n: the most any row asked for)
    top_logprobs: torch.Tensor  # [rows, n] float32

    def per_row(self, token_ids: list[int], num_logprobs: list[int | None]) -> list[TokenLogprobs | None]:
        """Each row's TokenLogprobs (None where its request asked for none). A row's top list
        leaves out tokens it could not sample (cut by top-k/top-p/min-p: logprob -inf)."""
        n = self.top_logprobs.shape[1]
        # float64 holds every token id exactly, so one tensor (and one host read) carries all three
        columns = (self.sampled[:, None], self.top_logprobs, self.top_token_ids)
        host = torch.cat([column.double() for column in columns], dim=1).tolist()
        rows: list[TokenLogprobs | None] = []
        for token_id, wanted, values in zip(token_ids, num_logprobs, host, strict=True):
            if wanted is None:
                rows.append(None)
                continue
            top_logprobs, top_ids = values[1 : 1 + wanted], values[1 + n : 1 + n + wanted]
            kept = [lp > NEG_INF for lp in top_logprobs]
            rows.append(
                TokenLogprobs(
                    token_id,
                    values[0],
                    [int(i) for i, keep in zip(top_ids, kept, strict=True) if keep],
                    [lp for lp, keep in zip(top_logprobs, kept, strict=True) if keep],
                )
            )
        return rows


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [rows] int64
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


class Sampler:
    """Samples one token per row of logits [rows, vocab], each row with its request's parameters.

    Logprobs are vLLM's "processed_logprobs": log-softmax of the logits after penalties,
    temperature, top-k, top-p and min-p, i.e. of the distribution the row sampled from (a cut
    token has -inf). A greedy row's are those of its penalised logits at temperature 1, since the
    point mass it samples from would say nothing.
    """

    def __init__(
        self, run_seed: int, device: torch.device | str, argmax_rows: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        self.noise = ExponentialNoise(run_seed, device)
        self.argmax_rows = argmax_rows  # the greedy choice: the backend's (ops/backend.py)

    def processed_logits(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """float32 logits after every stage the rows ask for; -inf where a token is cut."""
        logits = logits.float()
        if metadata.penalties is not None:
            logits = apply_penalties(logits, metadata.penalties)
        if metadata.temperature is not None:
            logits = apply_temperature(logits, metadata.temperature)
        if metadata.top_k is not None or metadata.top_p is not None:
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.max_top_k, metadata.top_p)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        return logits

    def probabilities(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """[rows, vocab] float32: the distribution each row samples from; a greedy row's is a point
        mass on its argmax, so that a rejection sampler treats greedy and random rows alike."""
        processed = self.processed_logits(logits, metadata)
        probs = processed.softmax(dim=-1)
        if metadata.any_greedy:
            point_mass = torch.zeros_like(probs).scatter_(1, self.argmax_rows(processed)[:, None], 1.0)
            probs = point_mass if metadata.greedy is None else torch.where(metadata.greedy[:, None], point_mass, probs)
        return probs

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """Every row's argmax of the raw logits (NaN rows marked): a step no row of which needs
        processing, which the runner asks for without building metadata."""
        return mark_nan_rows(logits, self.argmax_rows(logits))

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """The token of every row (greedy rows: argmax; random rows: a draw from `probabilities`),
        and logprobs when a row asks. An all-greedy step with no penalty or logprobs is one argmax."""
        if not metadata.needs_processing:
            return SamplerOutput(self.greedy(logits), None)
        processed = self.processed_logits(logits, metadata)
        token_ids = self.argmax_rows(processed)
        if metadata.random_rows is not None:
            probs = processed[metadata.random_rows].softmax(dim=-1)
            noise = self.noise.sample(metadata.random_seeds, metadata.random_positions, probs.shape[-1])
            token_ids = token_ids.index_copy(0, metadata.random_rows, self.argmax_rows(probs / noise))
        max_num_logprobs = metadata.max_num_logprobs
        logprobs = None if max_num_logprobs is None else _logprobs(processed, token_ids, max_num_logprobs)
        return SamplerOutput(mark_nan_rows(logits, token_ids), logprobs)


def without_nan_marks(token_ids: list[int]) -> list[int]:
    """Sampled ids with token 0 where a row's logits held NaN: for a drafter, which embeds what it
    reads (the request fails, or its drafts are verified and rejected, so the token is never kept)."""
    return [max(token_id, 0) for token_id in token_ids]


def mark_nan_rows(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """`token_ids` with NAN_LOGITS_TOKEN on the rows whose logits hold a NaN; on the device, no host read."""
    return torch.where(logits.isnan().any(dim=-1), NAN_LOGITS_TOKEN, token_ids)


def prompt_logprobs(logits: torch.Tensor, token_ids: list[int], num_logprobs: list[int]) -> list[TokenLogprobs]:
    """vLLM's prompt logprobs: per row, the fp32 log-softmax of its raw logits (no penalty,
    temperature or filter applies to a prompt token nobody sampled) at the given token, and the
    top `num_logprobs[row]`; one host read for the whole step."""
    targets = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    rows = _logprobs(logits.float(), targets, max(num_logprobs)).per_row(token_ids, list(num_logprobs))
    return [row for row in rows if row is not None]


def _logprobs(processed: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    logprobs = processed.log_softmax(dim=-1)
    top_logprobs, top_token_ids = logprobs.topk(num_top, dim=-1)
    return LogprobsTensors(logprobs.gather(1, token_ids[:, None])[:, 0], top_token_ids, top_logprobs)
