"""The GPU check: everything a scarce GPU machine should tell us, from one command.

    PYTHONPATH=. python -m megainfer.gpucheck --out DIR [--budget-s 420] [--device cuda|cpu]

It runs from a plain checkout with no install step, on the package set of the GPU machine this
project is lent (torch, Triton, transformers, numpy, safetensors, pyyaml, grpcio, pynvml; no
Ray, FastAPI, pydantic, httpx2, NIXL or pyverbs): nothing it imports may need those
(`tests/test_gpucheck.py` runs it where they cannot be imported).

Checks run in order of value, each in a process of its own (`child.py`): a CUDA fault is
sticky for its process and a hung kernel cannot be interrupted, so one check's crash or hang
costs only that check, and the runner can stop at its budget whatever a check is doing. Each
result is appended to `DIR/gpucheck.jsonl` as it finishes (`records.py`), and `DIR/gpucheck.md`
is rewritten after every check, so a run cut off still returns everything finished so far.

The checks: `environment` (the GPU, driver, versions, the C compiler Triton needs),
`kernels` (every Triton kernel, forced, against its torch reference at real shapes),
`engine` (the colocated engine against transformers), `pair` (an attention node and an expert
node in two processes), `memory` (pinned copy bandwidth, KV sizing, NVML energy),
`kernel_bench` (the kernels against their peers). `--device cpu` runs the same checks on the
CPU, kernels under Triton's interpreter at small shapes: what CI can prove is that it imports
and runs.
"""
