"""A small client for megainfer.v1.Inference (used by `megainfer generate --server`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import grpc

from megainfer.errors import MegaInferError
from megainfer.sampling_params import SamplingParams
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
    for name in ("seed", "logprobs", "prompt_logprobs"):  # None: unset
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
    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        self.channel = grpc.insecure_channel(address)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise MegaInferError(f"no megainfer server answers at {address} (is `megainfer deploy` running?)") from None
        self.stub = pb_grpc.InferenceStub(self.channel)

    def generate(self, prompt, params: SamplingParams, request_id: str = "",
                 server_defaults: Iterable[str] = ()) -> Iterator[pb.GenerateResponse]:
        """The responses of all `params.n` completions, interleaved (each says its `index`)."""
        try:
            yield from self.stub.Generate(request_message(prompt, params, request_id, server_defaults))
        except grpc.RpcError as exc:
            raise MegaInferError(f"server refused the request: {exc.code().name}: {exc.details()}") from None

    def info(self) -> pb.ServerInfoResponse:
        return self.stub.ServerInfo(pb.ServerInfoRequest())

    def close(self) -> None:
        self.channel.close()
