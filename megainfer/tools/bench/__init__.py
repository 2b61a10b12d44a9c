"""Benchmarks behind `megainfer bench`."""
