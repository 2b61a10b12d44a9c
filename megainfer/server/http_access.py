"""API keys on the HTTP API: an ASGI middleware that answers every request without a valid
`Authorization: Bearer <key>` with 401 and OpenAI's error object (code "invalid_api_key"),
except the open paths (/health), and holds each key's limits over the requests that generate
(429, type "rate_limit_error", with Retry-After where a wait is known).

Plain ASGI rather than Starlette's BaseHTTPMiddleware: the wrapped call returns only when the
response, streamed or not, has ended or its client has gone, which is when a request's
concurrency slot must be given back."""

from __future__ import annotations

import math
from collections.abc import Iterable
from http import HTTPStatus

from starlette.responses import Response

from megainfer.server.access import MISSING_KEY, WRONG_KEY, AccessPolicy, KeyLimitExceeded, bearer_key
from megainfer.server.openai_errors import INVALID, ApiError

OPEN_PATHS = frozenset({"/health"})
GENERATION_ROUTES = frozenset({("POST", "/v1/completions"), ("POST", "/v1/chat/completions")})
RATE_LIMITED = "rate_limit_error"


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _error(error: ApiError, headers: dict[str, str]) -> Response:
    return Response(error.body.model_dump_json(), status_code=error.status, media_type="application/json",
                    headers=headers)


class HttpAccess:
    def __init__(self, app, policy: AccessPolicy, open_paths: Iterable[str] = OPEN_PATHS,
                 limited: Iterable[tuple[str, str]] = GENERATION_ROUTES) -> None:
        """open_paths: served without a key. limited: (method, path) of the requests that generate,
        which count against their key's limits."""
        self.app = app
        self.policy = policy
        self.open_paths = frozenset(open_paths)
        self.limited = frozenset(limited)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        key = bearer_key(_header(scope, b"authorization"))
        principal = self.policy.authenticate(key)
        if principal is None:
            error = ApiError(HTTPStatus.UNAUTHORIZED, MISSING_KEY if key is None else WRONG_KEY, INVALID,
                             code="invalid_api_key")
            await _error(error, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        if (scope["method"], scope["path"]) not in self.limited:
            await self.app(scope, receive, send)
            return
        try:
            admission = self.policy.admit(principal)
        except KeyLimitExceeded as exc:
            headers = {} if exc.retry_after_s is None else {"Retry-After": str(math.ceil(exc.retry_after_s))}
            error = ApiError(HTTPStatus.TOO_MANY_REQUESTS, str(exc), RATE_LIMITED, code="rate_limit_exceeded")
            await _error(error, headers)(scope, receive, send)
            return
        with admission:
            await self.app(scope, receive, send)
