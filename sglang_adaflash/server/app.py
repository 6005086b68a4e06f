"""The HTTP app of `adaflash serve`: OpenAI-compatible routes around one engine loop.

Handlers run on the asyncio event loop and never touch the engine: they tokenize, hand a
:class:`~.engine_loop.Job` to the :class:`~.engine_loop.EngineLoop` thread, and turn the events
it posts back into a JSON body or a stream of server-sent events. Text comes from one
:class:`~.textstream.TextStream` per request on both paths, so a streamed answer joins to
exactly the non-streamed one.

Failure rules, each answered with an OpenAI-style error body: a body that is not valid JSON or
a field that is wrong is 400 and touches nothing else; a full queue is 429; an unknown model is
404; a request past ``--request-timeout`` is aborted in the engine and answered 504 (or ends its
stream with an error event); a request the engine failed on (a fault it blames on that request
alone) is 500 ``engine_fault`` and the others go on; a stopped or broken engine loop is 503. A
broken loop also marks ``/health`` failed and, ``FATAL_EXIT_GRACE_S`` later, stops the server,
whose command then exits 1 so that a supervisor restarts it. A client that goes away (a closed
stream, a dropped connection while waiting) has its request aborted at the next step boundary,
which frees its slot for the next request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request as HTTPRequest

from ..core.sampling import SamplingParams
from ..engine.request import Request
from ..launch.prompts import encode_prompt
from ..validation import parse_json_body
from . import sse
from .engine_loop import ACCEPTED, DONE, FAILED, TOKENS, EngineLoop, Job, LoopClosed, QueueFull
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseBuilder,
    bad_request,
    check_text,
    error_body,
    new_id,
    parse,
    speculation,
)
from .textstream import TextStream

logger = logging.getLogger(__name__)

DISCONNECTED = "disconnected"  # posted by the handler's own watcher, not by the engine loop
#: How long a server whose engine loop failed keeps answering (``/health`` 503 with the error,
#: requests 503) before it stops, so that a probe or a log collector sees why.
FATAL_EXIT_GRACE_S = 2.0
#: The exit status of `adaflash serve` after its engine loop failed.
EXIT_ENGINE_FAILED = 1
#: OpenAI's default max_tokens for /v1/completions.
COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass
class ServerSettings:
    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    request_timeout_s: float = 600.0
    mode: str = "adaflash"
    fatal_exit_grace_s: float = FATAL_EXIT_GRACE_S


class _Handle:
    """The handler's side of a job: the events the loop posted, in order."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False  # the engine is done with it, or was told to drop it

    def put(self, event: tuple) -> None:
        self.queue.put_nowait(event)


class ClientGone(Exception):
    """The client disconnected; there is nobody to answer."""


def refusal(out) -> APIError:
    """A request the engine ended with an error: its input refused (400), or a fault the engine
    blamed on it alone (500 ``engine_fault``: the server serves the others)."""
    if out.fault:
        return APIError(500, out.error or "the engine failed on this request", "server_error", None,
                        "engine_fault")
    return bad_request(out.error or "the engine refused the request")


class AdaFlashServer:
    """What one server holds, and the app built around it."""

    def __init__(self, *, engine, loop: EngineLoop, tokenizer, stop_token_ids, settings: ServerSettings,
                 reloader=None, recorder=None, registry=None, admin_env=None):
        self.engine = engine
        self.loop = loop
        self.tokenizer = tokenizer
        self.stop_token_ids = tuple(stop_token_ids)
        self.settings = settings
        self.reloader = reloader
        self.recorder = recorder
        self.registry = registry
        self.admin_env = admin_env
        self.started_at = int(time.time())
        self.ready = False
        self._request_exit = None  # set by uvicorn_server(): stops the HTTP server
        self._counter = None
        self._gauges = None
        if registry is not None:
            import prometheus_client as prom

            self._counter = prom.Counter("adaflash_server_requests", "HTTP requests answered, by endpoint and status.",
                                         ["endpoint", "status"], registry=registry)
            self._gauges = {k: prom.Gauge(f"adaflash_server_{k}_requests", f"Requests {k} in the engine now.",
                                          registry=registry) for k in ("running", "waiting")}

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        self.loop.post = aio_loop.call_soon_threadsafe
        self.loop.on_fatal = lambda error: aio_loop.call_soon_threadsafe(self._fatal, error, aio_loop)
        self.loop.start()
        if self.reloader is not None:
            self.reloader.start()
        self.ready = True

    @property
    def exit_code(self) -> int:
        """What `adaflash serve` exits with once the HTTP server stopped."""
        return EXIT_ENGINE_FAILED if self.loop.error is not None else 0

    def uvicorn_server(self, **config):
        """The uvicorn server for this app; it is stopped when the engine loop fails."""
        import uvicorn

        server = uvicorn.Server(uvicorn.Config(self.app(), **config))
        self._request_exit = lambda: setattr(server, "should_exit", True)
        return server

    def _fatal(self, error: str, aio_loop: asyncio.AbstractEventLoop) -> None:
        """On the event loop, once: stop being ready, and stop the server after the grace."""
        self.ready = False
        logger.error("adaflash serve: %s; /health answers 503, and the server stops in %g s (exit status "
                     "%d) so that its supervisor restarts it", error, self.settings.fatal_exit_grace_s,
                     EXIT_ENGINE_FAILED)
        if self._request_exit is not None:
            aio_loop.call_later(self.settings.fatal_exit_grace_s, self._request_exit)

    def stop(self) -> None:
        self.ready = False
        self.loop.stop()
        if self.reloader is not None:
            self.reloader.stop()
        if self.recorder is not None:
            self.recorder.close()

    # -- the app -------------------------------------------------------------------------------

    def app(self):
        from fastapi import FastAPI
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, Response
        from starlette.exceptions import HTTPException

        @asynccontextmanager
        async def lifespan(app):
            self.start(asyncio.get_running_loop())
            try:
                yield
            finally:
                self.stop()

        app = FastAPI(title="adaflash serve", lifespan=lifespan, docs_url=None, redoc_url=None,
                      openapi_url=None)

        @app.exception_handler(APIError)
        async def _api_error(request, exc: APIError):
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(HTTPException)
        async def _http_error(request, exc: HTTPException):
            kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

        @app.exception_handler(RequestValidationError)
        async def _validation_error(request, exc: RequestValidationError):
            first = (exc.errors() or [{}])[0]
            param = ".".join(str(x) for x in first.get("loc", ())) or None
            return JSONResponse(error_body(f"{param}: {first.get('msg')}", param=param), status_code=400)

        @app.exception_handler(Exception)
        async def _internal(request, exc: Exception):
            logger.exception("adaflash serve: unexpected error")
            return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"),
                                status_code=500)

        @app.get("/health")
        async def health():
            if self.loop.alive:
                return {"status": "ok"}
            return JSONResponse({"status": "failed", "error": self.loop.error or "not running"},
                                status_code=503)

        @app.get("/ready")
        async def ready():
            state = {"ready": self.ready and self.loop.alive, "model": self.settings.model_name,
                     "mode": self.settings.mode, **self.loop.snapshot()}
            return JSONResponse(state, status_code=200 if state["ready"] else 503)

        @app.get("/metrics")
        async def metrics():
            import prometheus_client as prom

            if self.registry is None:
                raise APIError(404, "metrics are disabled", "not_found_error")
            snap = self.loop.snapshot()
            self._gauges["running"].set(snap["running"])
            self._gauges["waiting"].set(snap["waiting"])
            return Response(prom.generate_latest(self.registry), media_type=prom.CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{model_id}")
        async def model(model_id: str):
            self._check_model(model_id)
            return self._model_card()

        @app.post("/v1/completions")
        async def completions(request: HTTPRequest):
            return await self._endpoint(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: HTTPRequest):
            return await self._endpoint(request, chat=True)

        if self.admin_env is not None:
            from .reload import mount_admin

            mount_admin(app, self.admin_env, self.settings.host)
        return app

    # -- requests ------------------------------------------------------------------------------

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.settings.model_name, "object": "model", "created": self.started_at,
                "owned_by": "adaflash"}

    def _check_model(self, name: str) -> None:
        if name != self.settings.model_name:
            raise APIError(404, f"model {name!r} is not served here; this server serves "
                                f"{self.settings.model_name!r} (GET /v1/models)",
                           "invalid_request_error", "model", "model_not_found")

    def _count(self, endpoint: str, status: int) -> None:
        if self._counter is not None:
            self._counter.labels(endpoint, str(status)).inc()

    async def _endpoint(self, request, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            response = await self._serve(request, chat)
        except APIError as e:
            self._count(endpoint, e.status)
            raise
        except ClientGone:
            self._count(endpoint, 499)
            from fastapi.responses import Response

            return Response(status_code=499)  # nobody reads it
        self._count(endpoint, response.status_code)
        return response

    async def _serve(self, request, chat: bool):
        from fastapi.responses import JSONResponse, StreamingResponse

        try:
            body = parse_json_body(await request.body())
        except ValueError as e:
            raise bad_request(str(e)) from None
        req = parse(ChatCompletionRequest if chat else CompletionRequest, body)
        req.check_supported()
        self._check_model(req.model)
        prompt_ids = self._prompt_ids(req, chat)
        limit = req.limit() if chat else req.max_tokens
        if limit is None:
            limit = max(1, self.engine.max_seq_len - len(prompt_ids)) if chat else COMPLETION_DEFAULT_MAX_TOKENS
        temperature, top_p, top_k = req.sampling_values()
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=limit,
                                  stop_token_ids=() if req.ignore_eos else self.stop_token_ids, seed=req.seed)
        sampling = sampling.canonical(self.engine.target.vocab_size)  # what the engine does, as recorded
        headers = request.headers
        rid = new_id("chatcmpl" if chat else "cmpl")
        handle = _Handle()
        stops = req.stops()
        job = Job(Request(prompt_ids, sampling, rid, req.domain(headers.get("x-adaflash-domain"))),
                  deliver=handle.put, wants_tokens=bool(req.stream or stops),
                  no_log=req.no_log(headers.get("x-adaflash-no-log")))
        try:
            self.loop.submit(job)
        except QueueFull as e:
            raise APIError(429, f"the server is at capacity ({e}); retry later", "rate_limit_error",
                           None, "queue_full") from None
        except LoopClosed as e:
            raise APIError(503, f"the server is not serving: {e}", "server_error", None, "unavailable") from None
        deadline = time.monotonic() + self.settings.request_timeout_s
        watcher = None if req.stream else asyncio.ensure_future(self._watch_disconnect(request, handle))
        try:
            first = await self._next(job, handle, deadline)
            if first[0] == DONE and first[1].finish_reason == "error":
                handle.finished = True
                raise refusal(first[1])
            if first[0] == FAILED:
                handle.finished = True
                raise APIError(503, first[1], "server_error", None, "unavailable")
            builder = ResponseBuilder(chat, self.settings.model_name, rid, self.loop.version)
            text = TextStream(self.tokenizer, stops)
            if req.stream:
                stream = self._stream(job, handle, text, deadline, first, builder, len(prompt_ids),
                                      req.include_usage())
                return StreamingResponse(stream, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
            pieces, end = [], (None, [])
            async for piece, finish, ids in self._drive(job, handle, text, deadline, first, builder):
                pieces.append(piece)
                end = (finish, ids)
            body = builder.full("".join(pieces), end[0], len(prompt_ids), end[1], req.return_token_ids,
                                speculation(job.by_version))
            return JSONResponse(body)
        finally:
            if watcher is not None:
                watcher.cancel()
            if not req.stream and not handle.finished:
                self.loop.abort(job)
                handle.finished = True

    def _prompt_ids(self, req, chat: bool) -> list[int]:
        tok = self.tokenizer
        if chat:
            if tok is None or not getattr(tok, "chat_template", None):
                raise bad_request("the served model's tokenizer has no chat template: use /v1/completions")
            conversation = req.conversation()
            for message in conversation:
                check_text(message["content"], "messages")
            try:
                out = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
            except Exception as e:  # jinja errors, roles the template refuses
                raise bad_request(f"the chat template cannot render these messages: {e}", "messages") from None
            ids = out["input_ids"] if hasattr(out, "keys") else out
            return [int(t) for t in ids]
        prompt = req.single_prompt()
        if isinstance(prompt, list):
            return prompt  # token ids: the engine checks the range
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        check_text(prompt, "prompt")
        if tok is None:
            raise bad_request("the served model has no tokenizer: send the prompt as token ids", "prompt")
        try:
            return encode_prompt(tok, prompt, use_chat_template=False)
        except Exception as e:
            raise bad_request(f"the tokenizer cannot encode this prompt: {e}", "prompt") from None

    async def _watch_disconnect(self, request, handle: _Handle) -> None:
        """Post DISCONNECTED when the client goes away while its (non-streamed) answer waits.

        The body is already read, so the next ASGI message can only be ``http.disconnect``.
        """
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                handle.put((DISCONNECTED,))
                return

    async def _next(self, job: Job, handle: _Handle, deadline: float) -> tuple:
        q = handle.queue
        if not q.empty():
            return q.get_nowait()
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            return await asyncio.wait_for(q.get(), remaining)
        except (TimeoutError, asyncio.TimeoutError):
            self.loop.abort(job)
            handle.finished = True
            raise APIError(504, f"the request took longer than {self.settings.request_timeout_s:g} s "
                                "(--request-timeout) and was aborted", "server_error", None, "timeout") from None

    async def _drive(self, job: Job, handle: _Handle, text: TextStream, deadline: float, event: tuple,
                     builder: ResponseBuilder):
        """Yields (text piece, finish reason or None, output ids so far) until the request ends."""
        ids: list[int] = []
        while True:
            kind = event[0]
            if kind == ACCEPTED:
                pass  # admitted: its tokens follow
            elif kind == TOKENS:
                ids = ids + list(event[1])
                piece = text.update(ids)
                if text.stopped:  # a stop string: drop the request now, the text is final
                    job.finish_as = "stop"
                    self.loop.abort(job)
                    handle.finished = True
                    yield piece, "stop", ids
                    return
                if piece:
                    yield piece, None, ids
            elif kind == DONE:
                handle.finished = True
                out, builder.fingerprint = event[1], event[2]
                if out.finish_reason == "error":
                    raise refusal(out)
                ids = list(out.output_ids)
                piece = text.update(ids)
                finish = "stop"
                if not text.stopped:
                    piece += text.finish()
                    finish = "length" if out.finish_reason == "length" else "stop"
                yield piece, finish, ids
                return
            elif kind == FAILED:
                handle.finished = True
                raise APIError(503, event[1], "server_error", None, "unavailable")
            elif kind == DISCONNECTED:
                self.loop.abort(job)
                handle.finished = True
                raise ClientGone
            event = await self._next(job, handle, deadline)

    async def _stream(self, job, handle, text, deadline, first, builder, prompt_tokens, include_usage):
        try:
            if builder.chat:
                yield sse.event(builder.chunk("", role=True))
            async for piece, finish, ids in self._drive(job, handle, text, deadline, first, builder):
                if piece:
                    yield sse.event(builder.chunk(piece))
                if finish is not None:
                    yield sse.event(builder.chunk(None, finish))
                    if include_usage:
                        yield sse.event(builder.usage_chunk(prompt_tokens, len(ids),
                                                            speculation(job.by_version)))
                    yield sse.DONE
        except APIError as e:  # the status is sent already: the error travels as an event
            yield sse.event(e.body())
        finally:
            # A closed stream (the client went away) ends here by cancellation: free the slot.
            if not handle.finished:
                self.loop.abort(job)
                handle.finished = True
