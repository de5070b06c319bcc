"""Benchmarks: offline throughput, serving load generation and their shared metrics, and the soak test."""
