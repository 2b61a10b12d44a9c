"""Every published serving measurement the performance model is checked against: the
layered-prefill paper's runs ("From Tokens to Layers", arXiv 2510.08055, as quoted in issues 20
and 37) of Qwen3-30B-A3B, gpt-oss-20b, gpt-oss-120b and Qwen3-235B-A22B on 2 and 8 H100s, TP
across the instance, a vLLM-based engine, bf16 (gpt-oss-120b's experts in MXFP4), Poisson
arrivals, chunked prefill at 512 tokens unless said, layered prefill with the given number of
layer groups (N_lg; otherwise 512 tokens per group).

`megainfer simulate --validate` (validation.py) predicts each row and reports its error, fitted
and left out."""

from __future__ import annotations

from dataclasses import dataclass

MXFP4_BYTES = 4.25 / 8  # a 4-bit value and one 8-bit scale per 32


@dataclass(frozen=True)
class PublishedRow:
    label: str
    model: str  # preset
    gpus: int  # H100s of the instance, all tensor parallel
    workload: str  # built-in workload name
    rate: float  # requests per second
    policy: str  # chunked or layered
    ttft_mean_s: float
    tbt_mean_s: float
    ttft_p99_s: float | None = None
    tbt_p99_s: float | None = None
    chunk_size: int = 512
    num_layer_groups: int | None = None  # layered: N_lg (None: 512 tokens per group)
    # Layered with N_lg: a cohort carries whole prompts (up to 8,192 tokens) through the N_lg
    # groups, as the paper's does; megainfer caps a cohort at group_tokens x N_lg.
    group_tokens: int = 512
    expert_bytes_per_param: float | None = None  # None: bf16
    gpu: str = "H100"

    @property
    def config(self) -> tuple:
        """Rows that differ only in policy share a pair: the direction of layered vs chunked."""
        return self.model, self.gpus, self.workload, self.rate


def _row(label, model, gpus, workload, rate, policy, ttft, tbt, *, p99=(None, None), **kw) -> PublishedRow:
    return PublishedRow(label, model, gpus, workload, rate, policy, ttft, tbt * 1e-3, p99[0],
                        p99[1] * 1e-3 if p99[1] is not None else None, **kw)


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
    _row("Qwen3-30B 2xH100 arXiv 1.4 layered N2", Q30, 2, "arxiv", 1.4, "layered", 0.480, 20.9, num_layer_groups=2, group_tokens=8192),
    _row("Qwen3-30B 2xH100 arXiv 1.4 layered N4", Q30, 2, "arxiv", 1.4, "layered", 0.566, 20.6, num_layer_groups=4, group_tokens=8192),
    _row("Qwen3-30B 2xH100 arXiv 1.4 layered N8", Q30, 2, "arxiv", 1.4, "layered", 0.768, 20.8, num_layer_groups=8, group_tokens=8192),
    _row("Qwen3-30B 2xH100 arXiv 1.4 layered N16", Q30, 2, "arxiv", 1.4, "layered", 1.27, 19.7, num_layer_groups=16, group_tokens=8192),
    _row("gpt-oss-20b 2xH100 arXiv 2.1 chunked", OSS20, 2, "arxiv", 2.1, "chunked", 3.00, 25.1, p99=(8.57, 30.6)),
    _row("gpt-oss-20b 2xH100 arXiv 2.1 layered", OSS20, 2, "arxiv", 2.1, "layered", 0.87, 18.2, p99=(2.82, 32.3)),
    _row("gpt-oss-20b 2xH100 arXiv 2.7 layered", OSS20, 2, "arxiv", 2.7, "layered", 2.18, 25.7, p99=(6.86, 33.2)),
    _row("gpt-oss-120b 2xH100 arXiv 1.2 chunked", OSS120, 2, "arxiv", 1.2, "chunked", 3.11, 34.9, p99=(8.82, 47.2),
         **FP4),
    _row("gpt-oss-120b 2xH100 arXiv 1.2 layered N12", OSS120, 2, "arxiv", 1.2, "layered", 1.09, 20.5,
         p99=(3.89, 44.8), num_layer_groups=12, group_tokens=8192, **FP4),
    _row("Qwen3-235B 8xH100 ShareGPT 3.5 chunked", Q235, 8, "sharegpt-lp", 3.5, "chunked", 6.65, 50.2,
         p99=(16.4, 70.2)),
    _row("Qwen3-235B 8xH100 ShareGPT 3.5 layered N16", Q235, 8, "sharegpt-lp", 3.5, "layered", 3.35, 50.8,
         p99=(8.48, 88.5), num_layer_groups=16, group_tokens=8192),
    _row("gpt-oss-120b 8xH100 arXiv 3.0 chunked", OSS120, 8, "arxiv", 3.0, "chunked", 1.05, 14.4, p99=(3.45, 18.6),
         **FP4),
    _row("gpt-oss-120b 8xH100 arXiv 3.0 layered N12", OSS120, 8, "arxiv", 3.0, "layered", 0.530, 11.8,
         p99=(1.75, 19.3), num_layer_groups=12, group_tokens=8192, **FP4),
    _row("gpt-oss-120b 8xH100 ShareGPT 6.5 chunked", OSS120, 8, "sharegpt-lp", 6.5, "chunked", 0.212, 12.2,
         p99=(0.791, 19.6), **FP4),
    _row("gpt-oss-120b 8xH100 ShareGPT 6.5 layered N12", OSS120, 8, "sharegpt-lp", 6.5, "layered", 0.178, 11.3,
         p99=(0.572, 21.0), num_layer_groups=12, group_tokens=8192, **FP4),
)
