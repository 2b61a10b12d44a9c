"""Everything a serving process listens on, over one backend: the gRPC service, the
OpenAI-compatible HTTP API (with /metrics), and optionally a metrics-only port. One
`ServingMetrics` and one `Readiness` serve both frontends. `megainfer serve` and `megainfer
deploy` build this."""

from __future__ import annotations

import logging

from megainfer.server.backend import GenerationBackend
from megainfer.server.metrics import ServingMetrics
from megainfer.server.readiness import Readiness
from megainfer.server.served_model import ServedModel
from megainfer.server.service import Server

logger = logging.getLogger(__name__)


class Endpoints:
    def __init__(self, backend: GenerationBackend, served: ServedModel, host: str = "127.0.0.1", port: int = 50051,
                 http_host: str | None = None, http_port: int | None = 8000, metrics_port: int | None = None) -> None:
        """host, port: gRPC. http_port None: no HTTP API; http_host defaults to `host`.
        Ports may be 0 (any free port); a port in use raises ConfigError naming its flag."""
        from megainfer.server.http_server import HttpServer
        from megainfer.server.openai_server import OpenAIServer

        self.served = served
        self.metrics = ServingMetrics(backend, served.name)
        self.readiness = Readiness(backend)
        self.grpc = Server(backend, host, port, metrics_port=metrics_port, metrics=self.metrics, served=served,
                           readiness=self.readiness)
        self.openai: OpenAIServer | None = None
        self.http: HttpServer | None = None
        if http_port is not None:
            self.openai = OpenAIServer(backend, served, self.metrics, self.readiness)
            try:
                self.http = HttpServer(self.openai.app, http_host or host, http_port)
            except BaseException:
                self.openai.close()
                self.grpc.grpc.stop(None)  # bound, never started: release its port
                raise

    @property
    def http_url(self) -> str | None:
        return self.http.url if self.http is not None else None

    def start(self) -> "Endpoints":
        try:
            self.grpc.start()
            if self.http is not None:
                self.http.start()
        except BaseException:
            self.stop(0)
            raise
        return self

    def describe(self) -> list[str]:
        """Where each listener is, for the CLI to print."""
        lines = [f"gRPC megainfer.v1.Inference on {self.grpc.address}"]
        if self.http is not None:
            lines.append(f"OpenAI-compatible HTTP API on {self.http.url}/v1 (model {', '.join(self.served.names)}; "
                         f"metrics at {self.http.url}/metrics)")
        if self.grpc.metrics_url is not None:
            lines.append(f"metrics on {self.grpc.metrics_url}")
        return lines

    def stop(self, grace: float = 2.0) -> None:
        if self.http is not None:
            self.http.stop()
        if self.openai is not None:
            self.openai.close()
        self.grpc.stop(grace)
