"""The megainfer.v1.Inference RPCs registered on a gRPC server with request decoding that
answers bytes which are not the RPC's request message with INVALID_ARGUMENT.

grpcio's generated `add_InferenceServicer_to_server` decodes with the message's `FromString`;
when that raises (truncated or garbled protobuf, a string field that is not UTF-8), grpcio answers
INTERNAL "Exception deserializing request!", a server fault for a client's mistake. Here the
decoder returns an `UndecodableRequest` instead, and the RPC answers INVALID_ARGUMENT with what
protobuf objected to, before the servicer sees anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from megainfer.v1 import inference_pb2 as pb

SERVICE_NAME = "Inference"


@dataclass(frozen=True)
class UndecodableRequest:
    """Bytes that did not decode as the RPC's request message."""

    message_type: str  # the message the bytes should have held, e.g. megainfer.v1.GenerateRequest
    size: int  # bytes received
    reason: str  # protobuf's complaint

    def describe(self) -> str:
        return (f"the request ({self.size} bytes) is not a valid {self.message_type} ({self.reason}); send a "
                f"protobuf-encoded {self.message_type} whose strings are UTF-8")


def _decoder(message_class) -> Callable[[bytes], object]:
    def decode(data: bytes):
        try:
            return message_class.FromString(data)
        except (DecodeError, ValueError, UnicodeDecodeError) as exc:  # a string field that is not UTF-8
            return UndecodableRequest(message_class.DESCRIPTOR.full_name, len(data), str(exc) or type(exc).__name__)

    return decode


def _refusing_undecodable(behaviour: Callable) -> Callable:
    """`behaviour` (unary or server-streaming) run only on a decoded request."""

    def run(request, context: grpc.ServicerContext):
        if isinstance(request, UndecodableRequest):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
        return behaviour(request, context)

    return run


def add_inference_service(servicer, server: grpc.Server) -> None:
    """`pb_grpc.add_InferenceServicer_to_server`, with requests decoded as the module docstring says."""
    service = pb.DESCRIPTOR.services_by_name[SERVICE_NAME]
    handlers = {}
    for method in service.methods:
        if method.client_streaming:
            raise TypeError(f"{service.full_name}/{method.name}: client streaming is not handled here")
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(_refusing_undecodable(getattr(servicer, method.name)),
                                     request_deserializer=_decoder(GetMessageClass(method.input_type)),
                                     response_serializer=GetMessageClass(method.output_type).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
