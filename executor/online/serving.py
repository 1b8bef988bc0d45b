"""From an HTTP body to engine requests, and from their updates to OpenAI's response shapes.

A body becomes one engine Request per (prompt, choice): its token ids (text through the tokenizer
as the offline run tokenizes a dataset line; chat messages through the model's chat template) and
its SamplingParams (the recipe's defaults, then the body's fields). A choice's text is decoded
from all its tokens each step (`TextStream`): what is new since the last chunk is sent, except a
tail that may still turn into a stop string or an unfinished UTF-8 character, so streamed chunks
joined equal the text of the same request not streamed.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from executor.core.sampler.constraints import prepare_constraints
from executor.core.sampler.structured_output import StructuredOutputCompiler
from executor.offline.dataset import DatasetError, PromptRecord, tokenize_record
from executor.online.engine_loop import Update
from executor.online.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from executor.types_ import SamplingParams, TokenLogprobs
from executor.types_.structured_output import GUIDED_FIELDS, parse_structured_output, response_format_spec


class BadRequest(Exception):
    """A request the server refuses (400), its message naming the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def sampling_params(
    body: SamplingFields,
    defaults: SamplingParams,
    *,
    choice: int = 0,
    compiler: StructuredOutputCompiler | None = None,
) -> SamplingParams:
    """The recipe's defaults with the body's fields; choice j of n > 1 gets seed + j. With a
    `compiler`, bad words are tokenized and the grammar compiled here, so that one that does not
    compile is a 400 with the compiler's message."""
    overrides: dict[str, Any] = {}
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if max_tokens is not None:
        overrides["max_new_tokens"] = max_tokens
    for key in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if (value := getattr(body, key)) is not None:
            overrides[key] = value
    if body.top_k is not None:
        overrides["top_k"] = max(body.top_k, 0)
    if body.ignore_eos is not None:
        overrides["ignore_eos"] = body.ignore_eos
    if body.stop_token_ids is not None:
        overrides["stop_token_ids"] = tuple(body.stop_token_ids)
    if body.seed is not None:
        overrides["seed"] = (body.seed + choice) % 2**63
    if isinstance(body, CompletionRequest):
        overrides["logprobs"] = body.logprobs
        overrides["prompt_logprobs"] = body.logprobs if body.echo and body.logprobs is not None else None
    elif isinstance(body, ChatCompletionRequest):
        overrides["logprobs"] = (body.top_logprobs or 0) if body.logprobs else None
        overrides["prompt_logprobs"] = None
    overrides |= _constraint_overrides(body)
    params = dataclasses.replace(defaults, **overrides)
    if (reason := params.check()) is not None:
        key = reason.split(" ", 1)[0]
        raise BadRequest(
            reason.replace("max_new_tokens", "max_tokens", 1), "max_tokens" if key == "max_new_tokens" else key
        )
    if compiler is not None and (params.bad_words or params.structured_output is not None):
        try:
            params = prepare_constraints(params, compiler).params
        except ValueError as exc:
            raise BadRequest(
                str(exc), "bad_words" if str(exc).startswith("bad_words") else "structured_outputs"
            ) from exc
    return params


def _constraint_overrides(body: SamplingFields) -> dict[str, Any]:
    """The body's bad words and structured output (vLLM's fields, or a chat's response_format)."""
    overrides: dict[str, Any] = {}
    if body.bad_words is not None:
        overrides["bad_words"] = tuple(body.bad_words)
    try:
        spec = parse_structured_output(body.model_dump(include={*GUIDED_FIELDS, "structured_outputs"}))
        if isinstance(body, ChatCompletionRequest) and (from_format := response_format_spec(body.response_format)):
            if spec is not None:
                raise ValueError("give response_format or a guided_* / structured_outputs field, not both")
            spec = from_format
    except ValueError as exc:
        raise BadRequest(str(exc), "response_format") from exc
    if spec is not None:
        overrides["structured_output"] = spec
    return overrides


def prompt_token_ids(body: CompletionRequest | ChatCompletionRequest, tokenizer: Any) -> list[list[int]]:
    """The body's prompts as token ids: a completion's one or several, a chat's one."""
    try:
        if isinstance(body, ChatCompletionRequest):
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            return [tokenize_record(PromptRecord("chat", messages=messages), tokenizer, apply_chat_template=True)]
    except (DatasetError, ValueError) as exc:
        raise BadRequest(str(exc), "messages") from exc
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [prompt]  # type: ignore[list-item]
    else:
        prompts = list(prompt)  # type: ignore[arg-type]
    return [
        list(p) if isinstance(p, list) else tokenize_record(PromptRecord("p", prompt=p), tokenizer, False)
        for p in prompts
    ]


def check_prompt(token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """Refuse a prompt the model cannot take: empty, ids outside the vocabulary, too long."""
    if not token_ids:
        raise BadRequest("prompt is empty (no tokens)", "prompt")
    if max(token_ids) >= vocab_size:
        raise BadRequest(f"prompt token id {max(token_ids)} is outside the vocabulary of {vocab_size}", "prompt")
    if len(token_ids) >= max_model_len:
        raise BadRequest(
            f"prompt has {len(token_ids)} tokens; the model's limit is {max_model_len} tokens including at least "
            "one generated token (scheduler_config.max_model_len)",
            "prompt",
        )


class TextStream:
    """A choice's text as its tokens come: decoded whole each time, cut at the first stop string."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.held = max((len(stop) for stop in stops), default=1) - 1  # a stop string may still be forming
        self.token_ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of `text` already handed out
        self.stopped = False  # a stop string was met: the request ends here

    def push(self, token_ids: list[int], final: bool) -> str:
        """Take new tokens; the text ready to send (all that is left when `final` or stopped)."""
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        found = [index for stop in self.stops if (index := text.find(stop)) >= 0]
        if found:
            text, self.stopped = text[: min(found)], True
        self.text = text
        ready = len(text) if final or self.stopped else len(text.rstrip("\ufffd")) - self.held
        delta = text[self.sent : max(ready, self.sent)]
        self.sent += len(delta)
        return delta


@dataclass(slots=True)
class Choice:
    """One engine request of an HTTP request, as its updates arrive."""

    index: int
    prompt_index: int  # which of the body's prompts it continues
    request_id: str
    prompt_token_ids: list[int]
    stream: TextStream
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    error: str | None = None

    def apply(self, update: Update) -> str:
        """The update's text delta; records the finish (a stop string met finishes it as "stop")."""
        self.logprobs.extend(update.new_logprobs)
        if update.prompt_logprobs is not None:
            self.prompt_logprobs = update.prompt_logprobs
        was_stopped = self.stream.stopped
        delta = self.stream.push(update.new_token_ids, final=update.finish_reason is not None)
        if self.stream.stopped and not was_stopped:
            self.finish_reason = "stop"
        elif update.finish_reason is not None and self.finish_reason is None:
            self.finish_reason = update.finish_reason
            self.error = update.error
        return delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def output_token_ids(self) -> list[int]:
        return self.stream.token_ids


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(choices: list[Choice]) -> dict[str, int]:
    """Tokens of the request: each prompt once (its n choices share it), every choice's output."""
    prompt_tokens = sum({choice.prompt_index: len(choice.prompt_token_ids) for choice in choices}.values())
    completion_tokens = sum(len(choice.output_token_ids) for choice in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class TokenText:
    """Each token's own text, as logprobs name tokens (vLLM decodes each id alone)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def top(self, entry: TokenLogprobs) -> dict[str, float]:
        """The entry's top tokens and its own, as {text: logprob} (OpenAI's completions shape)."""
        top = {self(token): logprob for token, logprob in zip(entry.top_token_ids, entry.top_logprobs, strict=True)}
        top.setdefault(self(entry.token_id), entry.logprob)
        return top


def completion_logprobs(
    token_text: TokenText,
    entries: list[TokenLogprobs],
    text_offset: int,
    prompt: list[TokenLogprobs] | None = None,
    prompt_token_ids: list[int] | None = None,
) -> dict[str, list[Any]]:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset; with `prompt`
    (echo) the prompt's tokens first, the first with no logprob."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    if prompt is not None and prompt_token_ids is not None:
        tokens.append(token_text(prompt_token_ids[0]))
        token_logprobs.append(None)
        top_logprobs.append(None)
    for entry in [*(prompt or []), *entries]:
        tokens.append(token_text(entry.token_id))
        token_logprobs.append(entry.logprob)
        top_logprobs.append(token_text.top(entry))
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(token_text: TokenText, entries: list[TokenLogprobs]) -> dict[str, list[dict[str, Any]]]:
    """OpenAI's chat logprobs: each token with its logprob, bytes and top alternatives."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            item(entry.token_id, entry.logprob)
            | {"top_logprobs": [item(t, lp) for t, lp in zip(entry.top_token_ids, entry.top_logprobs, strict=True)]}
            for entry in entries
        ]
    }
