"""The demo checkpoint: a small Mixtral-style MoE trained by `megainfer.tools.demo_train` on the
Python standard library's sources, so demos print text instead of random bytes."""

from pathlib import Path

CHECKPOINT = Path(__file__).resolve().parent / "checkpoint"
