"""The OpenAI-compatible HTTP API (FastAPI) over a generation backend: /v1/completions and
/v1/chat/completions (whole or streamed as server-sent events), /v1/models, /health, /metrics
and /version.

The event loop never waits on the engine: preparing and submitting a request (a deployment's
submit waits on its attention node) and reading the backend's state run in the server's own
thread pool, and deltas reach the loop through `ChoiceStreams`. A client that goes away,
streaming or not, has its requests aborted, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

import megainfer
from megainfer.errors import ConfigError
from megainfer.expert_load_profile import ExpertLoadProfile
from megainfer.server import openai_generate as gen
from megainfer.server.access import AccessPolicy
from megainfer.server.backend import PREFIX_CACHING_OFF, GenerationBackend
from megainfer.server.choice_streams import ChoiceStreams
from megainfer.server.http_access import HttpAccess
from megainfer.server.metrics import ServingMetrics
from megainfer.server.openai_errors import INVALID, NOT_FOUND, UNAVAILABLE, ApiError, api_error, validation_error
from megainfer.server.openai_protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from megainfer.server.readiness import Readiness
from megainfer.server.request_size import MAX_REQUEST_BYTES, RequestSizeLimit
from megainfer.server.served_model import ServedModel

logger = logging.getLogger(__name__)

BACKEND_THREADS = 64  # submits, aborts and state reads in flight at once (each may wait on a node)


def error_response(error: ApiError) -> Response:
    return Response(error.body.model_dump_json(), status_code=error.status, media_type="application/json")


class EventStream(StreamingResponse):
    """Server-sent events that run `on_close` however the stream ends: finished, failed, or the
    client gone (Starlette then stops iterating without closing the generator)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()


async def _disconnected(request: Request) -> None:
    """Returns once the client closed its connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable):
    """`work`'s result, or None if the client left first (then `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


class OpenAIServer:
    def __init__(self, backend: GenerationBackend, served: ServedModel, metrics: ServingMetrics | None = None,
                 readiness: Readiness | None = None, *, access: AccessPolicy | None = None) -> None:
        """access: the API keys every route but /health requires, and their limits (None: open)."""
        self.backend = backend
        self.served = served
        self.metrics = metrics
        self.readiness = readiness or Readiness(backend)
        self.executor = ThreadPoolExecutor(BACKEND_THREADS, thread_name_prefix="http-backend")
        self.app = self._build()
        if access is not None:
            self.app.add_middleware(HttpAccess, policy=access)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=False)

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _check_model(self, name: str | None) -> None:
        if not self.served.serves(name):
            raise ApiError(HTTPStatus.NOT_FOUND, f"the model {name!r} does not exist; this server serves "
                           f"{', '.join(map(repr, self.served.names))}", INVALID, "model", "model_not_found")

    async def _generate(self, request: Request, body, prepare, respond, events, prefix: str) -> Response:
        streams = None
        try:
            body.warn_ignored(request.url.path)
            self._check_model(body.model)
            request_id = f"{prefix}-{uuid.uuid4().hex}"
            group = await self._in_thread(prepare, self.served, body, request_id)
            streams = ChoiceStreams(self.backend, self.metrics, self.executor, group)
            await streams.submit()
        except asyncio.CancelledError:
            if streams is not None:
                streams.close()
            raise
        except Exception as exc:
            return error_response(api_error(exc))
        if body.stream:
            return EventStream(events(streams, body, self.served, request_id), streams.close)
        try:
            response = await unless_disconnected(request, respond(streams, body, self.served, request_id))
        except Exception as exc:
            return error_response(api_error(exc))
        finally:
            streams.close()
        if response is None:  # nobody is left to read it
            return Response(status_code=499)
        return Response(response.model_dump_json(), media_type="application/json")

    def _build(self) -> FastAPI:
        app = FastAPI(title="megainfer", version=megainfer.__version__, docs_url=None, redoc_url=None)
        app.add_middleware(RequestSizeLimit, max_bytes=MAX_REQUEST_BYTES)  # 413 before a body is parsed
        _handle_errors(app)

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request) -> Response:
            return await self._generate(request, body, gen.completion_group, gen.completion_response,
                                        gen.completion_events, "cmpl")

        @app.post("/v1/chat/completions")
        async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
            return await self._generate(request, body, gen.chat_group, gen.chat_response, gen.chat_events,
                                        "chatcmpl")

        @app.get("/v1/models")
        async def models() -> Response:
            cards = [self._card(name) for name in self.served.names]
            return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

        @app.get("/v1/models/{name:path}")
        async def model(name: str) -> Response:
            try:
                self._check_model(name)
            except ApiError as exc:
                return error_response(exc)
            return Response(self._card(name).model_dump_json(), media_type="application/json")

        @app.get("/health")
        async def health() -> Response:
            ready = await self._in_thread(self.readiness.check)
            if ready.ok:
                return JSONResponse({"status": "serving"})
            return error_response(ApiError(HTTPStatus.SERVICE_UNAVAILABLE, f"not serving: {ready.reason}",
                                           UNAVAILABLE))

        @app.get("/metrics")
        async def metrics() -> Response:
            if self.metrics is None:
                return error_response(ApiError(HTTPStatus.NOT_FOUND, "this server keeps no metrics", NOT_FOUND))
            return Response(await self._in_thread(generate_latest, self.metrics.registry),
                            media_type=CONTENT_TYPE_LATEST)

        @app.get("/version")
        async def version() -> Response:
            return JSONResponse({"version": megainfer.__version__})

        self._add_admin_routes(app)
        return app

    def _add_admin_routes(self, app: FastAPI) -> None:
        """Operators' calls, behind the API keys as every route but /health."""

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> Response:  # vLLM's route, behind the API keys
            try:
                reset = await self._in_thread(self.backend.reset_prefix_cache)
            except Exception as exc:
                return error_response(api_error(exc))
            if not reset:
                return error_response(ApiError(HTTPStatus.BAD_REQUEST, PREFIX_CACHING_OFF))
            return Response(status_code=HTTPStatus.OK)

        @app.get("/admin/experts/load")
        async def expert_load() -> Response:  # the profile `megainfer plan --expert-load` prices
            try:
                window = await self._in_thread(self.backend.expert_load)
            except Exception as exc:
                return error_response(api_error(exc))
            if window is None:
                return error_response(ApiError(HTTPStatus.CONFLICT, "no step has counted the experts' load yet: "
                                               "serve some requests, then ask again"))
            return JSONResponse(ExpertLoadProfile.of(self.served.name, window).to_dict())

        @app.post("/admin/experts/rebalance")
        async def rebalance_experts() -> Response:  # behind the API keys, as every route but /health
            try:
                return JSONResponse(dataclasses.asdict(await self._in_thread(self.backend.rebalance_experts)))
            except ConfigError as exc:  # nothing to re-place here: the caller's mistake, not the server's
                return error_response(ApiError(HTTPStatus.BAD_REQUEST, str(exc)))
            except Exception as exc:
                return error_response(api_error(exc))

    def _card(self, name: str) -> ModelCard:
        return ModelCard(id=name, root=self.served.root, max_model_len=self.served.max_model_len)


def _handle_errors(app: FastAPI) -> None:
    """Every error as the OpenAI API shapes it: a bad body (400), an unknown route or method, a bug
    (500, logged; the server serves on)."""

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> Response:
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:  # unknown route, wrong method
        kind = NOT_FOUND if exc.status_code == HTTPStatus.NOT_FOUND else "invalid_request_error"
        detail = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(ApiError(exc.status_code, detail, kind))

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> Response:  # the server logs it and serves on
        return error_response(api_error(exc))
