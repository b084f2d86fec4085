"""The HTTP side of `engine.py serve`: the OpenAI routes, authentication, request limits, error
bodies, and a graceful shutdown, over the engine thread of loop.py.

Starlette and uvicorn, not FastAPI: every field is checked by hand in protocol.py to give
OpenAI's 400 bodies (FastAPI's schema validation answers 422 in its own format, which would have
to be undone), so FastAPI would add pydantic and nothing we use. Starlette streams responses and
notices a client that goes away; uvicorn is the ASGI server both are built for.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llm import LLM
from server.loop import EngineLoop, Stream
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.protocol import APIError, Reply, parse_request, read_body

log = logging.getLogger("nanokv.server")


def build_app(llm: LLM, *, model_name: str, api_key: str | None = None, max_body_bytes: int = 2**20,
              max_waiting: int = 256, default_max_tokens: int = 128) -> Starlette:
    """The server's ASGI app; its engine thread starts with the app (lifespan) and is app.state.engine."""
    metrics = ServerMetrics(llm)
    engine = EngineLoop(llm, on_step=metrics.observe_step, on_finish=metrics.observe_finish)
    context = llm.model.config.max_seq_len

    async def completions(request: Request) -> Response:
        chat = request.url.path.endswith("/chat/completions")
        if not engine.accepting:
            raise APIError("the server is shutting down; retry on another instance", status=503, code="unavailable")
        body = read_body(await _read_limited(request, max_body_bytes))
        parsed = await run_in_threadpool(  # tokenizing a long prompt would stall the streams being written
            parse_request, body, chat=chat, model_name=model_name, tokenizer=llm.tokenizer,
            vocab_size=llm.model.config.vocab_size, context=context, default_max_tokens=default_max_tokens)
        try:
            req = llm.new_request(parsed.prompt_ids, parsed.params)
        except ValueError as e:  # e.g. more pages than the whole pool holds
            raise APIError(str(e)) from None
        if engine.num_waiting >= max_waiting:
            raise APIError(f"{engine.num_waiting} requests are already waiting; retry shortly", status=429,
                           code="rate_limit_exceeded")
        stream = engine.submit(req)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, engine, stream))
        reply = Reply(chat, model_name)
        if parsed.stream:
            events = _sse_events(engine, stream, reply, parsed.include_usage, watcher)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text = []
        try:
            async for event in stream:
                if event.error:
                    raise APIError(event.error, status=500)
                text.append(event.text)
        finally:
            watcher.cancel()
            if not stream.done:
                engine.cancel(stream)
        return JSONResponse(reply.full("".join(text), req.finish_reason, len(req.prompt_ids), len(req.output_ids)))

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                                         "owned_by": "nanokv", "max_model_len": context}]})

    async def health(request: Request) -> Response:
        if not engine.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_text(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        engine.start()
        yield

    app = Starlette(
        routes=[Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/chat/completions", completions, methods=["POST"]),
                Route("/v1/models", models), Route("/health", health), Route("/metrics", metrics_text)],
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )
    app.state.engine = engine
    return BearerAuth(app, api_key) if api_key else app


async def _read_limited(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes: by its declared length, or while it arrives."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(f"the request body is {declared} bytes, over this server's limit of {limit}", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(f"the request body is over this server's limit of {limit} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


async def _cancel_on_disconnect(request: Request, engine: EngineLoop, stream: Stream) -> None:
    """Cancel the request when its client goes away, even while it waits in the queue and sends nothing."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    if not stream.done:
        engine.cancel(stream)


async def _sse_events(engine: EngineLoop, stream: Stream, reply: Reply, include_usage: bool, watcher: asyncio.Task):
    """Server-sent events of a streamed answer, ending in `data: [DONE]`. An engine failure after
    the 200 header went out arrives as an error object in the stream, as OpenAI sends them."""

    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    req = stream.req
    try:
        if reply.chat:
            yield sse(reply.chunk(None, role=True))
        async for event in stream:
            if event.error:
                yield sse(APIError(event.error, status=500).body())
                return
            if event.text:
                yield sse(reply.chunk(event.text))
            if event.finish_reason:
                yield sse(reply.chunk(None, event.finish_reason))
        if include_usage:
            yield sse(reply.usage_chunk(len(req.prompt_ids), len(req.output_ids)))
        yield "data: [DONE]\n\n"
    finally:  # also when the client disconnected and Starlette cancelled the response
        watcher.cancel()
        if not stream.done:
            engine.cancel(stream)


async def _api_error(request: Request, exc: APIError) -> Response:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _http_error(request: Request, exc: HTTPException) -> Response:  # unknown route, wrong method
    return await _api_error(request, APIError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code))


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return await _api_error(request, APIError(f"internal error: {type(exc).__name__}", status=500))


class BearerAuth:
    """ASGI middleware: every route but /health needs `Authorization: Bearer <api key>`."""

    def __init__(self, app: Starlette, api_key: str):
        self.app, self.state = app, app.state
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                error = APIError("missing or wrong API key: send the header 'Authorization: Bearer <key>'", status=401,
                                 code="invalid_api_key")
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, where SIGTERM (or a first Ctrl-C) drains instead of dropping work: new
    requests get 503, running ones finish, then it exits. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, engine: EngineLoop):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        if not self.engine.accepting:
            self.should_exit = self.force_exit = True
            return
        self.engine.accepting = False
        log.warning("draining: refusing new requests, finishing the running ones (signal again to stop now)")
        threading.Thread(target=self._exit_when_idle, daemon=True).start()

    def _exit_when_idle(self) -> None:
        self.engine.wait_idle()
        self.should_exit = True


def serve(llm: LLM, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", **app_options) -> None:
    """Run the server until SIGTERM or Ctrl-C (see DrainingServer); app_options go to build_app."""
    logging.basicConfig(format="%(levelname)s:  %(name)s: %(message)s", level=log_level.upper())
    app = build_app(llm, **app_options)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30)
    DrainingServer(config, app.state.engine).run()
