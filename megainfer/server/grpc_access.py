"""API keys on the gRPC server: an interceptor that refuses every call without a valid key
(metadata `authorization: Bearer <key>`, OpenAI's header) with UNAUTHENTICATED, except the
standard health service, and holds each key's limits over the calls that generate
(RESOURCE_EXHAUSTED when over). A refused call's request is never parsed."""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from megainfer.server.access import MISSING_KEY, WRONG_KEY, AccessPolicy, KeyLimitExceeded, bearer_key

OPEN_PREFIX = "/grpc.health.v1.Health/"  # probes (Kubernetes, load balancers) carry no key


def metadata_key(metadata: Iterable[tuple[str, str]] | None) -> str | None:
    """The key an `authorization: Bearer <key>` metadata entry carries."""
    for name, value in metadata or ():
        if name == "authorization":
            return bearer_key(value if isinstance(value, str) else value.decode(errors="replace"))
    return None


def principal_of(policy: AccessPolicy | None, context: grpc.ServicerContext) -> str | None:
    """Who made the call `context` belongs to (None without a policy: everyone is the same)."""
    return None if policy is None else policy.authenticate(metadata_key(context.invocation_metadata()))


def _refusal(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    def refuse(request_iterator, context: grpc.ServicerContext):
        context.abort(code, message)

    # Stream-stream with no deserializer answers a call of any shape, and reads none of its bytes.
    return grpc.stream_stream_rpc_method_handler(refuse)


def _admitted(handler: grpc.RpcMethodHandler, policy: AccessPolicy, principal: str) -> grpc.RpcMethodHandler:
    """A unary-stream handler that runs only within `principal`'s limits, and holds a slot of its
    concurrency until the call ends (finished, failed, or the client gone)."""
    behavior = handler.unary_stream

    def admitted(request, context: grpc.ServicerContext):
        try:
            admission = policy.admit(principal)
        except KeyLimitExceeded as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        context.add_callback(admission.release)  # gRPC calls it when the call ends, however
        try:
            yield from behavior(request, context)
        finally:
            admission.release()

    return grpc.unary_stream_rpc_method_handler(admitted, handler.request_deserializer, handler.response_serializer)


class AccessInterceptor(grpc.ServerInterceptor):
    def __init__(self, policy: AccessPolicy, limited: Iterable[str]) -> None:
        """limited: the full method names ("/package.Service/Method", unary-stream) that generate."""
        self.policy = policy
        self.limited = frozenset(limited)

    def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        method = handler_call_details.method
        if method.startswith(OPEN_PREFIX):
            return continuation(handler_call_details)
        key = metadata_key(handler_call_details.invocation_metadata)
        principal = self.policy.authenticate(key)
        if principal is None:
            return _refusal(grpc.StatusCode.UNAUTHENTICATED, MISSING_KEY if key is None else WRONG_KEY)
        handler = continuation(handler_call_details)
        if handler is None or method not in self.limited:
            return handler
        return _admitted(handler, self.policy, principal)
