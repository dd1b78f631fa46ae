"""The OpenAI-compatible HTTP API (FastAPI): routes, error bodies, and cancellation when a client goes away.

Routes: ``GET /v1/models`` and ``/v1/models/{model}``, ``POST /v1/completions`` and ``/v1/chat/completions``
(JSON, or server-sent events with ``stream``), ``GET /health`` (200 while the engine's Triton model is ready,
503 otherwise). Bodies are validated by the `protocol` models; every error is OpenAI's error object with its
status (`errors`). A body over the ``max_request_bytes`` limit is answered 413 before it is parsed (`edge_limits`'
`BodySizeLimit`, in front of every route). A client that disconnects, streaming or not, has its request cancelled:
the handler races the work against the connection's ``http.disconnect`` and cancels the work first, which cancels
its gRPC streams, so the engine aborts the sequences and frees their memory.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any

import anyio
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dhisparse.serving.openai.edge_limits import BodySizeLimit, EdgeLimits
from dhisparse.serving.openai.errors import OpenAIError, bad_request
from dhisparse.serving.openai.protocol import ChatCompletionRequest, CompletionRequest
from dhisparse.serving.openai.serving import OpenAIServing


def _param(location: tuple) -> str:
    """A pydantic error location as OpenAI writes a parameter: ``messages[0].role``."""
    out = ""
    for part in location:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not (isinstance(part, str) and ("[" in part or part in ("str", "int", "list[int]", "list[str]"))):
            out += f".{part}" if out else str(part)
    return out


async def _body(request: Request, model: type[pydantic.BaseModel], edge: EdgeLimits) -> Any:
    try:
        raw = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"the request body is not valid JSON: {error}") from None
    if not isinstance(raw, dict):
        raise bad_request("the request body must be a JSON object")
    edge.check_sizes(raw)
    try:
        return model.model_validate(raw)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        param = _param(tuple(first["loc"]))
        raise bad_request(f"{param}: {first['msg']}" if param else first["msg"], param or None) from None


async def _disconnected(request: Request) -> None:
    """Returns when the client has disconnected (the body is read already, so only that message is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result; cancelled (and None returned) when the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        watcher.cancel()
        with anyio.CancelScope(shield=True):  # the cleanup must run even when this handler is being cancelled
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


async def _events(request: Request, events: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    """`events`, ended (and their sequences cancelled) as soon as the client disconnects, even while no event is
    due (a sequence waiting for admission or in prefill). Starlette also cancels the response when it sees the
    disconnect; either way the cleanup below runs shielded, so the sequences are cancelled."""
    watcher = asyncio.ensure_future(_disconnected(request))
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(events.__anext__())
            await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                return  # disconnected
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            step = None
            yield item
    finally:
        watcher.cancel()
        with anyio.CancelScope(shield=True):
            if step is not None and not step.done():  # the generator is running: cancelling it runs its cleanup
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
            await events.aclose()


def create_app(serving: OpenAIServing) -> FastAPI:
    """The FastAPI application serving `serving`."""
    app = FastAPI(title="dhisparse OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodySizeLimit, limits=lambda: serving.edge.limits)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, error: OpenAIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        failure = OpenAIError(500, f"internal error: {type(error).__name__}: {error}")
        return JSONResponse(failure.body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = await serving.engine.ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    def model_card() -> dict[str, Any]:
        return {"id": serving.model_name, "object": "model", "created": 0, "owned_by": "dhisparse",
                "max_model_len": serving.limits.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        serving.check_model(model)
        return model_card()

    async def respond(request: Request, work: Awaitable[Any]) -> Any:
        result = await _unless_disconnected(request, work)
        if result is None:  # the client is gone; nobody reads this
            return JSONResponse({}, status_code=499)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(_events(request, result), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await _body(request, CompletionRequest, serving.edge)
        return await respond(request, serving.completions(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await _body(request, ChatCompletionRequest, serving.edge)
        return await respond(request, serving.chat(body))

    return app
