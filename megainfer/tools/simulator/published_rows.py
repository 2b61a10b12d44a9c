"""Every published serving measurement the performance model is checked against: the
layered-prefill paper's runs ("From Tokens to Layers", arXiv 2510.08055, as quoted in issues 20
and 37) of Qwen3-30B-A3B, gpt-oss-20b, gpt-oss-120b and Qwen3-235B-A22B on 2 and 8 H100s, TP
across the instance, a vLLM-based engine, bf16 (gpt-oss-120b's experts in MXFP4), Poisson
arrivals, chunked prefill at 512 tokens unless said. The paper's engine (github.com/scale-snu/
layered-prefill, a nano-vllm fork) runs layered prefill with --num-stages N_lg (16 unless said)
and --max-num-batched-tokens 8192: a cohort takes waiting prompts up to 8,192 tokens and passes
in G stages, G growing with the cohort's tokens by its get_num_stages table (1, 2 and 4 stages
up to 512, 1,024 and 2,048 tokens, then 8 for N_lg 16 and 6 for N_lg 12 up to 4,096, N_lg
above: `STAGE_TABLES`), every member cut as needed to fill the 8,192 (the rest of a cut prompt
leads the next cohort). Its rows run megainfer's layered policy with the same table
(`LayeredSettings.group_table`) and filling (`fill_cohorts`); megainfer's own default derives
G = ceil(tokens / 512) and cuts only a cohort's first member. The table has no rows for N_lg 2
and 8, so the sweep over N_lg (2, 4, 8, 16 at 1.4 req/s) ran with get_num_stages returning N_lg,
the line that stands commented out at its top: those rows pass every cohort in N_lg stages
(`PublishedRow.fixed_stages`; an inference from the code, the paper does not say).

How the paper ran them is in its benchmark driver (benchmarks/benchmark_batch.py of that
repository), and each row is simulated the same way: after a warm-up run that finishes first,
the measured run sends min(6,000, 600 s x rate) requests at the rate (`PublishedRow.
num_requests`: 780 at 1.3 req/s), so the instance starts empty and runs ten minutes; 256
running sequences at most on 2 GPUs, 1,024 on 8 (`max_num_seqs`); gpt-oss-20b in bf16 with
--num-stages 12, Qwen3-30B-A3B with 16.

`megainfer simulate --validate` (validation.py) predicts each row and reports its error, fitted
and left out."""

from __future__ import annotations

from dataclasses import dataclass

MXFP4_BYTES = 4.25 / 8  # a 4-bit value and one 8-bit scale per 32
# The paper's driver: each measured run lasts MAX_TIME seconds of arrivals, NUM_REQUESTS at most.
RUN_SECONDS, MAX_REQUESTS = 600.0, 6000
OFFLINE_REQUESTS = 300  # the offline rows' batch (the paper does not say how many)
# The paper's engine's Scheduler.get_num_stages: (most cohort tokens, stages) rows by --num-stages,
# --num-stages itself above the last row.
STAGE_TABLES = {4: ((512, 1), (1024, 2)),
                12: ((512, 1), (1024, 2), (2048, 4), (4096, 6)),
                16: ((512, 1), (1024, 2), (2048, 4), (4096, 8))}


SERVING, OFFLINE, SINGLE_PROMPT = "serving", "offline", "single prompt"

# The paper quotes arXiv's lengths (mean 9,194 prompt and 231 output tokens) in Llama-2 tokens,
# from its repository's arxiv_summarization_filtered_stats_llama2_tokenizer.csv; its driver sent
# each article through the served model's own tokenizer. Each model's tokens per Llama-2 token on
# arXiv-summarization text (lower case, spaced punctuation, @xmath and @xcite placeholders),
# counted on two articles of its test split (3,639 Llama-2 tokens in all; the two articles' ratios
# differ by 0.005 for Qwen, 0.025 for o200k): Llama-2's SentencePiece model, Qwen's BPE (qwen.tiktoken, Qwen3's
# vocabulary, with Qwen2's pre-tokenizer: digits one by one, as Llama-2's) and o200k_base (gpt-oss's
# o200k_harmony without its special tokens: up to three digits a token).
ARXIV_TOKENS_PER_LLAMA2 = {"qwen3-30b-a3b": 0.944, "gpt-oss-20b": 0.889, "gpt-oss-120b": 0.889}


@dataclass(frozen=True)
class PublishedRow:
    label: str
    model: str  # preset
    gpus: int  # H100s of the instance, all tensor parallel
    workload: str  # built-in workload name
    rate: float  # requests per second (offline: every request at once; single prompt: one)
    policy: str  # chunked or layered
    ttft_mean_s: float | None  # serving and single prompt
    tbt_mean_s: float | None  # serving
    ttft_p99_s: float | None = None
    tbt_p99_s: float | None = None
    chunk_size: int = 512
    max_layer_groups: int = 16  # layered: N_lg, the most stages a cohort passes in
    expert_bytes_per_param: float | None = None  # None: bf16
    gpu: str = "H100"
    kind: str = SERVING
    throughput_tok_s: float | None = None  # offline: output tokens per second
    prompt_tokens: int = 0  # single prompt: its length
    # The paper's engine never passes gpt-oss's sliding window to its attention (its
    # GptOssAttention builds Attention without one): every layer attends, and caches, the whole
    # context. Its rows are priced that way.
    windowed_attention: bool = False
    max_num_seqs: int = 256  # the engine's --max-num-seqs (1,024 in the paper's 8-GPU runs)
    fixed_stages: bool = False  # layered: every cohort passes in max_layer_groups stages (the N_lg sweep)
    # The engine's bf16 experts run vLLM's fused_moe, whose tiles come from a file named by the
    # experts, their width per rank and the device (nanovllm/layers/for_moe/configs/ in the
    # paper's repository); it ships one for Qwen3-235B-A22B at TP 8 on H100 (E=128, N=192) and
    # none for Qwen3-30B-A3B at TP 2 (E=128, N=384) or gpt-oss-20b at TP 2 (E=32, N=1,440),
    # which run its small default tiles. gpt-oss-120b's 4-bit experts run another kernel.
    tuned_expert_tiles: bool = False

    @property
    def group_table(self) -> tuple[tuple[int, int], ...]:
        """Layered: the stages a cohort takes by its tokens (LayeredSettings.group_table); empty
        when every cohort takes max_layer_groups."""
        return () if self.fixed_stages else STAGE_TABLES[self.max_layer_groups]

    @property
    def length_scale(self) -> float:
        """The row's model's tokens per token of its workload's quoted lengths: arXiv's are
        Llama-2 tokens (ARXIV_TOKENS_PER_LLAMA2); ShareGPT's lengths the driver sends as quoted,
        and a single prompt is its own length."""
        if self.workload != "arxiv" or self.kind == SINGLE_PROMPT:
            return 1.0
        return ARXIV_TOKENS_PER_LLAMA2[self.model]

    @property
    def num_requests(self) -> int:
        """Requests of the run as the paper's driver sent them: ten minutes of arrivals at the
        rate, at most 6,000; the offline batch; one prompt alone."""
        if self.kind == SERVING:
            return min(MAX_REQUESTS, int(RUN_SECONDS * self.rate))
        return OFFLINE_REQUESTS if self.kind == OFFLINE else 1

    @property
    def config(self) -> tuple:
        """Rows that differ only in policy share a pair: the direction of layered vs chunked."""
        return self.kind, self.model, self.gpus, self.workload, self.rate

    @property
    def measured(self) -> dict[str, float]:
        """What the row measured, by metric: ttft and tbt (seconds), throughput (tokens/s)."""
        values = {"ttft": self.ttft_mean_s, "tbt": self.tbt_mean_s, "throughput": self.throughput_tok_s}
        return {name: v for name, v in values.items() if v is not None}


def _row(label, model, gpus, workload, rate, policy, ttft, tbt, *, p99=(None, None), **kw) -> PublishedRow:
    kw.setdefault("max_num_seqs", 1024 if gpus == 8 else 256)  # the driver's setups for 8 and 2 GPUs
    return PublishedRow(label, model, gpus, workload, rate, policy, ttft, tbt * 1e-3, p99[0],
                        p99[1] * 1e-3 if p99[1] is not None else None, **kw)


def _offline(label, policy, tokens_per_s, **kw) -> PublishedRow:
    """Qwen3-30B-A3B on 2 H100s, every arXiv request at once: output tokens per second."""
    return PublishedRow(label, "qwen3-30b-a3b", 2, "arxiv", 0.0, policy, None, None, kind=OFFLINE,
                        throughput_tok_s=tokens_per_s, **kw)


def _single(label, chunk_size, prefill_s) -> PublishedRow:
    """One 8,192-token prompt alone on Qwen3-30B-A3B, 2 H100s, chunked: its prefill time."""
    return PublishedRow(label, "qwen3-30b-a3b", 2, "arxiv", 0.0, "chunked", prefill_s, None, kind=SINGLE_PROMPT,
                        chunk_size=chunk_size, prompt_tokens=8192)


Q30, OSS20, OSS120, Q235 = "qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-120b", "qwen3-235b-a22b"
FP4 = dict(expert_bytes_per_param=MXFP4_BYTES)
ROWS: tuple[PublishedRow, ...] = (
    _row("Qwen3-30B 2xH100 arXiv 1.3 chunked", Q30, 2, "arxiv", 1.3, "chunked", 2.80, 32.2, p99=(8.65, 51.3)),
    _row("Qwen3-30B 2xH100 arXiv 1.3 layered", Q30, 2, "arxiv", 1.3, "layered", 1.24, 21.4, p99=(4.10, 37.5)),
    _row("Qwen3-30B 2xH100 arXiv 1.6 layered", Q30, 2, "arxiv", 1.6, "layered", 2.46, 28.1, p99=(8.01, 41.2)),
    _row("Qwen3-30B 2xH100 arXiv 1.7 chunked 1024", Q30, 2, "arxiv", 1.7, "chunked", 2.32, 43.6, p99=(5.83, 83.4),
         chunk_size=1024),
    _row("Qwen3-30B 2xH100 arXiv 2.6 chunked 2048", Q30, 2, "arxiv", 2.6, "chunked", 2.56, 73.6, p99=(5.58, 129),
         chunk_size=2048),
    _row("Qwen3-30B 2xH100 arXiv 1.4 layered N2", Q30, 2, "arxiv", 1.4, "layered", 0.480, 20.9, max_layer_groups=2,
         fixed_stages=True),
    _row("Qwen3-30B 2xH100 arXiv 1.4 layered N4", Q30, 2, "arxiv", 1.4, "layered", 0.566, 20.6, max_layer_groups=4,
         fixed_stages=True),
    _row("Qwen3-30B 2xH100 arXiv 1.4 layered N8", Q30, 2, "arxiv", 1.4, "layered", 0.768, 20.8, max_layer_groups=8,
         fixed_stages=True),
    _row("Qwen3-30B 2xH100 arXiv 1.4 layered N16", Q30, 2, "arxiv", 1.4, "layered", 1.27, 19.7, max_layer_groups=16,
         fixed_stages=True),
    _row("gpt-oss-20b 2xH100 arXiv 2.1 chunked", OSS20, 2, "arxiv", 2.1, "chunked", 3.00, 25.1, p99=(8.57, 30.6)),
    _row("gpt-oss-20b 2xH100 arXiv 2.1 layered N12", OSS20, 2, "arxiv", 2.1, "layered", 0.87, 18.2, p99=(2.82, 32.3),
         max_layer_groups=12),
    _row("gpt-oss-20b 2xH100 arXiv 2.7 layered N12", OSS20, 2, "arxiv", 2.7, "layered", 2.18, 25.7, p99=(6.86, 33.2),
         max_layer_groups=12),
    _row("gpt-oss-120b 2xH100 arXiv 1.2 chunked", OSS120, 2, "arxiv", 1.2, "chunked", 3.11, 34.9, p99=(8.82, 47.2),
         **FP4),
    _row("gpt-oss-120b 2xH100 arXiv 1.2 layered N12", OSS120, 2, "arxiv", 1.2, "layered", 1.09, 20.5,
         p99=(3.89, 44.8), max_layer_groups=12, **FP4),
    _row("Qwen3-235B 8xH100 ShareGPT 3.5 chunked", Q235, 8, "sharegpt-lp", 3.5, "chunked", 6.65, 50.2,
         p99=(16.4, 70.2), tuned_expert_tiles=True),
    _row("Qwen3-235B 8xH100 ShareGPT 3.5 layered N16", Q235, 8, "sharegpt-lp", 3.5, "layered", 3.35, 50.8,
         p99=(8.48, 88.5), max_layer_groups=16, tuned_expert_tiles=True),
    _row("gpt-oss-120b 8xH100 arXiv 3.0 chunked", OSS120, 8, "arxiv", 3.0, "chunked", 1.05, 14.4, p99=(3.45, 18.6),
         **FP4),
    _row("gpt-oss-120b 8xH100 arXiv 3.0 layered N12", OSS120, 8, "arxiv", 3.0, "layered", 0.530, 11.8,
         p99=(1.75, 19.3), max_layer_groups=12, **FP4),
    _row("gpt-oss-120b 8xH100 ShareGPT 6.5 chunked", OSS120, 8, "sharegpt-lp", 6.5, "chunked", 0.212, 12.2,
         p99=(0.791, 19.6), **FP4),
    _row("gpt-oss-120b 8xH100 ShareGPT 6.5 layered N12", OSS120, 8, "sharegpt-lp", 6.5, "layered", 0.178, 11.3,
         p99=(0.572, 21.0), max_layer_groups=12, **FP4),
    _offline("Qwen3-30B 2xH100 arXiv offline chunked", "chunked", 315.36),
    _offline("Qwen3-30B 2xH100 arXiv offline layered N16", "layered", 391.59),
    # The calibration issue's (20) single prompt; at chunk 512 the paper says only "over 0.5 s".
    _single("Qwen3-30B 2xH100 8,192-token prompt chunk 4096", 4096, 0.200),
    _single("Qwen3-30B 2xH100 8,192-token prompt chunk 8192", 8192, 0.200),
)
