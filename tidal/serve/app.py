"""The FastAPI app: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`.

Every error is an OpenAI-style body (`{"error": {"message", "type", "param", "code"}}`):
400 for a bad request, 401 without the API key when one is set, 404 for an unknown path, 500
for a failure inside the engine; never a traceback. The handlers check and encode a request
on the event loop (fast), then await the Engine's future: generation runs on the engine's
thread, so the loop keeps accepting other clients, whose requests join the same batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tidal.serve.api import Prepared, Served
from tidal.serve.schema import ApiError
from tidal.serve.streaming import EventStream

Record = Callable[[Mapping[str, str], dict[str, Any]], None]
"""`record(headers, response)`: sees every completion served, with its request's headers."""


def create_app(
    served: Served,
    *,
    api_key: str | None = None,
    manage_engine: bool = True,
    record: Record | None = None,
) -> Any:
    """The app serving `served`. With `api_key`, every request needs `Authorization: Bearer
    KEY`. `manage_engine`: start the engine with the app and stop it at shutdown. `record`
    is called with each request's headers and its whole response body (streamed or not), on
    the event loop; tidal/rl/envs/verifiers.py collects an external agent's token-exact turns
    with it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_engine:
            served.engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await asyncio.to_thread(served.engine.stop)

    app = FastAPI(title="tidal", docs_url=None, redoc_url=None, lifespan=lifespan)

    def error(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error(ApiError(str(exc.detail), status=exc.status_code, type=kind))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        message = f"internal error: {type(exc).__name__}: {exc}"
        return error(ApiError(message, status=500, type="server_error"))

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error(
                    ApiError(
                        "missing or incorrect API key (Authorization: Bearer KEY)",
                        status=401,
                        code="invalid_api_key",
                    )
                )
        return await call_next(request)

    def failed(e: BaseException, future: Future) -> ApiError:
        """The 500 of a request whose engine failed, or whose response failed to build."""
        if future.exception() is not None:
            return ApiError(
                f"the engine failed: {type(e).__name__}: {e}", status=500, type="server_error"
            )
        message = f"internal error: {type(e).__name__}: {e}"
        return ApiError(message, status=500, type="server_error")

    async def run(request: Request, prepare) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(ApiError(f"the request body is not JSON: {e}"))
        heard: asyncio.Queue[tuple[int, int, list[int]] | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        try:
            prepared: Prepared = prepare(body)
            live = prepared.events is not None and prepared.events.live
            future = served.engine.submit(
                prepared.prompts,
                prepared.params,
                (lambda i, j, ids: _post(loop, heard.put_nowait, (i, j, ids))) if live else None,
            )
        except ApiError as e:
            return error(e)
        except ValueError as e:  # the Generator's own checks, if ours missed one
            return error(ApiError(str(e)))
        if prepared.events is None:
            try:
                groups = await asyncio.wrap_future(future)
            except Exception as e:  # the engine failed (it serves on): this request gets a 500
                return error(failed(e, future))
            return JSONResponse(finish(prepared, groups, request))
        outcome: dict[str, Any] = {}

        def settle(done: Future) -> None:
            """On the loop once the engine is done: the response (recorded, its session
            remembered) whether or not the client still reads the stream."""
            try:
                outcome["body"] = finish(prepared, done.result(), request)
            except Exception as e:
                outcome["error"] = failed(e, done)
            heard.put_nowait(None)

        future.add_done_callback(lambda done: _post(loop, settle, done))
        first = await heard.get()  # the status goes out with the first event
        if first is None and "error" in outcome:
            return error(outcome["error"])
        stream = sse(prepared.events, first, heard, outcome)
        return StreamingResponse(stream, media_type="text/event-stream")

    def finish(prepared: Prepared, groups, request: Request) -> dict[str, Any]:
        body = prepared.respond(groups)
        if record is not None:
            record(request.headers, body)
        return body

    async def sse(
        events: EventStream,
        first: tuple[int, int, list[int]] | None,
        heard: asyncio.Queue,
        outcome: dict[str, Any],
    ) -> AsyncIterator[bytes]:
        """A streamed request's events: its text as the Engine reports tokens (`first`, then
        `heard` until the None that says the response is settled), then the closing, or an
        error event (the status went out with the first event)."""
        for event in events.opening():
            yield event
        item = first
        while item is not None:
            for event in events.tokens(*item):
                yield event
            item = await heard.get()
        if "error" in outcome:
            for event in events.error(outcome["error"].body()):
                yield event
            return
        for event in events.closing(outcome["body"]):
            yield event

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        session = request.headers.get("x-session-id")
        return await run(request, lambda body: served.chat_completion(body, session))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run(request, served.completion)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(served.models())

    return app


def _post(loop: asyncio.AbstractEventLoop, call: Callable[..., Any], *args: Any) -> None:
    """`call(*args)` on the event loop, from any thread (the Engine's); nothing once the loop
    is closed (the server shut down while a request ran)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(call, *args)


@contextlib.contextmanager
def serve_in_thread(app: Any, *, timeout: float = 60.0) -> Iterator[str]:
    """Serve `app` with uvicorn on a free 127.0.0.1 port in a thread for the block; yields
    its /v1 URL. The app's lifespan (its engine) starts before and stops after."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the tidal server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
