"""`megainfer generate`: stream a completion (or n) of one prompt and report tokens/s.

Sampling flags take vLLM's names. Those left out take the model's generation_config.json
defaults (a server's model, with --server), else greedy; --max-tokens is always sent. The
text is the engine's deltas joined, as the servers stream them.
"""

from __future__ import annotations

import argparse
import sys
import time

from megainfer.cli.options import add_engine_options, engine_config, positive_int
from megainfer.errors import RequestError

_CONTROL = {c: f"\\x{c:02x}" for c in range(32) if chr(c) not in "\n\t"}
# Flags whose absence means "the model's default" (the gRPC API's optional fields, less max_tokens).
_MODEL_DEFAULTED = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
_FALLBACK = {"temperature": 0.0}  # where the model sets none: greedy


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from one prompt, streaming it",
                       description="Generate from a checkpoint or preset, streaming the text as it comes.")
    add_engine_options(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true",
                   help="send --prompt as one user message, rendered with the model's chat template")
    p.add_argument("--chat-template", metavar="FILE",
                   help="with --chat: a Jinja chat template (file or text) replacing the checkpoint's")
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--temperature", type=float, help="0 is greedy (default: the model's, else 0)")
    p.add_argument("--top-k", type=int, help="0 or -1: off (default: the model's, else off)")
    p.add_argument("--top-p", type=float, help="default: the model's, else 1")
    p.add_argument("--min-p", type=float, help="default: the model's, else 0")
    p.add_argument("--repetition-penalty", type=float, help="default: the model's, else 1 (off)")
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--min-tokens", type=int, default=0, help="EOS and stop tokens are masked until this many")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeat for several); the text ends before it")
    p.add_argument("--n", type=positive_int, default=1,
                   help="completions of the prompt; with more than one, each is printed whole as it ends")
    p.add_argument("--logprobs", type=int, metavar="N",
                   help="after the text, a table of each token's logprob and rank and the N most likely")
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--server", metavar="HOST:PORT",
                   help="ask a running server (megainfer deploy / serve) instead of loading the model here")
    p.add_argument("--api-key", metavar="KEY",
                   help="with --server: the key the server requires (default: $MEGAINFER_API_KEY)")
    p.add_argument("--ssl-ca-certs", metavar="PATH",
                   help="with --server: connect over TLS, trusting the server's certificate if these PEM CA "
                        "certificates (or the self-signed certificate itself) signed it")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megainfer.sampling_params import SamplingParams

    if args.prompt is not None:
        prompt = args.prompt
    else:
        if args.chat:
            raise RequestError("--chat takes the message as --prompt text, not --prompt-ids")
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise RequestError(f"--prompt-ids {args.prompt_ids!r}: write comma-separated integers") from None
    given = {name: getattr(args, name) for name in _MODEL_DEFAULTED if getattr(args, name) is not None}
    fixed = dict(max_tokens=args.max_tokens, seed=args.sample_seed, n=args.n, presence_penalty=args.presence_penalty,
                 frequency_penalty=args.frequency_penalty, min_tokens=args.min_tokens, stop=args.stop,
                 ignore_eos=args.ignore_eos, logprobs=args.logprobs)
    params = SamplingParams(**{**_FALLBACK, **given}, **fixed)  # checked before any model loads
    if args.server:
        if args.chat:
            raise RequestError("--chat renders the model's chat template here and cannot with --server; ask the "
                               "server's HTTP API (/v1/chat/completions) instead")
        return _run_remote(args, prompt, params, [n for n in _MODEL_DEFAULTED if n not in given])
    return _run_local(args, prompt, given, fixed)


def _run_local(args: argparse.Namespace, prompt, given: dict, fixed: dict) -> int:
    from megainfer.engine.engine import Engine
    from megainfer.generation_config import generation_defaults
    from megainfer.model_resolution import resolve_model
    from megainfer.request_group import RequestGroup
    from megainfer.sampling_params import SamplingParams

    checkpoint = resolve_model(args.model)[1]
    template = _chat_template(args, checkpoint) if args.chat else None
    # The flags given win over the checkpoint's generation_config.json, which wins over the fallbacks.
    params = SamplingParams(**{**_FALLBACK, **generation_defaults(checkpoint), **given, **fixed})
    engine = Engine(args.model, engine_config(args, show_progress=True))
    if template is not None:
        if engine.tokenizer is None:
            raise RequestError(f"--chat: model {args.model} has no tokenizer to encode the chat with")
        text = template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    group = RequestGroup.of("cli", prompt, params)
    start = time.perf_counter()
    group.start(engine.add_request, engine.abort)
    completions = {c.engine_id: c for c in group.completions}
    out = _Printer(params.n)
    while not group.finished:
        for delta in engine.step():
            if delta.error:
                print(f"\nmegainfer generate: request failed: {delta.error}", file=sys.stderr)
                return 1
            shown, _ = group.arrived(completions[delta.request_id], delta)
            for c, d in shown:
                out.add(c.index, d.new_token_ids, d.new_text,
                        [_local_row(t, p, args.logprobs) for t, p in zip(d.new_token_ids, d.logprobs or [])],
                        d.finish_reason.value if d.finished else "")
    out.report(time.perf_counter() - start, f"first token {out.ttft_ms(start):.0f} ms")
    return 0


def _chat_template(args: argparse.Namespace, checkpoint):
    from megainfer.chat_template import ChatTemplate

    template = ChatTemplate.load(checkpoint, args.chat_template)
    if template is None:
        raise RequestError(f"--chat: model {args.model} has no chat template (none in its tokenizer_config.json "
                           "or chat_template.jinja); pass --chat-template FILE")
    return template


def _run_remote(args: argparse.Namespace, prompt, params, server_defaults: list[str]) -> int:
    from megainfer.server.client import Client
    from megainfer.server.tls import ClientTls
    from megainfer.settings import API_KEY

    tls = None if args.ssl_ca_certs is None else ClientTls(ca_certs=args.ssl_ca_certs)
    client = Client(args.server, api_key=args.api_key or API_KEY.read(), tls=tls)
    start = time.perf_counter()
    out = _Printer(params.n)
    last = None
    for r in client.generate(prompt, params, server_defaults=server_defaults):
        rows = [(p.token_id, p.text, p.logprob, p.rank, [(t.text, t.logprob) for t in p.top]) for p in r.logprobs]
        out.add(r.index, list(r.token_ids), r.text, rows, r.finish_reason)
        last = r
    client.close()
    out.report(time.perf_counter() - start, f"first token {last.timings.ttft_ms:.0f} ms, "
                                            f"mean TBT {last.timings.mean_tbt_ms:.1f} ms")
    return 0


def _local_row(token: int, position, top: int) -> tuple:
    """(token id, text, logprob, rank, [(text, logprob) of the top `top`]) of one position."""
    chosen = position[token]
    ranked = sorted(position.values(), key=lambda lp: lp.rank)[:top]
    return token, chosen.decoded_token or "", chosen.logprob, chosen.rank, [(lp.decoded_token or "", lp.logprob)
                                                                            for lp in ranked]


class _Printer:
    """One completion streams as it comes; several are printed whole, each as it ends. Each is
    followed by its logprobs table when asked."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.text: list[list[str]] = [[] for _ in range(n)]
        self.rows: list[list[tuple]] = [[] for _ in range(n)]
        self.reasons: list[str] = [""] * n
        self.tokens = 0
        self.first: float | None = None

    def add(self, index: int, token_ids: list[int], text: str, rows: list[tuple], finish_reason: str) -> None:
        if token_ids and self.first is None:
            self.first = time.perf_counter()
        self.tokens += len(token_ids)
        self.rows[index] += rows
        if self.n == 1:
            sys.stdout.write(_printable(text))
            sys.stdout.flush()
        else:
            self.text[index].append(text)
        if finish_reason:
            self.reasons[index] = finish_reason
            self._end(index)

    def _end(self, index: int) -> None:
        if self.n > 1:
            print(f"--- completion {index} ({self.reasons[index]}) ---")
            sys.stdout.write(_printable("".join(self.text[index])))
        print()
        if self.rows[index]:
            print(_logprobs_table(self.rows[index]))
        sys.stdout.flush()

    def ttft_ms(self, start: float) -> float:
        return (self.first - start) * 1e3 if self.first is not None else float("nan")

    def report(self, elapsed: float, timing: str) -> None:
        reasons = ", ".join(self.reasons)
        print(f"[{self.tokens} tokens in {elapsed:.2f} s: {self.tokens / elapsed:.1f} tokens/s, {timing}, "
              f"finish reason{'s' if self.n > 1 else ''} {reasons}]", file=sys.stderr)


def _printable(text: str) -> str:
    """The text as generated; on a terminal, control characters escaped (random-weight presets
    produce arbitrary bytes)."""
    return text.translate(_CONTROL) if sys.stdout.isatty() else text


def _logprobs_table(rows: list[tuple]) -> str:
    from megainfer.tools.bench.report import format_table

    def shown(text: str) -> str:
        return repr(text)[:14]  # repr escapes control characters

    return format_table(["#", "token", "text", "logprob", "rank", "top"], [
        [i, token, shown(text), f"{logprob:.3f}", rank, "  ".join(f"{shown(t)} {lp:.2f}" for t, lp in top)]
        for i, (token, text, logprob, rank, top) in enumerate(rows)])
