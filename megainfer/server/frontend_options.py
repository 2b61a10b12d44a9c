"""The serving process's own options, shared by `megainfer serve` and `megainfer deploy`: the HTTP
API's, access (API keys and TLS), and waiting for a signal to stop. Argument tables only: the
server modules they configure are imported where used, so `megainfer --help` stays fast."""

from __future__ import annotations

import argparse
import signal
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megainfer.server.access import AccessPolicy
    from megainfer.server.tls import TlsFiles

HTTP_PORT = 8000  # vLLM's and the OpenAI clients' usual local port


def add_frontend_options(parser: argparse.ArgumentParser) -> None:
    """The HTTP API's options, shared with `megainfer deploy`."""
    parser.add_argument("--http-port", type=int, default=HTTP_PORT,
                        help=f"port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                             f"/v1/models, /health, /metrics); 0: any free port (default {HTTP_PORT})")
    parser.add_argument("--http-host", help="bind address of the HTTP API (default: the gRPC host)")
    parser.add_argument("--no-http", action="store_true", help="serve gRPC only")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="the model's name(s) in the API: requests may use any, responses carry the first "
                             "(default: the model argument)")
    parser.add_argument("--chat-template", metavar="FILE",
                        help="Jinja chat template for /v1/chat/completions, replacing the checkpoint's "
                             "(needed where its tokenizer_config.json has none)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="also serve Prometheus metrics on this port (they are at the HTTP API's /metrics too)")
    access = parser.add_argument_group("access", "API keys and TLS, for every listener (docs/http-api.md, Access)")
    access.add_argument("--api-key", action="append", metavar="KEY",
                        help="require this key (`Authorization: Bearer KEY`, gRPC metadata `authorization`) on every "
                             "call but health; repeat for several (default: $MEGAINFER_API_KEY, if set)")
    access.add_argument("--api-key-file", metavar="PATH",
                        help="more keys: *.yaml with a `keys:` list (key, name, rate_limit, max_concurrency each), "
                             "else one key per line")
    access.add_argument("--api-key-rate-limit", type=float, metavar="R",
                        help="generation requests per second each key may start, sustained (bursts of up to R); "
                             "over it: RESOURCE_EXHAUSTED / 429 (default: no limit)")
    access.add_argument("--api-key-max-concurrency", type=int, metavar="N",
                        help="generation requests each key may have in flight at once; over it: "
                             "RESOURCE_EXHAUSTED / 429 (default: no limit)")
    access.add_argument("--ssl-certfile", metavar="PATH", help="serve TLS (gRPC and HTTPS) with this PEM certificate")
    access.add_argument("--ssl-keyfile", metavar="PATH", help="the certificate's PEM private key")
    access.add_argument("--ssl-ca-certs", metavar="PATH",
                        help="mutual TLS: clients must present a certificate signed by these PEM CA certificates")


def frontend_access(args: argparse.Namespace) -> tuple[AccessPolicy | None, TlsFiles | None]:
    """(AccessPolicy or None, TlsFiles or None) from the access flags, checked: a bad key, key file,
    limit or TLS file is a ConfigError naming its flag."""
    from megainfer.server.access import AccessPolicy
    from megainfer.server.tls import TlsFiles

    access = AccessPolicy.from_options(args.api_key, args.api_key_file, args.api_key_rate_limit,
                                       args.api_key_max_concurrency)
    return access, TlsFiles.from_options(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs)


def wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
