"""`megainfer deploy PLAN.yaml`: bring a plan up on Ray and serve it over gRPC and the
OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import sys
import time

from megainfer.server.frontend_options import add_frontend_options, frontend_access, wait_for_signal
from megainfer.routing.policies import ROUTERS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("deploy", help="deploy a plan.yaml on Ray and serve it over gRPC and HTTP",
                       description="Start attention and expert nodes as Ray actors (a local Ray instance unless "
                                   "--address is given), wire them over M2N, and serve megainfer.v1.Inference "
                                   "and the OpenAI-compatible HTTP API.")
    p.add_argument("plan", help="plan.yaml (e.g. deploy/plans/tiny-cpu.yaml)")
    p.add_argument("--address", help="join this Ray cluster instead of starting a local one")
    p.add_argument("--host", help="gRPC bind address (default: the plan's serve.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="gRPC port (default: the plan's serve.port)")
    add_frontend_options(p)
    p.add_argument("--router", choices=list(ROUTERS),
                   help="how requests are spread over attention nodes (default: the plan's serve.router)")
    p.add_argument("--profile", metavar="PATH",
                   help="operator profile from `megainfer profile`: the predictive router's prior step model "
                        "(default: its generic prior, until each node's own steps calibrate it)")
    p.add_argument("--demo", type=int, default=0, metavar="N",
                   help="send N requests through the server, print the answers, then shut down")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per --demo request")
    p.add_argument("--device", choices=["cpu", "cuda"],
                   help="where tensors live (default: the plan's); 'cpu' rehearses a GPU plan with its real "
                        "placement (GPU counts, GPU types, TP groups) on a cluster that declares those resources")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run decode eager on CUDA instead of as CUDA graphs captured at start-up (vLLM's flag; "
                        "the plan's serve.enforce_eager)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="share cached prompt prefixes on the attention nodes (vLLM's flag; default: the plan's "
                        "scheduler.enable_prefix_caching, on unless it says false)")
    p.add_argument("--dry-run", action="store_true",
                   help="print each node's runtime configuration, bundles and groups without starting anything; "
                        "exit 1 when the runtime would not reach the plan's predicted batch")
    p.set_defaults(run=run)


# Control characters other than newline and tab are shown escaped (a random-weight preset emits any byte).
CONTROL = {c: f"\\x{c:02x}" for c in range(32) if chr(c) not in "\n\t"}
# megainfer-demo (the tiny plans' model) learnt the Python standard library: prompts it can continue.
DEMO_PROMPTS = ["def read_config(path):", "class LRUCache:", "import os\n\n\ndef ", "    def __repr__(self):",
                "# Copyright"]
DEMO_SEED = 0  # the model's own sampling settings (its generation_config.json), reproducibly seeded


def run(args: argparse.Namespace) -> int:
    from megainfer.plan import Plan

    plan = Plan.load(args.plan)
    if args.enforce_eager:
        plan.serve.enforce_eager = True
    if args.enable_prefix_caching is not None:
        plan.scheduler.enable_prefix_caching = args.enable_prefix_caching
    if args.dry_run:
        from deploy import dry_run
        from deploy.runtime_config import runtime_of

        return dry_run.run(runtime_of(plan, args.device))
    # Below the dry run: these bring in torch and Ray, which a dry run never needs (~3 s).
    from deploy.status import kernel_lines
    from megainfer.server.endpoints import Endpoints

    if args.router:
        plan.serve.router = args.router
    served = _served_model(plan, args)  # a bad --chat-template fails before any actor starts
    access, tls = frontend_access(args)  # as does a bad key, key file or TLS file
    deployment = _start(plan, args)
    endpoints = None
    try:
        served.max_model_len = max_model_len(deployment)
        host = args.host or plan.serve.host
        endpoints = Endpoints(deployment, served, host, plan.serve.port if args.port is None else args.port,
                              args.http_host, None if args.no_http else args.http_port, args.metrics_port,
                              access=access, tls=tls).start()
        scale = "" if plan.autoscale is None else \
            f", {plan.autoscale.min_replicas} to {plan.autoscale.max_replicas} replicas on predicted TTFT"
        print(f"serving {plan.model} ({plan.attention.nodes} attention x {plan.experts.nodes} expert node(s), "
              f"m={plan.pipeline.micro_batches}{scale})"
              + (" (rehearsal: the plan's GPU placement, tensors on the CPU)" if deployment.runtime.is_rehearsal
                 else "") + ":", file=sys.stderr)
        for line in endpoints.describe() + kernel_lines(deployment.groups):
            print(f"  {line}", file=sys.stderr)
        if args.demo:
            _demo(endpoints.grpc.address, args.demo, args.max_tokens, args)
            return 0
        wait_for_signal()
        print("shutting down", file=sys.stderr)
        return 0
    finally:
        if endpoints is not None:
            endpoints.stop()
        deployment.close()


def _served_model(plan, args: argparse.Namespace):
    from megainfer.server.served_model import ServedModel

    return ServedModel.load(plan.model, args.served_model_name, args.chat_template)


def _router_prior(plan, args: argparse.Namespace) -> tuple[float, ...] | None:
    """The predictive router's prior from the profile's step model, where one was given."""
    if not args.profile:
        return None
    from planner.step_prior import step_prior
    from planner.catalog import Catalog
    from planner.operator_profile import OperatorProfile
    from planner.step_cost_model import ColocatedStepModel
    from megainfer.model_resolution import resolve_model

    profile = OperatorProfile.load(args.profile)
    gpu = Catalog.load()[profile.device.catalog_name] if profile.device.catalog_name else None
    return step_prior(ColocatedStepModel(resolve_model(plan.model)[0], gpu, profile.tp, profile=profile))


def _start(plan, args: argparse.Namespace):
    return start_backend(plan, address=args.address, device=args.device, step_prior=_router_prior(plan, args))


def start_backend(plan, address: str | None = None, device: str | None = None,
                  step_prior: tuple[float, ...] | None = None, show_progress: bool = True):
    """The plan brought up as `megainfer deploy` brings it up: a ReplicaSet for a plan that
    autoscales, else one Deployment."""
    if plan.autoscale is not None:
        from deploy.replicas import ReplicaSet

        return ReplicaSet(plan, address=address, show_progress=show_progress, device=device,
                          step_prior=step_prior).start()
    from deploy.deployment import Deployment

    return Deployment(plan, address=address, show_progress=show_progress, device=device,
                      step_prior=step_prior).start()


def max_model_len(deployment) -> int:
    """What the attention nodes take: prompt plus generated tokens, at most."""
    runtime = deployment.runtime
    return runtime.attention[0].engine.resolved_max_model_len(runtime.model)


def _demo(address: str, n: int, max_tokens: int, args: argparse.Namespace) -> None:
    from megainfer.sampling_params import SamplingParams
    from megainfer.server.client import Client
    from megainfer.server.service import MODEL_DEFAULTED
    from megainfer.server.tls import ClientTls
    from megainfer.settings import API_KEY

    # The demo client holds the first --api-key (or $MEGAINFER_API_KEY) and trusts the server's own
    # certificate (a self-signed one; mutual TLS would need a client certificate it does not have).
    key = (args.api_key or [API_KEY.read()])[0]
    client = Client(address, api_key=key, tls=ClientTls(ca_certs=args.ssl_certfile) if args.ssl_certfile else None)
    # Sampling as the model's generation_config.json says (greedy decoding of a small model loops);
    # max_tokens is the demo's own.
    server_defaults = [name for name in MODEL_DEFAULTED if name != "max_tokens"]
    for i in range(n):
        prompt = DEMO_PROMPTS[i % len(DEMO_PROMPTS)]
        params = SamplingParams(max_tokens=max_tokens, seed=DEMO_SEED + i)
        start = time.perf_counter()
        text, last = [], None
        for response in client.generate(prompt, params, server_defaults=server_defaults):
            text.append(response.text)
            last = response
        elapsed = time.perf_counter() - start
        tokens = last.usage.completion_tokens
        print(f"[{i}] {tokens} tokens, TTFT {last.timings.ttft_ms:.0f} ms, {tokens / elapsed:.1f} tokens/s, "
              f"finish reason {last.finish_reason}")
        for line in (prompt + "".join(text)).translate(CONTROL).splitlines():
            print(f"    {line}")
    client.close()
