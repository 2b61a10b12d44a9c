"""`megainfer generate`: stream one completion and report tokens/s."""

from __future__ import annotations

import argparse
import sys
import time

from megainfer.cli.options import add_engine_options, engine_config, positive_int
from megainfer.errors import RequestError

_CONTROL = {c: f"\\x{c:02x}" for c in range(32) if chr(c) not in "\n\t"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from one prompt, streaming it",
                       description="Generate from a checkpoint or preset, streaming the text as it comes.")
    add_engine_options(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--server", metavar="HOST:PORT",
                   help="ask a running server (megainfer deploy / serve) instead of loading the model here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megainfer.engine import Engine
    from megainfer.sampling_params import SamplingParams

    if args.prompt is not None:
        prompt = args.prompt
    else:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise RequestError(f"--prompt-ids {args.prompt_ids!r}: write comma-separated integers") from None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.sample_seed, ignore_eos=args.ignore_eos)
    if args.server:
        return _run_remote(args.server, prompt, params)
    engine = Engine(args.model, engine_config(args, show_progress=True))
    start = time.perf_counter()
    engine.add_request("cli", prompt, params)
    first = None
    num_tokens = 0
    reason = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if first is None and delta.new_token_ids:
                first = time.perf_counter()
            num_tokens += len(delta.new_token_ids)
            # Random-weight presets produce arbitrary bytes: keep the terminal sane.
            sys.stdout.write(delta.new_text.translate(_CONTROL))
            sys.stdout.flush()
            if delta.finished:
                reason = delta.finish_reason
                if delta.error:
                    print(f"\nmegainfer generate: request failed: {delta.error}", file=sys.stderr)
                    return 1
    elapsed = time.perf_counter() - start
    print()
    ttft = (first - start) * 1000 if first else float("nan")
    print(f"[{num_tokens} tokens in {elapsed:.2f} s: {num_tokens / elapsed:.1f} tokens/s, "
          f"first token {ttft:.0f} ms, finish reason {reason}]", file=sys.stderr)
    return 0


def _run_remote(address: str, prompt, params) -> int:
    from megainfer.server.client import Client

    client = Client(address)
    start = time.perf_counter()
    last = None
    for response in client.generate(prompt, params):
        sys.stdout.write(response.text.translate(_CONTROL))
        sys.stdout.flush()
        last = response
    elapsed = time.perf_counter() - start
    print()
    n = last.usage.completion_tokens
    print(f"[{n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tokens/s, first token {last.timings.ttft_ms:.0f} ms, "
          f"mean TBT {last.timings.mean_tbt_ms:.1f} ms, finish reason {last.finish_reason}]", file=sys.stderr)
    client.close()
    return 0
