"""Benchmarks: offline throughput, serving load generation, and their shared metrics."""
