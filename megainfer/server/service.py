"""The megainfer.v1.Inference gRPC service, the standard health service and reflection."""

from __future__ import annotations

import logging
import time
import uuid
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

import megainfer
from megainfer.errors import DataPlaneError, Overloaded, RequestError
from megainfer.messages import ErrorCode, FinishReason
from megainfer.sampling_params import SamplingParams
from megainfer.server.backend import GenerationBackend
from megainfer.server.metrics import ServingMetrics
from megainfer.v1 import inference_pb2 as pb
from megainfer.v1 import inference_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
SERVICE = "megainfer.v1.Inference"
POLL_S = 0.25  # how often a waiting stream checks that its client is still there


def sampling_params(msg: pb.SamplingParams) -> SamplingParams:
    """Proto -> SamplingParams; unset optional fields take the API's defaults."""
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else 16,
        temperature=msg.temperature if msg.HasField("temperature") else 0.0,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos)


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, backend: GenerationBackend, metrics: ServingMetrics | None = None) -> None:
        self.backend = backend
        self.metrics = metrics

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        rid = request.request_id or uuid.uuid4().hex
        which = request.WhichOneof("prompt")
        if which is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is missing: set text or token_ids")
        prompt = request.text if which == "text" else list(request.token_ids.ids)
        try:
            stream = self.backend.submit(rid, prompt, sampling_params(request.sampling))
        except RequestError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Overloaded as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except DataPlaneError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finished = False

        def on_done() -> None:  # the client went away (or the RPC ended): free its blocks
            if not finished:
                self.backend.abort(rid)

        if not context.add_callback(on_done):  # the client left before the callback could be set
            self.backend.abort(rid)
            return
        completion = 0
        first = last = None
        while True:
            delta = stream.get(POLL_S)
            if delta is None:
                if not context.is_active():
                    self.backend.abort(rid)  # idempotent: the callback may have done it already
                    return
                continue
            now = time.monotonic()
            if delta.new_token_ids:
                completion += len(delta.new_token_ids)
                first = first or now
                last = now
            if not delta.finished:
                yield pb.GenerateResponse(request_id=rid, token_ids=delta.new_token_ids, text=delta.new_text)
                continue
            finished = True
            if delta.finish_reason is FinishReason.ERROR:
                code = grpc.StatusCode.UNAVAILABLE if delta.error_code is ErrorCode.UNAVAILABLE \
                    else grpc.StatusCode.INTERNAL
                context.abort(code, delta.error or "request failed")
            ttft_s, e2e_s = (first or now) - stream.arrival, now - stream.arrival
            tpot_s = (last - first) / (completion - 1) if completion > 1 else None
            if self.metrics is not None:
                self.metrics.observe_request(ttft_s, tpot_s, e2e_s)
            timings = pb.Timings(ttft_ms=ttft_s * 1e3, mean_tbt_ms=(tpot_s or 0.0) * 1e3, e2e_ms=e2e_s * 1e3)
            yield pb.GenerateResponse(request_id=rid, token_ids=delta.new_token_ids, text=delta.new_text,
                                      finish_reason=delta.finish_reason.value,
                                      usage=pb.Usage(prompt_tokens=stream.prompt_tokens, completion_tokens=completion),
                                      timings=timings)
            return

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(aborted=self.backend.abort(request.request_id))

    def ServerInfo(self, request: pb.ServerInfoRequest, context: grpc.ServicerContext) -> pb.ServerInfoResponse:
        info = self.backend.info()
        return pb.ServerInfoResponse(version=megainfer.__version__, model=info.model, plan_yaml=info.plan_yaml,
                                     nodes=[pb.NodeInfo(name=n.name, role=n.role.value, state=n.state.value,
                                                        detail=n.detail) for n in info.nodes])


class Server:
    """A running gRPC server; `stop()` drains it."""

    def __init__(self, backend: GenerationBackend, host: str = "127.0.0.1", port: int = 50051,
                 workers: int = 64, metrics_port: int | None = None) -> None:
        """metrics_port: also serve Prometheus metrics over HTTP on host:metrics_port (0: any free port)."""
        self.backend = backend
        self.metrics = ServingMetrics(backend) if metrics_port is not None else None
        self._metrics_bind = (host, metrics_port)
        self.metrics_port: int | None = None
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"))
        pb_grpc.add_InferenceServicer_to_server(InferenceServicer(backend, self.metrics), self.grpc)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (pb.DESCRIPTOR.services_by_name["Inference"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME),
            self.grpc)
        self.port = self.grpc.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            from megainfer.errors import ConfigError
            raise ConfigError(f"cannot listen on {host}:{port} (in use, or not an address of this machine)")
        self.address = f"{host}:{self.port}"

    def start(self) -> "Server":
        if self.metrics is not None:
            host, port = self._metrics_bind
            try:
                self.metrics_port = self.metrics.serve(host, port)
            except OSError as exc:
                from megainfer.errors import ConfigError
                raise ConfigError(f"--metrics-port {port}: cannot listen on {host}:{port} ({exc.strerror})") from None
            logger.info("metrics on http://%s:%d/metrics", host, self.metrics_port)
        self.grpc.start()
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info("serving %s on %s", SERVICE, self.address)
        return self

    def stop(self, grace: float = 2.0) -> None:
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.grpc.stop(grace).wait()
        if self.metrics is not None:
            self.metrics.close()
