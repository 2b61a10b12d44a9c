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
from megainfer.request_group import Completion, RequestGroup
from megainfer.sampling_params import SamplingParams
from megainfer.server.backend import PREFIX_CACHING_OFF, GenerationBackend, RequestStream
from megainfer.server.fan_in import FanIn
from megainfer.server.grpc_decoding import add_inference_service
from megainfer.server.grpc_access import AccessInterceptor, principal_of
from megainfer.server.metrics import ServingMetrics, take_delta
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
_OPTIONAL = ("seed", "n", "logprobs", "prompt_logprobs", "skip_special_tokens", "cache_salt")  # unset: SamplingParams' default
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


class InferenceServicer(pb_grpc.InferenceServicer):
    """Generate fans a request's n completions out into n engine requests (`RequestGroup`),
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
        self._live: dict[str, _Live] = {}  # API request id -> its group, while streaming
        self._live_lock = threading.Lock()

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        rid = request.request_id or uuid.uuid4().hex
        which = request.WhichOneof("prompt")
        if which is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is missing: set text or token_ids")
        prompt = request.text if which == "text" else list(request.token_ids.ids)
        try:
            params = sampling_params(request.sampling, self.defaults)
            live = self._submit(rid, prompt, params, principal_of(self.access, context))
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status; bugs are logged
            if _status(exc) is grpc.StatusCode.INTERNAL:
                logger.exception("request %s could not be submitted", rid)
            context.abort(_status(exc), str(exc))
        try:
            if not context.add_callback(lambda: self._abort(live)):
                return  # the client left before the callback could be set: `finally` aborts
            yield from self._stream(live, context)
        finally:
            with self._live_lock:
                if self._live.get(rid) is live:
                    del self._live[rid]
            self._abort(live)
            now = time.monotonic()
            for c, abort in live.group.abort_deltas():  # the client went away: the rest count as aborted
                take_delta(self.metrics, live.group, c, abort, now)

    def _submit(self, rid: str, prompt, params: SamplingParams, owner: str | None = None) -> _Live:
        """Start the n engine requests, or none (the backend refuses an id in use). owner: the
        principal whose key may abort it."""
        group = RequestGroup.of(rid, prompt, params)
        live = _Live(group, group.start(self.backend.submit, self.backend.abort), owner)
        group.prompts[0].num_tokens = live.streams[0].prompt_tokens  # a text prompt's, as the engine tokenized it
        with self._live_lock:
            self._live[rid] = live
        return live

    def _stream(self, live: _Live, context: grpc.ServicerContext):
        group = live.group
        fan_in = FanIn(live.streams)
        while True:
            got = fan_in.get(POLL_S)
            if got is None:
                if not context.is_active():
                    return
                continue
            index, delta = got
            c = group.completions[index]
            now = time.monotonic()
            shown = take_delta(self.metrics, group, c, delta, now)
            if delta.finished and c.last is delta:
                if delta.finish_reason is FinishReason.ERROR:
                    code = grpc.StatusCode.UNAVAILABLE if delta.error_code is ErrorCode.UNAVAILABLE \
                        else grpc.StatusCode.INTERNAL
                    where = f"completion {index}: " if len(group.completions) > 1 else ""
                    context.abort(code, where + (delta.error or "request failed"))
            if not shown:
                continue
            batch = [_response(group.request_id, shown_c, shown_delta) for shown_c, shown_delta in shown]
            top = group.prompts[0].params.prompt_logprobs
            if top is not None and shown[0][0].index == 0 and shown[0][1].prompt_logprobs is not None:
                batch[0].prompt_logprobs.extend(token_logprobs(p, top) for p in shown[0][1].prompt_logprobs
                                                if p is not None)
            if group.finished:
                batch[-1].usage.CopyFrom(pb.Usage(prompt_tokens=group.prompt_tokens,
                                                  completion_tokens=group.completion_tokens,
                                                  cached_tokens=group.cached_tokens))
                batch[-1].timings.CopyFrom(_timings(group.completions, now))
            yield from batch
            if group.finished:
                return

    def _abort(self, live: _Live) -> bool:
        """Cancel the completions still running (any thread); each stream gets its "abort" last
        delta (`RequestGroup.abort_deltas`). True where one was still running."""
        aborted = False
        for c, abort in live.group.abort_deltas():
            aborted = self.backend.abort(c.engine_id) or aborted
            live.streams[c.index].put(abort)
        return aborted

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        """With API keys, another key's request is treated as unknown (aborted=false), and only
        requests this servicer started can be aborted (not an HTTP request's engine ids)."""
        principal = principal_of(self.access, context)
        with self._live_lock:
            live = self._live.get(request.request_id)
        if live is None and self.access is None:
            return pb.AbortResponse(aborted=self.backend.abort(request.request_id))
        return pb.AbortResponse(aborted=live is not None and live.owner == principal and self._abort(live))

    def ResetPrefixCache(self, request: pb.ResetPrefixCacheRequest,
                         context: grpc.ServicerContext) -> pb.ResetPrefixCacheResponse:
        """HTTP's POST /reset_prefix_cache over gRPC: every attention node forgets its cached blocks."""
        try:
            reset = self.backend.reset_prefix_cache()
        except Exception as exc:  # a node that cannot be reached: the caller sees why, the server serves on
            logger.warning("ResetPrefixCache failed: %s", exc)
            context.abort(_status(exc), f"the prefix cache was not reset: {exc}")
        if not reset:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, PREFIX_CACHING_OFF)
        return pb.ResetPrefixCacheResponse()

    def ServerInfo(self, request: pb.ServerInfoRequest, context: grpc.ServicerContext) -> pb.ServerInfoResponse:
        info = self.backend.info()
        return pb.ServerInfoResponse(version=megainfer.__version__, model=info.model, plan_yaml=info.plan_yaml,
                                     nodes=[pb.NodeInfo(name=n.name, role=n.role.value, state=n.state.value,
                                                        detail=n.detail) for n in info.nodes])


@dataclass
class _Live:
    """A request being streamed: its group, each completion's stream (by index), who started it."""

    group: RequestGroup
    streams: list[RequestStream]
    owner: str | None


def _response(rid: str, c: Completion, delta: RequestDelta) -> pb.GenerateResponse:
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


def _timings(completions: list[Completion], now: float) -> pb.Timings:
    """Over all completions: arrival to the first token of any, the mean gap between two tokens
    of one completion, arrival to the end."""
    arrival = min(c.started_at for c in completions)
    firsts = [c.first_token_at for c in completions if c.first_token_at is not None]
    gaps = sum(len(c.token_ids) - 1 for c in completions if len(c.token_ids) > 1)
    spread = sum(c.last_token_at - c.first_token_at for c in completions if len(c.token_ids) > 1)
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
