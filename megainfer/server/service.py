"""The megainfer.v1.Inference gRPC service, the standard health service and reflection."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

import megainfer
from megainfer.errors import DataPlaneError, Overloaded, RequestError
from megainfer.messages import ErrorCode, FinishReason, PositionLogprobs, RequestDelta
from megainfer.sampling_params import SamplingParams
from megainfer.server.backend import GenerationBackend, RequestStream
from megainfer.server.fan_in import FanIn
from megainfer.server.grpc_decoding import add_inference_service
from megainfer.server.grpc_access import AccessInterceptor, principal_of
from megainfer.server.metrics import ServingMetrics
from megainfer.server.readiness import Readiness
from megainfer.v1 import inference_pb2 as pb
from megainfer.v1 import inference_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
SERVICE = "megainfer.v1.Inference"
POLL_S = 0.25  # how often a waiting stream checks that its client is still there
HEALTH_POLL_S = 1.0  # how often the health service re-reads the backend's readiness

if TYPE_CHECKING:  # only its `defaults` are read
    from megainfer.server.access import AccessPolicy
    from megainfer.server.served_model import ServedModel
    from megainfer.server.tls import TlsFiles


API_DEFAULTS = {"max_tokens": 16, "temperature": 0.0}  # for fields unset, where the model sets none
# Optional in the proto: unset means "the served model's default" (generation_config.json).
MODEL_DEFAULTED = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")
_OPTIONAL = ("seed", "n", "logprobs", "prompt_logprobs", "skip_special_tokens")  # unset: SamplingParams' default
_PLAIN = ("ignore_eos", "presence_penalty", "frequency_penalty", "min_tokens", "include_stop_str_in_output")
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def sampling_params(msg: pb.SamplingParams, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """Proto -> SamplingParams, checked (a bad value raises RequestError naming the field). An unset
    field of MODEL_DEFAULTED takes `defaults` (the served model's), else API_DEFAULTS, else
    SamplingParams' own."""
    fallback = {**API_DEFAULTS, **(defaults or {})}
    values: dict[str, Any] = {name: fallback[name] for name in MODEL_DEFAULTED if name in fallback}
    sent = {name: getattr(msg, name) for name in MODEL_DEFAULTED + _OPTIONAL if msg.HasField(name)}
    sent.update({name: getattr(msg, name) for name in _PLAIN})
    for name in _FLOATS:
        if name in sent:  # float32 on the wire: 0.7 arrives as 0.699999988, whose shortest decimal was sent
            sent[name] = float(str(np.float32(sent[name])))
    values.update(sent)
    return SamplingParams(**values, stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids))


def token_logprobs(position: PositionLogprobs, top: int) -> pb.TokenLogprobs:
    """One position's logprobs: its token (the dict's first entry) and the `top` most likely."""
    token_id, chosen = next(iter(position.items()))
    ranked = sorted(position.items(), key=lambda item: item[1].rank)[:top]
    return pb.TokenLogprobs(token_id=token_id, logprob=chosen.logprob, rank=chosen.rank,
                            text=chosen.decoded_token or "",
                            top=[pb.TopLogprob(token_id=t, logprob=lp.logprob, rank=lp.rank,
                                               text=lp.decoded_token or "") for t, lp in ranked])


def _status(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, RequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, DataPlaneError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


@dataclass
class _Completion:
    """One of a request's n completions: its engine request and what its stream has shown."""

    index: int
    request_id: str  # the engine's: "<api id>-<index>", or the API's id when n == 1
    params: SamplingParams
    stream: RequestStream
    tokens: int = 0
    first: float | None = None  # when its first token arrived (time.monotonic)
    last: float | None = None  # when its latest token arrived
    ended: bool = False

    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.stream.arrival

    def tpot_s(self) -> float | None:
        return (self.last - self.first) / (self.tokens - 1) if self.tokens > 1 else None


class InferenceServicer(pb_grpc.InferenceServicer):
    """Generate fans a request's n completions out into n engine requests (`SamplingParams.for_choice`),
    streams their deltas interleaved (each response says its `index`) and ends when all n ended;
    a completion that fails fails the call and aborts the others, as does the client leaving.
    With API keys, Abort stops only requests the same key started."""

    def __init__(self, backend: GenerationBackend, metrics: ServingMetrics | None = None,
                 served_model: ServedModel | None = None, access: AccessPolicy | None = None) -> None:
        """served_model: whose `defaults` fill the sampling fields a request leaves unset. access: the
        API keys (checked by the server's interceptor); here, who owns which request."""
        self.backend = backend
        self.metrics = metrics
        self.defaults = served_model.defaults if served_model is not None else {}
        self.access = access
        self._live: dict[str, list[_Completion]] = {}  # API request id -> its completions, while streaming
        self._owner: dict[str, str | None] = {}  # API request id -> the principal that started it, while live
        self._live_lock = threading.Lock()

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        rid = request.request_id or uuid.uuid4().hex
        which = request.WhichOneof("prompt")
        if which is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is missing: set text or token_ids")
        prompt = request.text if which == "text" else list(request.token_ids.ids)
        try:
            params = sampling_params(request.sampling, self.defaults)
            completions = self._submit(rid, prompt, params, principal_of(self.access, context))
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status; bugs are logged
            if _status(exc) is grpc.StatusCode.INTERNAL:
                logger.exception("request %s could not be submitted", rid)
            context.abort(_status(exc), str(exc))
        try:
            if not context.add_callback(lambda: self._abort(completions)):
                return  # the client left before the callback could be set: `finally` aborts
            yield from self._stream(rid, params, completions, context)
        finally:
            with self._live_lock:
                self._live.pop(rid, None)
                self._owner.pop(rid, None)
            self._abort(completions)
            for c in completions:  # the client went away: the rest count as aborted
                if not c.ended:
                    self._end(c, RequestDelta(c.request_id, [], "", True, FinishReason.ABORT), time.monotonic())

    def _submit(self, rid: str, prompt, params: SamplingParams, owner: str | None = None) -> list[_Completion]:
        """Start the n engine requests; if one is refused, abort those started and raise. owner:
        the principal whose key may abort it."""
        choices = [params.for_choice(i) for i in range(params.n)]
        # Every choice has the same prompt: its logprobs are computed once, by choice 0.
        choices[1:] = [c.replace(prompt_logprobs=None) for c in choices[1:]]
        ids = [rid] if params.n == 1 else [f"{rid}-{i}" for i in range(params.n)]
        with self._live_lock:
            if rid in self._live:
                raise RequestError(f"request id {rid!r} is already in use")
            completions = self._live[rid] = []
            self._owner[rid] = owner
        try:
            for i, (engine_id, choice) in enumerate(zip(ids, choices)):
                completions.append(_Completion(i, engine_id, choice, self.backend.submit(engine_id, prompt, choice)))
        except BaseException:
            with self._live_lock:
                del self._live[rid]
                del self._owner[rid]
            self._abort(completions)
            raise
        return completions

    def _stream(self, rid: str, params: SamplingParams, completions: list[_Completion],
                context: grpc.ServicerContext):
        fan_in = FanIn([c.stream for c in completions])
        # The prompt's logprobs come with choice 0's first delta and belong on the stream's first
        # response: the other choices' responses wait for it.
        held: list[pb.GenerateResponse] | None = [] if params.prompt_logprobs is not None else None
        while True:
            got = fan_in.get(POLL_S)
            if got is None:
                if not context.is_active():
                    return
                continue
            index, delta = got
            c = completions[index]
            if c.ended:  # an abort raced the completion's own last delta: the first one counts
                continue
            now = time.monotonic()
            if delta.new_token_ids:
                if self.metrics is not None and c.last is not None:
                    self.metrics.observe_token_gap(now - c.last)
                c.tokens += len(delta.new_token_ids)
                c.first = c.first or now
                c.last = now
            if delta.finished:
                self._end(c, delta, now)
                if delta.finish_reason is FinishReason.ERROR:
                    code = grpc.StatusCode.UNAVAILABLE if delta.error_code is ErrorCode.UNAVAILABLE \
                        else grpc.StatusCode.INTERNAL
                    where = f"completion {index}: " if len(completions) > 1 else ""
                    context.abort(code, where + (delta.error or "request failed"))
            batch = [_response(rid, c, delta)]
            if held is not None:
                if index != 0:
                    held.append(batch.pop())
                    continue
                batch[0].prompt_logprobs.extend(token_logprobs(p, params.prompt_logprobs)
                                                for p in (delta.prompt_logprobs or []) if p is not None)
                batch += held
                held = None
            done = all(c.ended for c in completions)
            if done:
                batch[-1].usage.CopyFrom(pb.Usage(prompt_tokens=completions[0].stream.prompt_tokens,
                                                  completion_tokens=sum(c.tokens for c in completions)))
                batch[-1].timings.CopyFrom(_timings(completions, now))
            yield from batch
            if done:
                return

    def _end(self, c: _Completion, final: RequestDelta, now: float) -> None:
        c.ended = True
        if self.metrics is not None:
            self.metrics.observe_request(final, c.ttft_s(), c.tpot_s(), now - c.stream.arrival)

    def _abort(self, completions: list[_Completion]) -> bool:
        """Cancel the completions still running; each stream gets an "abort" last delta. Any thread.
        True where one was still running. The backend forgets an aborted request either way, so a
        completion whose abort came too late (it had just ended, its last delta not yet handed
        over) would never get that delta: its stream ends here too. Where its last delta did
        arrive first, the stream reads that and passes over this one."""
        aborted = False
        for c in list(completions):
            if not c.ended:
                aborted = self.backend.abort(c.request_id) or aborted
                c.stream.put(RequestDelta(c.request_id, [], "", True, FinishReason.ABORT))
        return aborted

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        """With API keys, another key's request is treated as unknown (aborted=false), and only
        requests this servicer started can be aborted (not an HTTP request's engine ids)."""
        principal = principal_of(self.access, context)
        with self._live_lock:
            completions = self._live.get(request.request_id)
            owned = completions is not None and self._owner.get(request.request_id) == principal
        if completions is None and self.access is None:
            return pb.AbortResponse(aborted=self.backend.abort(request.request_id))
        return pb.AbortResponse(aborted=owned and self._abort(completions))

    def ServerInfo(self, request: pb.ServerInfoRequest, context: grpc.ServicerContext) -> pb.ServerInfoResponse:
        info = self.backend.info()
        return pb.ServerInfoResponse(version=megainfer.__version__, model=info.model, plan_yaml=info.plan_yaml,
                                     nodes=[pb.NodeInfo(name=n.name, role=n.role.value, state=n.state.value,
                                                        detail=n.detail) for n in info.nodes])


def _response(rid: str, c: _Completion, delta: RequestDelta) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=rid, index=c.index, token_ids=delta.new_token_ids,
                                   text=delta.new_text)
    if delta.logprobs and c.params.logprobs is not None:
        response.logprobs.extend(token_logprobs(p, c.params.logprobs) for p in delta.logprobs)
    if delta.finished:
        response.finish_reason = delta.finish_reason.value
        if isinstance(delta.stop_reason, int):
            response.stop_token_id = delta.stop_reason
        elif isinstance(delta.stop_reason, str):
            response.stop_string = delta.stop_reason
    return response


def _timings(completions: list[_Completion], now: float) -> pb.Timings:
    """Over all completions: arrival to the first token of any, the mean gap between two tokens
    of one completion, arrival to the end."""
    arrival = min(c.stream.arrival for c in completions)
    firsts = [c.first for c in completions if c.first is not None]
    gaps = sum(c.tokens - 1 for c in completions if c.tokens > 1)
    spread = sum(c.last - c.first for c in completions if c.tokens > 1)
    return pb.Timings(ttft_ms=((min(firsts) if firsts else now) - arrival) * 1e3,
                      mean_tbt_ms=(spread / gaps if gaps else 0.0) * 1e3, e2e_ms=(now - arrival) * 1e3)


class Server:
    """A running gRPC server; `stop()` drains it. Its health service says SERVING while every
    node of the backend serves and NOT_SERVING while one is down or re-wiring (a poller thread
    reads `readiness`, shared with the HTTP /health)."""

    def __init__(self, backend: GenerationBackend, host: str = "127.0.0.1", port: int = 50051,
                 workers: int = 64, metrics_port: int | None = None, *, metrics: ServingMetrics | None = None,
                 served: ServedModel | None = None, readiness: Readiness | None = None,
                 access: AccessPolicy | None = None, tls: TlsFiles | None = None) -> None:
        """metrics_port: also serve Prometheus metrics over HTTP on host:metrics_port (0: any free port;
        never key-checked: Endpoints serves a checked one). metrics: the process's ServingMetrics, shared
        with the HTTP frontend (default: one of its own when metrics_port is set). served: the model
        whose generation defaults fill unset fields. access: API keys every RPC but health requires
        (grpc_access.py). tls: serve TLS only (mutual TLS where it names a CA)."""
        from megainfer.errors import ConfigError

        self.backend = backend
        if metrics is None and metrics_port is not None:
            metrics = ServingMetrics(backend, served.name if served is not None else backend.info().model)
        self.metrics = metrics
        self.readiness = readiness or Readiness(backend)
        self._metrics_bind = (host, metrics_port)
        self.metrics_port: int | None = None
        # Without SO_REUSEPORT a port another server holds is refused, instead of shared with it.
        interceptors = None if access is None else [AccessInterceptor(access, [f"/{SERVICE}/Generate"])]
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
                                interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
        add_inference_service(InferenceServicer(backend, self.metrics, served_model=served,
                                                access=access), self.grpc)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (pb.DESCRIPTOR.services_by_name["Inference"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME),
            self.grpc)
        self.tls = tls
        try:
            self.port = self.grpc.add_insecure_port(f"{host}:{port}") if tls is None else \
                self.grpc.add_secure_port(f"{host}:{port}", tls.grpc_credentials())
        except RuntimeError:  # grpcio raises where older releases returned 0
            self.port = 0
        if self.port == 0:
            raise ConfigError(f"--port {port}: cannot listen on {host}:{port} (in use, or not an address of this "
                              "machine); choose another port, or 0 for any free one")
        self.address = f"{host}:{self.port}"
        self.serving: bool | None = None  # what the health service says now (None: not started)
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch_health, name="grpc-health", daemon=True)

    def start(self) -> "Server":
        from megainfer.errors import ConfigError

        if self.metrics is not None and self._metrics_bind[1] is not None:
            host, port = self._metrics_bind
            try:
                self.metrics_port = self.metrics.serve(host, port)
            except OSError as exc:
                raise ConfigError(f"--metrics-port {port}: cannot listen on {host}:{port} ({exc.strerror})") from None
            logger.info("metrics on http://%s:%d/metrics", host, self.metrics_port)
        self.grpc.start()
        self._set_serving(self.readiness.check().ok)
        self._watcher.start()
        logger.info("serving %s on %s", SERVICE, self.address)
        return self

    @property
    def metrics_url(self) -> str | None:
        """The metrics-only listener's address, once started (None without --metrics-port)."""
        return None if self.metrics_port is None else f"http://{self._metrics_bind[0]}:{self.metrics_port}/metrics"

    def _set_serving(self, serving: bool) -> None:
        if serving == self.serving:
            return
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            self.health.set(name, status)
        if self.serving is not None:
            logger.warning("health: %s", "serving again" if serving else
                           f"not serving ({self.readiness.check().reason})")
        self.serving = serving

    def _watch_health(self) -> None:
        while not self._stopping.wait(HEALTH_POLL_S):
            self._set_serving(self.readiness.check().ok)

    def stop(self, grace: float = 2.0) -> None:
        self._stopping.set()
        if self._watcher.is_alive():
            self._watcher.join(5)
        self.health.enter_graceful_shutdown()  # NOT_SERVING for every service, for good
        self.grpc.stop(grace).wait()
        if self.metrics_port is not None:
            self.metrics.close()
