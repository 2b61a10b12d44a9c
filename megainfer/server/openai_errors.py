"""Every error a client of the HTTP API can see, as OpenAI's error object with its status code:
400 a bad request (megainfer's RequestError, pydantic's validation errors), 404 an unknown model
or route, 429 overloaded, 503 the deployment cannot serve now (retry), 500 a bug."""

from __future__ import annotations

import logging
from http import HTTPStatus

from megainfer.errors import DataPlaneError, MegaInferError, Overloaded, RequestError
from megainfer.messages import ErrorCode, RequestDelta
from megainfer.server.openai_protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

INVALID = "invalid_request_error"
NOT_FOUND = "not_found_error"
OVERLOADED = "overloaded_error"
UNAVAILABLE = "service_unavailable_error"
INTERNAL = "internal_error"


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = INVALID, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))


def api_error(exc: BaseException) -> ApiError:
    """The ApiError a client gets for `exc`; anything unexpected is a 500, logged with its traceback."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestError):
        return ApiError(HTTPStatus.BAD_REQUEST, str(exc))
    if isinstance(exc, Overloaded):
        return ApiError(HTTPStatus.TOO_MANY_REQUESTS, str(exc), OVERLOADED)
    if isinstance(exc, DataPlaneError):
        return ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), UNAVAILABLE)
    if isinstance(exc, MegaInferError):  # e.g. a node's error Ray could not unwrap
        logger.warning("request failed: %s", exc)
        return ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, str(exc), INTERNAL)
    logger.error("request failed on a bug", exc_info=exc)
    return ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error ({type(exc).__name__}); see the server's log",
                    INTERNAL)


def failed_request(delta: RequestDelta) -> ApiError:
    """A request that failed in the engine (its last delta says why)."""
    if delta.error_code is ErrorCode.UNAVAILABLE:
        return ApiError(HTTPStatus.SERVICE_UNAVAILABLE, delta.error or "unavailable; retry", UNAVAILABLE)
    return ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, delta.error or "request failed", INTERNAL)


def validation_error(errors: list[dict]) -> ApiError:
    """pydantic's errors (a malformed body) as one 400 naming the first offending field."""
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                        for e in errors[:5])
    return ApiError(HTTPStatus.BAD_REQUEST, message or "invalid request body", INVALID, param)
