"""Mutual authentication of a control connection with the shared secret.

Each side sends a random nonce, then an HMAC over both nonces and its role (initiator or
responder, so a proof cannot be reflected back). A side whose proof does not verify is
refused before any other byte is exchanged.
"""

from __future__ import annotations

import hmac
import secrets
import socket

from transport.errors import HandshakeError
from transport.wire import proof, recv_frame, send_frame

NONCE_BYTES = 32


def authenticate(sock: socket.socket, secret: bytes, initiator: bool) -> None:
    own_nonce = secrets.token_bytes(NONCE_BYTES)
    send_frame(sock, own_nonce)
    peer_nonce = recv_frame(sock)
    if len(peer_nonce) != NONCE_BYTES:
        raise HandshakeError("peer sent a malformed challenge")
    own_role, peer_role = (b"I", b"R") if initiator else (b"R", b"I")
    send_frame(sock, proof(secret, own_role, own_nonce, peer_nonce))
    expected = proof(secret, peer_role, peer_nonce, own_nonce)
    if not hmac.compare_digest(recv_frame(sock), expected):
        raise HandshakeError("peer failed authentication: it does not hold the shared secret")
