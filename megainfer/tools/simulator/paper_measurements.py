"""The published measurements the H100 efficiency curves are fitted to (`curve_fit.py`): the
layered-prefill paper's serving runs of Qwen3-30B-A3B on 2 x H100 and its single-prompt prefill
times, with the workload and instance they ran, and the bar the fit must meet."""

from __future__ import annotations

from dataclasses import dataclass

PAPER = ("Layered prefill, 'From Tokens to Layers' (arXiv 2510.08055): Qwen3-30B-A3B, 2 x H100 TP 2, "
         "vLLM-based, bf16, arXiv summarisation, Poisson arrivals (figures as quoted in issue 20)")


# -- the measurements -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ServingMeasurement:
    """One measured serving run: a prefill policy at a request rate."""

    label: str
    policy: str  # chunked or layered
    chunk_size: int  # chunked: the step's token budget
    rate: float  # requests per second
    ttft_mean_s: float
    ttft_p99_s: float
    tbt_mean_s: float
    tbt_p99_s: float
    expert_gb_per_request: float | None = None  # expert weights read per request, GB
    mj_per_token: float | None = None  # energy per processed (prompt + output) token
    source: str = PAPER

    @property
    def scenario(self) -> tuple[str, int, float]:
        """Runs of the same configuration share one simulation."""
        return self.policy, self.chunk_size, self.rate


@dataclass(frozen=True)
class SinglePromptMeasurement:
    """One prompt alone on the instance: its prefill time at one chunk size."""

    label: str
    prompt_tokens: int
    chunk_size: int
    prefill_s: float
    lower_bound: bool = False  # the paper says "over" prefill_s
    moe_share_at_least: float | None = None  # the MoE's share of the prefill, as a lower bound
    source: str = PAPER


CHUNKED_512 = ServingMeasurement("chunked 512, run 1", "chunked", 512, 1.3, 2.68, 8.05, 29.0e-3, 48.4e-3,
                                 expert_gb_per_request=955, mj_per_token=60.2)
CHUNKED_512_RERUN = ServingMeasurement("chunked 512, run 2", "chunked", 512, 1.3, 2.80, 8.65, 32.9e-3, 51.1e-3)
CHUNKED_1024 = ServingMeasurement("chunked 1024", "chunked", 1024, 1.7, 2.32, 5.83, 43.6e-3, 83.4e-3,
                                  expert_gb_per_request=631, mj_per_token=45.4)
CHUNKED_2048 = ServingMeasurement("chunked 2048", "chunked", 2048, 2.6, 2.56, 5.58, 73.6e-3, 129e-3,
                                  expert_gb_per_request=304, mj_per_token=32.4)
LAYERED_512 = ServingMeasurement("layered", "layered", 512, 1.3, 1.24, 4.10, 21.5e-3, 37.1e-3)
SERVING = (CHUNKED_512, CHUNKED_512_RERUN, CHUNKED_1024, CHUNKED_2048, LAYERED_512)

PROMPT_CHUNK_512 = SinglePromptMeasurement("8,192-token prompt, chunk 512", 8192, 512, 0.500, lower_bound=True,
                                           moe_share_at_least=0.5)
PROMPT_CHUNK_4096 = SinglePromptMeasurement("8,192-token prompt, chunk 4096", 8192, 4096, 0.200)
PROMPT_CHUNK_8192 = SinglePromptMeasurement("8,192-token prompt, chunk 8192", 8192, 8192, 0.200)
SINGLE_PROMPTS = (PROMPT_CHUNK_512, PROMPT_CHUNK_4096, PROMPT_CHUNK_8192)

# The workload the measurements serve, and the instance.
MODEL, WORKLOAD, TP, NUM_REQUESTS = "qwen3-30b-a3b", "arxiv", 2, 300
MEASURED_GPUS = ("H100",)

# Issue 20's bar: mean TTFT and mean TBT of these within 25%, and layered below chunked.
TOLERANCE = 0.25
