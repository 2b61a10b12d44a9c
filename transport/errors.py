"""Errors the transport raises. `transport/` knows nothing of megainfer: these stand alone."""


class TransportError(Exception):
    """Base class of every transport failure; the message names the peer and the fix."""


class HandshakeError(TransportError):
    """A connection could not be authenticated or its parameters do not match."""


class PeerTimeout(TransportError):
    """A peer did not answer within the endpoint's timeout."""


class PeerClosed(TransportError):
    """A peer closed its connection (its process exited or it shut down)."""


class ProtocolViolation(PeerClosed):
    """An authenticated peer sent what the protocol forbids (a bad header, a replayed or skipped
    sequence number, a write into a slot still held, a malformed credit): the endpoint dropped
    that peer's channels, as if it had closed them. The message says what was wrong."""


class PayloadTooLarge(TransportError):
    """A send's payload does not fit the receiver's slot."""


class BackendUnavailable(TransportError):
    """The requested backend cannot serve this endpoint or peer (the reason is in the message)."""
