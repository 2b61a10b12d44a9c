"""`bench serve`'s request functions: one streamed request each, timed on the client as
`vllm bench serve` times it, over one asyncio client per run.

- megainfer-grpc: megainfer.v1.Inference/Generate over a grpc.aio channel; a response carrying
  token ids is a chunk. A prompt of token ids goes in the request's token_ids field.
- openai: POST /v1/completions with stream=True and stream_options.include_usage; each
  server-sent event with `choices` is a chunk (its text may be empty). A prompt of token ids is
  sent as OpenAI's list-of-integers prompt.
- openai-chat: POST /v1/chat/completions, the same, the text in choices[0].delta.content; the
  request's `messages` where it has them (a conversation's turn), else one user message.

A request with a `cache_salt` carries it in the JSON body (vLLM's field: it salts the prefix cache's
block hashes, so the request shares cached blocks with no request of another salt; over gRPC the
sampling message's field of the same name): how --compare-prefix-caching turns caching off for one
run. `reset_prefix_cache` POSTs vLLM's /reset_prefix_cache route (megainfer serve's too), or calls
the ResetPrefixCache RPC over gRPC.

Per request: TTFT is sent -> first chunk; ITL one gap per pair of consecutive chunks (a chunk
carrying several tokens is one gap, as in vLLM); latency is sent -> last chunk (a trailing
usage-only event does not extend it); output_tokens and prompt_len are the server's usage where
it reports them (0 output tokens: the metrics count the text's tokens instead), cached_tokens its
usage.prompt_tokens_details.cached_tokens (gRPC: usage.cached_tokens; None where absent: the server
does not say). A request fails
alone: whatever goes wrong is recorded in its `error`. OPENAI_API_KEY, where set, goes with every
request as `Authorization: Bearer <key>` (gRPC: the `authorization` metadata), as vLLM's bench sends it.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import httpx2

from megainfer.errors import MegaInferError
from megainfer.sampling_params import SamplingParams
from megainfer.server.client import request_message
from megainfer.v1 import inference_pb2 as pb
from megainfer.v1 import inference_pb2_grpc as pb_grpc

BACKENDS = ("megainfer-grpc", "openai", "openai-chat")
OPENAI_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
CONNECT_TIMEOUT_S = 10.0  # how long the first contact with the server may take
REQUEST_TIMEOUT_S = 6 * 60 * 60  # one request, streamed to its end (vLLM's aiohttp total timeout)
SERVER_DEFAULTED = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


@dataclass
class RequestInput:
    prompt: str | list[int]  # text, or token ids (megainfer-grpc and openai send ids as they are)
    prompt_len: int
    output_len: int  # max_tokens
    model: str  # the name sent in the request (the served model name)
    url: str  # HTTP backends: the endpoint's full URL; megainfer-grpc: unused
    request_id: str = ""
    ignore_eos: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, top_k where given
    messages: list[dict[str, str]] | None = None  # openai-chat: the chat sent (a conversation's turn)
    cache_salt: str | None = None  # HTTP backends: sent as the body's cache_salt (vLLM's field)


@dataclass
class RequestOutput:
    generated_text: str = ""
    success: bool = False
    latency: float = 0.0  # s, sent -> last chunk
    output_tokens: int = 0  # the server's count; 0 where it gave none
    ttft: float = 0.0  # s, sent -> first chunk
    itl: list[float] = field(default_factory=list)  # s, between consecutive chunks
    prompt_len: int = 0
    error: str = ""
    start_time: float = 0.0  # perf_counter() when sent
    cached_tokens: int | None = None  # prompt tokens the server found cached; None: its usage does not say


class ChunkClock:
    """The chunk timings of one request."""

    def __init__(self, output: RequestOutput) -> None:
        self.output = output
        self.start = self.last = output.start_time = time.perf_counter()
        self.chunks = 0

    def chunk(self) -> None:
        now = time.perf_counter()
        if self.chunks == 0:
            self.output.ttft = now - self.start
        else:
            self.output.itl.append(now - self.last)
        self.last = now
        self.chunks += 1

    def finish(self) -> None:
        self.output.latency = self.last - self.start
        self.output.success = self.chunks > 0
        if not self.chunks and not self.output.error:
            self.output.error = "the stream ended without a token chunk; this request counts as failed"


_EOL = re.compile(r"\r\n|\r|\n")


class SSEDecoder:
    """Server-sent events (the WHATWG text/event-stream format) -> each event's data, as bytes
    arrive in pieces of any size: lines end at CRLF, LF or CR; a blank line ends an event; `data:`
    lines join with newlines; comment lines (`:` first, servers' pings) and other fields are
    skipped."""

    def __init__(self) -> None:
        self._text = codecs.getincrementaldecoder("utf-8")()
        self._buffer = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += self._text.decode(chunk)
        events: list[str] = []
        while m := _EOL.search(self._buffer):
            if m.group() == "\r" and m.end() == len(self._buffer):
                break  # perhaps the first half of a CRLF split across pieces
            line, self._buffer = self._buffer[:m.start()], self._buffer[m.end():]
            self._line(line, events)
        return events

    def close(self) -> list[str]:
        """The event left when the stream ends without its blank line (delivered, as vLLM's parser does)."""
        events: list[str] = []
        self._buffer += self._text.decode(b"", final=True)
        for line in (*_EOL.split(self._buffer), ""):
            self._line(line, events)
        self._buffer = ""
        return events

    def _line(self, line: str, events: list[str]) -> None:
        if not line:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)


async def _sse_events(response: httpx2.Response) -> AsyncIterator[dict]:
    decoder = SSEDecoder()
    async for piece in response.aiter_bytes():
        for data in decoder.feed(piece):
            if data != "[DONE]":
                yield json.loads(data)
    for data in decoder.close():
        if data != "[DONE]":
            yield json.loads(data)


def _grpc_metadata() -> tuple[tuple[str, str], ...]:
    """The key of OPENAI_API_KEY, as the HTTP backends send it, for a server started with --api-key."""
    api_key = os.environ.get("OPENAI_API_KEY")
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def _headers(request_id: str) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key := os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {api_key}"
    if request_id:
        headers["x-request-id"] = request_id
    return headers


async def _openai_stream(inp: RequestInput, client: httpx2.AsyncClient, payload: dict[str, Any],
                         text_of: Callable[[dict], str | None]) -> RequestOutput:
    payload.update(stream=True, stream_options={"include_usage": True}, **inp.sampling)
    if inp.ignore_eos:
        payload["ignore_eos"] = True
    if inp.cache_salt is not None:
        payload["cache_salt"] = inp.cache_salt
    output = RequestOutput(prompt_len=inp.prompt_len)
    clock = ChunkClock(output)
    text: list[str] = []
    # A request fails alone whatever the server sent or did (vLLM's rule): the error is kept.
    try:
        async with client.stream("POST", inp.url, json=payload, headers=_headers(inp.request_id)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                output.error = f"HTTP {response.status_code} from {inp.url}: {body[:500]}"
            else:
                async for event in _sse_events(response):
                    if choices := event.get("choices"):
                        clock.chunk()
                        text.append(text_of(choices[0]) or "")
                    elif usage := event.get("usage"):
                        _read_usage(usage, output)
    except Exception as exc:  # noqa: BLE001
        output.error = f"{type(exc).__name__}: {exc}"
    output.generated_text = "".join(text)
    clock.finish()
    return output


def _read_usage(usage: dict, output: RequestOutput) -> None:
    output.output_tokens = usage.get("completion_tokens") or 0
    if usage.get("prompt_tokens") is not None:
        output.prompt_len = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        output.cached_tokens = details["cached_tokens"]


async def openai_completions(inp: RequestInput, client: httpx2.AsyncClient) -> RequestOutput:
    payload = {"model": inp.model, "prompt": inp.prompt, "max_tokens": inp.output_len}
    return await _openai_stream(inp, client, payload, lambda choice: choice.get("text"))


async def openai_chat(inp: RequestInput, client: httpx2.AsyncClient) -> RequestOutput:
    payload = {"model": inp.model, "messages": inp.messages or [{"role": "user", "content": inp.prompt}],
               "max_completion_tokens": inp.output_len}
    return await _openai_stream(inp, client, payload, lambda choice: (choice.get("delta") or {}).get("content"))


async def megainfer_grpc(inp: RequestInput, stub: pb_grpc.InferenceStub) -> RequestOutput:
    params = SamplingParams(max_tokens=inp.output_len, ignore_eos=inp.ignore_eos, cache_salt=inp.cache_salt,
                            **inp.sampling)
    # Sampling not asked for is left to the server's defaults, as the HTTP backends leave it.
    message = request_message(inp.prompt, params, inp.request_id,
                              server_defaults=[f for f in SERVER_DEFAULTED if f not in inp.sampling])
    output = RequestOutput(prompt_len=inp.prompt_len)
    clock = ChunkClock(output)
    text: list[str] = []
    try:
        async for response in stub.Generate(message, timeout=REQUEST_TIMEOUT_S, metadata=_grpc_metadata()):
            if response.token_ids:
                clock.chunk()
            text.append(response.text)
            if response.HasField("usage") and response.usage.completion_tokens:
                output.output_tokens = response.usage.completion_tokens
                output.prompt_len = response.usage.prompt_tokens or output.prompt_len
                output.cached_tokens = response.usage.cached_tokens
    except grpc.aio.AioRpcError as exc:
        output.error = f"{exc.code().name}: {exc.details()}"
    output.generated_text = "".join(text)
    clock.finish()
    return output


RequestFunc = Callable[[RequestInput, Any], Awaitable[RequestOutput]]
REQUEST_FUNCS: dict[str, RequestFunc] = {
    "megainfer-grpc": megainfer_grpc, "openai": openai_completions, "openai-chat": openai_chat}


@dataclass
class ServerModel:
    name: str  # what requests ask for (the served model name)
    root: str  # the model it serves (a path, preset or Hugging Face id): the default tokenizer


@contextlib.asynccontextmanager
async def open_session(backend: str, target: str, max_concurrency: int | None) -> AsyncIterator[Any]:
    """The one client a run's requests share: a grpc.aio stub (target host:port) or an HTTP client
    (target the base URL), checked to answer before the run starts."""
    if backend == "megainfer-grpc":
        async with grpc.aio.insecure_channel(target) as channel:
            try:
                await asyncio.wait_for(channel.channel_ready(), CONNECT_TIMEOUT_S)
            except TimeoutError:
                raise MegaInferError(f"no megainfer gRPC server answers at {target} within {CONNECT_TIMEOUT_S:g} s; "
                                     f"start one (`megainfer serve`) or pass --host/--port (or --base-url)") from None
            yield pb_grpc.InferenceStub(channel)
        return
    # No pool limit beyond --max-concurrency: with a rate of inf every request is in flight at once.
    limits = httpx2.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    timeout = httpx2.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    async with httpx2.AsyncClient(limits=limits, timeout=timeout) as client:
        try:
            await client.get(f"{target}/v1/models", headers=_headers(""))
        except httpx2.HTTPError as exc:
            raise MegaInferError(f"no server answers at {target} ({type(exc).__name__}: {exc}); start one or pass "
                                 f"--base-url (or --host/--port)") from None
        yield client


async def server_model(backend: str, session: Any, target: str) -> ServerModel:
    """The model the server serves, for a run without --model: ServerInfo over gRPC, the first
    entry of /v1/models (its id and root, as vLLM reads them) over HTTP."""
    if backend == "megainfer-grpc":
        try:
            info = await session.ServerInfo(pb.ServerInfoRequest(), timeout=CONNECT_TIMEOUT_S,
                                            metadata=_grpc_metadata())
        except grpc.aio.AioRpcError as exc:
            raise MegaInferError(f"--model not given and ServerInfo at {target} failed ({exc.code().name}: "
                                 f"{exc.details()}); pass --model") from None
        return ServerModel(info.model, info.model)
    url = f"{target}/v1/models"
    try:
        response = await session.get(url, headers=_headers(""))
        models = response.json().get("data") if response.status_code == 200 else None
    except (httpx2.HTTPError, ValueError, AttributeError):
        models = None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise MegaInferError(f"--model not given and {url} names no model; pass --model")
    return ServerModel(models[0]["id"], models[0].get("root") or models[0]["id"])


async def reset_prefix_cache(backend: str, session: Any, target: str) -> bool:
    """Empty the server's prefix cache: POST {target}/reset_prefix_cache (vLLM's route) or, for
    megainfer-grpc, the ResetPrefixCache RPC. True once emptied, False where the server has no such
    route (404, 405; gRPC UNIMPLEMENTED); any other failure is an error."""
    if backend == "megainfer-grpc":
        try:
            await session.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=CONNECT_TIMEOUT_S,
                                           metadata=_grpc_metadata())
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return False
            raise MegaInferError(f"ResetPrefixCache at {target}: {exc.code().name} ({exc.details()}); the "
                                 f"prefix-caching comparison resets the cache before each run") from None
        return True
    url = f"{target}/reset_prefix_cache"
    try:
        response = await session.post(url, headers=_headers(""))
    except httpx2.HTTPError as exc:
        raise MegaInferError(f"POST {url} failed ({type(exc).__name__}: {exc}); the prefix-caching comparison "
                             f"resets the cache before each run") from None
    if response.status_code in (404, 405):
        return False
    if response.status_code >= 400:
        raise MegaInferError(f"POST {url}: HTTP {response.status_code} ({response.text[:300]}); the prefix-caching "
                             f"comparison resets the cache before each run: check the server's log (or its "
                             f"--api-key and OPENAI_API_KEY)")
    return True
