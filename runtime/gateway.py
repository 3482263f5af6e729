"""OpenAI-compatible HTTP gateway over a `Coordinator`: the front door of a verifier pod.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (the model's chat template applied),
both streaming as server-sent events (`data: {chunk}` ... `data: [DONE]`) when `stream` is true;
`GET /v1/models`; `GET /health` (200 when ready, else 503); `GET /metrics` (Prometheus).

Errors have OpenAI's shape, `{"error": {"message", "type", "code", "param"}}`: 400 for malformed
JSON, invalid fields (pydantic's 422 is turned into a 400 naming the field) and prompts that do not
fit the context; 401 for a missing or wrong API key (when one is configured; /health and /metrics
stay open); 404 for an unknown model; 429 with Retry-After when the coordinator's queue is full;
503 until the app's lifespan has started (and again once it is shutting down).

Text: each step's tokens are appended and the whole output decoded again, and only text that can
no longer change is sent (`IncrementalDetokenizer`): a trailing U+FFFD is an incomplete UTF-8
character whose remaining bytes are in the next token, and a suffix that could begin a stop
sequence waits until it cannot. Stop sequences end the request early (its coordinator slot is
freed), as does a client that disconnects, streaming or not.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any, TypeVar, cast

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from cosine.runtime.coordinator import Coordinator, GenerationRequest, Overloaded
from cosine.runtime.metrics import ServingMetrics
from cosine.runtime.models import ModelRunner
from cosine.runtime.openai_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    DeltaMessage,
    ErrorDetail,
    ErrorResponse,
    FinishReason,
    ModelCard,
    ModelList,
    Usage,
)
from cosine.runtime.speculative_decoding import StepOutput
from cosine.runtime.speculative_sampling import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256  # when the request names none; clamped to what the context leaves
_REPLACEMENT_CHAR = "\ufffd"
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
T = TypeVar("T")


def create_app(
    coordinator: Coordinator,
    runner: ModelRunner,
    *,
    model_name: str,
    api_key: str | None = None,
    metrics: ServingMetrics | None = None,
) -> FastAPI:
    """The gateway app. Its lifespan starts `coordinator` and marks the app ready; on shutdown it
    marks the app not ready and stops the coordinator. `app.state.ready` may also be set by the
    caller (e.g. False to drain before a rolling update).

    Args:
        coordinator: serves the requests; the app owns its start and stop while served.
        runner: the target model's runner, for its tokenizer, chat template and EOS tokens.
        model_name: the one name clients must send as `model` (and /v1/models lists).
        api_key: if set, /v1/* requires `Authorization: Bearer <api_key>`.
        metrics: exported at /metrics; None = the coordinator's own (`coordinator.metrics`).

    Raises:
        ValueError: `runner` has no tokenizer.
    """
    if runner.tokenizer is None:
        raise ValueError(f"the gateway needs a tokenizer; {runner.name} has none")
    if metrics is None:
        metrics = coordinator.metrics
    gateway = _Gateway(coordinator, runner, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        coordinator.start()
        app.state.ready = True
        try:
            yield
        finally:
            app.state.ready = False
            await asyncio.to_thread(coordinator.stop)  # joins the engine thread

    app = FastAPI(title="CoSine", summary="OpenAI-compatible speculative inference", lifespan=lifespan)
    app.state.ready = False
    app.add_middleware(_Gate, api_key=api_key, state=app.state)
    app.add_exception_handler(_ApiError, _api_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(_ClientGone, _client_gone_response)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal_error_response)

    @app.post("/v1/completions", response_model=Completion)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await gateway.completions(body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletion)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await gateway.chat_completions(body, request)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=[gateway.model_card])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def get_model(model_id: str) -> ModelCard:
        gateway.check_model(model_id, param=None)
        return gateway.model_card

    @app.get("/health")
    async def health(request: Request) -> Response:
        if not request.app.state.ready:
            return _error_response(_ApiError(503, "the server is not ready", code="not_ready"))
        return JSONResponse(
            {"status": "ok", "num_requests_running": coordinator.num_running,
             "num_requests_waiting": coordinator.num_waiting}
        )

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        registry = metrics.registry if metrics is not None else prometheus_client.CollectorRegistry()
        return Response(
            prometheus_client.generate_latest(registry), media_type=prometheus_client.CONTENT_TYPE_LATEST
        )

    return app


class IncrementalDetokenizer:
    """The text of a growing token sequence, released only once it can no longer change.

    Every `feed` decodes the whole output again (quadratic in the output length, but a decode is
    microseconds per token next to a model step, and it is exactly what the non-streamed response
    decodes). Held back: a trailing U+FFFD (the token ended inside a multi-byte UTF-8 character) and
    a suffix that is the start of a stop sequence. A stop sequence cuts the text where it begins,
    even across steps; the stop sequence itself is not part of the text (OpenAI's behaviour).

    Args:
        decode: token ids -> text (`ModelRunner.decode`).
        stop: stop sequences, non-empty strings.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._max_stop_chars = max((len(s) for s in self._stop), default=0)
        self.token_ids: list[int] = []
        self.text = ""  # everything decoded so far (cut at a stop sequence)
        self.released_chars = 0
        self.stopped = False  # a stop sequence was found

    def feed(self, token_ids: Sequence[int]) -> str:
        """Append tokens; returns the newly releasable text (possibly empty)."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        text = self._decode(self.token_ids)
        # A stop sequence cannot lie inside the released text (its start would have been held
        # back), so it must end past `released_chars`: search only from there.
        search_from = max(0, self.released_chars - self._max_stop_chars + 1)
        cuts = [i for i in (text.find(s, search_from) for s in self._stop) if i >= 0]
        if cuts:
            self.text, self.stopped = text[: max(min(cuts), self.released_chars)], True
            return self._release(len(self.text))
        self.text = text
        return self._release(len(text) - self._held_back_chars(text))

    def flush(self) -> str:
        """Release the rest (the output is complete)."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        piece = self.text[self.released_chars : end] if end > self.released_chars else ""
        self.released_chars += len(piece)
        return piece

    def _held_back_chars(self, text: str) -> int:
        body = text.rstrip(_REPLACEMENT_CHAR)
        stop_prefix = 0  # longest suffix of `body` that begins a stop sequence
        for s in self._stop:
            for k in range(min(len(s) - 1, len(body)), stop_prefix, -1):
                if body.endswith(s[:k]):
                    stop_prefix = k
                    break
        return len(text) - len(body) + stop_prefix


class _ApiError(Exception):
    """An error answered in OpenAI's shape with `status`."""

    def __init__(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers


class _ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class _Generation:
    """One request being generated: its coordinator stream turned into text pieces."""

    def __init__(self, steps: AsyncGenerator[StepOutput, None], first: StepOutput | None, prompt_tokens: int,
                 detok: IncrementalDetokenizer, eos_token_ids: frozenset[int]) -> None:
        self._steps, self._first, self._eos = steps, first, eos_token_ids
        self.detok = detok
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.finish_reason: FinishReason = "length"

    @property
    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=self.prompt_tokens + self.completion_tokens)

    async def pieces(self) -> AsyncGenerator[str, None]:
        """Yield the output text in pieces; sets `finish_reason` and `completion_tokens` at the end.
        Closing this generator early closes the coordinator stream, which frees the request."""
        try:
            step, last_token = self._first, None
            while step is not None:
                self.completion_tokens += len(step.token_ids)
                last_token = step.token_ids[-1] if step.token_ids else last_token
                if piece := self.detok.feed(step.token_ids):
                    yield piece
                if self.detok.stopped or step.finished:
                    break
                step = await anext(self._steps, None)
            if self.detok.stopped or last_token in self._eos:
                self.finish_reason = "stop"
            if piece := self.detok.flush():
                yield piece
        finally:
            await self.close()  # a stop sequence or a disconnect: free the slot now

    async def close(self) -> None:
        """Close the coordinator stream (idempotent); this ends the request and frees its slot."""
        await self._steps.aclose()

    async def text(self) -> str:
        async with aclosing(self.pieces()) as pieces:
            async for _ in pieces:
                pass
        return self.detok.text


class _Gateway:
    """The endpoints' logic; `create_app` wires it to routes."""

    def __init__(self, coordinator: Coordinator, runner: ModelRunner, model_name: str) -> None:
        self.coordinator, self.runner, self.model_name = coordinator, runner, model_name
        self.model_card = ModelCard(
            id=model_name, created=int(time.time()), max_model_len=coordinator.max_context_tokens
        )

    def check_model(self, model: str, *, param: str | None = "model") -> None:
        if model != self.model_name:
            raise _ApiError(
                404, f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                code="model_not_found", param=param,
            )

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        if isinstance(body.prompt, str):
            if not body.prompt:
                raise _ApiError(400, "Invalid 'prompt': empty.", code="invalid_value", param="prompt")
            # Raw text, no chat template (that is /v1/chat/completions).
            prompt_ids = self.runner.encode_text(body.prompt)
        else:
            bad = [t for t in body.prompt if not 0 <= t < self.runner.vocab_size]
            if bad:
                raise _ApiError(
                    400, f"Invalid 'prompt': token ids outside [0, {self.runner.vocab_size}): {bad[:5]}.",
                    code="invalid_value", param="prompt",
                )
            prompt_ids = list(body.prompt)
        gen = await self._start(request, body, prompt_ids, body.max_tokens, prompt_param="prompt")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, finish: FinishReason | None = None, usage: Usage | None = None) -> Completion:
            choices = [] if usage else [CompletionChoice(text=text, finish_reason=finish)]
            return Completion(id=rid, created=created, model=self.model_name, choices=choices, usage=usage)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def events() -> AsyncGenerator[Completion, None]:
                async with aclosing(gen.pieces()) as pieces:
                    async for piece in pieces:
                        yield chunk(piece)
                yield chunk("", gen.finish_reason)
                if include_usage:
                    yield chunk("", usage=gen.usage)

            return _sse(events(), gen)
        try:
            text = await _unless_disconnected(request, gen.text())
        finally:
            await gen.close()
        choice = CompletionChoice(text=text, finish_reason=gen.finish_reason)
        out = Completion(id=rid, created=created, model=self.model_name, choices=[choice], usage=gen.usage)
        return JSONResponse(out.model_dump(mode="json"))

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        # `developer` is OpenAI's newer `system`; chat templates know only the latter.
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.content}
                    for m in body.messages]
        try:
            prompt_ids = self.runner.encode_prompt(messages)
        except (ValueError, TemplateError) as e:  # empty messages, or the template refused them
            raise _ApiError(400, f"Invalid 'messages': {e}.", code="invalid_value", param="messages") from e
        gen = await self._start(request, body, prompt_ids, body.completion_limit, prompt_param="messages")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(delta: DeltaMessage | None, finish: FinishReason | None = None,
                  usage: Usage | None = None) -> ChatCompletionChunk:
            choices = [] if delta is None else [ChatChunkChoice(delta=delta, finish_reason=finish)]
            return ChatCompletionChunk(
                id=rid, created=created, model=self.model_name, choices=choices, usage=usage
            )

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def events() -> AsyncGenerator[ChatCompletionChunk, None]:
                yield chunk(DeltaMessage(role="assistant", content=""))
                async with aclosing(gen.pieces()) as pieces:
                    async for piece in pieces:
                        yield chunk(DeltaMessage(content=piece))
                yield chunk(DeltaMessage(), gen.finish_reason)
                if include_usage:
                    yield chunk(None, usage=gen.usage)

            return _sse(events(), gen)
        try:
            text = await _unless_disconnected(request, gen.text())
        finally:
            await gen.close()
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=gen.finish_reason)
        out = ChatCompletion(id=rid, created=created, model=self.model_name, choices=[choice],
                             usage=gen.usage)
        return JSONResponse(out.model_dump(mode="json"))

    async def _start(self, request: Request, body: CompletionRequest | ChatCompletionRequest,
                     prompt_ids: list[int], max_tokens: int | None, *, prompt_param: str) -> _Generation:
        """Admit the request and wait for its first step, so that admission errors (429) and bad
        requests (400) still get their status code before a stream starts."""
        room = self.coordinator.max_context_tokens - len(prompt_ids)
        if room < 1:
            raise _ApiError(
                400, f"Invalid '{prompt_param}': {len(prompt_ids)} tokens; the model's context is "
                f"{self.coordinator.max_context_tokens} tokens, leaving none for the output.",
                code="context_length_exceeded", param=prompt_param,
            )
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(0, body.top_k or 0),  # vLLM's -1 = off
            seed=body.seed,
        )
        request_id = uuid.uuid4().hex
        generation = GenerationRequest(
            prompt_ids=tuple(prompt_ids), max_tokens=min(max_tokens or DEFAULT_MAX_TOKENS, room),
            params=params, request_id=request_id,
        )
        # An async generator (annotated as an iterator): closing it is what frees the slot.
        steps = cast(AsyncGenerator[StepOutput, None], self.coordinator.generate(generation))
        try:
            first = await _unless_disconnected(request, anext(steps, None))
        except Overloaded as e:
            if self.coordinator.metrics is not None:
                self.coordinator.metrics.request_rejected()
            raise _ApiError(429, str(e), code="overloaded",
                            headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))}) from e
        except ValueError as e:  # the coordinator's own checks (prompt, max_tokens, context)
            message = f"Invalid '{prompt_param}': {e}."
            raise _ApiError(400, message, code="invalid_value", param=prompt_param) from e
        except BaseException:
            await steps.aclose()
            raise
        log.debug("request %s admitted: %d prompt tokens", request_id, len(prompt_ids))
        detok = IncrementalDetokenizer(self.runner.decode, body.stop)
        return _Generation(steps, first, len(prompt_ids), detok, self.runner.eos_token_ids)


def _sse(events: AsyncGenerator[Completion, None] | AsyncGenerator[ChatCompletionChunk, None],
         gen: _Generation) -> EventSourceResponse:
    """Stream `events` as `data: {json}` server-sent events, then `data: [DONE]`. A failure after
    the stream started can only be reported in the stream: an `{"error": ...}` event (the openai
    client raises it as an APIError). `gen` is closed at the end in any case, also when the client
    left before `events` ever ran."""

    async def frames() -> AsyncGenerator[dict[str, str], None]:
        try:
            async with aclosing(events) as chunks:
                async for c in chunks:
                    yield {"data": c.model_dump_json()}
        except Exception as e:
            log.exception("streaming failed")
            error = ErrorResponse(error=ErrorDetail(message=str(e), type="server_error"))
            yield {"data": error.model_dump_json()}
        yield {"data": "[DONE]"}

    # sep="\n": OpenAI's framing (sse-starlette defaults to "\r\n").
    return EventSourceResponse(frames(), sep="\n", background=BackgroundTask(gen.close))


async def _unless_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """Await `aw`, cancelling it if the client disconnects first (raises `_ClientGone`).

    uvicorn does not cancel a handler whose client went away, so without this a request abandoned
    while queued, or while its non-streamed answer is generated, would hold its slot to the end.
    (Once a stream has started, sse-starlette watches for the disconnect.)
    """
    work = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also if this handler is itself cancelled
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)  # let its cleanup run
    if work.cancelled():
        raise _ClientGone()
    return work.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _Gate:
    """ASGI middleware for /v1/*: API key (401), then readiness (503), before the body is read, so
    neither an unauthenticated client nor a draining server does any work on it."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, state: Any) -> None:
        self.app, self.api_key, self.state = app, api_key, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The path within this app (ASGI's `path` includes a mount's `root_path`).
        if scope["type"] == "http" and _app_path(scope).startswith("/v1/"):
            error = self._check(scope)
            if error is not None:
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> _ApiError | None:
        if self.api_key is not None:
            headers = dict(scope["headers"])
            scheme, _, key = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            valid = secrets.compare_digest(key.strip().encode(), self.api_key.encode())
            if scheme.lower() != "bearer" or not valid:
                return _ApiError(401, "Incorrect or missing API key (Authorization: Bearer <key>).",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not self.state.ready:
            return _ApiError(503, "The server is not ready.", code="not_ready", headers={"Retry-After": "1"})
        return None


def _app_path(scope: Scope) -> str:
    path: str = scope["path"]
    return path.removeprefix(scope.get("root_path", ""))


def _error_response(e: _ApiError) -> JSONResponse:
    detail = ErrorDetail(message=e.message, type=_ERROR_TYPES.get(e.status, "invalid_request_error"),
                         code=e.code, param=e.param)
    return JSONResponse(ErrorResponse(error=detail).model_dump(), status_code=e.status, headers=e.headers)


async def _api_error_response(request: Request, e: _ApiError) -> Response:
    return _error_response(e)


async def _validation_error_response(request: Request, e: RequestValidationError) -> Response:
    """FastAPI's 422 as OpenAI's 400, naming the first offending field (`messages[0].content`)."""
    err = e.errors()[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    kind = err.get("type", "")
    if kind == "json_invalid":
        error = _ApiError(400, f"Invalid JSON body: {err.get('ctx', {}).get('error', 'decode error')}.",
                          code="invalid_json")
    elif param is None:
        error = _ApiError(400, "The request body must be a JSON object (Content-Type: application/json).",
                          code="invalid_request")
    elif kind == "missing":
        error = _ApiError(400, f"Missing required parameter: '{param}'.", code="missing_required_parameter",
                          param=param)
    else:
        code = "unsupported_parameter" if kind == "unsupported_parameter" else "invalid_value"
        message = f"Invalid '{param}': {err.get('msg', 'invalid value')}."
        error = _ApiError(400, message, code=code, param=param)
    return _error_response(error)


async def _http_error_response(request: Request, e: StarletteHTTPException) -> Response:
    error = _ApiError(e.status_code, str(e.detail), headers=dict(e.headers) if e.headers else None)
    return _error_response(error)


async def _client_gone_response(request: Request, e: _ClientGone) -> Response:
    return Response(status_code=499)  # nobody is listening; nginx's "client closed request"


async def _internal_error_response(request: Request, e: Exception) -> Response:
    # Starlette re-raises `e` after this response is sent, so the server logs the traceback.
    return _error_response(_ApiError(500, f"Internal error: {type(e).__name__}: {e}"))
