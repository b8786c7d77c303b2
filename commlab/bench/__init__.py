"""Micro-benchmarks that run two implementations alternately in one run and print their ratio."""
