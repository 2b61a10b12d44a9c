"""Train the demo checkpoint: a small Mixtral-style MoE on the Python standard library.

    python -m megainfer.tools.demo_train --out megainfer/demo/checkpoint --steps 1800 --minutes 42

Deterministic given --seed and --steps on one machine and Python version: the corpus is a
sorted walk of the stdlib, every shuffle is seeded, and the learning-rate schedule follows
the step count. --minutes is a deadline: if the run falls behind it, the schedule follows
elapsed time instead so the run still anneals and saves in time (the model card says which
one governed the run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# The CPU is usually shared: spinning OpenMP workers then steal each other's time slices
# (steps measured 3-5x slower), so idle workers sleep unless the user chose otherwise.
# Read once when torch loads its OpenMP runtime, hence before the import; only when run as
# a program, so importing this module (tests) leaves the environment alone.
if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from tqdm import tqdm

from megainfer.demo import CHECKPOINT, bpe, corpus
from megainfer.errors import ConfigError

MIN_LR_RATIO = 0.1  # cosine decays to this share of the peak learning rate
VAL_WINDOWS = 64  # held-out windows the final loss is measured on


@dataclass
class RunStats:
    steps: int = 0
    tokens_seen: int = 0
    seconds: float = 0.0
    time_bound: bool = False  # the deadline, not --steps, drove the schedule at some step
    train_loss: float = float("nan")  # mean cross-entropy over the last steps, nats/token
    val_loss: float = float("nan")  # cross-entropy on held-out windows, nats/token
    unigram_loss: float = float("nan")  # the same windows under unigram token frequencies
    num_files: int = 0
    num_chat_samples: int = 0
    corpus_chars: int = 0
    corpus_tokens: int = 0
    parameters: int = 0
    safetensors_bytes: int = 0
    sample: str = ""
    losses: list[float] = field(default_factory=list)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megainfer.tools.demo_train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=CHECKPOINT,
                   help="checkpoint directory to write (default: the shipped megainfer/demo/checkpoint)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (the schedule's length)")
    p.add_argument("--minutes", type=float, default=None, help="wall-clock deadline for training")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", type=Path, default=None,
                   help="directory of .py files to train on (default: the standard library)")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N files of the sorted walk")
    p.add_argument("--no-chat", action="store_true", help="leave out the chat-formatted samples")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-size", type=int, default=128, help="intermediate size of one expert")
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--log-every", type=int, default=25)
    args = p.parse_args(argv)
    if args.steps is None and args.minutes is None:
        p.error("give --steps, --minutes or both")
    for name in ("steps", "minutes", "vocab_size", "seq_len", "batch_size", "threads"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    return args


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("training the demo checkpoint needs transformers; install it with "
                          "`pip install -e \".[test]\"`") from None
    return transformers


def load_texts(args: argparse.Namespace) -> tuple[list[str], int]:
    root = args.corpus if args.corpus is not None else corpus.stdlib_root()
    if not root.is_dir():
        raise ConfigError(f"--corpus {str(root)!r} is not a directory; pass a directory of .py files")
    files = corpus.source_files(root)[:args.max_files]
    texts = corpus.read_sources(files)
    if not texts:
        raise ConfigError(f"--corpus {str(root)!r} has no usable .py files")
    return texts, len(files)


def tokenize_corpus(tok, texts: list[str], chat: list[corpus.ChatSample], seed: int) -> torch.Tensor:
    """Documents as BOS + text + EOS (chat samples as the chat template renders them, + EOS),
    in a seeded order, concatenated into one token stream."""
    eos = tok.token_to_id(bpe.EOS)
    docs = [enc.ids + [eos] for enc in tok.encode_batch(texts, add_special_tokens=True)]
    rendered = [bpe.render_chat([{"role": "user", "content": s.request},
                                 {"role": "assistant", "content": s.answer}]) for s in chat]
    docs += [enc.ids + [eos] for enc in tok.encode_batch(rendered, add_special_tokens=False)]
    random.Random(seed).shuffle(docs)
    return torch.tensor([t for doc in docs for t in doc], dtype=torch.long)


def model_config(transformers, args: argparse.Namespace, tok):
    return transformers.MixtralConfig(
        vocab_size=tok.get_vocab_size(with_added_tokens=True), hidden_size=args.hidden_size,
        intermediate_size=args.expert_size, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, num_local_experts=args.experts, num_experts_per_tok=args.top_k,
        max_position_embeddings=args.max_position_embeddings, rope_theta=10000.0, sliding_window=None,
        tie_word_embeddings=False,  # the engine loads a separate lm_head
        router_aux_loss_coef=0.02, initializer_range=0.02,
        bos_token_id=tok.token_to_id(bpe.BOS), eos_token_id=tok.token_to_id(bpe.EOS),
        pad_token_id=tok.token_to_id(bpe.PAD))


def learning_rate(args: argparse.Namespace, step: int, progress: float) -> float:
    warm = min(1.0, (step + 1) / args.warmup_steps) if args.warmup_steps > 0 else 1.0
    cosine = MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * warm * cosine


def optimizer(model, args: argparse.Namespace) -> torch.optim.AdamW:
    # Weight decay on matrices only; norms' gains stay free.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    keep = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": keep, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))


@torch.no_grad()
def mean_loss(model, windows: torch.Tensor, batch_size: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        batch = windows[i:i + batch_size]
        logits = model(input_ids=batch[:, :-1]).logits
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                 reduction="sum").item()
        count += batch[:, 1:].numel()
    model.train()
    return total / count


def unigram_loss(train: torch.Tensor, val: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy of val's targets under add-one-smoothed token frequencies of train."""
    counts = torch.bincount(train.reshape(-1), minlength=vocab_size).double() + 1
    logp = (counts / counts.sum()).log()
    return -logp[val[:, 1:].reshape(-1)].mean().item()


def train(args: argparse.Namespace, model, windows: torch.Tensor, stats: RunStats) -> None:
    start = time.monotonic()
    deadline = args.minutes * 60 if args.minutes is not None else None
    opt = optimizer(model, args)
    g = torch.Generator().manual_seed(args.seed)
    order, pos = torch.randperm(len(windows), generator=g), 0
    recent: list[float] = []
    bar = tqdm(total=args.steps, desc="training", unit="step", mininterval=5, file=sys.stdout)
    step = 0
    while True:
        elapsed = time.monotonic() - start
        by_steps = step / args.steps if args.steps else 0.0
        by_time = elapsed / deadline if deadline else 0.0
        progress = max(by_steps, by_time)
        if progress >= 1.0:
            break
        stats.time_bound |= by_time > by_steps
        if pos + args.batch_size > len(order):
            order, pos = torch.randperm(len(windows), generator=g), 0
        batch = windows[order[pos:pos + args.batch_size]]
        pos += args.batch_size
        lr = learning_rate(args, step, progress)
        for group in opt.param_groups:
            group["lr"] = lr
        out = model(input_ids=batch[:, :-1], output_router_logits=True)
        ce = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss = ce + model.config.router_aux_loss_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        recent = (recent + [ce.item()])[-args.log_every:]
        stats.tokens_seen += batch[:, 1:].numel()
        bar.update(1)
        bar.set_postfix(loss=f"{ce.item():.3f}", lr=f"{lr:.2e}")
        if step % args.log_every == 0:
            mean = sum(recent) / len(recent)
            stats.losses.append(round(mean, 4))
            tqdm.write(f"step {step} loss {mean:.4f} lr {lr:.2e} tokens {stats.tokens_seen} "
                       f"tok/s {stats.tokens_seen / (time.monotonic() - start):.0f}", file=sys.stdout)
    bar.close()
    stats.steps = step
    stats.seconds = time.monotonic() - start
    stats.train_loss = sum(recent) / len(recent) if recent else float("nan")


def write_generation_config(transformers, out: Path, tok) -> None:
    gen = transformers.GenerationConfig(
        bos_token_id=tok.token_to_id(bpe.BOS),
        eos_token_id=[tok.token_to_id(bpe.EOS), tok.token_to_id(bpe.IM_END)],
        pad_token_id=tok.token_to_id(bpe.PAD), do_sample=True, temperature=0.7, top_p=0.95,
        max_new_tokens=256)
    gen.save_pretrained(out)


def write_model_card(out: Path, args: argparse.Namespace, argv: list[str], stats: RunStats, cfg) -> None:
    command = "python -m megainfer.tools.demo_train " + shlex.join(argv)
    governed = ("elapsed time (the --minutes deadline), so a rerun may differ" if stats.time_bound
                else "the step count, so the command above reproduces it")
    text = f"""# megainfer-demo

A demo checkpoint, **not a useful model**: a {stats.parameters / 1e6:.2f}M-parameter Mixtral-style
mixture of experts ({cfg.num_hidden_layers} layers, hidden size {cfg.hidden_size}, {cfg.num_local_experts}
experts of intermediate size {cfg.intermediate_size}, top-{cfg.num_experts_per_tok} routing, vocabulary of
{cfg.vocab_size} byte-level BPE tokens) trained for a few minutes on a CPU so that megainfer's demos print
text that reads like Python rather than random bytes. It writes plausible-looking, mostly wrong code.

## Data

The Python {sys.version_info.major}.{sys.version_info.minor} standard library's own sources, docstrings
included: {stats.num_files} `.py` files from a sorted walk of `sysconfig.get_paths()["stdlib"]` (tests,
`pydoc_data`, `site-packages` and generated codec tables left out), {stats.corpus_chars:,} characters, plus
{stats.num_chat_samples:,} chat samples (user: "Write a function `name`: <docstring summary>", assistant: the
function's source) formatted with the shipped chat template (ChatML: `<|im_start|>role\\n...<|im_end|>`).
That is {stats.corpus_tokens:,} tokens; the tokenizer was trained on the same text.

## Training

    {command}

{stats.steps} steps of {args.batch_size} x {args.seq_len} tokens ({stats.tokens_seen:,} tokens) with AdamW
(peak learning rate {args.lr}, {args.warmup_steps} warm-up steps, cosine decay to {MIN_LR_RATIO:g} of the peak,
weight decay {args.weight_decay}, router load-balancing loss {cfg.router_aux_loss_coef}) in
{stats.seconds / 60:.1f} minutes on {args.threads} CPU threads. The schedule followed {governed}.

| cross-entropy (nats/token)                     | value |
|------------------------------------------------|-------|
| training, mean of the last {args.log_every} steps | {stats.train_loss:.3f} |
| held-out windows                               | {stats.val_loss:.3f} |
| unigram token frequencies, same windows        | {stats.unigram_loss:.3f} |

## Files

`model.safetensors` ({stats.safetensors_bytes / 1e6:.1f} MB, float32, the hub's per-expert naming),
`config.json`, `tokenizer.json`, `tokenizer_config.json` (BOS is prepended by the tokenizer; the chat
template writes it itself), `generation_config.json` (temperature 0.7, top-p 0.95; `</s>` and `<|im_end|>`
end generation).

Greedy continuation of `def ` after training:

```
{stats.sample}
```

Use it with `megainfer generate --model megainfer-demo --prompt "def "` or the tiny CPU plans.
"""
    (out / "README.md").write_text(text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    transformers = require_transformers()
    torch.set_num_threads(args.threads)
    stats = RunStats()

    texts, stats.num_files = load_texts(args)
    chat = [] if args.no_chat else [s for text in texts for s in corpus.chat_samples(text)]
    stats.num_chat_samples, stats.corpus_chars = len(chat), sum(map(len, texts))
    print(f"corpus: {stats.num_files} files, {stats.corpus_chars:,} characters, {len(chat):,} chat samples")
    tok = bpe.train_tokenizer(texts, args.vocab_size)
    stream = tokenize_corpus(tok, texts, chat, args.seed)
    stats.corpus_tokens = len(stream)
    width = args.seq_len + 1
    windows = stream[:len(stream) // width * width].view(-1, width)
    if len(windows) < 2:
        raise ConfigError(f"--corpus has {len(stream)} tokens, too few for two windows of --seq-len {args.seq_len}")
    held = torch.randperm(len(windows), generator=torch.Generator().manual_seed(args.seed + 1))
    n_val = min(VAL_WINDOWS, max(1, len(windows) // 20))
    val, train_windows = windows[held[:n_val]], windows[held[n_val:]]
    print(f"tokens: {len(stream):,} ({stats.corpus_chars / len(stream):.2f} characters/token), "
          f"{len(train_windows)} training windows of {args.seq_len}, {n_val} held out")

    torch.manual_seed(args.seed)
    cfg = model_config(transformers, args, tok)
    model = transformers.MixtralForCausalLM(cfg)
    model.train()
    stats.parameters = sum(p.numel() for p in model.parameters())
    print(f"model: {stats.parameters:,} parameters")

    train(args, model, train_windows, stats)
    stats.val_loss = mean_loss(model, val, args.batch_size)
    stats.unigram_loss = unigram_loss(train_windows, val, cfg.vocab_size)
    model.eval()
    prompt = torch.tensor([tok.encode("def ").ids])
    with torch.no_grad():
        ids = model.generate(prompt, max_new_tokens=60, do_sample=False, pad_token_id=cfg.pad_token_id)
    stats.sample = tok.decode(ids[0].tolist(), skip_special_tokens=True)

    args.out.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False
    model.config.dtype = torch.float32
    model.save_pretrained(args.out)
    bpe.save_tokenizer(tok, args.out, args.max_position_embeddings)
    write_generation_config(transformers, args.out, tok)
    stats.safetensors_bytes = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    write_model_card(args.out, args, argv, stats, cfg)
    print(json.dumps({"steps": stats.steps, "tokens": stats.tokens_seen, "minutes": round(stats.seconds / 60, 2),
                      "time_bound": stats.time_bound, "train_loss": round(stats.train_loss, 4),
                      "val_loss": round(stats.val_loss, 4), "unigram_loss": round(stats.unigram_loss, 4),
                      "safetensors_bytes": stats.safetensors_bytes}))
    print("sample:", stats.sample)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as exc:  # a user's mistake or a missing extra: one line, as the CLI does
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
