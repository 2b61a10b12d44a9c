"""A small client for megainfer.v1.Inference (used by `megainfer generate --server`)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from megainfer.errors import MegaInferError
from megainfer.sampling_params import SamplingParams
from megainfer.v1 import inference_pb2 as pb
from megainfer.v1 import inference_pb2_grpc as pb_grpc


def request_message(prompt, params: SamplingParams, request_id: str = "") -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_k=params.top_k,
                                 top_p=params.top_p, stop_token_ids=params.stop_token_ids,
                                 ignore_eos=params.ignore_eos)
    if params.seed is not None:
        sampling.seed = params.seed
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

    def generate(self, prompt, params: SamplingParams, request_id: str = "") -> Iterator[pb.GenerateResponse]:
        try:
            yield from self.stub.Generate(request_message(prompt, params, request_id))
        except grpc.RpcError as exc:
            raise MegaInferError(f"server refused the request: {exc.code().name}: {exc.details()}") from None

    def info(self) -> pb.ServerInfoResponse:
        return self.stub.ServerInfo(pb.ServerInfoRequest())

    def close(self) -> None:
        self.channel.close()
