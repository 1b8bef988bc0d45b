"""Request: one prompt's journey through the scheduler, as plain data."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_new_tokens or the model's length limit
    ERROR = "error"  # the request failed alone; see Request.error


@dataclass(slots=True)
class SamplingParams:
    """How a request's tokens are chosen and when it stops. Greedy argmax for now."""

    max_new_tokens: int = 32
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()


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
    finish_reason: FinishReason | None = None
    error: str | None = None
    arrival_time_s: float = 0.0
    first_token_time_s: float | None = None
    finish_time_s: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

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

    def fail(self, reason: str, now_s: float) -> None:
        """Finish this request alone with an error; other requests are unaffected."""
        self.status = RequestStatus.FINISHED
        self.finish_reason = FinishReason.ERROR
        self.error = reason
        self.finish_time_s = now_s
