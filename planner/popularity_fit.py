"""The expert popularity MegaScale-Infer-style skew is priced with by default: popularity ~
(rank + FITTED_RANK_OFFSET)^-FITTED_SKEW, fitted to the expert coverage the layered-prefill paper
measured for Qwen3-30B-A3B on ShareGPT (megainfer/tools/simulator/routing_skew.py fits it and
prints the table). Constants only: the CLIs read them while parsing their arguments."""

FITTED_SKEW = 3.61
FITTED_RANK_OFFSET = 46.6
