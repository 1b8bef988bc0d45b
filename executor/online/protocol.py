"""The request bodies the server takes, as OpenAI's API and vLLM's extensions name their fields.

Pydantic checks each field's type and range, so a bad value is a 400 that names the field; an
unknown field is refused the same way (`extra="forbid"`), except the fields clients send that
change nothing here (`user`, `metadata`, ...), which are taken and ignored. A field left out takes
the recipe's value (scheduler_config / data_config), so the server's defaults are the offline run's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from executor.types_.request import MAX_LOGPROBS, PENALTY_RANGE
from executor.types_.structured_output import response_format_spec

TokenIds = list[Annotated[int, Field(ge=0)]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """The sampling fields both endpoints share; None: the recipe's value."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1 or 0: no cut (vLLM takes -1)
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    stop_token_ids: TokenIds | None = None
    presence_penalty: Annotated[float, Field(ge=-PENALTY_RANGE, le=PENALTY_RANGE)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-PENALTY_RANGE, le=PENALTY_RANGE)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    ignore_eos: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the response
    # prefill-decode disaggregation: the Router's room and the prefill instance's bootstrap server
    # (cann-recipes' and SGLang's names); ignored by a combined server
    bootstrap_room: Annotated[int, Field(ge=0)] | None = None
    bootstrap_host: str | None = None
    bootstrap_port: Annotated[int, Field(ge=0, le=65535)] | None = None
    # vLLM's: words no output holds, and what the output must match (docs/sampling.md)
    bad_words: list[str] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # taken and ignored: they change nothing a response holds here
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    skip_special_tokens: Literal[True] = True
    spaces_between_special_tokens: Literal[True] = True
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = None  # only an empty one

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(not stop for stop in stops):
            raise ValueError("a stop string must not be empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        return stops


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Literal[1] | None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value: object) -> object:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text: a string, or the text parts of a content list (no other part is taken)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages: content part of type {part.get('type')!r} is not supported (text only)")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    add_generation_prompt: bool = True
    response_format: dict[str, Any] | None = None
    tools: Annotated[list[Any], Field(max_length=0)] | None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        response_format_spec(value)  # text, json_object or json_schema with a schema
        return value


class GenerateRequest(BaseModel):
    """cann-recipes' (and SGLang's) POST /generate: text or input_ids, with sampling_params."""

    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    input_ids: TokenIds | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    rid: str | None = None
    # the prefill-decode Router's fields (cann-recipes), passed on; ignored by a combined server
    bootstrap_room: Annotated[int, Field(ge=0)] | None = None
    bootstrap_host: str | None = None
    bootstrap_port: Annotated[int, Field(ge=0, le=65535)] | None = None
