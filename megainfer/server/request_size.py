"""A cap on an HTTP request's body (ASGI middleware): larger bodies are answered 413 with
OpenAI's error object before they are parsed, so one client cannot make the server hold and
parse an unbounded JSON document.

The largest useful body is a batch of token-id prompts filling the context: 8 MiB holds about a
million token ids as JSON, twice what gRPC's default 4 MiB message limit lets through. A body
that declares its length (Content-Length) is refused before any of it is read; a chunked one
is counted as it arrives and refused once it passes the cap.
"""

from __future__ import annotations

from http import HTTPStatus

from megainfer.server.openai_errors import INVALID, ApiError

MAX_REQUEST_BYTES = 8 * 1024 * 1024


class RequestSizeLimit:
    """Pure ASGI middleware: `app` sees only bodies of at most `max_bytes` bytes."""

    def __init__(self, app, max_bytes: int = MAX_REQUEST_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, f"{declared} bytes")
            return
        received = 0
        refused = False

        async def counted_receive():
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request" and not refused:
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    await self._refuse(send, f"more than {self.max_bytes} bytes")
                    return {"type": "http.disconnect"}  # the app stops reading; its answer is dropped
            return message

        async def send_unless_refused(message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counted_receive, send_unless_refused)

    async def _refuse(self, send, size: str) -> None:
        error = ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                         f"the request body has {size}; at most {self.max_bytes} bytes are accepted (send fewer or "
                         "shorter prompts per request)", INVALID, code="request_too_large")
        body = error.body.model_dump_json().encode()
        await send({"type": "http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope) -> int | None:
    """The declared body length; None when absent or unreadable (then the body is counted)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
