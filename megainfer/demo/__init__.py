"""The demo checkpoint: a small Mixtral-style MoE trained by `megainfer.demo.train` on the
Python standard library's sources, so demos print text instead of random bytes."""

from pathlib import Path

CHECKPOINT = Path(__file__).resolve().parent / "checkpoint"
