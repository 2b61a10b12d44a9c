"""One attention node and one expert node in two processes (torch.multiprocessing spawn, no
Ray), ping-ponging m = 2 micro-batches over M2N endpoints: the attention node's greedy tokens
equal the colocated engine's, and the expert node served exactly the attention node's steps.
On the CPU by default; the same test runs on CUDA under the `gpu` marker, where it also
prints the pair's decode tokens/s."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass

import pytest
import torch
import torch.multiprocessing as mp

from deploy.link import SwitchableLink
from megainfer import Engine, SamplingParams
from megainfer.config import EngineConfig, ModelConfig
from megainfer.disagg.expert_link import dispatch_bytes
from megainfer.disagg.expert_worker import ExpertWorker
from megainfer.disagg.pipelined_runner import PipelinedModelRunner
from megainfer.model.weights import SafetensorsCheckpoint
from tests.helpers import generate_all
from transport import PeerClosed

SECRET = b"two-process-pair" * 2
MICRO_BATCHES = 2
ATTENTION, EXPERT = "attention0", "expert0"
BATCH_TOKENS = 64  # the engine's token budget: what one micro-batch can carry, what the slots hold
WAIT_S = 120  # longest wait for a child process's next word


@dataclass
class AttentionResult:
    tokens: list[list[int]]  # per prompt, its greedy tokens
    steps: int  # engine steps taken (the expert node must have served as many)
    decode_tokens: int  # tokens sampled in steps with no prompt left to prefill
    decode_seconds: float  # wall time of those steps


def engine_config(device: str) -> EngineConfig:
    return EngineConfig(device=device, num_kv_blocks=64, block_size=8, max_num_batched_tokens=BATCH_TOKENS)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def wire(link: SwitchableLink, conn) -> None:
    """Open the endpoint, trade addresses through the parent, connect to the peer."""
    conn.send(link.open())
    link.connect(conn.recv())


def attention_node(path: str, device: str, backend: str, prompts: list[list[int]], max_tokens: int, conn) -> None:
    try:
        torch.set_num_threads(1)
        model = ModelConfig.from_pretrained(path)
        link = SwitchableLink(ATTENTION, 0, SECRET, "127.0.0.1", BATCH_TOKENS * model.hidden_size * 4,
                              MICRO_BATCHES, backend, 30)

        def runner(mc, cfg, weights, max_len):
            return PipelinedModelRunner(mc, cfg, weights, max_len, link=link, expert_nodes=[EXPERT],
                                        expert_assignment=[list(range(mc.num_experts))], micro_batches=MICRO_BATCHES)

        engine = Engine(path, engine_config(device), runner_factory=runner)
        wire(link, conn)
        conn.send(generate(engine, prompts, max_tokens))
        link.close()  # the expert node's next receive fails with PeerClosed: its cue to stop
    except BaseException:
        conn.send(traceback.format_exc())


def generate(engine: Engine, prompts: list[list[int]], max_tokens: int) -> AttentionResult:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(max_tokens))
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    steps = decode_tokens = 0
    decode_seconds = 0.0
    while engine.has_unfinished_requests():
        decoding = all(tokens.values())  # every prompt has its first token: nothing left to prefill
        t0 = time.perf_counter()
        deltas = engine.step()
        if decoding:
            decode_seconds += time.perf_counter() - t0
            decode_tokens += sum(len(d.new_token_ids) for d in deltas)
        for d in deltas:
            tokens[d.request_id].extend(d.new_token_ids)
        steps += 1
    return AttentionResult([tokens[f"r{i}"] for i in range(len(prompts))], steps, decode_tokens, decode_seconds)


def expert_node(path: str, device: str, backend: str, conn) -> None:
    try:
        torch.set_num_threads(1)
        model = ModelConfig.from_pretrained(path)
        link = SwitchableLink(EXPERT, 100, SECRET, "127.0.0.1",
                              dispatch_bytes(BATCH_TOKENS, model.hidden_size, model.top_k, torch.float32),
                              MICRO_BATCHES, backend, 30)
        worker = ExpertWorker(model, list(range(model.num_experts)), "float32", device, SafetensorsCheckpoint(path),
                              attention_nodes=[ATTENTION], micro_batches=MICRO_BATCHES, link=link)
        wire(link, conn)
        try:
            while True:
                worker.run_step()
        except PeerClosed:  # the attention node is done
            pass
        conn.send(worker.steps)
        link.close()
    except BaseException:
        conn.send(traceback.format_exc())


def receive(conn, who: str):
    if not conn.poll(WAIT_S):
        raise TimeoutError(f"the {who} process said nothing for {WAIT_S} s")
    message = conn.recv()
    if isinstance(message, str) and "Traceback" in message:
        raise AssertionError(f"the {who} process failed:\n{message}")
    return message


def run_pair(path: str, device: str, backend: str, prompts: list[list[int]], max_tokens: int) -> tuple[
        AttentionResult, int]:
    """(the attention node's result, the steps the expert node served)."""
    ctx = mp.get_context("spawn")
    attention_conn, attention_end = ctx.Pipe()
    expert_conn, expert_end = ctx.Pipe()
    processes = [ctx.Process(target=attention_node, args=(path, device, backend, prompts, max_tokens, attention_end)),
                 ctx.Process(target=expert_node, args=(path, device, backend, expert_end))]
    for process in processes:
        process.start()
    try:
        attention_address = receive(attention_conn, "attention")
        expert_address = receive(expert_conn, "expert")
        attention_conn.send({EXPERT: expert_address})
        expert_conn.send({ATTENTION: attention_address})
        return receive(attention_conn, "attention"), receive(expert_conn, "expert")
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()


def colocated(path: str, device: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return generate_all(Engine(path, engine_config(device)), prompts, greedy(max_tokens))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_attention_and_expert_processes_match_the_colocated_engine(mixtral_ref, device):
    max_tokens = 12 if device == "cpu" else 64  # the CPU here is slow and shared; a GPU run measures decode
    prompts = mixtral_ref.prompts
    expected = colocated(str(mixtral_ref.path), device, prompts, max_tokens)
    result, expert_steps = run_pair(str(mixtral_ref.path), device, "shm", prompts, max_tokens)
    assert result.tokens == expected
    assert expert_steps == result.steps
    if device == "cuda":
        rate = result.decode_tokens / result.decode_seconds
        print(f"\ntwo-process pair on {torch.cuda.get_device_name()}: decode {rate:.1f} tokens/s "
              f"({result.decode_tokens} tokens in {result.decode_seconds:.3f} s, {len(prompts)} sequences, "
              f"m = {MICRO_BATCHES}, float32, tiny Mixtral)")
