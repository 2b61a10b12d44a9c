"""An ASGI app served by uvicorn on a thread of its own, with its own event loop, beside the gRPC
server in the same process. The socket is bound here, before the thread starts, so a port in
use is a ConfigError at once and port 0 gets a free port the caller can read. With TLS files
it serves HTTPS only (a plaintext client's request fails its handshake)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from megainfer.errors import ConfigError
from megainfer.server.tls import TlsFiles

START_TIMEOUT_S = 30.0


def listen_socket(host: str, port: int, flag: str) -> socket.socket:
    """A TCP socket bound to host:port (not yet listening); `flag` names the option in errors."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(f"{flag} {port}: cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    try:
        # Rebinding right after a restart works; a port a live listener holds is still refused.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{flag} {port}: cannot listen on {host}:{port} ({exc.strerror or exc}); choose another "
                          "port, or 0 for any free one") from None
    return sock


class HttpServer:
    def __init__(self, app, host: str, port: int, flag: str = "--http-port", grace_s: float = 2.0, *,
                 tls: TlsFiles | None = None) -> None:
        """tls: serve HTTPS with these files (checked already: TlsFiles.from_options)."""
        self.host = host
        self.tls = tls
        self.sock = listen_socket(host, port, flag)
        self.port: int = self.sock.getsockname()[1]
        config = uvicorn.Config(app, http="h11", ws="none", lifespan="off", log_config=None, log_level="warning",
                                access_log=False, timeout_graceful_shutdown=grace_s,
                                **(tls.uvicorn_options() if tls is not None else {}))
        self.server = uvicorn.Server(config)
        self.grace_s = grace_s
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="http",
                                       daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls is not None else 'http'}://{host}:{self.port}"

    def start(self) -> "HttpServer":
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.sock.close()
                raise ConfigError(f"the HTTP server on {self.url} did not start (see the log above)")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop accepting, give open requests `grace_s` to finish, then cancel them."""
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(self.grace_s + 10)
        self.sock.close()
