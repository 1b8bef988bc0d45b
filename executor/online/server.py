"""The OpenAI-compatible HTTP server (FastAPI), in front of the engine loop.

Routes: POST /v1/completions and /v1/chat/completions (OpenAI's shapes, `stream` as server-sent
events ending in `data: [DONE]`), GET /v1/models, /health, /metrics (Prometheus), and
cann-recipes' POST /generate, GET /stats and POST /stop. Each HTTP request becomes one engine
request per (prompt, choice); a handler waits on an asyncio queue the engine loop's thread feeds.
A client that goes away (or times out) has its requests aborted, their blocks freed at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError

from executor.core.sampler.structured_output import StructuredOutputCompiler
from executor.online.disagg.loop import DisaggEngineLoop
from executor.online.disagg.scheduler import DisaggTicket
from executor.online.disagg.transfer import TRANSFER_ERROR
from executor.online.engine_loop import EngineLoop, QueueFull, Update
from executor.online.metrics import ServerMetrics
from executor.online.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest, SamplingFields
from executor.online.serving import (
    BadRequest,
    Choice,
    TextStream,
    TokenText,
    chat_logprobs,
    check_prompt,
    completion_logprobs,
    new_id,
    now_s,
    prompt_token_ids,
    sampling_params,
    usage,
)
from executor.types_ import Request as EngineRequest
from executor.types_ import SamplingParams

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there


@dataclass(slots=True)
class ServerSettings:
    model_names: list[str]  # "default" first, then --served-model-name
    max_model_len: int
    vocab_size: int
    defaults: SamplingParams  # the recipe's (scheduler_config, data_config)
    # grammars compile (and bad words tokenize) when a request comes; the engine's, shared with its runner
    compiler: StructuredOutputCompiler | None = None


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """OpenAI's error body."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(
        status, "InternalServerError"
    )
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


def first_error(errors: Sequence[Any], prefix: str = "") -> tuple[str, str | None]:
    """The first problem pydantic found in a body, as a message naming its field, and the field."""
    error = errors[0]
    location = [prefix] if prefix else []
    location += [str(part) for part in error.get("loc", ()) if part != "body"]
    field = ".".join(location) or None
    if error.get("type") == "json_invalid":
        return f"malformed JSON body: {error.get('ctx', {}).get('error', error.get('msg'))}", None
    if error.get("type") == "extra_forbidden":
        return f"unknown field {field!r}", field
    if field is None:
        return f"request body: {error.get('msg')}", None
    return f"{field}: {error.get('msg')} (got {error.get('input')!r})", field


class OnlineServer:
    """The app and what its handlers share: the engine loop, the tokenizer, the metrics."""

    def __init__(self, loop: EngineLoop, tokenizer: Any, settings: ServerSettings) -> None:
        self.engine_loop = loop
        self.tokenizer = tokenizer
        self.token_text = TokenText(tokenizer)
        self.settings = settings
        self.metrics = ServerMetrics(lambda: loop.stats)
        self.request_stop: Callable[[], None] = lambda: None  # set by whoever runs the app (uvicorn)
        self.app = self._make_app()

    def _make_app(self) -> FastAPI:
        app = FastAPI(title="infer-recipes", docs_url=None, redoc_url=None)

        @app.exception_handler(RequestValidationError)
        async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
            message, param = first_error(exc.errors())
            return error_response(400, message, param)

        @app.exception_handler(BadRequest)
        async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
            return error_response(exc.status, str(exc), exc.param)

        @app.exception_handler(QueueFull)
        async def _full(_: Request, exc: QueueFull) -> JSONResponse:
            return error_response(503, f"the server is busy: {exc}; retry later")

        @app.exception_handler(Exception)
        async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
            logger.exception("request failed")
            return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.get("/v1/models")(self.models)
        app.get("/health")(self.health)
        app.get("/metrics")(self.metrics_text)
        app.post("/generate")(self.generate)
        app.get("/stats")(self.stats)
        app.post("/stop")(self.stop)
        app.get("/bootstrap_info")(self.bootstrap_info)
        return app

    # -- routes -----------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        return await self._serve(body, raw, chat=False)

    async def chat_completions(self, body: ChatCompletionRequest, raw: Request) -> Response:
        return await self._serve(body, raw, chat=True)

    async def models(self) -> dict[str, Any]:
        created = now_s()
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "infer-recipes",
                "max_model_len": self.settings.max_model_len,
            }
            for name in self.settings.model_names
        ]
        return {"object": "list", "data": data}

    async def health(self) -> Response:
        if self.engine_loop.error is not None:
            return error_response(503, f"the engine stopped: {self.engine_loop.error}")
        return Response(status_code=200)

    async def metrics_text(self) -> Response:
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def stats(self) -> dict[str, Any]:
        stats = asdict(self.engine_loop.stats) | {"num_in_flight": self.engine_loop.num_in_flight}
        if isinstance(self.engine_loop, DisaggEngineLoop):
            stats |= self.engine_loop.transfer_stats()
        return stats

    async def bootstrap_info(self) -> Response:
        """Prefill-decode disaggregation: this instance's role and its bootstrap server (the Router asks)."""
        if not isinstance(self.engine_loop, DisaggEngineLoop):
            return JSONResponse({"role": "combined"})
        return JSONResponse(self.engine_loop.bootstrap_info())

    async def stop(self) -> dict[str, str]:
        """cann-recipes' /stop: stop taking requests, finish or abort the running ones, exit."""
        self.request_stop()
        return {"status": "stopping"}

    async def generate(self, body: GenerateRequest, raw: Request) -> Response:
        """cann-recipes' /generate (SGLang's shape): text or input_ids, sampling_params with
        max_new_tokens; the answer is text, output_ids and meta_info."""
        params = dict(body.sampling_params)
        if "max_new_tokens" in params:
            params["max_tokens"] = params.pop("max_new_tokens")
        try:
            fields = SamplingFields.model_validate(params)
        except ValidationError as exc:
            message, param = first_error(exc.errors(), "sampling_params")
            raise BadRequest(message, param) from exc
        if (body.text is None) == (body.input_ids is None):
            raise BadRequest("give exactly one of text and input_ids", "text")
        prompt = body.input_ids if body.input_ids is not None else body.text
        pd_fields = body.model_dump(include={"bootstrap_room", "bootstrap_host", "bootstrap_port"}, exclude_none=True)
        completion = CompletionRequest.model_validate(
            fields.model_dump(exclude_unset=True) | pd_fields | {"prompt": prompt}
        )
        tracked = self._submit(completion, body.rid or new_id("gen"))
        await self._collect(tracked, raw)
        choice = tracked[0].choice
        return JSONResponse(
            {
                "text": choice.stream.text,
                "output_ids": choice.output_token_ids,
                "meta_info": {
                    "id": choice.request_id,
                    "prompt_tokens": len(choice.prompt_token_ids),
                    "completion_tokens": len(choice.output_token_ids),
                    "finish_reason": {"type": choice.finish_reason, "message": choice.error},
                },
            }
        )

    # -- serving ------------------------------------------------------------------------------

    async def _serve(self, body: CompletionRequest | ChatCompletionRequest, raw: Request, chat: bool) -> Response:
        self._check_model(body.model)
        request_id = new_id("chatcmpl" if chat else "cmpl")
        tracked = self._submit(body, request_id)
        if body.stream:
            events = self._stream(body, raw, request_id, tracked, chat)
            return StreamingResponse(events, media_type="text/event-stream")
        await self._collect(tracked, raw)
        failed = next((item.choice for item in tracked if item.choice.finish_reason == "error"), None)
        if failed is not None:
            status = 503 if (failed.error or "").startswith(TRANSFER_ERROR) else 400
            return error_response(status, f"request failed: {failed.error}")
        return JSONResponse(self._response(body, request_id, tracked, chat))

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.settings.model_names:
            served = ", ".join(self.settings.model_names)
            raise BadRequest(f"model {name!r} does not exist; this server serves: {served}", "model", status=404)

    def _submit(self, body: CompletionRequest | ChatCompletionRequest, request_id: str) -> list[_Tracked]:
        """Tokenize, check, and hand each (prompt, choice) to the engine loop; all or none."""
        prompts = prompt_token_ids(body, self.tokenizer)
        disagg = self._disagg_loop(body)
        for token_ids in prompts:
            check_prompt(token_ids, self.settings.vocab_size, self.settings.max_model_len)
        tracked: list[_Tracked] = []
        arrival_s = time.perf_counter()
        try:
            for prompt_index, token_ids in enumerate(prompts):
                for j in range(body.n):
                    params = sampling_params(body, self.settings.defaults, choice=j, compiler=self.settings.compiler)
                    index = prompt_index * body.n + j
                    stream = TextStream(self.tokenizer, list(body.stop or []))
                    choice = Choice(index, prompt_index, f"{request_id}-{index}", token_ids, stream)
                    item = _Tracked(choice, asyncio.Queue(), arrival_s)
                    engine_request = EngineRequest(choice.request_id, None, token_ids, params)
                    if disagg is None:
                        self.engine_loop.submit(engine_request, item.sink())
                    else:  # each choice its own room: the Router's, and its index
                        ticket = DisaggTicket(
                            f"{body.bootstrap_room}-{index}", str(body.bootstrap_host), int(body.bootstrap_port or 0)
                        )
                        disagg.submit_disagg(engine_request, item.sink(), ticket)
                    tracked.append(item)
        except Exception:
            for item in tracked:
                self.engine_loop.abort(item.choice.request_id)
            raise
        return tracked

    def _disagg_loop(self, body: CompletionRequest | ChatCompletionRequest) -> DisaggEngineLoop | None:
        """The role loop a request goes to with its ticket; None on a combined server (which
        ignores the bootstrap fields). A prefill or decode instance takes only the Router's requests."""
        if not isinstance(self.engine_loop, DisaggEngineLoop):
            return None
        for field in ("bootstrap_room", "bootstrap_host", "bootstrap_port"):
            if getattr(body, field) is None:
                raise BadRequest(
                    f"this is a {self.engine_loop.role} instance of prefill-decode disaggregation: it takes requests "
                    f"through the Router (python -m executor.online.router), which sets {field}",
                    field,
                )
        return self.engine_loop

    async def _collect(self, tracked: list[_Tracked], raw: Request) -> None:
        """Wait for every choice to finish; abort them all if the client goes away first."""
        watcher = asyncio.ensure_future(self._watch_disconnect(raw, tracked))
        try:
            for item in tracked:
                while not item.choice.finished:
                    self._apply(item, await item.queue.get())
        finally:
            watcher.cancel()
            self._abort_unfinished(tracked)

    async def _watch_disconnect(self, raw: Request, tracked: list[_Tracked]) -> None:
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await raw.is_disconnected():
                logger.info("client of %s went away: aborting", tracked[0].choice.request_id.rsplit("-", 1)[0])
                self._abort_unfinished(tracked)
                for item in tracked:  # wake the handler, which stops waiting for the loop
                    item.queue.put_nowait(Update(item.choice.request_id, [], [], finish_reason="abort"))
                return

    def _abort_unfinished(self, tracked: list[_Tracked]) -> None:
        """End the choices still running (their client went away): aborted in the engine, counted
        as aborted in the metrics."""
        for item in tracked:
            if not item.engine_done:
                self.engine_loop.abort(item.choice.request_id)
            if not item.choice.finished:
                self._apply(item, Update(item.choice.request_id, [], [], finish_reason="abort"))

    def _apply(self, item: _Tracked, update: Update) -> str:
        """Apply an update to its choice; the text delta. A stop string met aborts the engine request."""
        was_finished = item.choice.finished
        if update.new_token_ids and item.first_token_s is None:
            item.first_token_s = time.perf_counter()
        item.engine_done = item.engine_done or update.finish_reason is not None
        delta = item.choice.apply(update)
        if item.choice.finished and not was_finished:
            if not item.engine_done:  # a stop string met here
                self.engine_loop.abort(item.choice.request_id)
            self.metrics.request_finished(
                item.choice.finish_reason or "abort",
                len(item.choice.prompt_token_ids),
                len(item.choice.output_token_ids),
                item.arrival_s,
                item.first_token_s,
                time.perf_counter(),
            )
        return delta

    def _response(
        self, body: CompletionRequest | ChatCompletionRequest, request_id: str, tracked: list[_Tracked], chat: bool
    ) -> dict[str, Any]:
        choices = [item.choice for item in tracked]
        model = body.model or self.settings.model_names[0]
        out: list[dict[str, Any]] = []
        for choice in choices:
            entry: dict[str, Any] = {"index": choice.index, "finish_reason": choice.finish_reason}
            if chat:
                assert isinstance(body, ChatCompletionRequest)
                entry["message"] = {"role": "assistant", "content": choice.stream.text}
                entry["logprobs"] = chat_logprobs(self.token_text, choice.logprobs) if body.logprobs else None
            else:
                assert isinstance(body, CompletionRequest)
                prompt_text = self.tokenizer.decode(choice.prompt_token_ids) if body.echo else ""
                entry["text"] = prompt_text + choice.stream.text
                entry["logprobs"] = self._completion_logprobs(body, choice, choice.logprobs, echo=body.echo)
            if body.return_token_ids:
                entry["prompt_token_ids"] = choice.prompt_token_ids
                entry["token_ids"] = choice.output_token_ids
            out.append(entry)
        return {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": now_s(),
            "model": model,
            "choices": out,
            "usage": usage(choices),
        }

    def _completion_logprobs(
        self, body: CompletionRequest, choice: Choice, entries: list[Any], echo: bool, text_offset: int = 0
    ) -> dict[str, Any] | None:
        if body.logprobs is None:
            return None
        prompt = choice.prompt_logprobs if echo else None
        return completion_logprobs(self.token_text, entries, text_offset, prompt, choice.prompt_token_ids)

    async def _stream(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        raw: Request,
        request_id: str,
        tracked: list[_Tracked],
        chat: bool,
    ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per choice per step that made text, the finish, usage if asked."""
        model = body.model or self.settings.model_names[0]
        created = now_s()
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict[str, Any]], **extra: Any) -> str:
            chunk = {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices}
            return f"data: {json.dumps(chunk | extra)}\n\n"

        merged: asyncio.Queue[tuple[_Tracked, Update]] = asyncio.Queue()
        forwarders = [asyncio.ensure_future(_forward(item, merged)) for item in tracked]
        try:
            num_open = len(tracked)
            started: set[int] = set()  # choices that sent a chunk: the first carries the role, or the echo
            while num_open:
                item, update = await merged.get()
                if item.choice.finished:
                    continue
                num_logprobs_before = len(item.choice.logprobs)
                text = self._apply(item, update)
                choice = item.choice
                new_logprobs = choice.logprobs[num_logprobs_before:]
                entry: dict[str, Any] = {"index": choice.index, "finish_reason": choice.finish_reason}
                if chat:
                    assert isinstance(body, ChatCompletionRequest)
                    entry["delta"] = {"content": text} if text else {}
                    if choice.index not in started:  # with the first token, as vLLM: TTFT reads true
                        started.add(choice.index)
                        entry["delta"] = {"role": "assistant", "content": text}
                    entry["logprobs"] = chat_logprobs(self.token_text, new_logprobs) if body.logprobs else None
                else:
                    assert isinstance(body, CompletionRequest)
                    echo = body.echo and choice.index not in started  # the prompt goes first, once
                    if echo:
                        started.add(choice.index)
                        text = self.tokenizer.decode(choice.prompt_token_ids) + text
                    entry["text"] = text
                    entry["logprobs"] = self._completion_logprobs(body, choice, new_logprobs, echo=echo)
                if choice.finished and choice.finish_reason == "error":
                    error = {"error": {"message": f"request failed: {choice.error}", "code": 400}}
                    yield f"data: {json.dumps(error)}\n\n"
                elif text or choice.finished or entry.get("logprobs") or "role" in entry.get("delta", {}):
                    if body.return_token_ids:
                        entry["token_ids"] = update.new_token_ids
                    yield event([entry])
                num_open -= choice.finished
            if body.stream_options is not None and body.stream_options.include_usage:
                yield event([], usage=usage([item.choice for item in tracked]))
            yield "data: [DONE]\n\n"
        finally:
            for forwarder in forwarders:
                forwarder.cancel()
            self._abort_unfinished(tracked)


@dataclass(slots=True)
class _Tracked:
    """A choice on the HTTP side: its queue of updates (fed from the engine loop's thread) and times."""

    choice: Choice
    queue: asyncio.Queue[Update]
    arrival_s: float
    first_token_s: float | None = None
    engine_done: bool = False  # the engine sent its last update (or it was aborted from here)

    def sink(self) -> Callable[[Update], None]:
        loop = asyncio.get_running_loop()
        return lambda update: loop.call_soon_threadsafe(self.queue.put_nowait, update)


async def _forward(item: _Tracked, merged: asyncio.Queue[tuple[_Tracked, Update]]) -> None:
    while True:
        merged.put_nowait((item, await item.queue.get()))
