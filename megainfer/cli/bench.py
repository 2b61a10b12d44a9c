"""`megainfer bench ...`: benchmarks. Each prints a table, writes JSON with --json, and
measures against a peer in the same run (a ratio), because shared machines are noisy."""

from __future__ import annotations

import argparse

from megainfer.cli.options import add_engine_options, engine_config, length_range, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (engine, m2n, serve, simulator, ...)", description="Benchmarks.")
    benches = p.add_subparsers(dest="bench", required=True, metavar="BENCH")

    e = benches.add_parser("engine", help="offline throughput of the engine, optionally against transformers",
                           description="Offline throughput on a mixed-length workload of random prompts.")
    add_engine_options(e)
    e.add_argument("--num-prompts", type=positive_int, default=64)
    e.add_argument("--input-len", type=length_range, default=(32, 256), help="prompt lengths A:B (uniform)")
    e.add_argument("--output-len", type=length_range, default=(32, 128), help="output lengths C:D (uniform)")
    e.add_argument("--vs-hf", action="store_true", help="also run transformers' generate on the same prompts")
    e.add_argument("--hf-batch-size", type=positive_int, default=64,
                   help="transformers batch size (prompts left-padded, as vLLM's HF baseline does)")
    e.add_argument("--workload-seed", type=int, default=0)
    e.add_argument("--json", metavar="PATH", help="write the results as JSON")
    e.set_defaults(run=_run_engine)

    m = benches.add_parser(
        "m2n", help="the M2N transport against torch.distributed and against its floor",
        description="Spawns M sender and N receiver processes and measures latency and throughput per message "
                    "size; with --baseline torch the same exchange over torch.distributed, and always the "
                    "protocol-free floor of the backend.")
    m.add_argument("--backend", default="shm", metavar="BACKENDS",
                   help="shm, tcp, rdma, nixl, or several comma-separated (e.g. shm,tcp,nixl: one run each, one "
                        "chart); torch alone runs only the torch.distributed exchange")
    m.add_argument("--senders", type=positive_int, default=1)
    m.add_argument("--receivers", type=positive_int, default=1)
    m.add_argument("--sizes", default="4K,64K,256K,1M,4M,16M", help="message sizes, e.g. 4K,64K,256K,1M,4M,16M")
    m.add_argument("--iters", type=positive_int, default=500,
                   help="timed iterations per size up to 1M; larger sizes move the same bytes (at least 50)")
    m.add_argument("--warmup", type=int, default=50)
    m.add_argument("--pattern", choices=["m2n", "one-to-n", "ping-pong"], default="m2n")
    m.add_argument("--duplex", action="store_true",
                   help="both directions at once: every process sends to each peer, then receives (as the "
                        "ping-pong pipeline overlaps dispatch and answers)")
    m.add_argument("--slots", type=positive_int, default=2, help="receive slots per peer (micro-batches in flight)")
    m.add_argument("--baseline", choices=["torch"], help="also run the torch.distributed exchange")
    m.add_argument("--no-floor", action="store_true", help="skip the protocol-free floor runs")
    m.add_argument("--json", metavar="PATH", help="write the results as JSON")
    m.add_argument("--plot", metavar="PATH", help="draw latency and throughput against size, every backend on one "
                                                  "chart (PNG)")
    m.set_defaults(run=_run_m2n)

    h = benches.add_parser(
        "host", help="the host's CPU time per M2N round at a plan's scale (attention rank and expert node)",
        description="The runner's dispatch and combine to the plan's N expert nodes, and the expert worker's "
                    "round with the plan's M attention ranks, through the real code with the model compute "
                    "stubbed: CPU microseconds per round (every thread of the measured process), per step, and "
                    "against the plan's predicted t_a and t_e; at 4 KiB messages and at the plan's own size. Then "
                    "an attention rank's step boundary (scheduling, inputs, sampling, bookkeeping, deltas; the "
                    "layers skipped) at several running-sequence counts, and the serving process's delta handling "
                    "for the plan's attention nodes.")
    h.add_argument("plan", help="plan.yaml (e.g. deploy/plans/qwen3-235b-h20-l40s.yaml)")
    h.add_argument("--rounds", type=positive_int, default=400, help="timed rounds per side and size")
    h.add_argument("--repeats", type=positive_int, default=3,
                   help="measurements of each row (fresh peers each time); the median is reported")
    h.add_argument("--running", type=positive_int, action="append", default=[], metavar="N",
                   help="also measure the step boundary at N running sequences (repeatable; always at 512, "
                        "1,024 and the plan's max_num_seqs)")
    h.add_argument("--backend", choices=("shm", "tcp"), default="shm",
                   help="the M2N backend of the rounds (over loopback; shm: peers on one host, tcp: across hosts)")
    h.add_argument("--json", metavar="PATH", help="write the results as JSON")
    h.set_defaults(run=_run_host)

    pl = benches.add_parser("pipeline", help="decode throughput of a deployment for several micro-batch counts",
                            description="Deploy the plan once per micro-batch count (one Ray session) and measure "
                                        "decode throughput of a fixed workload on each.")
    pl.add_argument("plan", help="plan.yaml (e.g. deploy/plans/tiny-cpu.yaml)")
    pl.add_argument("--micro-batches", default="1,2,3", help="micro-batch counts, e.g. 1,2,3")
    pl.add_argument("--requests", type=positive_int, help="concurrent requests (default: the plan's global batch)")
    pl.add_argument("--prompt-len", type=positive_int, default=16)
    pl.add_argument("--output-len", type=positive_int, default=64)
    pl.add_argument("--json", metavar="PATH")
    pl.add_argument("--plot", metavar="PATH", help="draw the nodes' timelines as a Gantt chart, one panel per "
                                                   "micro-batch count (PNG)")
    pl.set_defaults(run=_run_pipeline)

    ep = benches.add_parser("eplb", help="expert load balance before and after one re-placement, under decode load",
                            description="Deploy the plan, run a steady decode load, measure each expert node's "
                                        "(token, expert) pairs and decode tokens/s over a window, re-place the "
                                        "experts (MegaScale-Infer's redundancy plan), measure again; tokens are "
                                        "checked against the colocated engine.")
    ep.add_argument("plan", help="plan.yaml with experts.redundant_per_node or experts.rebalance "
                                 "(e.g. deploy/plans/skewed-cpu.yaml)")
    ep.add_argument("--requests", type=positive_int, default=32,
                    help="greedy requests kept running (each finished one replaced by a new one)")
    ep.add_argument("--prompt-len", type=positive_int, default=16)
    ep.add_argument("--output-len", type=positive_int, default=64, help="tokens per request")
    ep.add_argument("--window-s", type=float, default=3.0, help="seconds of each measured window")
    ep.add_argument("--json", metavar="PATH")
    ep.set_defaults(run=_run_eplb)

    rt = benches.add_parser("routing", help="the same online load against a deployment under each router",
                            description="Deploy the plan once and send the same bench-serve workload under each "
                                        "router in turn (the routers alternate over rounds); compare TTFT and E2E "
                                        "latency pooled over the rounds.")
    rt.add_argument("plan", help="plan.yaml with at least 2 attention nodes (e.g. deploy/plans/tiny-cpu-2a.yaml)")
    rt.add_argument("--routers", default="round_robin,predictive", help="comma-separated, the first is the baseline")
    rt.add_argument("--dataset", default="sharegpt", help="random, mixed, sharegpt, arxiv or a JSONL trace")
    rt.add_argument("--request-rate", type=float, default=2.0)
    rt.add_argument("--num-prompts", type=positive_int, default=60, help="requests per router per round")
    rt.add_argument("--rounds", type=positive_int, default=3,
                    help="rounds; each sends a fresh workload to every router, in alternating order")
    rt.add_argument("--input-len", type=positive_int, default=128, help="random and mixed datasets")
    rt.add_argument("--output-len", type=positive_int, default=16, help="random dataset")
    rt.add_argument("--random-range-ratio", type=float, default=0.0,
                    help="random and mixed datasets: lengths uniform in [len*(1-r), len*(1+r)], as vllm bench serve")
    _add_mixed_options(rt)
    rt.add_argument("--max-model-len", type=positive_int, default=512, help="sharegpt/arxiv lengths are clipped")
    rt.add_argument("--shared-prefixes", type=int, default=0, metavar="N",
                    help="each prompt starts with one of N shared prefixes (drawn uniformly): the attention nodes' "
                         "prefix caches are reset before each router's run and their hit rate reported")
    rt.add_argument("--prefix-len", type=positive_int, default=512, help="tokens of each shared prefix")
    rt.add_argument("--seed", type=int, default=0)
    rt.add_argument("--json", metavar="PATH")
    rt.set_defaults(run=_run_routing)

    sv = benches.add_parser(
        "serve", help="online load against a running server: vllm bench serve's flags, summary and JSON",
        description="Send a ShareGPT, random, trace, prefix_repetition or multi-turn conversation workload to a "
                    "running server (megainfer gRPC, or any OpenAI-compatible HTTP server: megainfer's, vLLM's, "
                    "SGLang's) at --request-rate (a trace: each request at its arrival) with at most "
                    "--max-concurrency in flight, and report throughput, goodput, TTFT, TPOT, ITL and E2E latency "
                    "as `vllm bench serve` does (the same flags, printed block and JSON keys). "
                    "--compare-prefix-caching runs the workload twice, prefix caching off (cache_salt) then on, "
                    "and reports the TTFT ratio.")
    _add_serve_options(sv)
    sv.set_defaults(run=_run_serve)

    sm = benches.add_parser(
        "simulator", help="the simulator against the real engine on one trace (real vs simulated TTFT, TBT, "
                          "throughput)",
        description="The closed loop: serve a trace with the real colocated engine (`megainfer serve`, one "
                    "subprocess per prefill policy, the trace replayed as `bench serve --dataset-name trace` does) "
                    "and simulate the same trace with the same scheduler settings and KV blocks, the step model "
                    "reading an operator profile measured on this machine; print mean TTFT, mean time between "
                    "tokens and output throughput, real and simulated, with sim/real ratios. Make the profile "
                    "first: `megainfer profile --model M` (it prints the file it writes).")
    sm.add_argument("--model", default="megainfer-demo", help="the model served and simulated (default "
                                                              "megainfer-demo)")
    sm.add_argument("--profile", required=True, metavar="PATH",
                    help="operator profile JSON of this model on this machine, from `megainfer profile --model M`")
    sm.add_argument("--trace", metavar="PATH", help='a JSONL trace of {"arrival": s, "input_len": n, '
                                                    '"output_len": n} lines (default: generated from the flags below)')
    # Defaults for megainfer-demo on a 2-core CPU: about a minute of trace per policy, the engine busy
    # most of the time but not queueing; prompts long enough to be chunked and split into layer groups.
    sm.add_argument("--requests", type=positive_int, default=180, help="generated trace: requests (default 180)")
    sm.add_argument("--rate", type=float, default=3.0,
                    help="generated trace: Poisson arrivals, requests per second (default 3)")
    sm.add_argument("--input-len-range", type=length_range, default=(64, 512), metavar="A:B",
                    help="generated trace: prompt lengths, uniform (default 64:512)")
    sm.add_argument("--output-len-range", type=length_range, default=(16, 64), metavar="A:B",
                    help="generated trace: output lengths, uniform (default 16:64)")
    sm.add_argument("--seed", type=int, default=0, help="the generated trace, the prompts and the engine")
    sm.add_argument("--policy", choices=["chunked", "layered", "both"], default="both")
    sm.add_argument("--chunk-size", type=positive_int, default=256,
                    help="token budget of a step (the server's --max-num-batched-tokens; default 256)")
    sm.add_argument("--group-tokens", type=positive_int, default=128,
                    help="layered: prompt tokens per layer group (default 128)")
    sm.add_argument("--num-layer-groups", type=positive_int, default=None, help="layered: a fixed G")
    sm.add_argument("--max-num-seqs", type=positive_int, default=256)
    sm.add_argument("--threads", type=positive_int, help="the server's CPU threads (default: the profile's)")
    sm.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="the server's dtype (default: the profile's, the only one its times hold for)")
    sm.add_argument("--tolerance", type=float, default=0.15, help="|sim/real - 1| counted as a match (0.15: 15%%)")
    sm.add_argument("--server-log", metavar="DIR", help="keep the servers' logs here (default: a temporary "
                                                        "directory, removed)")
    sm.add_argument("--json", metavar="PATH", help="write the trace, both sides' figures and the comparison")
    sm.set_defaults(run=_run_simulator)

    sk = benches.add_parser(
        "soak", help="mixed traffic against a deployment for a long while, optionally with faults: ends, leaks, RSS",
        description="Deploy the plan (as `megainfer deploy` does, on loopback, any free ports) and drive mixed "
                    "traffic at its gRPC and HTTP frontends for --duration: short and long prompts, text and token "
                    "ids, streamed and whole, n=2, stop strings, client aborts and disconnects. Report requests by "
                    "status, requests without an end, KV blocks and M2N slots still held after the drain, RSS "
                    "growth per node, p99 TTFT and TBT over time; with --chaos, faults at random times (nodes "
                    "killed or stopped, connections dropped, clients restarted) and each one's recovery. Exits 1 "
                    "when a request never ended, something leaked, or a fault was not recovered within its bound.")
    sk.add_argument("plan", help="plan.yaml (e.g. deploy/plans/tiny-cpu-2a.yaml)")
    sk.add_argument("--duration", type=duration_s, default=600.0, metavar="TIME",
                    help="how long traffic is sent: seconds, or with a unit: 90, 120s, 10m, 1h (default 10m)")
    sk.add_argument("--concurrency", type=positive_int, default=8, help="clients, each with one request in flight "
                                                                        "(default 8)")
    sk.add_argument("--chaos", action="store_true", help="inject faults at random times (deploy/chaos.py)")
    sk.add_argument("--request-timeout", type=duration_s, default=120.0, metavar="TIME",
                    help="a request with no final response or status within this is counted as unended "
                         "(default 120s)")
    sk.add_argument("--seed", type=int, default=0, help="the traffic mix and the faults")
    sk.add_argument("--json", metavar="PATH", help="write the report as JSON")
    sk.add_argument("--plot", metavar="PATH", help="draw p99 TTFT, TBT and RSS over time, faults marked (PNG; "
                                                   "default: beside --json)")
    sk.set_defaults(run=_run_soak)

    k = benches.add_parser("kernels", help="Triton kernels on a GPU: POD fused attention, decode attention, "
                                           "grouped expert GEMM",
                           description="POD fused attention against the prefill and decode kernels run one after "
                                       "the other and against torch SDPA on hybrid batches, decode attention "
                                       "against torch SDPA on gathered pages, and the grouped expert GEMM against a "
                                       "per-expert cuBLAS loop, in bf16, each with its ratio. Needs a CUDA GPU "
                                       "(--smoke: tiny shapes, also on a CPU with TRITON_INTERPRET=1).")
    k.add_argument("--json", metavar="PATH", help="write the results as JSON")
    k.add_argument("--smoke", action="store_true",
                   help="tiny shapes, to check the benchmark runs (its times mean nothing)")
    k.set_defaults(run=_run_kernels)


def _run_engine(args: argparse.Namespace) -> int:
    from megainfer.tools.bench.engine_bench import EngineBenchSpec, run_engine_bench

    spec = EngineBenchSpec(model=args.model, num_prompts=args.num_prompts, input_len=args.input_len,
                           output_len=args.output_len, seed=args.workload_seed, vs_hf=args.vs_hf,
                           hf_batch_size=args.hf_batch_size)
    return run_engine_bench(spec, engine_config(args), json_path=args.json)


def _run_host(args: argparse.Namespace) -> int:
    from megainfer.tools.host_cost import run

    return run(args.plan, args.rounds, args.json, repeats=args.repeats, boundary_running=tuple(args.running),
               backend=args.backend)


def _run_m2n(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from megainfer.tools import m2n_report
    from megainfer.errors import ConfigError, MegaInferError
    from transport.bench import BenchSpec, measure
    from transport.errors import TransportError

    try:
        sizes = m2n_report.parse_sizes(args.sizes)
        backends = m2n_report.parse_backends(args.backend)
        specs = {backend: BenchSpec(backend=backend, senders=args.senders, receivers=args.receivers, sizes=sizes,
                                    iters=args.iters, warmup=args.warmup, pattern=args.pattern, slots=args.slots,
                                    duplex=args.duplex)
                 for backend in backends}
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    for backend in backends:
        reason = m2n_report.unavailable(backend)
        if reason:
            raise ConfigError(f"--backend {backend}: {reason}; use --backend shm or tcp here")
    runs = [(backend, "m2n" if backend != "torch" else "torch") for backend in backends]
    if not args.no_floor:
        runs += [(backend, "floor") for backend in backends if backend != "torch"]
    if args.baseline and "torch" not in backends:
        runs.append((backends[0], "torch"))
    out: list = []
    with tqdm(total=len(runs) * len(sizes), desc="bench m2n", unit="size") as bar:
        for backend, system in runs:
            bar.set_postfix_str(f"{system} {backend}")
            try:
                out += measure(system, specs[backend], progress=lambda _: bar.update(1))
            except (TransportError, RuntimeError, TimeoutError, OSError, ValueError) as exc:
                raise MegaInferError(f"{system} run over {backend} failed: {exc}") from None
    machine = m2n_report.machine()
    print(f"{args.pattern}{' duplex' if args.duplex else ''} {args.senders}x{args.receivers}, {args.iters} "
          f"iterations (+{args.warmup} warm-up) up to 1M, machine: {machine['cpu']}, {machine['cores']} cores")
    print(m2n_report.tables(out))
    if args.json:
        m2n_report.save_json(args.json, backends, out)
    if args.plot:
        m2n_report.plot(args.plot, out)
        print(f"plot: {args.plot}")
    return 0


def _run_pipeline(args: argparse.Namespace) -> int:
    from megainfer.errors import ConfigError

    try:
        counts = [int(x) for x in args.micro_batches.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--micro-batches {args.micro_batches!r}: write counts like 1,2,3") from None
    if not counts or min(counts) < 1:
        raise ConfigError("--micro-batches: every count must be at least 1")
    from deploy.bench_pipeline import run

    return run(args.plan, counts, args.requests, args.prompt_len, args.output_len, args.json, args.plot)


def _run_eplb(args: argparse.Namespace) -> int:
    from megainfer.errors import ConfigError

    if not args.window_s > 0:
        raise ConfigError(f"--window-s must be positive, got {args.window_s}")
    from deploy.bench_eplb import run

    return run(args.plan, args.requests, args.prompt_len, args.output_len, args.window_s, args.json)


def _run_routing(args: argparse.Namespace) -> int:
    from megainfer.tools.bench.routing_load import ServeBenchSpec
    from megainfer.errors import ConfigError

    if not args.request_rate > 0:
        raise ConfigError(f"--request-rate must be positive, got {args.request_rate}")
    if args.shared_prefixes < 0:
        raise ConfigError(f"--shared-prefixes must be 0 (none) or a positive count, got {args.shared_prefixes}")
    from deploy.bench_routing import run

    spec = ServeBenchSpec(server="", dataset=args.dataset, request_rate=args.request_rate,
                          num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                          random_range_ratio=args.random_range_ratio, long_input_len=args.long_input_len,
                          long_fraction=args.long_fraction, max_model_len=args.max_model_len, seed=args.seed,
                          shared_prefixes=args.shared_prefixes,
                          prefix_len=args.prefix_len if args.shared_prefixes else 0)
    return run(args.plan, [r.strip() for r in args.routers.split(",") if r.strip()], spec, args.json, args.rounds)


def _add_mixed_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--long-input-len", type=positive_int, default=1024,
                   help="mixed dataset: random prompts (--input-len) of which --long-fraction are this long")
    p.add_argument("--long-fraction", type=float, default=0.2, help="mixed dataset: the share of long prompts")


def _run_simulator(args: argparse.Namespace) -> int:
    from megainfer.tools.simulator_check import POLICIES, CheckSpec, run_check

    spec = CheckSpec(model=args.model, profile=args.profile, trace=args.trace, requests=args.requests, rate=args.rate,
                     input_len=args.input_len_range, output_len=args.output_len_range, seed=args.seed,
                     policies=POLICIES if args.policy == "both" else (args.policy,), chunk_size=args.chunk_size,
                     group_tokens=args.group_tokens, num_layer_groups=args.num_layer_groups,
                     max_num_seqs=args.max_num_seqs, threads=args.threads, dtype=args.dtype,
                     tolerance=args.tolerance, server_log=args.server_log)
    run_check(spec, args.json)
    return 0  # a benchmark: the JSON says which figures matched


DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def duration_s(text: str) -> float:
    """'90', '120s', '10m', '1.5h' -> seconds (positive)."""
    value = text.strip().lower()
    scale = DURATION_UNITS.get(value[-1:], None)
    try:
        seconds = float(value[:-1] if scale else value) * (scale or 1.0)
    except ValueError:
        seconds = None
    if seconds is None or not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive duration; write seconds or a number with s, m "
                                         f"or h, e.g. 90, 120s, 10m, 1h")
    return seconds


def _run_soak(args: argparse.Namespace) -> int:
    from deploy.bench_soak import SoakSpec, run

    spec = SoakSpec(duration_s=args.duration, concurrency=args.concurrency, chaos=args.chaos, seed=args.seed,
                    request_timeout_s=args.request_timeout)
    return run(args.plan, spec, args.json, args.plot)


def _run_kernels(args: argparse.Namespace) -> int:
    from megainfer.errors import ConfigError

    from kernels.bench import NoGPU, run

    try:
        return run(args.json, smoke=args.smoke)
    except NoGPU as exc:
        raise ConfigError(str(exc)) from None


def _add_serve_options(p: argparse.ArgumentParser) -> None:
    import uuid

    server = p.add_argument_group("server")
    server.add_argument("--backend", choices=["megainfer-grpc", "openai", "openai-chat"], default="openai",
                        help="megainfer-grpc: megainfer.v1.Inference/Generate; openai: /v1/completions; openai-chat: "
                             "/v1/chat/completions (both streamed)")
    server.add_argument("--base-url", help="the server's base URL (http://HOST:PORT; HOST:PORT for megainfer-grpc) "
                                           "instead of --host and --port")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, help="default: 8000 for openai and openai-chat (vLLM's), 50051 for "
                                                 "megainfer-grpc (megainfer serve's)")
    server.add_argument("--endpoint", help="API path (default: /v1/completions, /v1/chat/completions for openai-chat)")
    server.add_argument("--model", help="the model the server serves (default: the first one it lists)")
    server.add_argument("--served-model-name", help="the name requests ask for (default: the model)")
    server.add_argument("--tokenizer", help="checkpoint directory, preset or Hugging Face id whose tokenizer counts "
                                            "and makes the prompts (default: the model)")
    server.add_argument("--label", help="the result's label and file-name prefix (default: the backend)")
    data = p.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=["sharegpt", "random", "trace", "prefix_repetition", "conversation"],
                      default="random",
                      help="trace: replay a JSONL trace (--dataset-path): each request at its arrival, with a "
                           "prompt of exactly input_len token ids and output_len tokens generated (EOS ignored); "
                           "prefix_repetition: vLLM's, N random-token prefixes each shared by num_prompts / N "
                           "requests with their own random suffixes (sent as token ids); conversation: multi-turn "
                           "chats (--backend openai-chat), turn k sent with the conversation so far once turn k-1 "
                           "has completed, from a ShareGPT file (--dataset-path) or generated")
    data.add_argument("--dataset-path", help="sharegpt and conversation: the ShareGPT JSON file (e.g. "
                                             "ShareGPT_V3_unfiltered_cleaned_split.json); trace: a JSONL file of "
                                             '{"arrival": s, "input_len": n, "output_len": n} lines (the format '
                                             "`megainfer simulate --workload` reads)")
    data.add_argument("--num-prompts", type=positive_int, help="default 1000; trace: the file's first N lines "
                                                               "(default: all); not for conversation "
                                                               "(--conversation-num)")
    data.add_argument("--seed", type=int, default=0, help="the prompts and the arrival times")
    data.add_argument("--input-len", type=int, help="sets --random-input-len and --conversation-input-len")
    data.add_argument("--output-len", type=positive_int, help="sets --random-output-len, --sharegpt-output-len, "
                                                              "--prefix-repetition-output-len and "
                                                              "--conversation-output-len")
    data.add_argument("--sharegpt-output-len", type=positive_int,
                      help="output tokens of every request (default: each conversation's answer length)")
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=positive_int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len*(1-r), len*(1+r)], r in [0, 1)")
    data.add_argument("--random-prefix-len", type=int, default=0, help="random tokens shared by every prompt's start")
    data.add_argument("--prefix-repetition-prefix-len", type=positive_int, default=256,
                      help="prefix_repetition: tokens of each shared prefix")
    data.add_argument("--prefix-repetition-suffix-len", type=positive_int, default=256,
                      help="prefix_repetition: tokens of each request's own suffix")
    data.add_argument("--prefix-repetition-num-prefixes", type=positive_int, default=10,
                      help="prefix_repetition: distinct prefixes (--num-prompts must be a multiple)")
    data.add_argument("--prefix-repetition-output-len", type=positive_int, default=128,
                      help="prefix_repetition: output tokens of every request")
    data.add_argument("--conversation-num", type=positive_int, default=100,
                      help="conversation: conversations replayed (default 100)")
    data.add_argument("--conversation-turns", type=positive_int,
                      help="conversation: turns per conversation at most (default: a file's all; generated: 5)")
    data.add_argument("--conversation-input-len", type=positive_int, default=256,
                      help="conversation, generated: tokens of each user turn")
    data.add_argument("--conversation-output-len", type=positive_int,
                      help="conversation: output tokens of every turn (default: the recorded reply's; generated: "
                           "128)")
    data.add_argument("--request-id-prefix", default=f"bench-{uuid.uuid4().hex[:8]}-")
    load = p.add_argument_group("traffic and sampling")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="requests per second (default inf: all at once); not with a trace, whose arrivals "
                           "set the pace")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the gaps between requests: 1 is Poisson, below 1 burstier, above steadier")
    load.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    load.add_argument("--ignore-eos", action="store_true",
                      help="generate every requested token (always on for the random, trace and prefix_repetition "
                           "datasets and generated conversations)")
    load.add_argument("--temperature", type=float, help="sent with each request (default: the server's)")
    load.add_argument("--top-p", type=float)
    load.add_argument("--top-k", type=int)
    load.add_argument("--compare-prefix-caching", action="store_true",
                      help="run the workload twice, each after POST /reset_prefix_cache (gRPC: ResetPrefixCache): "
                           "every request with its own cache_salt (prefix caching in effect off), then unsalted "
                           "(on); print both results and the mean TTFT ratio on/off")
    out = p.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=[],
                     help="SLOs a request must meet to count as goodput, KEY in ttft, tpot, e2el: e.g. ttft:500 "
                          "tpot:50")
    out.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="of ttft,tpot,itl,e2el")
    out.add_argument("--metric-percentiles", default="99", help="e.g. 50,90,99")
    out.add_argument("--save-result", action="store_true", help="save the result JSON (vLLM's file name)")
    out.add_argument("--result-dir", help="where --save-result writes (default: here)")
    out.add_argument("--result-filename", help="the file --save-result writes")
    out.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", default=[], help="recorded in the result JSON")
    out.add_argument("--disable-tqdm", action="store_true")
    out.add_argument("--json", metavar="PATH", help="also write the result JSON here")


def _run_serve(args: argparse.Namespace) -> int:
    from megainfer.tools.bench import serve_bench
    from megainfer.tools.bench.report import write_json
    from megainfer.tools.bench.serve_datasets import DatasetSpec
    from megainfer.tools.bench.serve_metrics import parse_goodput, parse_percentiles
    from megainfer.errors import ConfigError

    metadata = {}
    for item in args.metadata:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--metadata {item!r}: write KEY=VALUE, e.g. --metadata version=0.3.3 tp=1")
        metadata[key.strip()] = value.strip()
    dataset = DatasetSpec(
        name=args.dataset_name, path=args.dataset_path, seed=args.seed,
        num_prompts=args.num_prompts or (None if args.dataset_name in ("trace", "conversation") else 1000),
        sharegpt_output_len=args.output_len or args.sharegpt_output_len,
        random_input_len=args.input_len if args.input_len is not None else args.random_input_len,
        random_output_len=args.output_len or args.random_output_len, random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len, prefix_repetition_prefix_len=args.prefix_repetition_prefix_len,
        prefix_repetition_suffix_len=args.prefix_repetition_suffix_len,
        prefix_repetition_num_prefixes=args.prefix_repetition_num_prefixes,
        prefix_repetition_output_len=args.output_len or args.prefix_repetition_output_len,
        conversation_num=args.conversation_num, conversation_turns=args.conversation_turns,
        conversation_input_len=args.input_len if args.input_len is not None else args.conversation_input_len,
        conversation_output_len=args.output_len or args.conversation_output_len,
        request_id_prefix=args.request_id_prefix)
    # Prompts of random tokens ignore EOS, as vLLM's random dataset does: the lengths are the workload.
    noise = args.dataset_name in ("random", "trace", "prefix_repetition") or (
        args.dataset_name == "conversation" and args.dataset_path is None)
    sampling = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k))
                if v is not None}
    config = serve_bench.ServeBenchConfig(
        backend=args.backend, base_url=args.base_url, host=args.host, port=args.port, endpoint=args.endpoint,
        model=args.model, served_model_name=args.served_model_name, tokenizer=args.tokenizer, dataset=dataset,
        request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos or noise, sampling=sampling,
        goodput_ms=parse_goodput(args.goodput),
        percentile_metrics=[name.strip() for name in args.percentile_metrics.split(",") if name.strip()],
        metric_percentiles=parse_percentiles(args.metric_percentiles), label=args.label,
        disable_tqdm=args.disable_tqdm, compare_prefix_caching=args.compare_prefix_caching)
    result = serve_bench.run(config, metadata)
    if args.save_result:
        path = serve_bench.result_filename(result, config, args.result_dir, args.result_filename)
        serve_bench.save_result(result, path)
        print(f"result: {path}")
    if args.json:
        write_json(args.json, result)
    runs = [result["caching_off"], result["caching_on"]] if args.compare_prefix_caching else [result]
    return 0 if all(run["completed"] for run in runs) else 1
