"""A small client for megainfer.v1.Inference (used by `megainfer generate --server`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import grpc

from megainfer.errors import MegaInferError
from megainfer.sampling_params import SamplingParams
from megainfer.server.tls import ClientTls
from megainfer.v1 import inference_pb2 as pb
from megainfer.v1 import inference_pb2_grpc as pb_grpc


def sampling_message(params: SamplingParams, server_defaults: Iterable[str] = ()) -> pb.SamplingParams:
    """Every field of `params`, but those named in `server_defaults` (of MODEL_DEFAULTED in
    megainfer.server.service), left unset so that the served model's defaults apply."""
    leave = set(server_defaults)
    msg = pb.SamplingParams(
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        min_tokens=params.min_tokens, stop=params.stop, stop_token_ids=params.stop_token_ids,
        include_stop_str_in_output=params.include_stop_str_in_output, ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens, n=params.n)
    for name in ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
        if name not in leave:
            setattr(msg, name, getattr(params, name))
    for name in ("seed", "logprobs", "prompt_logprobs", "cache_salt"):  # None: unset
        if getattr(params, name) is not None:
            setattr(msg, name, getattr(params, name))
    return msg


def request_message(prompt, params: SamplingParams, request_id: str = "",
                    server_defaults: Iterable[str] = ()) -> pb.GenerateRequest:
    sampling = sampling_message(params, server_defaults)
    if isinstance(prompt, str):
        return pb.GenerateRequest(request_id=request_id, text=prompt, sampling=sampling)
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=list(prompt)), sampling=sampling)


class Client:
    def __init__(self, address: str, timeout_s: float = 10.0, *, api_key: str | None = None,
                 tls: ClientTls | None = None) -> None:
        """api_key: sent as `authorization: Bearer <key>` metadata on every call. tls: connect over
        TLS, trusting its CA certificates (and presenting its certificate, for mutual TLS)."""
        self.channel = grpc.insecure_channel(address) if tls is None else \
            grpc.secure_channel(address, tls.grpc_credentials())
        self.metadata = () if api_key is None else (("authorization", f"Bearer {api_key}"),)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            self.channel.close()
            hint = "is `megainfer deploy` running, and serving plaintext?" if tls is None else \
                "is `megainfer deploy` running with TLS, and is its certificate signed by the CA given?"
            raise MegaInferError(f"no megainfer server answers at {address} ({hint})") from None
        self.stub = pb_grpc.InferenceStub(self.channel)

    def generate(self, prompt, params: SamplingParams, request_id: str = "",
                 server_defaults: Iterable[str] = ()) -> Iterator[pb.GenerateResponse]:
        """The responses of all `params.n` completions, interleaved (each says its `index`)."""
        try:
            yield from self.stub.Generate(request_message(prompt, params, request_id, server_defaults),
                                          metadata=self.metadata)
        except grpc.RpcError as exc:
            raise MegaInferError(f"server refused the request: {exc.code().name}: {exc.details()}") from None

    def abort(self, request_id: str) -> bool:
        """Whether the server stopped the request (False: unknown, ended, or another key's)."""
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self.metadata).aborted

    def reset_prefix_cache(self) -> None:
        """Empty every attention node's prefix cache (MegaInferError where caching is off)."""
        try:
            self.stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), metadata=self.metadata)
        except grpc.RpcError as exc:
            raise MegaInferError(f"the server did not reset its prefix cache: {exc.code().name}: "
                                 f"{exc.details()}") from None

    def info(self) -> pb.ServerInfoResponse:
        return self.stub.ServerInfo(pb.ServerInfoRequest(), metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()
