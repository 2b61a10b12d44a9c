"""`bench soak`'s load: N concurrent clients driving mixed traffic at a server's gRPC and HTTP
frontends for as long as asked, recording how every request ended.

Each worker sends one request at a time, drawn from `TrafficMix`: a frontend (gRPC Generate or
HTTP /v1/completions), a prompt (short or long, text or token ids), streamed or whole (gRPC
always streams), sometimes n=2, sometimes stop strings, and an ending:
- normal: read to the end;
- abort: after a few token chunks the client aborts (gRPC: the Abort RPC with the request's id,
  then the stream is read to its end; HTTP has no abort route: closing the stream is the abort);
- disconnect: the client leaves at a random moment, perhaps before the first token (gRPC: the
  call is cancelled; HTTP: the connection is closed mid-response).

Every request gets one `Status` from one vocabulary for both frontends (HTTP codes and the
error events of a stream are mapped onto gRPC's names). A request with neither a final response
nor an error within `request_timeout_s` is UNENDED: counted, never dropped. `restart_clients()`
(any thread) closes and reopens the gRPC channel and the HTTP client; requests in flight on the
old ones end client-side as CANCELLED_BY_CLIENT, which the server must see as disconnects.

Times are seconds since `SoakTraffic.t0` (time.monotonic()), the clock the soak's resource
samples and faults are placed on."""

from __future__ import annotations

import asyncio
import enum
import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable
from http import HTTPStatus

import grpc
import grpc.aio
import httpx2

from megainfer.tools.bench.serve_requests import SSEDecoder
from megainfer.errors import ConfigError, MegaInferError
from megainfer.sampling_params import SamplingParams
from megainfer.server.client import request_message
from megainfer.tokenizer import Tokenizer
from megainfer.v1 import inference_pb2 as pb
from megainfer.v1 import inference_pb2_grpc as pb_grpc

CONNECT_TIMEOUT_S = 10.0  # the first contact with each frontend
ABORT_CALL_TIMEOUT_S = 10.0  # the Abort RPC itself
RESTART_TIMEOUT_S = 30.0  # restart_clients() waits this long for the event loop to do it
FAILURE_PAUSE_S = 0.25  # a worker's pause after a refusal: clients back off rather than spin on a recovering server
SERVER_DEFAULTED = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")  # the model's own sampling
FIRST_TOKEN_ID = 5  # token-id prompts avoid the demo vocabulary's special tokens (bos, eos, pad, ...)
# Openings the demo model (trained on Python's standard library) continues; long prompts repeat them.
TEXT_PROMPTS = ("def read_config(path):", "class LRUCache:", "import os\n\n\ndef ", "    def __repr__(self):",
                "# Copyright", "for key, value in sorted(items):", "try:\n    import json\nexcept ImportError:",
                "def parse_args(argv=None):\n    \"\"\"")
STOP_STRINGS = (["\n\n"], ["return", ":"], ["self."], ["def "])


class Status(str, enum.Enum):
    """How a request ended, one vocabulary for both frontends (gRPC's code names)."""

    OK = "OK"  # every completion finished (stop or length)
    ABORTED = "ABORTED"  # the server ended it with finish_reason "abort" after the client's Abort
    CANCELLED_BY_CLIENT = "CANCELLED_BY_CLIENT"  # the client closed the stream, cancelled the call or left
    CANCELLED = "CANCELLED"  # the server cancelled it
    UNAVAILABLE = "UNAVAILABLE"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    NOT_FOUND = "NOT_FOUND"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    INTERNAL = "INTERNAL"
    UNKNOWN = "UNKNOWN"
    UNENDED = "UNENDED"  # no final response or status within the request timeout

    def __str__(self) -> str:
        return self.value


# Statuses that are not failures: the request ended as the client wanted.
CLEAN = frozenset({Status.OK, Status.ABORTED, Status.CANCELLED_BY_CLIENT})

HTTP_STATUS = {HTTPStatus.BAD_REQUEST: Status.INVALID_ARGUMENT, HTTPStatus.UNAUTHORIZED: Status.UNAUTHENTICATED,
               HTTPStatus.FORBIDDEN: Status.PERMISSION_DENIED, HTTPStatus.NOT_FOUND: Status.NOT_FOUND,
               HTTPStatus.REQUEST_TIMEOUT: Status.DEADLINE_EXCEEDED, HTTPStatus.UNPROCESSABLE_ENTITY:
               Status.INVALID_ARGUMENT, HTTPStatus.TOO_MANY_REQUESTS: Status.RESOURCE_EXHAUSTED,
               499: Status.CANCELLED_BY_CLIENT, HTTPStatus.INTERNAL_SERVER_ERROR: Status.INTERNAL,
               HTTPStatus.NOT_IMPLEMENTED: Status.UNIMPLEMENTED, HTTPStatus.BAD_GATEWAY: Status.UNAVAILABLE,
               HTTPStatus.SERVICE_UNAVAILABLE: Status.UNAVAILABLE, HTTPStatus.GATEWAY_TIMEOUT: Status.DEADLINE_EXCEEDED}
# The `type` of an OpenAI error object (megainfer/server/openai_errors.py), as a stream's error event carries it.
ERROR_TYPES = {"invalid_request_error": Status.INVALID_ARGUMENT, "not_found_error": Status.NOT_FOUND,
               "overloaded_error": Status.RESOURCE_EXHAUSTED, "service_unavailable_error": Status.UNAVAILABLE,
               "internal_error": Status.INTERNAL, "authentication_error": Status.UNAUTHENTICATED,
               "permission_error": Status.PERMISSION_DENIED, "rate_limit_error": Status.RESOURCE_EXHAUSTED}


def http_status(code: int) -> Status:
    """An HTTP error status in the soak's vocabulary (other 4xx: the client's fault; other 5xx: the server's)."""
    if code in HTTP_STATUS:
        return HTTP_STATUS[code]
    return Status.INVALID_ARGUMENT if 400 <= code < 500 else Status.INTERNAL


def grpc_status(code: grpc.StatusCode) -> Status:
    return Status.__members__.get(code.name, Status.UNKNOWN)


class Frontend(str, enum.Enum):
    GRPC = "grpc"
    HTTP = "http"


class Ending(str, enum.Enum):
    NORMAL = "normal"
    ABORT = "abort"
    DISCONNECT = "disconnect"


@dataclass
class TrafficMix:
    """Shares of the request population (each drawn independently per request)."""

    http: float = 0.5  # else gRPC
    long: float = 0.2  # long prompts (a few hundred tokens), else short (a few to ~32 tokens)
    token_ids: float = 0.3  # prompts of token ids, else text
    whole: float = 0.3  # HTTP: one JSON response, else streamed
    n2: float = 0.1  # n=2
    stop: float = 0.15  # stop strings
    ignore_eos: float = 0.5  # generate max_tokens whatever the model says (else the model may end early)
    abort: float = 0.1
    disconnect: float = 0.1
    short_tokens: tuple[int, int] = (3, 32)
    long_tokens: tuple[int, int] = (200, 400)  # capped to half the model's length
    max_tokens: tuple[int, int] = (8, 64)
    abort_after_chunks: tuple[int, int] = (1, 8)
    disconnect_after_s: tuple[float, float] = (0.05, 2.0)


@dataclass
class TrafficSpec:
    grpc_target: str  # host:port of megainfer.v1.Inference
    http_url: str  # base URL of the OpenAI-compatible API
    model: str  # the served model name
    max_model_len: int  # prompt plus generated tokens the server takes
    vocab_size: int
    concurrency: int = 8
    seed: int = 0
    request_timeout_s: float = 120.0
    api_key: str | None = None  # sent as `authorization: Bearer` on both frontends
    mix: TrafficMix = field(default_factory=TrafficMix)


@dataclass
class Shape:
    """One request, as drawn before it is sent."""

    frontend: Frontend
    ending: Ending
    prompt: str | list[int]
    long: bool
    stream: bool
    n: int
    max_tokens: int
    stop: list[str]
    ignore_eos: bool
    seed: int
    abort_after_chunks: int
    disconnect_after_s: float

    @property
    def prompt_kind(self) -> str:
        return f"{'long' if self.long else 'short'}-{'text' if isinstance(self.prompt, str) else 'ids'}"


@dataclass
class RequestRecord:
    """One request's life on the client, in seconds since the soak's start."""

    request_id: str
    frontend: Frontend
    ending: Ending  # what the client meant to do
    prompt_kind: str  # short-text, short-ids, long-text, long-ids
    stream: bool
    n: int
    start_s: float
    token_times: list[list[float]] = field(default_factory=list)  # per completion: when each token chunk arrived
    end_s: float | None = None  # None: unended
    phase: str = "sent"  # how far it got: sent, answered (headers or a first message), aborting, left
    status: Status | None = None
    detail: str = ""

    @property
    def first_token_s(self) -> float | None:
        firsts = [times[0] for times in self.token_times if times]
        return min(firsts) if firsts else None

    @property
    def ttft_s(self) -> float | None:
        first = self.first_token_s
        return None if first is None else first - self.start_s

    def tbt_gaps(self) -> list[tuple[float, float]]:
        """(when, seconds) of every gap between consecutive token chunks of one completion."""
        return [(b, b - a) for times in self.token_times for a, b in zip(times, times[1:])]

    def token(self, index: int, now: float) -> None:
        while len(self.token_times) <= index:
            self.token_times.append([])
        self.token_times[index].append(now)

    def finish(self, status: Status, now: float | None, detail: str = "") -> None:
        """The first status given is the request's; later ones (a cancellation racing it) are ignored."""
        if self.status is None:
            self.status, self.end_s, self.detail = status, now, detail[:300]


class PromptPool:
    """Prompts of the mix's lengths: text openings (long ones repeated and cut to length with the
    served model's tokenizer, where there is one) and random token ids."""

    def __init__(self, spec: TrafficSpec, tokenizer: Tokenizer | None, rng: random.Random) -> None:
        mix = spec.mix
        self.vocab_size = spec.vocab_size
        self.long_cap = max(mix.short_tokens[1] + 1, spec.max_model_len // 2)  # tokens a prompt may have
        self.long_range = (min(mix.long_tokens[0], self.long_cap), min(mix.long_tokens[1], self.long_cap))
        self.short_range = mix.short_tokens
        self.short_texts = list(TEXT_PROMPTS)
        self.long_texts = [self._long_text(tokenizer, rng) for _ in range(8)]

    def _long_text(self, tokenizer: Tokenizer | None, rng: random.Random) -> str:
        target = rng.randint(*self.long_range)
        text = ""
        while len(text) < 6 * target:  # past the target at any tokenizer's 6 characters per token
            text += rng.choice(TEXT_PROMPTS) + "\n    pass\n\n"
        if tokenizer is None:
            return text[:4 * target]
        return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:target])

    def draw(self, rng: random.Random, long: bool, ids: bool) -> str | list[int]:
        if ids:
            length = rng.randint(*(self.long_range if long else self.short_range))
            return [rng.randrange(FIRST_TOKEN_ID, self.vocab_size) for _ in range(length)]
        return rng.choice(self.long_texts if long else self.short_texts)


def draw_shape(spec: TrafficSpec, prompts: PromptPool, rng: random.Random) -> Shape:
    mix = spec.mix
    frontend = Frontend.HTTP if rng.random() < mix.http else Frontend.GRPC
    roll = rng.random()
    ending = Ending.ABORT if roll < mix.abort else Ending.DISCONNECT if roll < mix.abort + mix.disconnect \
        else Ending.NORMAL
    # An abort happens mid-stream: an aborted HTTP request streams (closing a whole response is a disconnect).
    stream = frontend is Frontend.GRPC or ending is Ending.ABORT or rng.random() >= mix.whole
    long = rng.random() < mix.long
    prompt = prompts.draw(rng, long, rng.random() < mix.token_ids)
    prompt_len = len(prompt) if isinstance(prompt, list) else prompts.long_cap  # text: at most the cap (+ BOS)
    room = max(1, spec.max_model_len - prompt_len - 1)
    return Shape(frontend=frontend, ending=ending, prompt=prompt, long=long, stream=stream,
                 n=2 if rng.random() < mix.n2 else 1, max_tokens=min(rng.randint(*mix.max_tokens), room),
                 stop=list(rng.choice(STOP_STRINGS)) if rng.random() < mix.stop else [],
                 ignore_eos=rng.random() < mix.ignore_eos, seed=rng.randrange(2 ** 31),
                 abort_after_chunks=rng.randint(*mix.abort_after_chunks),
                 disconnect_after_s=rng.uniform(*mix.disconnect_after_s))


class Session:
    """One gRPC channel and one HTTP client, and the request tasks in flight on them."""

    def __init__(self, spec: TrafficSpec) -> None:
        self.channel = grpc.aio.insecure_channel(spec.grpc_target)
        self.stub = pb_grpc.InferenceStub(self.channel)
        # No cap on connections: each worker has one request in flight, and a cap would only let a
        # connection the client failed to return make later requests wait on the client, not the server.
        limits = httpx2.Limits(max_connections=None, max_keepalive_connections=spec.concurrency)
        # No read timeout: the soak's own request timeout decides when a request is unended.
        self.http = httpx2.AsyncClient(base_url=spec.http_url, limits=limits,
                                       timeout=httpx2.Timeout(None, connect=CONNECT_TIMEOUT_S))
        self.inflight: set[asyncio.Task] = set()

    async def close(self) -> None:
        for task in list(self.inflight):
            task.cancel()
        if self.inflight:
            await asyncio.wait(self.inflight, timeout=CONNECT_TIMEOUT_S)
        await self.channel.close()
        await self.http.aclose()


class RequestSender:
    """One request on the wire: sent to its frontend (gRPC Generate; HTTP /v1/completions, streamed
    or whole), its answer read into its `RequestRecord` (token times, how far it got) and ended with
    one `Status`, whatever happens (the client leaving, a broken connection, a malformed answer).
    `now`: the soak's clock."""

    def __init__(self, model: str, api_key: str | None, now: Callable[[], float]) -> None:
        self.model = model  # the served model's name, as HTTP requests carry it
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.metadata = tuple(self.headers.items())
        self.now = now

    async def send(self, session: Session, shape: Shape, record: RequestRecord) -> None:
        """Send `shape` on `session`'s clients, ending as it means to (`Ending`); `record` gets its end."""
        if shape.frontend is Frontend.GRPC:
            send = self._grpc
        else:
            send = self._http_stream if shape.stream else self._http_whole
        try:
            if shape.ending is Ending.DISCONNECT:
                await asyncio.wait_for(send(session, shape, record), shape.disconnect_after_s)
            else:
                await send(session, shape, record)
        except (TimeoutError, asyncio.CancelledError):  # the client left: its deadline, or restart_clients()
            record.phase = "left"
            record.finish(Status.CANCELLED_BY_CLIENT, self.now(), "the client left")
        except grpc.aio.AioRpcError as exc:
            record.finish(grpc_status(exc.code()), self.now(), exc.details() or "")
        except httpx2.HTTPError as exc:  # the connection failed or broke: the server is not there
            record.finish(Status.UNAVAILABLE, self.now(), f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a malformed answer is the server's fault, recorded
            record.finish(Status.INTERNAL, self.now(), f"client could not read the answer: {type(exc).__name__}: "
                                                       f"{exc}")

    async def _grpc(self, session: Session, shape: Shape, record: RequestRecord) -> None:
        params = SamplingParams(max_tokens=shape.max_tokens, n=shape.n, stop=shape.stop, ignore_eos=shape.ignore_eos,
                                seed=shape.seed)
        message = request_message(shape.prompt, params, record.request_id, server_defaults=SERVER_DEFAULTED)
        call = session.stub.Generate(message, metadata=self.metadata)
        finished: dict[int, str] = {}
        chunks = 0
        try:
            async for response in call:
                record.phase = "answered"
                if response.token_ids:
                    record.token(response.index, self.now())
                    chunks += 1
                    if shape.ending is Ending.ABORT and chunks == shape.abort_after_chunks:
                        record.phase = "aborting"
                        await session.stub.Abort(pb.AbortRequest(request_id=record.request_id),
                                                 metadata=self.metadata, timeout=ABORT_CALL_TIMEOUT_S)
                if response.finish_reason:
                    finished[response.index] = response.finish_reason
        except asyncio.CancelledError:
            call.cancel()
            raise
        record.finish(*_ended(finished, shape.n, self.now()))

    async def _http_stream(self, session: Session, shape: Shape, record: RequestRecord) -> None:
        finished: dict[int, str] = {}
        chunks = 0
        async with session.http.stream("POST", "/v1/completions", json=self._payload(shape, True),
                                       headers=self.headers) as response:
            record.phase = "answered"
            if response.status_code != HTTPStatus.OK:
                body = (await response.aread()).decode("utf-8", errors="replace")
                record.finish(http_status(response.status_code), self.now(), body)
                return
            decoder = SSEDecoder()
            async for piece in response.aiter_bytes():
                for data in decoder.feed(piece):
                    if data == "[DONE]":
                        record.finish(*_ended(finished, shape.n, self.now()))
                        return
                    event = json.loads(data)
                    if "error" in event:
                        error = event["error"]
                        record.finish(ERROR_TYPES.get(error.get("type"), Status.UNKNOWN), self.now(),
                                      error.get("message", ""))
                        return
                    for choice in event.get("choices") or []:
                        if choice.get("text"):
                            record.token(choice["index"], self.now())
                            chunks += 1
                        if choice.get("finish_reason"):
                            finished[choice["index"]] = choice["finish_reason"]
                    if shape.ending is Ending.ABORT and chunks >= shape.abort_after_chunks:
                        record.phase = "left"
                        record.finish(Status.CANCELLED_BY_CLIENT, self.now(), "the client closed the stream")
                        return  # leaving the block closes the response and its connection
        record.finish(Status.INTERNAL, self.now(), "the stream ended without [DONE]")

    async def _http_whole(self, session: Session, shape: Shape, record: RequestRecord) -> None:
        response = await session.http.post("/v1/completions", json=self._payload(shape, False), headers=self.headers)
        if response.status_code != HTTPStatus.OK:
            record.finish(http_status(response.status_code), self.now(), response.text)
            return
        finished = {c["index"]: c.get("finish_reason") or "" for c in response.json()["choices"]}
        record.finish(*_ended({i: reason for i, reason in finished.items() if reason}, shape.n, self.now()))

    def _payload(self, shape: Shape, stream: bool) -> dict:
        payload = {"model": self.model, "prompt": shape.prompt, "max_tokens": shape.max_tokens, "n": shape.n,
                   "seed": shape.seed, "ignore_eos": shape.ignore_eos, "stream": stream}
        if shape.stop:
            payload["stop"] = shape.stop
        return payload


class SoakTraffic:
    """The clients, on an event loop of their own thread: `start()`, `stop()` (no new requests,
    then the in-flight ones end or become unended), `records`."""

    def __init__(self, spec: TrafficSpec, tokenizer: Tokenizer | None = None) -> None:
        if spec.concurrency < 1:
            raise ConfigError(f"--concurrency must be at least 1, got {spec.concurrency}")
        if not spec.request_timeout_s > 0:
            raise ConfigError(f"--request-timeout must be positive, got {spec.request_timeout_s}")
        self.spec = spec
        self.prompts = PromptPool(spec, tokenizer, random.Random(spec.seed))
        self.records: list[RequestRecord] = []
        self.restarts: list[float] = []  # when restart_clients() ran (s since t0)
        self.t0 = 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="soak-traffic", daemon=True)
        self._session: Session | None = None
        self._stopping: asyncio.Event | None = None
        self._workers: list[asyncio.Task] = []
        self._sender = RequestSender(spec.model, spec.api_key, self.now)
        self._count = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- from the caller's thread ----------------------------------------------------------------
    def start(self) -> "SoakTraffic":
        """Open the clients (each frontend must answer) and start the workers."""
        self._thread.start()
        try:
            self._call(self._open(), CONNECT_TIMEOUT_S * 3)
        except BaseException:
            self.close()
            raise
        return self

    def stop(self) -> None:
        """No new requests; wait for the workers, whose requests end or turn unended within the request
        timeout."""
        self._call(self._drain(), self.spec.request_timeout_s + RESTART_TIMEOUT_S + CONNECT_TIMEOUT_S)
        self.close()

    def restart_clients(self) -> None:
        """Close and reopen the gRPC channel and the HTTP client (any thread)."""
        self._call(self._restart(), RESTART_TIMEOUT_S)

    def close(self) -> None:
        if self._loop.is_running():
            self._call(self._close_session(), RESTART_TIMEOUT_S)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(RESTART_TIMEOUT_S)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()

    def _call(self, coroutine, timeout_s: float):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    # -- on the loop -----------------------------------------------------------------------------
    async def _open(self) -> None:
        self._session = Session(self.spec)
        try:
            await asyncio.wait_for(self._session.channel.channel_ready(), CONNECT_TIMEOUT_S)
            response = await self._session.http.get("/health", headers=self._sender.headers)
        except (TimeoutError, httpx2.HTTPError) as exc:
            raise MegaInferError(f"the soak's clients could not reach {self.spec.grpc_target} (gRPC) and "
                                 f"{self.spec.http_url} (HTTP): {type(exc).__name__}: {exc}") from None
        if response.status_code != HTTPStatus.OK:
            raise MegaInferError(f"{self.spec.http_url}/health answered {response.status_code}: {response.text[:200]}")
        self.t0 = time.monotonic()
        self._stopping = asyncio.Event()
        self._workers = [asyncio.create_task(self._worker(k)) for k in range(self.spec.concurrency)]

    async def _drain(self) -> None:
        if self._stopping is not None:
            self._stopping.set()
        if self._workers:
            await asyncio.gather(*self._workers, return_exceptions=True)

    async def _restart(self) -> None:
        old, self._session = self._session, Session(self.spec)  # requests from now on use the new clients
        self.restarts.append(self.now())
        if old is not None:
            await old.close()

    async def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def _worker(self, k: int) -> None:
        rng = random.Random(self.spec.seed * 1_000_003 + k)
        while not self._stopping.is_set() and (session := self._session) is not None:  # None: torn down
            shape = draw_shape(self.spec, self.prompts, rng)
            self._count += 1
            record = RequestRecord(f"soak-{self.spec.seed}-{self._count}", shape.frontend, shape.ending,
                                   shape.prompt_kind, shape.stream, shape.n, self.now())
            self.records.append(record)
            task = asyncio.create_task(self._sender.send(session, shape, record))
            session.inflight.add(task)
            done, _ = await asyncio.wait({task}, timeout=self.spec.request_timeout_s)
            session.inflight.discard(task)
            if not done:
                record.finish(Status.UNENDED, None, f"no final response or status within "
                                                    f"{self.spec.request_timeout_s:g} s")
                task.cancel()  # its end, if it ever comes, is not counted
            elif record.status not in CLEAN:
                await asyncio.sleep(FAILURE_PAUSE_S)


def _ended(finished: dict[int, str], n: int, now: float) -> tuple[Status, float, str]:
    """`RequestRecord.finish`'s arguments for an answer that ended without an error: OK when every
    completion finished, ABORTED when one was aborted."""
    if len(finished) < n:
        return Status.INTERNAL, now, f"the answer ended with {len(finished)} of {n} completions finished"
    if "abort" in finished.values():
        return Status.ABORTED, now, ""
    return Status.OK, now, ""
