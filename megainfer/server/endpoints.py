"""Everything a serving process listens on, over one backend: the gRPC service, the
OpenAI-compatible HTTP API (with /metrics), and optionally a metrics-only port. One
`ServingMetrics`, one `Readiness` and one `AccessPolicy` (API keys and their limits) serve
them all, with the same TLS files. `megainfer serve` and `megainfer deploy` build this."""

from __future__ import annotations

import ipaddress
import logging

from megainfer.server.access import AccessPolicy
from megainfer.server.backend import GenerationBackend
from megainfer.server.metrics import ServingMetrics
from megainfer.server.readiness import Readiness
from megainfer.server.served_model import ServedModel
from megainfer.server.service import Server
from megainfer.server.tls import TlsFiles

logger = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach `host` (a host name other than localhost may resolve anywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(listeners: list[tuple[str, str, int]], access: AccessPolicy | None,
                    tls: TlsFiles | None) -> None:
    """One warning naming the listeners (what, host, port) other machines can reach with no key
    (anyone may use them), or with keys over plaintext (anyone on the path can read the keys)."""
    exposed = [f"{what} on {host}:{port}" for what, host, port in listeners if not is_loopback(host)]
    if not exposed:
        return
    if access is None:
        logger.warning("%s: other machines can reach this, and no API key is set: anyone who reaches it can "
                       "generate, read metrics and abort requests; set --api-key KEY (or MEGAINFER_API_KEY, or "
                       "--api-key-file PATH), or bind 127.0.0.1", ", ".join(exposed))
    elif tls is None:
        logger.warning("%s: other machines can reach this without TLS, so API keys and prompts cross the network in "
                       "plaintext; add --ssl-certfile and --ssl-keyfile", ", ".join(exposed))


class Endpoints:
    def __init__(self, backend: GenerationBackend, served: ServedModel, host: str = "127.0.0.1", port: int = 50051,
                 http_host: str | None = None, http_port: int | None = 8000, metrics_port: int | None = None, *,
                 access: AccessPolicy | None = None, tls: TlsFiles | None = None) -> None:
        """host, port: gRPC. http_port None: no HTTP API; http_host defaults to `host`. metrics_port:
        the metrics alone on a port of their own (on `host`). Ports may be 0 (any free port); a port
        in use raises ConfigError naming its flag. access: API keys every RPC and route but health
        requires (None: open to all). tls: every listener serves TLS only (mutual TLS where it names
        a CA)."""
        from megainfer.server.http_server import HttpServer
        from megainfer.server.openai_server import OpenAIServer

        self.served = served
        self.access = access
        self.tls = tls
        self.metrics = ServingMetrics(backend, served.name)
        self.readiness = Readiness(backend)
        self.grpc = Server(backend, host, port, metrics=self.metrics, served=served, readiness=self.readiness,
                           access=access, tls=tls)
        self.openai: OpenAIServer | None = None
        self.http: HttpServer | None = None
        self.metrics_http: HttpServer | None = None
        try:
            if http_port is not None:
                self.openai = OpenAIServer(backend, served, self.metrics, self.readiness, access=access)
                self.http = HttpServer(self.openai.app, http_host or host, http_port, tls=tls)
            if metrics_port is not None:
                self.metrics_http = HttpServer(self.metrics_app(), host, metrics_port, "--metrics-port", tls=tls)
        except BaseException:
            for listener in (self.http, self.metrics_http):
                if listener is not None:
                    listener.sock.close()
            if self.openai is not None:
                self.openai.close()
            self.grpc.grpc.stop(None)  # bound, never started: release its port
            raise
        listeners = [("gRPC", host, self.grpc.port)] + [
            (what, server.host, server.port) for what, server in
            (("the HTTP API", self.http), ("the metrics port", self.metrics_http)) if server is not None]
        warn_if_exposed(listeners, access, tls)

    def metrics_app(self):
        """The Prometheus exposition on every path, behind the API keys (no path is open)."""
        from prometheus_client import make_asgi_app

        from megainfer.server.http_access import HttpAccess

        app = make_asgi_app(self.metrics.registry)
        return app if self.access is None else HttpAccess(app, self.access, open_paths=())

    @property
    def http_url(self) -> str | None:
        return self.http.url if self.http is not None else None

    @property
    def metrics_url(self) -> str | None:
        return None if self.metrics_http is None else f"{self.metrics_http.url}/metrics"

    def start(self) -> "Endpoints":
        try:
            self.grpc.start()
            for listener in (self.http, self.metrics_http):
                if listener is not None:
                    listener.start()
        except BaseException:
            self.stop(0)
            raise
        return self

    def describe(self) -> list[str]:
        """Where each listener is, and who may use it, for the CLI to print."""
        security = "" if self.tls is None else " (mutual TLS)" if self.tls.mutual else " (TLS)"
        lines = [f"gRPC megainfer.v1.Inference on {self.grpc.address}{security}"]
        if self.http is not None:
            lines.append(f"OpenAI-compatible HTTP API on {self.http.url}/v1 (model {', '.join(self.served.names)}; "
                         f"metrics at {self.http.url}/metrics)")
        if self.metrics_url is not None:
            lines.append(f"metrics on {self.metrics_url}")
        if self.access is not None:
            lines.append(f"API keys: {len(self.access.principals)} ({', '.join(self.access.principals)}); every call "
                         "but health needs `Authorization: Bearer <key>`")
        return lines

    def stop(self, grace: float = 2.0) -> None:
        for listener in (self.http, self.metrics_http):
            if listener is not None:
                listener.stop()
        if self.openai is not None:
            self.openai.close()
        self.grpc.stop(grace)
