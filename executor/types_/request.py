"""Request: one prompt's journey through the scheduler, as plain data."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from executor.types_.block_hash import BlockHash
from executor.types_.structured_output import StructuredOutputSpec


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_new_tokens or the model's length limit
    ERROR = "error"  # the request failed alone; see Request.error
    ABORT = "abort"  # the caller aborted it (a client that went away, a server stopping)


GREEDY_TEMPERATURE = 1e-5  # temperatures below this choose greedily (as vLLM), so no row divides by ~0
MAX_LOGPROBS = 20  # the most top logprobs a request may ask for (vLLM's default cap)
PENALTY_RANGE = 2.0  # frequency and presence penalties lie in [-2, 2] (OpenAI, vLLM)


@dataclass(slots=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops; each request carries its own.

    Defaults come from data_config / scheduler_config and a dataset line may override them;
    docs/sampling.md says what each knob does and in which order the sampler applies them.
    """

    max_new_tokens: int = 32
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    temperature: float = 0.0  # below GREEDY_TEMPERATURE = greedy
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0  # 1.0 = no nucleus cut
    seed: int | None = None  # per-request seed for random sampling; None = the sampler's run generator
    min_p: float = 0.0  # 0 = no min-p cut
    repetition_penalty: float = 1.0  # 1.0 = off; over prompt + output tokens
    frequency_penalty: float = 0.0  # 0 = off; times each token's count in the output
    presence_penalty: float = 0.0  # 0 = off; once for each token present in the output
    logprobs: int | None = None  # None = off; 0 = the sampled token's; n = also the top n
    # None = off; 0 = each prompt token's logprob (teacher forced); n = also the top n (vLLM's)
    prompt_logprobs: int | None = None
    # vLLM's bad_words: words the output must not hold; their token sequences (each word with and
    # without a leading space) are filled in from the tokenizer when the request is made
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # what the output must match (a JSON schema, regex, choice or grammar); None = free text
    structured_output: StructuredOutputSpec | None = None

    @property
    def has_logits_constraints(self) -> bool:
        """Tokens are masked before sampling: banned words or a grammar (docs/sampling.md)."""
        return bool(self.bad_words_token_ids) or self.structured_output is not None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def is_plain_greedy(self) -> bool:
        """Its token is the argmax of the raw logits: greedy, no penalty, no logprobs asked for."""
        return self.is_greedy and not self.has_penalties and self.logprobs is None

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def check(self) -> str | None:
        """Why these parameters cannot be served, or None; the message starts with the key at fault."""
        if self.max_new_tokens < 1:
            return f"max_new_tokens must be >= 1, got {self.max_new_tokens}"
        # `not x >= lo` rather than `x < lo`: NaN (which json.loads accepts) fails every comparison
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            return f"temperature must be a finite number >= 0, got {self.temperature}"
        if self.top_k < 0:
            return f"top_k must be >= 0, got {self.top_k}"
        if not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {self.top_p}"
        if not 0.0 <= self.min_p <= 1.0:
            return f"min_p must be in [0, 1], got {self.min_p}"
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            return f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"
        for key in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, key)
            if not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                return f"{key} must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], got {value}"
        if self.seed is not None and not 0 <= self.seed < 2**63:
            return f"seed must be in [0, 2**63), got {self.seed}"
        for key in ("logprobs", "prompt_logprobs"):
            value = getattr(self, key)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                return f"{key} must be in [0, {MAX_LOGPROBS}], got {value}"
        if any(not isinstance(word, str) or not word.strip() for word in self.bad_words):
            return f"bad_words must be non-empty strings, got {list(self.bad_words)!r}"
        return None


@dataclass(slots=True)
class TokenLogprobs:
    """The logprobs of one token (an output token's, SamplingParams.logprobs, or a prompt token's,
    SamplingParams.prompt_logprobs): the token's own, and the top n tokens' of the same
    distribution, most likely first."""

    token_id: int
    logprob: float
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Request:
    request_id: str
    prompt: str | list[dict[str, str]] | None  # as given: text or chat messages; None for token ids
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose K/V is already in the cache.
    num_computed_tokens: int = 0
    # Hashes of the request's full blocks of tokens, for prefix caching (grown by the KV cache manager).
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Draft tokens proposed after the last step, for the next decode step to verify.
    spec_token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    arrival_time_s: float = 0.0
    first_token_time_s: float | None = None
    finish_time_s: float | None = None
    # One entry per sampled output token when sampling_params.logprobs is set (the scheduler appends).
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # When sampling_params.prompt_logprobs is set: one entry per prompt token from the second on
    # (entry i scores prompt token i + 1), as prefill computes them (the scheduler appends).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # How long its structured output's grammar took to compile when the request was made; None without one.
    grammar_compile_ms: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, from arrival; None before it (or for a request that failed first)."""
        return None if self.first_token_time_s is None else self.first_token_time_s - self.arrival_time_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two, or unfinished."""
        if self.finish_time_s is None or self.first_token_time_s is None or len(self.output_token_ids) < 2:
            return None
        return (self.finish_time_s - self.first_token_time_s) / (len(self.output_token_ids) - 1)

    def full_block_hashes(self, block_size: int) -> list[BlockHash]:
        """The hashes of every full block of the request's tokens, computed once each as it grows."""
        hashes = self.block_hashes
        parent = hashes[-1].chain() if hashes else None
        for start in range(len(hashes) * block_size, self.num_tokens - block_size + 1, block_size):
            block_hash = BlockHash(parent, tuple(self.token_ids_between(start, start + block_size)))
            hashes.append(block_hash)
            parent = block_hash.chain()
        return hashes

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole sequence each step."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @classmethod
    def failed(
        cls,
        request_id: str,
        prompt: str | list[dict[str, str]] | None,
        sampling_params: SamplingParams,
        reason: str,
        now_s: float,
    ) -> Request:
        """A request that fails before it is scheduled (it could not be tokenized, say)."""
        request = cls(request_id, prompt, [], sampling_params)
        request.fail(reason, now_s)
        return request

    def fail(self, reason: str, now_s: float) -> None:
        """Finish this request alone with an error; other requests are unaffected."""
        self.status = RequestStatus.FINISHED
        self.finish_reason = FinishReason.ERROR
        self.error = reason
        self.finish_time_s = now_s
