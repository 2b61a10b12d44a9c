"""TLS for both frontends, with vLLM's (uvicorn's) flag names: `--ssl-certfile` and
`--ssl-keyfile` turn on TLS for gRPC and HTTPS; `--ssl-ca-certs` also requires every client to
present a certificate signed by that CA (mutual TLS). The files are read and checked once, at
start-up, so a missing, unreadable or mismatched file is a ConfigError naming its flag before
anything listens."""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from megainfer.errors import ConfigError


def _read(path: Path, flag: str, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read it ({exc.strerror or exc}); give the path of {what}") from None
    if b"-----BEGIN" not in data:
        raise ConfigError(f"{flag} {path}: not a PEM file (no '-----BEGIN' line); give {what} in PEM format")
    return data


@dataclass(frozen=True)
class TlsFiles:
    """The server's certificate and key, and for mutual TLS the CA that signs clients' certificates."""

    certfile: Path  # PEM: the server's certificate (followed by its chain, if any)
    keyfile: Path  # PEM: its private key, unencrypted
    ca_certs: Path | None = None  # PEM: CA certificates; set, clients must present a certificate they signed

    @property
    def mutual(self) -> bool:
        return self.ca_certs is not None

    @classmethod
    def from_options(cls, certfile: str | os.PathLike | None, keyfile: str | os.PathLike | None,
                     ca_certs: str | os.PathLike | None = None) -> "TlsFiles | None":
        """None when no TLS flag is given; else checked files (ConfigError naming the flag)."""
        if certfile is None and keyfile is None:
            if ca_certs is not None:
                raise ConfigError(f"--ssl-ca-certs {ca_certs}: client certificates need TLS; add --ssl-certfile and "
                                  "--ssl-keyfile (the server's own certificate and key)")
            return None
        if certfile is None or keyfile is None:
            given, missing = ("--ssl-certfile", "--ssl-keyfile") if keyfile is None else \
                ("--ssl-keyfile", "--ssl-certfile")
            raise ConfigError(f"{given} needs {missing} too: TLS takes the server's certificate and its private key")
        files = cls(Path(certfile), Path(keyfile), None if ca_certs is None else Path(ca_certs))
        files.check()
        return files

    def check(self) -> None:
        """Each file readable PEM, the key the certificate's, the CA file loadable."""
        _read(self.certfile, "--ssl-certfile", "the server's certificate")
        _read(self.keyfile, "--ssl-keyfile", "the certificate's private key")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_verify_locations(cafile=str(self.certfile))
        except ssl.SSLError:
            raise ConfigError(f"--ssl-certfile {self.certfile}: holds no certificate; give the server's certificate "
                              "(PEM)") from None
        try:
            # An empty password: an encrypted key fails here instead of OpenSSL prompting on the terminal.
            context.load_cert_chain(str(self.certfile), str(self.keyfile), password=lambda: b"")
        except ssl.SSLError as exc:
            why = "is not the private key of --ssl-certfile's certificate" if "MISMATCH" in str(exc) else \
                f"cannot be loaded with --ssl-certfile ({exc.reason or exc}); it must be an unencrypted PEM key"
            raise ConfigError(f"--ssl-keyfile {self.keyfile}: {why}; give the key the certificate "
                              f"{self.certfile} was issued for") from None
        if self.ca_certs is not None:
            _read(self.ca_certs, "--ssl-ca-certs", "the CA certificate(s) that sign client certificates")
            try:
                context.load_verify_locations(cafile=str(self.ca_certs))
            except ssl.SSLError as exc:
                raise ConfigError(f"--ssl-ca-certs {self.ca_certs}: not a CA certificate file ({exc.reason or exc}); "
                                  "give the PEM certificate(s) of the CA that signs client certificates") from None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        root = self.ca_certs.read_bytes() if self.ca_certs is not None else None
        return grpc.ssl_server_credentials([(self.keyfile.read_bytes(), self.certfile.read_bytes())],
                                           root_certificates=root, require_client_auth=self.mutual)

    def uvicorn_options(self) -> dict:
        """uvicorn.Config's TLS arguments."""
        return dict(ssl_certfile=str(self.certfile), ssl_keyfile=str(self.keyfile),
                    ssl_ca_certs=None if self.ca_certs is None else str(self.ca_certs),
                    ssl_cert_reqs=ssl.CERT_REQUIRED if self.mutual else ssl.CERT_NONE)


@dataclass(frozen=True)
class ClientTls:
    """A client's side of TLS: whom to trust, and for mutual TLS its own certificate and key."""

    ca_certs: Path | None = None  # PEM: roots that sign the server's certificate (None: the system's)
    certfile: Path | None = None  # PEM: the client's certificate, for a server that requires one
    keyfile: Path | None = None  # PEM: its private key

    def __post_init__(self) -> None:
        if (self.certfile is None) != (self.keyfile is None):
            raise ConfigError("a client certificate needs its key and a key its certificate: give both or neither")

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        def read(path: Path | None, field: str, what: str) -> bytes | None:
            return None if path is None else _read(Path(path), f"client TLS {field}", what)

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_certs, "ca_certs", "the CA certificate(s) that sign the server's"),
            private_key=read(self.keyfile, "keyfile", "the client certificate's private key"),
            certificate_chain=read(self.certfile, "certfile", "the client certificate"))
