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


class RoundFailed(TransportError):
    """Part of a round failed: `failures` maps each peer that failed to its error (PeerClosed,
    PeerTimeout or ProtocolViolation); the other peers' messages were posted or collected
    (a collected round's messages are released before this is raised). The message names
    every failed peer and why."""

    def __init__(self, message: str, failures: dict[str, TransportError]) -> None:
        super().__init__(message)
        self.failures = failures

    @property
    def peers_closed(self) -> bool:
        """Every failed peer closed its end (rather than timing out): a clean way to stop."""
        return all(isinstance(exc, PeerClosed) and not isinstance(exc, ProtocolViolation)
                   for exc in self.failures.values())
