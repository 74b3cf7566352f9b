"""Benchmarks of jaxcomm: python -m benchmarks.<name>."""
